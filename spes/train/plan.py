"""What a node holds in memory, from the config alone (no model is built):

- weights: trainable in fp32, frozen experts in `train.frozen_dtype`; gradients and the two AdamW moments
  (fp32) of what it trains: the accounting SPES saves on;
- activations kept for the backward pass of one micro-batch, counted tensor by tensor from what this
  implementation saves (spes/model/transformer.py, spes/model/moe.py; checked against autograd's saved tensors in
  tests/spes/test_plan.py), with and without `train.activation_checkpointing: block`;
- a node of several ranks holds all of it on every rank with `train.node_parallel: ddp` (plus DDP's gradient
  buckets), or 1/G of the weights, gradients and Adam state with `fsdp`, plus what FSDP gathers: the root
  unit (embeddings, final norm, LM head) for the whole step, two blocks at a time (the one computing and
  the one prefetched); activations are those of the rank's micro-batch.

    python -m spes.plan [--params params.yaml] [--gpu-mem 48GiB] [--json] [key=value ...]
    python -m spes.plan --nodes 24GiB,48GiB,80GiB [configs/...] [--json]   # nodes of different sizes
    python -m spes.plan --link 100Mbit/s --rtt 50ms [--storage-link R] [--tflops T] [--mfu M]  # a round's
        transfer against its compute (spes/train/link_plan.py)

(`python -m spes.plan`, spes/plan.py) prints it per node, against training the whole model on one
device, and whether it fits; then the peak per GPU of the largest node with ddp and fsdp, plain and chunked
loss. Under bf16 autocast the estimate counts matmul inputs in bf16 and the bf16 weight copies autocast
keeps (with fsdp the gathered weights are bf16 instead); it is checked against measured peaks on the CPU in
fp32 only (bench/memory_plan.py).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from spes.config.schema import LOSS_IMPLS, ModelConfig, Params
from spes.errors import ConfigError
from spes.model.names import canonical_shapes, is_expert_param
from spes.train.planned_nodes import planned_nodes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
F32, I64 = 4, 8


def on_nodes(p: Params, method: str, num_nodes: int, ownership: Optional[list[list[int]]] = None) -> Params:
    """`p` trained by another method on another number of nodes (what a plan sets the run against). What was
    written for the run's own method and node count and is no part of a node's memory is left out: the
    membership settings (quorum, planned joins and leaves) and the outer step (the aggregator's; SPES's
    `outer.shared: nesterov` is refused for the baselines)."""
    return dataclasses.replace(
        p, sync=dataclasses.replace(p.sync, method=method, num_nodes=num_nodes, ownership=ownership),
        outer=dataclasses.replace(p.outer, shared="average"),
        orchestration=dataclasses.replace(p.orchestration, min_nodes=None, membership_plan=[], evict_after_rounds=0))


def node_memory(p: Params, node: int = 0) -> dict:
    """Parameter counts and bytes of node `node` (gradients and two Adam moments in fp32 for what it trains)."""
    cfg, t = p.model, p.train
    own = planned_nodes(p).owned[node]
    trainable = frozen = 0
    for name, shape in canonical_shapes(cfg).items():
        n = math.prod(shape)
        if is_expert_param(name):
            per_expert = n // cfg.num_experts
            trainable += per_expert * len(own)
            frozen += per_expert * (cfg.num_experts - len(own))
        else:
            trainable += n
    weights = trainable * 4 + frozen * DTYPE_BYTES[t.frozen_dtype]
    grads, optim = trainable * 4, trainable * 8
    return {"trainable_params": trainable, "frozen_params": frozen, "weights_bytes": weights, "grads_bytes": grads,
            "optimizer_bytes": optim, "total_bytes": weights + grads + optim}


def block_activation_bytes(cfg: ModelConfig, tokens: int, act: int = F32) -> int:
    """Bytes one transformer block keeps for its backward pass over `tokens` tokens (its input excluded).
    `act`: bytes of a matmul input/output (4 in fp32, 2 under bf16 autocast); norms and the router stay fp32."""
    D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
    Q, KV, I, E, K = H * hd, Hkv * hd, cfg.intermediate_size, cfg.num_experts, cfg.top_k
    norm_in = (D + 1) * F32 + D * act  # rsqrt, normalized (fp32), the output as the next matmul's input
    qk = {"head": (2 * Q + H + 2 * KV + Hkv) * F32, "full": (2 * Q + 2 * KV + 2) * F32, "none": 0}[cfg.qk_norm]
    sdpa = 4 * Q * act + H * F32  # q, k, v (k, v repeated to all heads), output, log-sum-exp
    per_token = norm_in + qk + sdpa + D * F32 + norm_in  # second norm also keeps its input (the residual sum)
    if cfg.is_moe:
        router = E * F32 + K * I64  # probabilities, top-k ids
        # per routed row: gathered input, gate_up output (2I), silu output, product, expert output, weighted
        # output (D each or I each), its row order and token ids (int64), its gate weight
        routed = 3 * D * act + 4 * I * act + 2 * I64 + F32
        per_token += router + K * routed
    else:
        per_token += 4 * I * act  # gate and up outputs, silu output, product
    return tokens * per_token


def saved_activation_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, checkpointing: bool = False,
                           autocast: Optional[str] = None) -> int:
    """What autograd keeps from one forward over `micro_batch` sequences until its backward: the block inputs,
    what the losses keep, and the blocks' own activations unless they are checkpointed."""
    T, D, V, L = micro_batch * seq_len, cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    act = F32 if autocast is None else 2
    router_losses = (cfg.num_experts + 1) * F32 * T if cfg.is_moe else 0  # z-loss: router logits, their lse
    # token ids, final norm (its input, rsqrt, normalized, the lm head's input), log-softmax of the logits,
    # RoPE's cos and sin (shared by the layers)
    # the loss keeps the log-softmax of the logits (plain), or only their logsumexp (chunked)
    loss = F32 if cfg.loss_impl == "chunked" else V * F32 + (V * act if autocast else 0)
    if cfg.loss_impl != "chunked" and cfg.lm_head_z_loss_coef > 0:
        loss += V * F32 + F32  # the z-loss's logsumexp keeps the fp32 logits (a copy under autocast), its output
    top = T * (I64 + (2 * D + 1) * F32 + D * act + loss) + 2 * seq_len * cfg.dim_per_head * F32
    blocks = 0 if checkpointing else L * block_activation_bytes(cfg, T, act)
    return L * (T * D * F32 + router_losses) + blocks + top


