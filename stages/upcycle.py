"""DVC stage `upcycle`: the initial MoE (round 0): upcycled from a dense HF checkpoint, or from scratch.

Reads artifacts/dense/hf (or init.dense_checkpoint) and artifacts/tokens; writes artifacts/init
(model.safetensors, config.json, metrics.json).
Example: python -m stages.upcycle init.noise_std=0.02
"""
from __future__ import annotations

import dataclasses
import json
import os

from stages.common import out_dir, parse, run, write_json


def main() -> None:
    _, p = parse(__doc__)
    import torch
    from safetensors.torch import save_file

    from spes.data.tokens import TokenData, check_vocab
    from spes.errors import DataError, HFConversionError, UpcycleError
    from spes.model.hf import load_hf
    from spes.model.transformer import CausalLM
    from spes.model.upcycle import upcycle

    d = out_dir(p, "init")
    tokens = os.path.join(p.artifacts_dir, "tokens")
    data = TokenData.open(tokens)
    try:
        check_vocab(p.model.vocab_size, data, tokens)
    except DataError as e:
        raise SystemExit(f"upcycle: {e}")
    metrics: dict = {"mode": p.init.mode}
    torch.manual_seed(p.init.seed)
    if p.init.mode == "scratch":
        model, source = CausalLM(p.model), "scratch"
        with torch.no_grad():  # the router gets init.router_init_std, as an upcycled one does (0 = zeros)
            for moe in model.moe_layers():
                moe.gate.weight.normal_(0.0, p.init.router_init_std) if p.init.router_init_std > 0 else moe.gate.weight.zero_()
    else:
        source = p.init.dense_checkpoint or os.path.join(p.artifacts_dir, "dense", "hf")
        try:
            dense = load_hf(source)
            model = upcycle(dense, p.model, p.init.noise_std, p.init.noise_fraction, p.init.router_init_std,
                            p.init.seed)
        except (HFConversionError, UpcycleError) as e:
            raise SystemExit(f"upcycle: {source}: {e}")
        # How far the upcycled MoE is from the dense function (0 up to float error with no noise + normalized gates).
        x = torch.from_numpy(data.val.read(0, 2 * 64).astype("int64")).view(2, 64)
        with torch.no_grad():
            metrics["max_abs_logit_diff_vs_dense"] = (model(x).logits - dense(x).logits).abs().max().item()
    save_file(model.canonical_state_dict(), os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_config": dataclasses.asdict(model.cfg), "source": source}, f, indent=2)
    metrics["parameters"] = sum(t.numel() for t in model.canonical_state_dict().values())
    write_json(os.path.join(d, "metrics.json"), metrics)
    print(f"upcycle: initial MoE from {source}: {metrics}")


if __name__ == "__main__":
    run(main)
