"""One SPES sync round as library calls (no orchestration): a node's local steps and the aggregation.

Everything a round needs comes from committed bundles on the store, and everything it produces is
committed there, so any node can run on any machine and a run resumes exactly from any committed round:
  global r-1  ->  node_round(i) for each node  ->  aggregate_round  ->  global r
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from spes.aggregate import NodeResult, OuterState, aggregate
from spes.config import ModelConfig, Params
from spes.data import BatchStream, TokenData
from spes.devices import resolve_device
from spes.merging import merge_alpha, merge_due, merge_experts
from spes.model import CausalLM
from spes.runs.layout import MODEL_FILE, OPTIM_FILE, OUTER_FILE, UPLOAD_FILE, RunLayout
from spes.store import Store, StoreError
from spes.trainer import build_node_trainer


def node_seed(seed: int, node: int, r: int) -> int:
    """Torch RNG seed of node `node` in round r: distinct per (run seed, node, round), so any future use of
    randomness in a step (dropout, noise) replays exactly on a retry or resume. Spaced by primes."""
    return seed * 100003 + node * 1009 + r


def load_global(store: Store, run: str, r: int) -> tuple[CausalLM, dict, Optional[OuterState]]:
    b = store.read_bundle(RunLayout(run).global_dir(r))
    model = ModelConfig(**b.meta["model_config"]).build()
    model.load_canonical_state_dict(b.files[MODEL_FILE])
    outer = OuterState(dict(b.files[OUTER_FILE])) if OUTER_FILE in b.files else None
    return model, b.manifest, outer


def latest_node_state(store: Store, run: str, node: int, before_round: int):
    """The node's most recent committed bundle before `before_round` (None at the start)."""
    layout = RunLayout(run)
    for r in range(before_round - 1, 0, -1):
        rel = layout.node_dir(r, node)
        if store.is_committed(rel):
            return store.read_bundle(rel, only=[OPTIM_FILE])
    return None


def node_round(p: Params, store: Store, run: str, r: int, node: int, data: TokenData,
               on_step: Optional[Callable[[int], None]] = None) -> dict:
    """Run node `node`'s `sync_steps` local steps of round r and commit its bundle; returns its meta."""
    s = p.spes
    rel = RunLayout(run).node_dir(r, node)
    if store.is_committed(rel):  # a retry after the node already finished: idempotent
        return node_meta(store.read_manifest(rel))
    t0 = time.perf_counter()
    device = resolve_device(p.orchestration.device, node)
    model, gmanifest, _ = load_global(store, run, r - 1)
    model.to(device)
    bytes_down = gmanifest["files"][MODEL_FILE]["bytes"]
    trainer = build_node_trainer(s, model, node)
    own = trainer.owned
    prev = latest_node_state(store, run, node, r)
    position = 0
    if prev is not None:
        trainer.load_optimizer_tensors({k: v for k, v in prev.files[OPTIM_FILE].items() if "::" in k})
        position = int(prev.meta["data_position"])
    torch.manual_seed(node_seed(s.seed, node, r))
    stream = BatchStream(data.train, s.batch_size, s.seq_len, s.seed, node, position)
    t_load = time.perf_counter() - t0

    losses, tokens, counts = [], 0, None
    t1 = time.perf_counter()
    for i in range(s.sync_steps):
        step = (r - 1) * s.sync_steps + i
        x, y = stream.next()
        m = trainer.train_step(x, y, step)
        losses.append(m.ce)
        tokens += m.tokens
        if m.expert_counts_LE is not None:
            counts = m.expert_counts_LE if counts is None else counts + m.expert_counts_LE
        if on_step is not None:
            on_step(i)
    losses = torch.stack(losses).tolist()  # the round's one wait for the device
    counts = counts.cpu() if counts is not None else None
    t_compute = time.perf_counter() - t1

    t2 = time.perf_counter()
    upload = trainer.upload()
    optim = trainer.optimizer_tensors()
    meta = {"round": r, "node": node, "experts": list(own), "tokens": tokens, "data_position": stream.position,
            "step_end": r * s.sync_steps, "loss_first": losses[0], "loss_last": losses[-1],
            "loss_mean": sum(losses) / len(losses), "losses": losses,
            "expert_load": counts.tolist() if counts is not None else [],
            "bytes_down": bytes_down, "seconds_load": t_load, "seconds_compute": t_compute, "device": str(device)}
    manifest = store.write_bundle(rel, {UPLOAD_FILE: upload, OPTIM_FILE: optim}, meta)
    return {**node_meta(manifest), "seconds_save": time.perf_counter() - t2}


def node_meta(manifest: dict) -> dict:
    """What a node reports for a committed round: its bundle's meta plus the bytes it uploaded."""
    return {**manifest["meta"], "bytes_up": manifest["files"][UPLOAD_FILE]["bytes"]}


def committed_nodes(store: Store, run: str, r: int, num_nodes: int) -> list[int]:
    layout = RunLayout(run)
    return [i for i in range(num_nodes) if store.is_committed(layout.node_dir(r, i))]


def aggregate_round(p: Params, store: Store, run: str, r: int, min_nodes: Optional[int] = None) -> dict:
    """Combine the committed node bundles of round r into global r (with merging when due)."""
    s, layout = p.spes, RunLayout(run)
    rel = layout.global_dir(r)
    if store.is_committed(rel):
        return store.read_manifest(rel)["meta"]
    t0 = time.perf_counter()
    gb = store.read_bundle(layout.global_dir(r - 1))  # tensors as stored: no model to build
    prev = gb.files[MODEL_FILE]
    cfg = ModelConfig(**gb.meta["model_config"])
    outer = OuterState(dict(gb.files[OUTER_FILE])) if OUTER_FILE in gb.files else None
    present = committed_nodes(store, run, r, s.num_nodes)
    need = min_nodes if min_nodes is not None else s.num_nodes
    if len(present) < need:
        raise StoreError(f"round {r}: only nodes {present} committed, quorum is {need} of {s.num_nodes}")
    results, node_meta = [], {}
    for i in present:
        b = store.read_bundle(layout.node_dir(r, i), only=[UPLOAD_FILE])
        results.append(NodeResult(i, b.files[UPLOAD_FILE], tuple(b.meta["experts"]), b.meta["tokens"]))
        node_meta[i] = b.meta
    if s.method == "diloco" and outer is None:
        outer = OuterState()
    new = aggregate(s.method, prev, results, outer, token_weighted=s.token_weighted,
                    outer_lr=s.outer_lr, outer_momentum=s.outer_momentum, outer_nesterov=s.outer_nesterov)
    step = r * s.sync_steps
    alpha = merge_alpha(step, s.merge.alpha_start, s.merge.decay_steps) if s.merge.enabled else 0.0
    merged = cfg.is_moe and s.merge.enabled and merge_due(step, s.merge.interval, alpha)
    if merged:
        new = merge_experts(new, alpha, s.merge.top_k)
    files = {MODEL_FILE: new}
    if outer is not None and outer.momentum:
        files[OUTER_FILE] = outer.momentum
    meta = {"round": r, "step": step, "method": s.method, "model_config": dataclasses.asdict(cfg),
            "contributors": present, "missing": [i for i in range(s.num_nodes) if i not in present],
            "merge_alpha": alpha if merged else 0.0, "merged": bool(merged),
            "node_loss": {str(i): node_meta[i]["loss_mean"] for i in present},
            "seconds_aggregate": time.perf_counter() - t0}
    store.write_bundle(rel, files, meta)
    return meta