def activation_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, checkpointing: bool = False,
                     autocast: Optional[str] = None) -> int:
    """Peak activation memory of one micro-batch's forward and backward: what autograd keeps, the logits
    the forward returns, and the backward's largest working set: the loss's gradient over the vocabulary
    (two T x V fp32 tensors, three with the LM-head z-loss, whose gradient joins the cross-entropy's; with
    model.loss_impl chunked, three chunk x V ones) or, with checkpointing, a recomputed block and its gradients."""
    T = micro_batch * seq_len
    act = F32 if autocast is None else 2
    if cfg.loss_impl == "chunked":  # no logits returned; the backward holds one chunk's logits, softmax, gradient
        returned, working = 0, 3 * min(cfg.loss_chunk_tokens, T) * cfg.vocab_size * F32
    else:
        z = cfg.lm_head_z_loss_coef > 0
        # the logits returned are those the z-loss keeps (counted as saved) unless autocast made a copy
        returned = 0 if z and autocast is None else T * cfg.vocab_size * act
        working = (3 if z else 2) * T * cfg.vocab_size * F32
    if checkpointing:
        working = max(working, 2 * block_activation_bytes(cfg, T, act))
    return saved_activation_bytes(cfg, micro_batch, seq_len, checkpointing, autocast) + returned + working


def autocast_weight_copies(cfg: ModelConfig, m: dict, frozen_dtype: str, checkpointing: bool) -> int:
    """bf16 copies of the fp32 matmul weights autocast makes and keeps for the backward pass: all of them,
    or with block checkpointing (nothing kept inside blocks) those of one layer and the lm head."""
    fp32 = m["trainable_params"] + (m["frozen_params"] if frozen_dtype == "float32" else 0)
    if checkpointing:
        head = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
        fp32 = head + (fp32 - head) // cfg.num_layers
    return fp32 * 2


def unit_params(p: Params, node: int) -> dict[str, tuple[int, int]]:
    """(trainable, frozen) parameter counts of each FSDP unit: 'root' and 'block' (the largest block)."""
    cfg = p.model
    own = planned_nodes(p).owned[node]
    units: dict[str, list[int]] = {}
    for name, shape in canonical_shapes(cfg).items():
        unit = name.split(".")[2] if name.startswith("model.layers.") else "root"
        t, f = units.setdefault(unit, [0, 0]), math.prod(shape)
        if is_expert_param(name):
            t[0] += f // cfg.num_experts * len(own)
            t[1] += f // cfg.num_experts * (cfg.num_experts - len(own))
        else:
            t[0] += f
    blocks = [(v[0], v[1]) for k, v in units.items() if k != "root"]
    return {"root": (units["root"][0], units["root"][1]), "block": max(blocks, key=sum) if blocks else (0, 0)}


