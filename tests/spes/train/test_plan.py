"""The memory planner: exact parameter accounting, and activation estimates that match what autograd keeps."""
import dataclasses
import math
from typing import Optional

import pytest
import torch

from spes.config.schema import ModelConfig, Params, SyncConfig, TrainConfig
from spes.errors import ConfigError
from spes.model.names import canonical_shapes
from spes.model.transformer import CausalLM
from spes.train.plan import (
    activation_bytes,
    node_memory,
    parse_bytes,
    plan_node,
    report,
    saved_activation_bytes,
    unit_params,
)
from tests.conftest import tiny_config, tiny_params


def _params(cfg: ModelConfig, sync: SyncConfig, train: Optional[TrainConfig] = None) -> Params:
    """The tiny settings (tests/conftest.py: tiny_params, sequences of 32) with model `cfg`, `sync` and `train`."""
    p = tiny_params(32)
    return dataclasses.replace(p, model=cfg, sync=sync, train=train or p.train)


def test_node_memory_counts_exactly():
    cfg = tiny_config()  # 4 experts of 3 x 32 x 16 weights per layer, 2 layers
    expert_params = 2 * 4 * 3 * 32 * 16
    total = sum(math.prod(s) for s in canonical_shapes(cfg).values())
    full = node_memory(_params(cfg, SyncConfig(method="fedavg", num_nodes=1)))
    assert full["trainable_params"] == total and full["frozen_params"] == 0
    node = node_memory(_params(cfg, SyncConfig(num_nodes=2), TrainConfig(frozen_dtype="bfloat16", seq_len=32)), 1)
    assert node["frozen_params"] == expert_params // 2 and node["trainable_params"] == total - expert_params // 2
    assert node["weights_bytes"] == node["trainable_params"] * 4 + node["frozen_params"] * 2
    assert node["grads_bytes"] == node["trainable_params"] * 4 and node["optimizer_bytes"] == node["trainable_params"] * 8
    assert node["total_bytes"] < full["total_bytes"]


def saved_bytes(cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool = False) -> int:
    """What autograd keeps for the backward pass of one forward (bytes of distinct storages, weights excluded)."""
    torch.manual_seed(0)
    model = CausalLM(cfg)
    model.activation_checkpointing = checkpointing
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return sum(seen.values())


@pytest.mark.parametrize("changes", [dict(qk_norm="head"), dict(qk_norm="full", num_kv_heads=2),
                                     dict(qk_norm="none", num_experts=0), dict(num_experts=8, top_k=1),
                                     dict(loss_impl="chunked", loss_chunk_tokens=16), dict(lm_head_z_loss_coef=1e-5)])
@pytest.mark.parametrize("batch,seq_len", [(2, 48), (1, 64)])
def test_activation_estimate_matches_autograds_saved_tensors(changes, batch, seq_len):
    cfg = tiny_config(**{"qk_norm": "none", **changes})
    full = saved_activation_bytes(cfg, batch, seq_len)
    assert full == pytest.approx(saved_bytes(cfg, batch, seq_len), rel=0.01)
    ckpt = saved_activation_bytes(cfg, batch, seq_len, checkpointing=True)  # the block inputs, not their insides
    assert ckpt == pytest.approx(saved_bytes(cfg, batch, seq_len, True), rel=0.01) and ckpt < full
    assert activation_bytes(cfg, batch, seq_len, True) < activation_bytes(cfg, batch, seq_len) > full


def test_plan_of_a_node_and_its_report():
    cfg = tiny_config()
    s = _params(cfg, SyncConfig(num_nodes=2), TrainConfig(batch_size=8, micro_batch_size=2, seq_len=32))
    m = plan_node(s, 0)
    assert m["micro_batch"] == 2 and m["peak_bytes"] == m["total_bytes"] + activation_bytes(cfg, 2, 32)
    s.train.activation_checkpointing = "block"
    assert plan_node(s, 0)["peak_bytes"] == m["total_bytes"] + m["activations_checkpointed_bytes"]
    s.outer.shared = "nesterov"  # SPES's own outer step: the whole-model line (a baseline) is planned all the same
    lines = report(s.validate(), 1, parse_bytes("1KiB"))
    assert len(lines) == 4 and lines[3].startswith("peak per GPU of the largest node: ddp plain loss") and lines[1].startswith("nodes 0-1: trainable") and "DOES NOT FIT in 0 GiB" in lines[1]
    assert "x training the whole model" in lines[1]
    assert parse_bytes("48GiB") == 48 * 2**30 and parse_bytes("80 GB") == 80 * 10**9
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")
    assert parse_bytes("1.5MiB") == 3 * 2**19 and parse_bytes("512b") == 512 and parse_bytes("2k") == 2000


@pytest.mark.parametrize("text", ["48iB", "1.2.3GiB", "", "  ", "GiB", "-8GiB", "0GiB", "8 GiBs"])
def test_a_bad_size_is_one_line_naming_the_flag(text):
    with pytest.raises(ConfigError, match=r"^--gpu-mem: (not a size|a size must be above 0)") as e:
        parse_bytes(text, "--gpu-mem")
    assert "\n" not in str(e.value)


def test_the_chunked_loss_plan_drops_the_logits():
    cfg, chunked = tiny_config(vocab_size=8192), tiny_config(vocab_size=8192, loss_impl="chunked", loss_chunk_tokens=64)
    plain_b, chunked_b = activation_bytes(cfg, 8, 64), activation_bytes(chunked, 8, 64)
    # plain: log-softmax kept, logits returned, two T x V gradients; chunked: three chunk x V blocks
    assert plain_b - chunked_b == 512 * 8192 * 4 * (1 + 1 + 2) - 512 * 4 - 3 * 64 * 8192 * 4



