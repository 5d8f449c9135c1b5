"""DVC stage `upcycle`: the initial MoE (round 0): upcycled from a dense HF checkpoint, or from scratch."""
from __future__ import annotations

import dataclasses
import json
import os

from stages.common import out_dir, parse, write_json


def main() -> None:
    _, p = parse(__doc__)
    import torch
    from safetensors.torch import save_file

    from spes.data import TokenData
    from spes.hf import HFConversionError, load_hf
    from spes.model import CausalLM
    from spes.upcycle import upcycle

    d = out_dir(p, "init")
    data = TokenData.open(os.path.join(p.artifacts_dir, "tokens"))
    metrics: dict = {"mode": p.init.mode}
    torch.manual_seed(p.init.seed)
    if p.init.mode == "scratch":
        model, source = CausalLM(p.model), "scratch"
    else:
        source = p.init.dense_checkpoint or os.path.join(p.artifacts_dir, "dense", "hf")
        try:
            dense = load_hf(source)
        except HFConversionError as e:
            raise SystemExit(f"upcycle: {e}")
        if dense.cfg.is_moe:
            raise SystemExit(f"upcycle: {source} is already an MoE checkpoint")
        m = p.model
        model = upcycle(dense, m.num_experts, m.top_k, m.norm_topk_prob, p.init.noise_std, p.init.noise_fraction,
                        p.init.router_init_std, p.init.seed)
        model.cfg = dataclasses.replace(model.cfg, lb_loss_coef=m.lb_loss_coef, z_loss_coef=m.z_loss_coef)
        # How far the upcycled MoE is from the dense function (0 up to float error with no noise + normalized gates).
        x = torch.from_numpy(data.val[: 2 * 64].astype("int64")).view(2, 64)
        with torch.no_grad():
            metrics["max_abs_logit_diff_vs_dense"] = (model(x).logits - dense(x).logits).abs().max().item()
    if model.cfg.vocab_size < data.vocab_size:
        raise SystemExit(f"upcycle: model vocab {model.cfg.vocab_size} < tokenizer vocab {data.vocab_size}")
    save_file(model.canonical_state_dict(), os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_config": dataclasses.asdict(model.cfg), "source": source}, f, indent=2)
    metrics["parameters"] = sum(t.numel() for t in model.canonical_state_dict().values())
    write_json(os.path.join(d, "metrics.json"), metrics)
    print(f"upcycle: initial MoE from {source}: {metrics}")


if __name__ == "__main__":
    main()