def fsdp_gathered_bytes(p: Params, node: int) -> int:
    """What a rank holds beyond its shards under fsdp at the step's peak, the start of the backward pass (all
    activations kept): the root unit's weights, unsharded for the whole step, and the LM head's gradient the
    loss has just made; the last block, gathered for its backward, and the one before it (prefetched). A
    block's unsharded gradients exist only while its backward runs, by which time the activations of the
    blocks after it are freed: not counted. Weights are gathered in the compute dtype (bf16 under autocast;
    else fp32 and frozen experts in train.frozen_dtype), gradients made in it."""
    t = p.train
    bf16 = t.autocast is not None

    def weights(trainable: int, frozen: int) -> int:
        return (trainable + frozen) * 2 if bf16 else trainable * F32 + frozen * DTYPE_BYTES[t.frozen_dtype]
    u = unit_params(p, node)
    root, block = u["root"], u["block"]
    return weights(*root) + root[0] * (2 if bf16 else F32) + 2 * weights(*block)


def plan_node(p: Params, node: int, ranks: int = 1, parallel: Optional[str] = None) -> dict:
    """The node's memory per rank: parameters, gradients, optimizer state, activations of one micro-batch.
    `parallel`: ddp or fsdp over `ranks` ranks (default train.node_parallel; one rank is neither)."""
    cfg, t = p.model, p.train
    m = node_memory(p, node)
    parallel = (parallel or t.node_parallel) if ranks > 1 else "single"
    micro = t.micro_batch_size or planned_nodes(p).batch_size // ranks
    for ckpt in (False, True):
        act = activation_bytes(cfg, micro, t.seq_len, ckpt, t.autocast)
        if t.autocast and parallel != "fsdp":  # fsdp gathers the weights in bf16 instead (counted below)
            act += autocast_weight_copies(cfg, m, t.frozen_dtype, ckpt)
        m["activations_checkpointed_bytes" if ckpt else "activations_bytes"] = act
    m["micro_batch"], m["parallel"] = micro, parallel
    if parallel == "fsdp":
        m["sharded_bytes"] = math.ceil(m["total_bytes"] / ranks)
        m["gathered_bytes"] = fsdp_gathered_bytes(p, node)
        state = m["sharded_bytes"] + m["gathered_bytes"]
    else:
        state = m["total_bytes"] + (m["grads_bytes"] if parallel == "ddp" else 0)  # DDP's gradient buckets
    m["state_bytes"] = state
    use = m["activations_checkpointed_bytes"] if t.activation_checkpointing == "block" else m["activations_bytes"]
    m["peak_bytes"] = state + use
    return m


SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i)?)?B?\s*", re.IGNORECASE)
"""A size: a number, then optionally K/M/G/T (decimal) or Ki/Mi/Gi/Ti (binary), then optionally B."""


def parse_bytes(text: str, flag: str = "size") -> int:
    """Bytes of a size such as 48GiB or 80GB; a ConfigError naming `flag` (the option it came from) otherwise."""
    m = SIZE.fullmatch(text or "")
    if not m:
        raise ConfigError(f"{flag}: not a size: {text!r} (a positive number with an optional unit: 48GiB, 80GB, 512MiB)")
    unit, binary = (m.group(2) or "").upper(), bool(m.group(3))
    power = "KMGT".index(unit) + 1 if unit else 0
    value = int(float(m.group(1)) * ((2**10 if binary else 1000) ** power))
    if value <= 0:
        raise ConfigError(f"{flag}: a size must be above 0 bytes, got {text!r}")
    return value


def gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB"


def variants(p: Params, ranks: int) -> dict[str, dict[str, int]]:
    """Peak per GPU of the largest node for each node_parallel (fsdp only with several ranks) x loss_impl."""
    cfg = p.model
    out: dict[str, dict[str, int]] = {}
    for parallel in ("ddp", "fsdp") if ranks > 1 else ("ddp",):
        for loss in LOSS_IMPLS:
            c = dataclasses.replace(p, model=dataclasses.replace(cfg, loss_impl=loss))
            out.setdefault(parallel, {})[loss] = max(plan_node(c, i, ranks, parallel)["peak_bytes"]
                                                     for i in range(planned_nodes(p).count))
    return out