@pytest.mark.parametrize("preset,ranks,parallel", [("spes-1b", 1, "single"), ("spes-2b-16nodes", 1, "single"),
                                                    ("spes-9b-upcycle", 1, "single"), ("spes-7b", 4, "fsdp")])
def test_every_preset_fits_a_48gib_gpu(preset, ranks, parallel):
    """With the chunked loss the 1B, the 2B on 16 nodes (micro-batch 8) and the 9B upcycled (micro-batch 1)
    presets fit a 48 GiB GPU with one GPU per node; the 7B with its node sharded over 4 GPUs."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-m", "spes.plan", "--params", f"configs/{preset}.yaml",
                          "--gpu-mem", "48GiB", "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["fits"] is True and last["loss_impl"] == "chunked" and last["ranks_per_node"] == ranks
    assert last["node_parallel"] == parallel and last["peak_bytes_per_gpu"] <= 48 * 2**30
    assert last["peak_bytes_per_gpu"] < last["peak_bytes_per_gpu_plain_loss"]
    grid = last["peak_bytes_per_gpu_by_choice"]
    assert set(grid) == ({"ddp", "fsdp"} if ranks > 1 else {"ddp"})
    if ranks > 1:  # sharding is what makes it fit
        assert grid["fsdp"]["chunked"] == last["peak_bytes_per_gpu"] < 48 * 2**30 < grid["ddp"]["chunked"]


def test_fsdp_holds_a_share_of_the_node_plus_what_it_gathers():
    cfg = tiny_config(vocab_size=512)
    s = _params(cfg, SyncConfig(num_nodes=2), TrainConfig(batch_size=8, micro_batch_size=2, seq_len=32))
    ddp, fsdp = plan_node(s, 0, 2, "ddp"), plan_node(s, 0, 2, "fsdp")
    assert ddp["state_bytes"] == ddp["total_bytes"] + ddp["grads_bytes"]  # DDP's buckets: a second gradient
    assert fsdp["sharded_bytes"] == math.ceil(fsdp["total_bytes"] / 2)
    u = unit_params(s, 0)
    # root: embeddings, LM head, final norm; a block: attention, norms, router, its 4 experts (2 owned)
    assert u["root"] == (2 * 512 * 32 + 32, 0)
    expert = 3 * 32 * 16
    assert u["block"][1] == 2 * expert and sum(u["block"]) == sum(
        math.prod(v) for k, v in canonical_shapes(cfg).items() if k.startswith("model.layers.0."))
    gathered = u["root"][0] * (4 + 4) + 2 * sum(u["block"]) * 4  # root weights and gradient, two blocks (fp32)
    assert fsdp["gathered_bytes"] == gathered and fsdp["state_bytes"] == fsdp["sharded_bytes"] + gathered
    assert fsdp["activations_bytes"] == ddp["activations_bytes"] and fsdp["peak_bytes"] < ddp["peak_bytes"] * 2
    assert plan_node(s, 0, 1, "fsdp")["parallel"] == "single"  # one rank: nothing to shard over


def test_the_lm_head_z_loss_is_counted_on_the_plain_path():
    cfg, z = tiny_config(vocab_size=8192), tiny_config(vocab_size=8192, lm_head_z_loss_coef=1e-5)
    T = 8 * 64
    # a third T x V gradient, and the logsumexp kept
    assert activation_bytes(z, 8, 64) - activation_bytes(cfg, 8, 64) == T * 8192 * 4 + T * 4
    # under bf16 autocast the z-loss also keeps the fp32 copy of the logits
    assert activation_bytes(z, 8, 64, autocast="bfloat16") - activation_bytes(cfg, 8, 64, autocast="bfloat16") \
        == 2 * T * 8192 * 4 + T * 4


def test_a_capacity_plan_fits_every_node_and_balances_the_largest_count():
    import json
    import os

    from spes.config.loader import load_params
    from spes.errors import ConfigError
    from spes.train.capacity import capacity_plan, plan_owning
    from tests.conftest import ROOT

    p = load_params(os.path.join(ROOT, "params.yaml"))  # 8 experts per layer
    peak = {k: plan_owning(p, k)["peak_bytes"] for k in range(1, 9)}
    assert all(peak[k] < peak[k + 1] for k in range(1, 8))  # owning more costs more
    # caps 1, 3 and 8 experts: the level where they hold all 8 is 4 -> 1, 3, 4
    cp = capacity_plan(p, [peak[1], peak[3] + 1, 10 * peak[8]])
    assert cp["max_experts_per_node"] == [1, 3, 8] and cp["experts_per_node"] == [1, 3, 4]
    assert cp["ownership"] == [[0], [1, 2, 3], [4, 5, 6, 7]]
    assert all(b <= m for b, m in zip(cp["peak_bytes"], cp["memory_bytes"]))
    assert cp["peak_bytes"] == [peak[1], peak[3], peak[4]]
    # equal big nodes: an even split; the printed settings are a valid run
    even = capacity_plan(p, [10 * peak[8]] * 2)
    assert even["experts_per_node"] == [4, 4]
    q = load_params(os.path.join(ROOT, "params.yaml"), cp["overrides"])
    assert q.sync.num_nodes == 3 and q.sync.ownership == [[0], [1, 2, 3], [4, 5, 6, 7]]
    assert json.loads(cp["overrides"][1].split("=", 1)[1]) == cp["ownership"]
    with pytest.raises(ConfigError, match=r"node 1 \(.*\): owning even one expert per layer needs"):
        capacity_plan(p, [peak[8], peak[1] - 1])
    with pytest.raises(ConfigError, match="hold at most 2 of the 8 experts"):
        capacity_plan(p, [peak[1], peak[1]])
