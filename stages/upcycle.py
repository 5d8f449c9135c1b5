"""DVC stage `upcycle`: the initial MoE (round 0): upcycled from a dense HF checkpoint, or from scratch.

Reads artifacts/dense/hf (or init.dense_checkpoint) and artifacts/tokens; writes artifacts/init
(model.safetensors, config.json, metrics.json).
Example: python -m stages.upcycle init.noise_std=0.02
"""
from __future__ import annotations

import os

from stages.common import out_dir, parse, run, write_json


def main() -> None:
    _, p = parse(__doc__)
    import torch
    from safetensors.torch import save_file

    from spes.data.tokens import TokenData, check_vocab
    from spes.errors import HFConversionError, UpcycleError
    from spes.model.initial import init_record, init_source, initial_model

    d = out_dir(p, "init")
    tokens = os.path.join(p.artifacts_dir, "tokens")
    data = TokenData.open(tokens)
    check_vocab(p.model.vocab_size, data, tokens)  # a DataError names the mismatch
    metrics: dict = {"mode": p.init.mode}
    source = init_source(p.init, p.artifacts_dir)
    try:
        model, dense = initial_model(p.model, p.init, p.artifacts_dir)
    except (HFConversionError, UpcycleError) as e:
        raise type(e)(f"{source}: {e}") from None
    if dense is not None:  # how far the upcycled MoE is from the dense function (0 up to float error with no
        x = torch.from_numpy(data.val.read(0, 2 * 64).astype("int64")).view(2, 64)  # noise + normalized gates)
        with torch.no_grad():
            metrics["max_abs_logit_diff_vs_dense"] = (model(x).logits - dense(x).logits).abs().max().item()
    save_file(model.canonical_state_dict(), os.path.join(d, "model.safetensors"))
    write_json(os.path.join(d, "config.json"), init_record(model, p.init, source))
    metrics["parameters"] = sum(t.numel() for t in model.canonical_state_dict().values())
    write_json(os.path.join(d, "metrics.json"), metrics)
    print(f"upcycle: initial MoE from {source}: {metrics}")


if __name__ == "__main__":
    run(main)