def report(p: Params, ranks: int, gpu_mem: Optional[int]) -> list[str]:
    cfg, t = p.model, p.train
    full = plan_node(on_nodes(p, "fedavg", 1), 0, ranks)
    how = f", {t.node_parallel}" if ranks > 1 else ""
    lines = [f"model: {sum(math.prod(v) for v in canonical_shapes(cfg).values()):,} parameters; micro-batch "
             f"{full['micro_batch']} x {t.seq_len} tokens per rank, {ranks} rank(s) per node{how}"]
    rows: dict[str, list[int]] = {}
    for i in range(planned_nodes(p).count):
        m = plan_node(p, i, ranks)
        fits = "" if gpu_mem is None else (" fits" if m["peak_bytes"] <= gpu_mem else " DOES NOT FIT") + \
            f" in {gpu_mem / 2**30:.0f} GiB"
        held = f"; per rank {gib(m['sharded_bytes'])} of shards + {gib(m['gathered_bytes'])} gathered" \
            if m["parallel"] == "fsdp" else ""
        rows.setdefault(
            f"trainable {m['trainable_params']:,} / frozen {m['frozen_params']:,} ({t.frozen_dtype}) params;"
            f" weights {m['weights_bytes'] / 2**30:.2f} + grads {m['grads_bytes'] / 2**30:.2f} + Adam "
            f"{m['optimizer_bytes'] / 2**30:.2f} GiB{held}; activations {gib(m['activations_bytes'])} "
            f"({gib(m['activations_checkpointed_bytes'])} with block checkpointing); peak per GPU "
            f"{gib(m['peak_bytes'])} = {m['peak_bytes'] / full['peak_bytes']:.2f}x training the whole "
            f"model{fits}", []).append(i)
    for text, nodes in rows.items():  # nodes with the same numbers share a line
        lines.append(f"node{'s' if len(nodes) > 1 else ''} {_ranges(nodes)}: {text}")
    lines.append(f"whole model on one node of {ranks} rank(s): peak per GPU {gib(full['peak_bytes'])}")
    grid = variants(p, ranks)
    lines.append("peak per GPU of the largest node: " + "; ".join(
        f"{par} {loss} loss {gib(b)}" for par, row in grid.items() for loss, b in row.items())
        + ("" if ranks > 1 else " (fsdp needs orchestration.gpus_per_node >= 2)"))
    return lines


def summary(p: Params, ranks: int, gpu_mem: Optional[int]) -> dict:
    """The largest node's plan as one JSON-able dict (`--json`): fits, peak bytes per GPU, and the peaks of the
    other node_parallel and loss_impl choices."""
    cfg, t = p.model, p.train
    nodes = [plan_node(p, i, ranks) for i in range(planned_nodes(p).count)]
    worst = max(nodes, key=lambda m: m["peak_bytes"])
    grid = variants(p, ranks)
    other = "plain" if cfg.loss_impl == "chunked" else "chunked"
    return {"fits": None if gpu_mem is None else worst["peak_bytes"] <= gpu_mem, "gpu_mem_bytes": gpu_mem,
            "peak_bytes_per_gpu": worst["peak_bytes"], "ranks_per_node": ranks, "node_parallel": worst["parallel"],
            "loss_impl": cfg.loss_impl, f"peak_bytes_per_gpu_{other}_loss": grid["ddp" if ranks == 1 else
                                                                               t.node_parallel][other],
            "peak_bytes_per_gpu_by_choice": grid, "micro_batch": worst["micro_batch"],
            "activation_checkpointing": t.activation_checkpointing, "nodes": len(nodes),
            "weights_grads_adam_bytes": worst["state_bytes"],
            "activations_bytes": worst["peak_bytes"] - worst["state_bytes"]}


def budget_bytes(budget: Optional[str], variants: dict) -> Optional[int]:
    """compare.node_memory in bytes: a variant's planned per-node weights + gradients + Adam (its largest
    node), or a size; None without a budget. `variants`: name -> its resolved Params."""
    if budget is None:
        return None
    if budget in variants:
        return node_peak_state(variants[budget])
    try:
        return parse_bytes(budget, "compare.node_memory")
    except ValueError:
        raise ConfigError(f"compare.node_memory must be a variant ({sorted(variants)}) or a size like 40MiB, "
                          f"got {budget!r}") from None


def node_peak_state(vp) -> int:
    """The planned weights + gradients + Adam of a run's largest node."""
    return max(node_memory(vp, i)["total_bytes"] for i in range(planned_nodes(vp).count))


def _ranges(nodes: list[int]) -> str:
    return f"{nodes[0]}-{nodes[-1]}" if len(nodes) > 1 and nodes == list(range(nodes[0], nodes[-1] + 1)) \
        else ", ".join(map(str, nodes))
