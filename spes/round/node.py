"""One node's part of a sync round, as a library call (no orchestration):

  global r-1 (rebuilt from deltas, or downloaded)  +  the node's state the global was built with
    -> sync_steps local steps  ->  encoded delta upload (committed)  +  the node's state after round r

The node's state stays on its machine (spes/run/node_state.py) and goes to shared storage only at checkpoint
rounds, before the upload is committed (so a committed upload implies its checkpoint exists). Every byte
the node reads or writes on shared storage is counted in what it reports.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from spes.config.schema import ModelConfig, Params
from spes.data.tokens import BatchStream, TokenData
from spes.errors import NonFiniteLoss, StorageError
from spes.model.transformer import CausalLM
from spes.round.fetch import fetch_global
from spes.run.layout import RunLayout
from spes.run.node_state import NodeState, NodeStateDir
from spes.run.run import Run
from spes.storage.store import BundleWriter, Store
from spes.sync.codecs import make_codec
from spes.sync.deltas import EXPERTS_FILE, encode_upload, experts_file
from spes.train.devices import resolve_device
from spes.train.distributed import broadcast_object, broadcast_tensors, rank_and_size
from spes.train.trainer import build_node_trainer


def node_seed(seed: int, node: int, r: int) -> int:
    """Torch RNG seed of node `node` in round r: distinct per (run seed, node, round), so any use of
    randomness in a step (dropout, noise) replays exactly on a retry or resume. Spaced by primes."""
    return seed * 100003 + node * 1009 + r


def node_state_root(p: Params) -> str:
    o = p.orchestration
    return os.path.expanduser(o.node_state_dir or os.path.join(o.node_cache_dir, "state"))


def last_checkpoint_round(r: int, every: int) -> int:
    return r - r % every


def node_meta(manifest: dict) -> dict:
    """What a node reports for a committed upload: its meta, plus every byte it wrote for it."""
    mbytes = len(json.dumps(manifest, indent=1, sort_keys=True).encode()) + 64  # manifest + COMMIT
    return {**manifest["meta"], "bytes_up": manifest["meta"]["bytes_up_files"] + mbytes}


def _check_finite(losses: list[float], first_step: int, node: int, r: int, trained: dict) -> None:
    for i, v in enumerate(losses):
        if not torch.isfinite(torch.tensor(v)):
            raise NonFiniteLoss(f"node {node} round {r}: loss is {v} at step {first_step + i}; nothing committed "
                                "(lower spes.optim.lr or check the data)")
    for name, t in trained.items():
        if not torch.isfinite(t).all():
            raise NonFiniteLoss(f"node {node} round {r}: {name} is not finite after step {first_step + len(losses) - 1}; "
                                "nothing committed")


@dataclass
class RoundInputs:
    """What a node needs to train round r, read by rank 0 (from storage and its own folder)."""

    prev: dict[str, torch.Tensor]
    prev_sha: str
    model_config: dict
    state: Optional[NodeState]
    ref: Optional[dict]
    local: NodeStateDir


def _round_inputs(p: Params, store: Store, run: str, r: int, node: int) -> RoundInputs:
    layout = RunLayout(run)
    info = Run(store, run).info()
    if info is None:
        raise StorageError(f"run {run!r} has no info on {store.url}")
    local = NodeStateDir(node_state_root(p), store.url, run, info["run_id"], node)
    prev_manifest = store.read_manifest(layout.global_dir(r - 1))
    prev_meta = prev_manifest["meta"]
    ref = prev_meta.get("node_states", {}).get(str(node))
    local.discard_after(int(ref["round"]) if ref else 0)
    state = local.load_state(ref, store, layout.state_dir(int(ref["round"]), node)) if ref else None
    codec = make_codec(p.sync.codec, p.sync.int8_block)
    # its own experts' rows in the delta are the bytes it uploaded last: no need to download them back
    own_cached = {experts_file(node): (state.experts_sha256, state.experts_upload)} \
        if state is not None and state.experts_upload else None
    prev, prev_sha = fetch_global(store, layout, r - 1, prev_manifest, codec, p.spes.method, local.base(),
                                  local.load_base, own_cached)
    if local.base() != (r - 1, prev_sha) and local.save_base(r - 1, prev) != prev_sha:
        raise StorageError(f"node {node}: global {r - 1} as held here does not hash to the committed {prev_sha[:12]}")
    return RoundInputs(prev, prev_sha, prev_meta["model_config"], state, ref, local)


def _share(inputs: Optional[RoundInputs]) -> tuple[dict, dict, dict, int]:
    """(global r-1, model config, optimizer tensors, data position) on every rank of the node."""
    lead = inputs is not None
    small = broadcast_object((inputs.model_config, inputs.state.data_position if inputs.state else 0,
                              inputs.state is not None) if lead else None)
    prev = broadcast_tensors(inputs.prev if lead else None)
    optim = broadcast_tensors(inputs.state.optim if lead and inputs.state else None) if small[2] else {}
    return prev, small[0], optim, small[1]


def node_round(p: Params, store: Store, run: str, r: int, node: int, data: TokenData,
               on_step: Optional[Callable[[int], None]] = None, checkpoint: bool = False) -> Optional[dict]:
    """Run node `node`'s `sync_steps` local steps of round r and commit its upload; returns its meta.

    On a node of several ranks (torch.distributed initialized) every rank calls this: each trains on its
    share of every batch (data parallel), rank 0 alone reads and writes storage and returns the meta
    (the others return None)."""
    s, layout = p.spes, RunLayout(run)
    rank, ranks = rank_and_size()
    lead = rank == 0
    rel = layout.node_dir(r, node)
    if broadcast_object(lead and store.is_committed(rel)):  # a retry after the node already finished
        return node_meta(store.read_manifest(rel)) if lead else None
    t0, read0, written0 = time.perf_counter(), store.bytes_read, store.bytes_written
    inputs = _round_inputs(p, store, run, r, node) if lead else None
    prev, model_config, optim, position = _share(inputs)

    device = resolve_device(p.orchestration.device, node * ranks + rank)
    model = CausalLM(ModelConfig(**model_config))
    model.load_canonical_state_dict(prev)
    trainer = build_node_trainer(s, model.to(device), node)
    if optim:
        trainer.load_optimizer_tensors(optim)
    torch.manual_seed(node_seed(s.seed, node, r))
    stream = BatchStream(data.train, s.node_batch_size, s.seq_len, s.seed, node, position, order=p.data.order,
                         num_nodes=s.nodes)
    share = slice(rank * s.node_batch_size // ranks, (rank + 1) * s.node_batch_size // ranks)
    t_load = time.perf_counter() - t0

    losses, tokens, counts = [], 0, None
    t1 = time.perf_counter()
    first_step = (r - 1) * s.sync_steps
    for i in range(s.sync_steps):
        x, y = stream.next()  # the node's batch; this rank's rows of it
        m = trainer.train_step(x[share], y[share], first_step + i)
        losses.append(m.ce)
        tokens += m.tokens
        if m.expert_counts_LE is not None:
            counts = m.expert_counts_LE if counts is None else counts + m.expert_counts_LE
        if on_step is not None:
            on_step(i)
    losses = torch.stack(losses).tolist()  # the round's one wait for the device
    t_compute = time.perf_counter() - t1
    if not lead:
        return None

    t2 = time.perf_counter()
    trained = trainer.upload()
    _check_finite(losses, first_step, node, r, trained)
    state, local = inputs.state, inputs.local
    codec = make_codec(p.sync.codec, p.sync.int8_block)
    files, residual = encode_upload(s.method, codec, prev, trained, trainer.owned,
                                    state.residual if state is not None else None, p.sync.error_feedback)
    saved = local.save_state(r, stream.position, trainer.optimizer_tensors(), residual, files.get(EXPERTS_FILE, {}))
    if checkpoint:  # the same files, so the same digest: a resume can take it from either place
        store.remove(layout.state_dir(r, node))
        store.write_bundle(layout.state_dir(r, node), saved["files"], saved["meta"])
    bytes_down = store.bytes_read - read0
    meta = {"round": r, "node": node, "experts": list(trainer.owned), "tokens": tokens,
            "base_round": r - 1, "base_sha256": inputs.prev_sha, "codec": codec.name,
            "state": {"round": r, "digest": saved["digest"], "checkpoint": checkpoint},
            "step_end": r * s.sync_steps, "loss_first": losses[0], "loss_last": losses[-1],
            "loss_mean": sum(losses) / len(losses), "losses": losses,
            "expert_load": counts.cpu().tolist() if counts is not None else [], "ranks": ranks,
            "bytes_down": bytes_down, "seconds_load": t_load, "seconds_compute": t_compute, "device": str(device),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    up = BundleWriter(store, rel)
    for fname, parts in files.items():
        up.add(fname, parts)
    meta["bytes_up_files"] = store.bytes_written - written0
    manifest = up.commit(meta)
    ref = inputs.ref
    local.prune_before(min(int(ref["round"]) if ref else 0, last_checkpoint_round(r, p.checkpoint.every_rounds)))
    return {**node_meta(manifest), "seconds_save": time.perf_counter() - t2}
