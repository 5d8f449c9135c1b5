"""A round's time over a node's link, from the config alone: what it moves (spes/sync/traffic.py) at the
link's rate and latency, against the time it computes at a stated throughput.

    python -m spes.plan --params configs/spes-2b-16nodes.yaml --link 100Mbit/s --rtt 50ms [--json]
        [--storage-link 10Gbit/s] [--tflops 150] [--mfu 0.3]

Compute per round: the node's tokens (train.batch_size x seq_len x sync.every_steps) x the training FLOPs per
token (6 x the parameters a token passes through, the embedding lookup excluded, the LM head included, plus
the attention scores: 12 x layers x heads x head dim x sequence length), over gpus_per_node x tflops x mfu.
Transfer per round: the steady round's bytes up, then down, at the link's rate, plus one round trip per file
moved; with `--storage-link`, the storage side carries every node's bytes at once, and a phase takes as
long as the slower of the two. The aggregation itself is taken to run beside the storage (not priced).
Sequential: compute + transfer (sync.overlap none). Hidden: max(compute, transfer), the bound that
sync.overlap one_round (the next round trained while this one is sent, aggregated and fetched) approaches.
"""
from __future__ import annotations

import math
import re
from typing import Optional

from spes.config.schema import ModelConfig, Params
from spes.errors import ConfigError
from spes.model.names import canonical_shapes, is_expert_param
from spes.sync.traffic import RoundTraffic, largest_node_traffic
from spes.train.planned_nodes import planned_nodes

DEFAULT_TFLOPS = 150.0
"""Dense bf16 peak of a 48 GB workstation GPU of the paper's class (RTX A6000 / A40: about 150 TFLOPS)."""
DEFAULT_MFU = 0.3

RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKMGT])?\s*(bit/s|bps|b/s|B/s|Bps)\s*")
DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*")


def parse_rate(text: str, flag: str = "rate") -> float:
    """Bits per second of a rate such as 100Mbit/s, 1Gbps, 12.5MB/s (decimal prefixes, B = bytes)."""
    m = RATE.fullmatch(text or "")
    if not m:
        raise ConfigError(f"{flag}: not a rate: {text!r} (e.g. 100Mbit/s, 1Gbit/s, 50Mbps, 12.5MB/s)")
    power = " kMGT".index(m.group(2).replace("K", "k")) if m.group(2) else 0
    bits = float(m.group(1)) * 1000**power * (8 if m.group(3) in ("B/s", "Bps") else 1)
    if bits <= 0:
        raise ConfigError(f"{flag}: a rate must be above 0, got {text!r}")
    return bits


def parse_duration(text: str, flag: str = "duration") -> float:
    """Seconds of a duration such as 50ms, 0.2s, 800us."""
    m = DURATION.fullmatch(text or "")
    if not m:
        raise ConfigError(f"{flag}: not a duration: {text!r} (e.g. 50ms, 0.2s)")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token (see the module doc)."""
    active = 0
    for name, shape in canonical_shapes(cfg).items():
        n = math.prod(shape)
        if name.endswith("embed_tokens.weight"):
            continue
        active += n * cfg.top_k // cfg.num_experts if is_expert_param(name) else n
    if cfg.tie_embeddings:
        active += cfg.vocab_size * cfg.hidden_size  # the LM head's matmul, with the embedding's weights
    return 6.0 * active + 12.0 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * seq_len


def link_plan(p: Params, gpus: int, link_bps: float, rtt_s: float,
              storage_bps: Optional[float] = None, tflops: float = DEFAULT_TFLOPS, mfu: float = DEFAULT_MFU) -> dict:
    """The largest node's steady round: bytes, transfer and compute seconds, their ratio (JSON-able)."""
    if not (tflops > 0 and 0 < mfu <= 1):
        raise ConfigError(f"--tflops must be > 0 and --mfu in (0, 1], got {tflops} and {mfu}")
    cfg, sync, seq_len = p.model, p.sync, p.train.seq_len
    planned = planned_nodes(p)
    traffic: RoundTraffic = largest_node_traffic(p, planned.method)
    nodes, tokens = planned.count, planned.batch_size * seq_len * sync.every_steps

    def phase(nbytes: int, files: int) -> float:
        t = nbytes * 8 / link_bps + files * rtt_s
        return max(t, nodes * nbytes * 8 / storage_bps) if storage_bps else t

    up_s, down_s = phase(traffic.up_bytes, len(traffic.up)), phase(traffic.down_bytes, len(traffic.down))
    compute_s = tokens * train_flops_per_token(cfg, seq_len) / (gpus * tflops * 1e12 * mfu)
    transfer_s = up_s + down_s
    return {"codec": sync.codec, "nodes": nodes, "link_bits_per_s": link_bps, "rtt_s": rtt_s,
            "storage_bits_per_s": storage_bps, "tflops": tflops, "mfu": mfu, "gpus_per_node": gpus,
            "tokens_per_node_round": tokens, "bytes_up_per_node_round": traffic.up_bytes,
            "bytes_down_per_node_round": traffic.down_bytes, "files_per_node_round": traffic.requests,
            "up_s": up_s, "down_s": down_s, "transfer_s": transfer_s, "compute_s": compute_s,
            "transfer_to_compute": transfer_s / compute_s, "round_s_sequential": compute_s + transfer_s,
            "round_s_hidden": max(compute_s, transfer_s),
            "wall_to_compute_sequential": (compute_s + transfer_s) / compute_s,
            "wall_to_compute_hidden": max(compute_s, transfer_s) / compute_s}


def _rate(bps: float) -> str:
    for unit, k in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= k:
            return f"{bps / k:g} {unit}"
    return f"{bps:g} bit/s"


def link_report(plan: dict) -> list[str]:
    storage = f", storage side {_rate(plan['storage_bits_per_s'])}" if plan["storage_bits_per_s"] else ""
    return [
        f"link {_rate(plan['link_bits_per_s'])}, RTT {plan['rtt_s'] * 1e3:g} ms{storage}; codec {plan['codec']}; "
        f"compute at {plan['tflops']:g} TFLOPS x MFU {plan['mfu']:g} x {plan['gpus_per_node']} GPU(s) per node "
        f"(--tflops, --mfu)",
        f"per node per round: up {plan['bytes_up_per_node_round'] / 1e6:,.1f} MB in {plan['up_s']:.1f} s, down "
        f"{plan['bytes_down_per_node_round'] / 1e6:,.1f} MB in {plan['down_s']:.1f} s "
        f"({plan['files_per_node_round']} files); compute {plan['tokens_per_node_round']:,} tokens in "
        f"{plan['compute_s']:.1f} s",
        f"transfer / compute {plan['transfer_to_compute']:.2f}; round {plan['round_s_sequential']:.1f} s sequential "
        f"({plan['wall_to_compute_sequential']:.2f}x compute), {plan['round_s_hidden']:.1f} s with the sync "
        f"hidden behind compute (sync.overlap one_round's bound) ({plan['wall_to_compute_hidden']:.2f}x)"]
