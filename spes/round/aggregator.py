"""The aggregator: committed node uploads of round r + global r-1 -> delta bundle r + global r.

Streams tensor by tensor: it holds one tensor of each input at a time (the previous global, its outer state
and residual, each node's upload), never a whole upload, and hashes every byte it reads and writes on the
way (on helper threads). Merging (SPES only) pulls each layer's experts toward their most similar peers
while alpha > 0. The expert rows of a non-merging round are not copied: the delta refers to the owners'
uploads. The global it committed last stays in memory (one model), so the next round need not read it.

Uploads that fail verification (truncated, altered, a delta against another base, another codec) are
moved aside to `runs/<run>/rejected/` with the file named in the log; with `rerun_rejected` the call then
raises UploadsRejected (the caller re-runs those nodes), else they are left out under the quorum.
"""
from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Optional

import torch

from spes.config.ownership import ownership_for
from spes.config.schema import Params
from spes.errors import IntegrityError, NotCommitted, QuorumError, StorageError, UploadsRejected
from spes.run.layout import MODEL_FILE, OUTER_FILE, RESIDUAL_FILE, RunLayout
from spes.storage.store import BundleWriter, Store
from spes.sync.codecs import make_codec
from spes.sync.deltas import (
    EXPERTS_FILE,
    SHARED_FILE,
    add_decoded,
    add_decoded_rows,
    encode_with_feedback,
    encoded_specs,
    experts_file,
    is_averaged,
    read_parts,
)
from spes.sync.merging import merge_alpha, merge_due, merge_layer
from spes.sync.methods import global_change, node_weights

log = logging.getLogger("spes.round.aggregator")


class _BadUpload(Exception):
    def __init__(self, node: int, msg: str):
        self.node, self.msg = node, msg


class _HeldGlobal:
    """The last global this process committed: (store url, run, round, sha256) -> tensors."""

    key: Optional[tuple] = None
    tensors: Optional[dict] = None

    @classmethod
    def get(cls, key: tuple) -> Optional[dict]:
        return cls.tensors if cls.key == key else None

    @classmethod
    def put(cls, key: Optional[tuple], tensors: Optional[dict]) -> None:
        cls.key, cls.tensors = key, tensors


