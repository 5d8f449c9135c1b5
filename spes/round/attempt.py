"""One attempt at aggregating a round (spes/round/aggregator.py holds the run's state between rounds and
retries an attempt that met a bad upload): the previous global and each contributor's upload streamed tensor
by tensor through the sync method, into delta r and global r, merging a layer's experts through the method's
hook in a merging round.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from spes.errors import IntegrityError
from spes.model.names import expert_layer
from spes.round.context import RoundContext
from spes.round.uploads import BadUpload, Contributions, RoundBase, check_finite, check_norms
from spes.run.layout import MODEL_FILE, OUTER_FILE, RESIDUAL_FILE
from spes.run.records import ExpertRef
from spes.storage.store import BundleWriter
from spes.sync.deltas import (
    EXPERTS_FILE,
    MOMENTS_FILE,
    SHARED_FILE,
    add_decoded,
    add_decoded_rows,
    encode_with_feedback,
    encoded_specs,
    experts_file,
    read_parts,
)
from spes.sync.method import node_weights, weighted_sum


def _shapes(entry: dict) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t["shape"]) for n, t in entry["tensors"].items()}


class _Cached:
    """A reader over held tensors (TensorReader's `read`): each is let go once read, so the previous and the
    new global together stay within about one model."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def read(self, name: str) -> torch.Tensor:
        return self.tensors.pop(name)


@dataclass
class Streams:
    """An attempt's open readers (global r-1's files, the nodes' uploads) and writers (global r's files, delta
    r's), opened together by `RoundAttempt.open` and closed together when its block ends."""

    prev_model: Any
    prev_outer: Any
    prev_res: Any
    shared_in: dict[int, Any]
    experts_in: dict[int, Any]
    w_model: Any
    w_outer: Any
    w_res: Any
    w_shared: Any
    w_experts: dict[int, Any]


class RoundAttempt:
    """One attempt at aggregating round r onto `base` from `contributions`; `held`: global r-1's tensors when
    this process holds them (else read from storage)."""

    def __init__(self, ctx: RoundContext, base: RoundBase, contributions: Contributions, held: Optional[dict]):
        p, method = ctx.p, ctx.method
        self.p, self.method, self.codec, self.store, self.layout = p, method, ctx.codec, ctx.store, ctx.layout
        self.base, self.r, self.prev = base, base.r, base.manifest
        self.uploads, self.held = contributions.uploads, held
        self.nodes = sorted(self.uploads)
        self.weights = node_weights([contributions.metas[i].tokens for i in self.nodes], p.sync.token_weighted)
        self.owners = base.membership.owners
        self.alpha = method.merge_alpha(self.r * p.sync.every_steps, base.meta.model_config["num_experts"])
        self.merging = self.alpha > 0
        self.expert_outer = method.has_expert_outer_step
        self.rewrite_experts = self.merging or self.expert_outer  # the delta carries experts of its own
        self.shapes = _shapes(self.prev["files"][MODEL_FILE])
        self.feedback = p.sync.error_feedback and not self.codec.exact
        self.contributions = contributions

    def rows(self, owner: int) -> list[int]:
        return list(self.owners[owner])

    def _groups(self, names: list[str], averaged: dict) -> list[list[str]]:
        """The tensors in the order they are computed: one at a time, except that a merging round takes a
        layer's expert tensors together (adjacent in sorted order, since they share the layer's prefix)."""
        groups: list[list[str]] = []
        for name in names:
            last = groups[-1] if groups else None
            if (self.merging and name not in averaged and last is not None and last[0] not in averaged
                    and expert_layer(last[0]) == expert_layer(name)):
                last.append(name)
            else:
                groups.append([name])
        return groups

    def run(self) -> tuple[BundleWriter, BundleWriter, dict[str, ExpertRef]]:
        """Write the delta and global bundles (uncommitted); returns their writers and the expert files."""
        averaged = {n: sh for n, sh in self.shapes.items() if self.method.is_averaged(n)}
        expert_names = {n: sh for n, sh in self.shapes.items() if n not in averaged}
        owners = [j for j in sorted(self.owners) if self.merging or j in self.uploads] if expert_names else []
        self.outer_specs = {n: self.method.outer_state_specs(n, averaged[n]) if n in averaged
                            else self.method.expert_state_specs(n, expert_names[n]) for n in sorted(self.shapes)}
        self.new_model: dict[str, torch.Tensor] = {}
        delta = BundleWriter(self.store, self.layout.delta_dir(self.r))
        glob = BundleWriter(self.store, self.layout.global_dir(self.r))
        with self.open(delta, glob, averaged, expert_names, owners) as io:
            for group in self._groups(sorted(self.shapes), averaged):
                if group[0] in averaged:
                    self._averaged(group[0], io)
                else:
                    self._experts(group, io)
            for i, rdr in list(io.shared_in.items()) + list(io.experts_in.items()):
                self._finish(i, rdr)
            if self.p.sync.average_optimizer_state:
                self._moments(glob)
        expert_files = {}
        for j in owners:
            ref = ExpertRef(rows=self.rows(j))
            if not self.rewrite_experts:  # the owner's upload is the delta of its rows: refer to it, copy nothing
                entry = self.uploads[j]["files"][EXPERTS_FILE]
                ref = ExpertRef(self.rows(j), self.layout.node_dir(self.r, j), EXPERTS_FILE, entry["sha256"],
                                entry["bytes"])
            expert_files[experts_file(j)] = ref
        return delta, glob, expert_files

    @contextlib.contextmanager
    def open(self, delta: BundleWriter, glob: BundleWriter, averaged: dict, expert_names: dict, owners: list[int]):
        """The attempt's readers and writers as one record, all closed when the block ends."""
        prev_files, prev_dir = self.prev["files"], self.layout.global_dir(self.r - 1)
        outer_flat = [spec for n in sorted(self.shapes) for spec in self.outer_specs[n]]
        with contextlib.ExitStack() as st:
            self._stack = st
            rd = lambda f: st.enter_context(self.store.open_reader(prev_dir, f, prev_files[f]))  # noqa: E731
            model_specs = [(n, torch.float32, self.shapes[n]) for n in sorted(self.shapes)]
            res_specs = [(n, torch.float32, averaged[n]) for n in sorted(averaged)]
            yield Streams(
                prev_model=_Cached(self.held) if self.held is not None else rd(MODEL_FILE),
                prev_outer=rd(OUTER_FILE) if outer_flat and OUTER_FILE in prev_files else None,
                prev_res=rd(RESIDUAL_FILE) if RESIDUAL_FILE in prev_files else None,
                shared_in={i: self._node_reader(i, SHARED_FILE) for i in self.nodes},
                experts_in={i: self._node_reader(i, EXPERTS_FILE) for i in self.nodes} if expert_names else {},
                w_model=st.enter_context(glob.stream(MODEL_FILE, model_specs)),
                w_outer=st.enter_context(glob.stream(OUTER_FILE, outer_flat)) if outer_flat else None,
                w_res=st.enter_context(glob.stream(RESIDUAL_FILE, res_specs)) if self.feedback else None,
                w_shared=st.enter_context(delta.stream(SHARED_FILE, encoded_specs(self.codec, averaged))),
                w_experts={j: st.enter_context(delta.stream(experts_file(j), encoded_specs(
                    self.codec, {n: (len(self.rows(j)), *sh[1:]) for n, sh in expert_names.items()})))
                    for j in owners} if self.rewrite_experts else {})

    def _moments(self, glob: BundleWriter) -> None:
        """sync.average_optimizer_state: the weighted mean of the nodes' Adam moments into the global bundle,
        tensor by tensor; every node's file must hold the same tensors."""
        readers = {i: self._node_reader(i, MOMENTS_FILE) for i in self.nodes}
        specs = {i: _shapes(self.uploads[i]["files"][MOMENTS_FILE]) for i in self.nodes}
        first = specs[self.nodes[0]]
        for i in self.nodes:
            if specs[i] != first:
                raise BadUpload(i, f"{self.store.url}/{self.layout.node_dir(self.r, i)}/{MOMENTS_FILE}: holds "
                                   f"other tensors than node {self.nodes[0]}'s")
        with glob.stream(MOMENTS_FILE, [(n, torch.float32, first[n]) for n in sorted(first)]) as w:
            for name in sorted(first):
                ts = []
                for i in self.nodes:
                    try:
                        ts.append(readers[i].read(name))
                    except IntegrityError as e:
                        raise BadUpload(i, str(e)) from None
                w.write(name, weighted_sum(ts, self.weights))
        for i, rdr in readers.items():
            self._finish(i, rdr)

    def _node_reader(self, i: int, fname: str):
        rel = self.layout.node_dir(self.r, i)
        entry = self.uploads[i]["files"].get(fname)
        if entry is None:
            raise BadUpload(i, f"{self.store.url}/{rel}: no {fname}")
        try:
            return self._stack.enter_context(self.store.open_reader(rel, fname, entry))
        except IntegrityError as e:
            raise BadUpload(i, str(e)) from None

    def _read(self, i: int, rdr, name: str, shape):
        try:
            parts = read_parts(rdr, self.codec, name, shape)
        except IntegrityError as e:
            raise BadUpload(i, str(e)) from None
        for part, dtype, want in self.codec.encoded_specs(name, shape):  # bytes that verify can still be wrong
            t = parts[part]
            if t.dtype != dtype or tuple(t.shape) != tuple(want):
                raise BadUpload(i, f"{rdr.where}: {part} is {t.dtype} {tuple(t.shape)}, the {self.codec.name} "
                                   f"codec expects {dtype} {tuple(want)}")
        return parts

    def _check_finite(self, name: str, decoded: dict[int, torch.Tensor], readers: dict) -> None:
        check_finite(name, decoded, {i: readers[i].where for i in decoded})

    def _finish(self, i: int, rdr) -> None:
        try:
            rdr.finish()
        except IntegrityError as e:
            raise BadUpload(i, str(e)) from None

    def _averaged(self, name: str, io: Streams) -> None:
        shape, specs = self.shapes[name], self.outer_specs[name]
        prev_outer, prev_res, shared_in, w_outer, w_res = io.prev_outer, io.prev_res, io.shared_in, io.w_outer, io.w_res
        prev_t = io.prev_model.read(name)
        deltas = [self.codec.decode(name, self._read(i, shared_in[i], name, shape), shape) for i in self.nodes]
        self._check_finite(name, dict(zip(self.nodes, deltas)), shared_in)
        check_norms(name, dict(zip(self.nodes, deltas)), self.p.sync.max_delta_norm_ratio,
                    {i: f"{self.store.url}/{self.layout.node_dir(self.r, i)}" for i in self.nodes})
        state = {key: prev_outer.read(key) for key, _, _ in specs} if prev_outer is not None else {}
        change, new_state = self.method.global_change(name, deltas, self.weights, state)
        residual = {name: prev_res.read(name)} if prev_res is not None else None
        parts, new_res = encode_with_feedback(self.codec, name, change, residual, self.feedback)
        for part in sorted(parts):
            io.w_shared.write(part, parts[part])
        self._put(io.w_model, name, add_decoded(prev_t, self.codec, name, parts))
        if w_outer is not None:
            for key, _, _ in specs:
                w_outer.write(key, new_state[key])
        if w_res is not None:
            w_res.write(name, new_res)

    def _experts(self, group: list[str], io: Streams) -> None:
        experts_in, w_model, w_experts = io.experts_in, io.w_model, io.w_experts
        prevs = {n: io.prev_model.read(n) for n in group}
        shapes = {n: self.shapes[n] for n in group}
        up: dict[str, dict[int, dict]] = {n: {} for n in group}  # name -> node -> parts, read in file order
        for n in group:
            for i in self.nodes:
                up[n][i] = self._read(i, experts_in[i], n, (len(self.rows(i)), *shapes[n][1:]))
        # prev + each owner's delta (through the method's outer step on experts when it has one), checked
        target = {n: self._expert_target(n, prevs[n], up[n], io) for n in group}
        if not self.rewrite_experts:  # the owners' uploads are the delta: target is what the nodes add up too
            for n in group:
                self._put(w_model, n, target[n])
            return
        if self.merging:  # the method's hook, on the layer's experts as their owners trained them
            target = self.method.merge(target, self.alpha)
        send = {n: {j: self.codec.encode(n, (target[n] - prevs[n])[self.rows(j)]) for j in w_experts} for n in group}
        for n in group:
            for j in sorted(w_experts):
                for part in sorted(send[n][j]):
                    w_experts[j].write(part, send[n][j][part])
            owners = sorted(send[n])  # sorted, like apply_delta on the nodes: the same bits
            self._put(w_model, n, add_decoded_rows(prevs[n], [(self.rows(j), send[n][j]) for j in owners], self.codec, n))

    def _expert_target(self, name: str, prev: torch.Tensor, parts: dict, io: Streams) -> torch.Tensor:
        """Expert tensor `name` after its owners' deltas, through the method's outer step on experts when it
        has one (its state read and written in name order, beside the averaged tensors')."""
        prev_outer, w_outer, readers = io.prev_outer, io.w_outer, io.experts_in
        owned = [(self.rows(i), parts[i]) for i in self.nodes]
        if not self.expert_outer:
            target = add_decoded_rows(prev, owned, self.codec, name)
            self._check_finite(name, {i: target[self.rows(i)] for i in self.nodes}, readers)
            return target
        delta = torch.zeros_like(prev)
        for rows, p in owned:
            delta[rows] = self.codec.decode(name, p, (len(rows), *prev.shape[1:]))
        self._check_finite(name, {i: delta[self.rows(i)] for i in self.nodes}, readers)
        present = torch.tensor(sorted(r for rs, _ in owned for r in rs), dtype=torch.long)
        specs = self.outer_specs[name]
        state = {key: prev_outer.read(key) for key, _, _ in specs} if prev_outer is not None else {}
        change, new_state = self.method.expert_change(name, delta, present, state)
        if w_outer is not None:
            for key, _, _ in specs:
                w_outer.write(key, new_state[key])
        return prev + (change if change is not None else delta)

    def _put(self, w_model, name: str, t: torch.Tensor) -> None:
        w_model.write(name, t)
        self.new_model[name] = t
