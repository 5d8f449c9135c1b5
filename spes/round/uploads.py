"""The aggregator's intake: which of round r's committed node uploads fit the round (its round and node, the
experts the membership gives the node, a delta against the committed global r-1, the run's codec), and the
error an upload that does not fit is set aside with; the checks of the values the aggregator decodes (finite,
and within sync.max_delta_norm_ratio of the others). Reading the tensors themselves is the attempt's."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

import torch

from spes.errors import IntegrityError, NotCommitted, RecordError
from spes.round.context import RoundContext
from spes.run.layout import MODEL_FILE
from spes.run.records import GlobalMeta, Membership, UploadMeta


@dataclass(frozen=True)
class RoundBase:
    """What round r is aggregated onto: global r-1's manifest and meta, and the round's membership (in it)."""

    r: int
    manifest: dict
    meta: GlobalMeta
    membership: Membership

    @property
    def sha256(self) -> str:
        return self.manifest["files"][MODEL_FILE]["sha256"]


@dataclass
class Contributions:
    """The uploads of round r that fit: node -> its manifest, and node -> its meta."""

    uploads: dict[int, dict]
    metas: dict[int, UploadMeta]


class BadUpload(Exception):
    """An upload found unusable while its tensors were read: its node and why (internal to the aggregator)."""

    def __init__(self, node: int, msg: str):
        self.node, self.msg = node, msg


def misfit(m: UploadMeta, node: int, base: RoundBase, codec: str, sparse: bool) -> Optional[str]:
    """Why upload meta `m` does not belong in round `base.r` as node `node`'s, or None when it does."""
    r, experts = base.r, base.membership.owners[node]
    if m.round != r or m.node != node:
        return f"upload says round {m.round} node {m.node}"
    if sparse and sorted(m.experts) != sorted(experts):
        return f"it trained experts {m.experts}, round {r}'s ownership gives node {node} experts {experts}"
    if m.base_sha256 != base.sha256:
        return (f"its delta is against global {m.base_round} ({m.base_sha256[:12]}), not the committed global "
                f"{r - 1} ({base.sha256[:12]})")
    if m.codec != codec:
        return f"codec {m.codec!r}, the run uses {codec!r}"
    return None


def committed_uploads(ctx: RoundContext, base: RoundBase, rejected: dict[int, str]) -> Contributions:
    """The committed uploads of round r's members that fit; the others go to `rejected` with the reason (a
    member that has not committed is neither)."""
    store, layout = ctx.store, ctx.layout
    fit = Contributions({}, {})
    for i in base.membership.members:
        rel = layout.node_dir(base.r, i)
        try:
            m = store.read_manifest(rel)
            meta = UploadMeta.from_json(m["meta"], f"{store.url}/{rel}")
        except NotCommitted:
            continue
        except (IntegrityError, RecordError) as e:
            rejected[i] = str(e)
            continue
        why = misfit(meta, i, base, ctx.p.sync.codec, ctx.method.sparse_experts)
        if why:
            rejected[i] = f"{store.url}/{rel}: {why}"
        else:
            fit.uploads[i], fit.metas[i] = m, meta
    return fit


def check_finite(name: str, decoded: dict[int, torch.Tensor], where: dict[int, str]) -> None:
    """Values are checked too, where they are decoded anyway: node i's decoded delta of `name` (or its rows of
    prev + delta, which are finite exactly when the delta is) must hold no NaN or inf."""
    for i, t in decoded.items():
        if not bool(torch.isfinite(t).all()):
            raise BadUpload(i, f"{where[i]}: {name} decodes to non-finite values (NaN or inf)")


def check_norms(name: str, deltas: dict[int, torch.Tensor], k: Optional[float], where: dict[int, str]) -> None:
    """sync.max_delta_norm_ratio `k`: a node's delta of `name` far above the other nodes' median is set aside."""
    if k is None or len(deltas) < 2:
        return
    nodes = list(deltas)
    norms = [float(torch.linalg.vector_norm(deltas[i].double())) for i in nodes]
    for j, i in enumerate(nodes):
        median = statistics.median(norms[:j] + norms[j + 1:])
        if median > 0 and norms[j] > k * median:
            raise BadUpload(i, f"{where[i]}: its delta of {name} has norm {norms[j]:.4g}, {norms[j] / median:.1f}x the "
                               f"other nodes' median {median:.4g} (sync.max_delta_norm_ratio {k:g})")