class _Cached:
    """A reader over held tensors (TensorReader's `read`): each is let go once read, so the previous and the
    new global together stay within about one model."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def read(self, name: str) -> torch.Tensor:
        return self.tensors.pop(name)


def _shapes(entry: dict) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t["shape"]) for n, t in entry["tensors"].items()}


def _check_upload(manifest: dict, r: int, node: int, base_sha: str, codec: str) -> Optional[str]:
    m = manifest["meta"]
    if m.get("round") != r or m.get("node") != node:
        return f"upload says round {m.get('round')} node {m.get('node')}"
    if m.get("base_sha256") != base_sha:
        return (f"its delta is against global {m.get('base_round')} ({str(m.get('base_sha256'))[:12]}), not the "
                f"committed global {r - 1} ({base_sha[:12]})")
    if m.get("codec") != codec:
        return f"codec {m.get('codec')!r}, the run uses {codec!r}"
    return None


class _Round:
    """One attempt at aggregating round r from a set of contributors."""

    def __init__(self, p: Params, store: Store, layout: RunLayout, r: int, prev: dict, uploads: dict[int, dict]):
        s = p.spes
        self.p, self.s, self.store, self.layout, self.r = p, s, store, layout, r
        self.codec = make_codec(p.sync.codec, p.sync.int8_block)
        self.prev, self.uploads = prev, uploads
        self.nodes = sorted(uploads)
        self.weights = node_weights([uploads[i]["meta"]["tokens"] for i in self.nodes], s.token_weighted)
        cfg = prev["meta"]["model_config"]
        self.own = ownership_for(s.method, cfg["num_experts"], s.nodes, s.ownership) if cfg["num_experts"] else None
        step = r * s.sync_steps
        alpha = merge_alpha(step, s.merge.alpha_start, s.merge.decay_steps)
        self.merging = s.method == "spes" and s.merge.enabled and cfg["num_experts"] > 0 and merge_due(step, s.merge.interval, alpha)
        self.alpha = alpha if self.merging else 0.0
        self.shapes = _shapes(prev["files"][MODEL_FILE])
        self.feedback = p.sync.error_feedback and not self.codec.exact

    def rows(self, owner: int) -> list[int]:
        return list(self.own.owned(owner))

    def run(self) -> tuple[BundleWriter, BundleWriter, dict[str, list[int]]]:
        """Write the delta and global bundles (uncommitted); returns their writers and the expert files."""
        prev_files = self.prev["files"]
        averaged = {n: sh for n, sh in self.shapes.items() if is_averaged(self.s.method, n)}
        expert_names = {n: sh for n, sh in self.shapes.items() if n not in averaged}
        owners = [j for j in range(self.s.nodes) if self.merging or j in self.uploads] if expert_names else []
        self.new_model: dict[str, torch.Tensor] = {}
        delta = BundleWriter(self.store, self.layout.delta_dir(self.r))
        glob = BundleWriter(self.store, self.layout.global_dir(self.r))
        outer_momentum = self.s.method == "diloco" and self.s.outer_momentum > 0
        with contextlib.ExitStack() as st:
            rd = lambda rel, f, e: st.enter_context(self.store.open_reader(rel, f, e))  # noqa: E731
            held = _HeldGlobal.get((self.store.url, self.layout.run, self.r - 1, prev_files[MODEL_FILE]["sha256"]))
            prev_model = _Cached(held) if held is not None else \
                rd(self.layout.global_dir(self.r - 1), MODEL_FILE, prev_files[MODEL_FILE])
            prev_outer = rd(self.layout.global_dir(self.r - 1), OUTER_FILE, prev_files[OUTER_FILE]) \
                if OUTER_FILE in prev_files else None
            prev_res = rd(self.layout.global_dir(self.r - 1), RESIDUAL_FILE, prev_files[RESIDUAL_FILE]) \
                if RESIDUAL_FILE in prev_files else None
            shared_in = {i: self._node_reader(st, i, SHARED_FILE) for i in self.nodes}
            experts_in = {i: self._node_reader(st, i, EXPERTS_FILE) for i in self.nodes} if expert_names else {}
            w_model = st.enter_context(glob.stream(MODEL_FILE, [(n, torch.float32, self.shapes[n]) for n in sorted(self.shapes)]))
            w_outer = st.enter_context(glob.stream(OUTER_FILE, [(n, torch.float32, averaged[n]) for n in sorted(averaged)])) \
                if outer_momentum else None
            w_res = st.enter_context(glob.stream(RESIDUAL_FILE, [(n, torch.float32, averaged[n]) for n in sorted(averaged)])) \
                if self.feedback else None
            w_shared = st.enter_context(delta.stream(SHARED_FILE, encoded_specs(self.codec, averaged)))
            w_experts = {j: st.enter_context(delta.stream(experts_file(j), encoded_specs(
                self.codec, {n: (len(self.rows(j)), *sh[1:]) for n, sh in expert_names.items()})))
                for j in owners} if self.merging else {}
            names = sorted(self.shapes)
            k = 0
            while k < len(names):
                name = names[k]
                if name in averaged:
                    self._averaged(name, prev_model, prev_outer, prev_res, shared_in, w_model, w_outer, w_res, w_shared)
                    k += 1
                else:
                    group = names[k:k + 2] if self.merging else [name]  # a layer's down_proj, gate_up_proj
                    if self.merging and [g.rsplit(".", 1)[-1] for g in group] != ["down_proj", "gate_up_proj"]:
                        raise StorageError(f"merging: expected a layer's down_proj and gate_up_proj, got {group}")
                    self._experts(group, prev_model, experts_in, w_model, w_experts)
                    k += len(group)
            for i, rdr in list(shared_in.items()) + list(experts_in.items()):
                self._finish(i, rdr)
        expert_files = {}
        for j in owners:
            ref = {"rows": self.rows(j)}
            if not self.merging:  # the owner's upload is the delta of its rows: refer to it, copy nothing
                entry = self.uploads[j]["files"][EXPERTS_FILE]
                ref.update(source=self.layout.node_dir(self.r, j), file=EXPERTS_FILE, sha256=entry["sha256"],
                           bytes=entry["bytes"])
            expert_files[experts_file(j)] = ref
        return delta, glob, expert_files

    def _node_reader(self, st, i: int, fname: str):
        rel = self.layout.node_dir(self.r, i)
        entry = self.uploads[i]["files"].get(fname)
        if entry is None:
            raise _BadUpload(i, f"{self.store.url}/{rel}: no {fname}")
        try:
            return st.enter_context(self.store.open_reader(rel, fname, entry))
        except IntegrityError as e:
            raise _BadUpload(i, str(e)) from None

    def _read(self, i: int, rdr, name: str, shape):
        try:
            return read_parts(rdr, self.codec, name, shape)
        except IntegrityError as e:
            raise _BadUpload(i, str(e)) from None

    def _finish(self, i: int, rdr) -> None:
        try:
            rdr.finish()
        except IntegrityError as e:
            raise _BadUpload(i, str(e)) from None

    def _averaged(self, name, prev_model, prev_outer, prev_res, shared_in, w_model, w_outer, w_res, w_shared):
        shape = self.shapes[name]
        prev_t = prev_model.read(name)
        deltas = [self.codec.decode(name, self._read(i, shared_in[i], name, shape), shape) for i in self.nodes]
        buf = prev_outer.read(name) if prev_outer is not None else None
        change, new_buf = global_change(self.s.method, deltas, self.weights, buf, outer_lr=self.s.outer_lr,
                                        outer_momentum=self.s.outer_momentum, outer_nesterov=self.s.outer_nesterov)
        residual = {name: prev_res.read(name)} if prev_res is not None else None
        parts, new_res = encode_with_feedback(self.codec, name, change, residual, self.feedback)
        for part in sorted(parts):
            w_shared.write(part, parts[part])
        self._put(w_model, name, add_decoded(prev_t, self.codec, name, parts))
        if w_outer is not None:
            w_outer.write(name, new_buf)
        if w_res is not None:
            w_res.write(name, new_res)

    def _experts(self, group, prev_model, experts_in, w_model, w_experts):
        prevs = {n: prev_model.read(n) for n in group}
        shapes = {n: self.shapes[n] for n in group}
        up = {n: {} for n in group}  # name -> node -> parts, read in file order
        for n in group:
            for i in self.nodes:
                up[n][i] = self._read(i, experts_in[i], n, (len(self.rows(i)), *shapes[n][1:]))
        if self.merging:
            target = {n: add_decoded_rows(prevs[n], [(self.rows(i), up[n][i]) for i in self.nodes], self.codec, n)
                      for n in group}
            merged = merge_layer({k.rsplit(".", 1)[-1]: v for k, v in target.items()}, self.alpha, self.s.merge.top_k)
            merged = {n: merged[n.rsplit(".", 1)[-1]] for n in group}
            send = {n: {j: self.codec.encode(n, (merged[n] - prevs[n])[self.rows(j)]) for j in w_experts} for n in group}
        else:
            send = up
        for n in group:
            for j in sorted(w_experts):
                for part in sorted(send[n][j]):
                    w_experts[j].write(part, send[n][j][part])
            owners = sorted(send[n])  # sorted, like apply_delta on the nodes: the same bits
            self._put(w_model, n, add_decoded_rows(prevs[n], [(self.rows(j), send[n][j]) for j in owners], self.codec, n))

    def _put(self, w_model, name: str, t: torch.Tensor) -> None:
        w_model.write(name, t)
        self.new_model[name] = t


def hold_global(store: Store, run: str, r: int) -> None:
    """Load committed global r as the aggregator's previous global, as a flow holds it after committing r
    (its first round after a start reads it from storage instead)."""
    b = store.read_bundle(RunLayout(run).global_dir(r), [MODEL_FILE])
    _HeldGlobal.put((store.url, run, r, b.manifest["files"][MODEL_FILE]["sha256"]), dict(b.files[MODEL_FILE]))


@contextlib.contextmanager
def _one_torch_thread():
    """Aggregation is memory-bound elementwise work; the other cores are better spent on the sha256 helper
    threads (spes/storage/tensorio.py) than on torch's intra-op threads, which would compete with them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _quarantine(store: Store, layout: RunLayout, r: int, node: int, why: str) -> None:
    dest = layout.rejected_dir(r, node, time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6])
    log.error("round %d: upload of node %d rejected (%s); moved to %s", r, node, why, dest)
    store.move(layout.node_dir(r, node), dest)


