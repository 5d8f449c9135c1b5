"""Per-node memory accounting, exact."""
import math

from spes.config import SpesConfig
from spes.model import canonical_shapes
from spes.plan import node_memory
from tests.conftest import tiny_config


def test_node_memory_counts_exactly():
    cfg = tiny_config()  # 4 experts of 3 x 32 x 16 weights per layer, 2 layers
    expert_params = 2 * 4 * 3 * 32 * 16
    total = sum(math.prod(s) for s in canonical_shapes(cfg).values())
    full = node_memory(cfg, SpesConfig(method="fedavg", num_nodes=1))
    assert full["trainable_params"] == total and full["frozen_params"] == 0
    node = node_memory(cfg, SpesConfig(num_nodes=2, frozen_dtype="bfloat16"), 1)
    assert node["frozen_params"] == expert_params // 2 and node["trainable_params"] == total - expert_params // 2
    assert node["weights_bytes"] == node["trainable_params"] * 4 + node["frozen_params"] * 2
    assert node["grads_bytes"] == node["trainable_params"] * 4 and node["optimizer_bytes"] == node["trainable_params"] * 8
    assert node["total_bytes"] < full["total_bytes"]
