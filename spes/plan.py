"""What a node holds in memory, from the config alone: weights (trainable fp32, frozen in
spes.frozen_dtype), gradients and AdamW state of what it trains (the accounting SPES saves on).
`python -m spes.plan [--params params.yaml] [key=value ...]` prints it per node and for the whole model."""
from __future__ import annotations

import argparse
import math

from spes.config import ModelConfig, SpesConfig
from spes.model import canonical_shapes, is_expert_param
from spes.ownership import ownership_for

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def node_memory(cfg: ModelConfig, s: SpesConfig, node: int = 0) -> dict:
    """Parameter counts and bytes of node `node` (gradients and two Adam moments in fp32 for what it trains)."""
    own = ownership_for(s.method, cfg.num_experts, s.nodes, s.ownership).owned(node) if cfg.is_moe else ()
    trainable = frozen = 0
    for name, shape in canonical_shapes(cfg).items():
        n = math.prod(shape)
        if is_expert_param(name):
            per_expert = n // cfg.num_experts
            trainable += per_expert * len(own)
            frozen += per_expert * (cfg.num_experts - len(own))
        else:
            trainable += n
    weights = trainable * 4 + frozen * DTYPE_BYTES[s.frozen_dtype]
    grads, optim = trainable * 4, trainable * 8
    return {"trainable_params": trainable, "frozen_params": frozen, "weights_bytes": weights, "grads_bytes": grads,
            "optimizer_bytes": optim, "total_bytes": weights + grads + optim}


def main() -> None:
    from spes.params import load_params

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    p = load_params(a.params, a.overrides)
    full = node_memory(p.model, SpesConfig(method="fedavg", num_nodes=1))
    for i in range(p.spes.nodes):
        m = node_memory(p.model, p.spes, i)
        print(f"node {i}: trainable {m['trainable_params']:,} frozen {m['frozen_params']:,} params; weights "
              f"{m['weights_bytes'] / 2**20:.1f} MiB, grads {m['grads_bytes'] / 2**20:.1f} MiB, Adam "
              f"{m['optimizer_bytes'] / 2**20:.1f} MiB = {m['total_bytes'] / 2**20:.1f} MiB "
              f"({m['total_bytes'] / full['total_bytes']:.2f}x training the whole model)")


if __name__ == "__main__":
    main()