def aggregate_round(p: Params, store: Store, run: str, r: int, min_nodes: Optional[int] = None,
                    rerun_rejected: bool = False) -> dict:
    """Combine the committed node uploads of round r into delta r and global r (with merging when due)."""
    s, layout = p.spes, RunLayout(run)
    if store.is_committed(layout.global_dir(r)):
        return store.read_manifest(layout.global_dir(r))["meta"]
    t0 = time.perf_counter()
    store.remove(layout.delta_dir(r))  # a delta of a global that was never committed (crash in between)
    prev = store.read_manifest(layout.global_dir(r - 1))
    base_sha = prev["files"][MODEL_FILE]["sha256"]
    need = min(min_nodes if min_nodes is not None else s.nodes, s.nodes)
    rejected: dict[int, str] = {}
    uploads: dict[int, dict] = {}
    for i in range(s.nodes):
        try:
            m = store.read_manifest(layout.node_dir(r, i))
        except NotCommitted:
            continue
        except IntegrityError as e:
            rejected[i] = str(e)
            continue
        why = _check_upload(m, r, i, base_sha, p.sync.codec)
        if why:
            rejected[i] = f"{store.url}/{layout.node_dir(r, i)}: {why}"
        else:
            uploads[i] = m
    while True:
        for i in list(rejected):
            if i in uploads or store.exists(layout.node_dir(r, i)):
                uploads.pop(i, None)
                _quarantine(store, layout, r, i, rejected[i])
        if rejected and rerun_rejected:
            raise UploadsRejected(rejected)
        if len(uploads) < need:
            raise QuorumError(f"round {r}: only nodes {sorted(uploads)} committed"
                              + (f" ({len(rejected)} rejected)" if rejected else "")
                              + f", quorum is {need} of {s.nodes}")
        try:
            attempt = _Round(p, store, layout, r, prev, uploads)
            with _one_torch_thread():
                delta, glob, expert_files = attempt.run()
            break
        except _BadUpload as e:
            rejected[e.node] = e.msg
            _HeldGlobal.put(None, None)  # partly consumed: the next attempt reads global r-1 from storage
        except BaseException:
            _HeldGlobal.put(None, None)
            raise
    new_sha = glob.entries[MODEL_FILE]["sha256"]
    states = dict(prev["meta"].get("node_states", {}))
    for i in uploads:
        states[str(i)] = uploads[i]["meta"]["state"]
    merged, step = attempt.merging, r * s.sync_steps
    delta.commit({"round": r, "base_round": r - 1, "base_sha256": base_sha, "global_sha256": new_sha,
                  "codec": p.sync.codec, "expert_files": expert_files, "merged": merged})
    meta = {"round": r, "step": step, "method": s.method, "model_config": prev["meta"]["model_config"],
            "contributors": sorted(uploads), "missing": [i for i in range(s.nodes) if i not in uploads],
            "rejected": {str(i): m for i, m in rejected.items()}, "merge_alpha": attempt.alpha,
            "merged": merged, "node_loss": {str(i): uploads[i]["meta"]["loss_mean"] for i in uploads},
            "node_states": states, "codec": p.sync.codec, "seconds_aggregate": time.perf_counter() - t0}
    glob.commit(meta)
    _HeldGlobal.put((store.url, run, r, new_sha), attempt.new_model)
    return meta
