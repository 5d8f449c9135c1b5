"""The aggregator's intake: which of round r's committed node uploads fit the round (its round and node, the
experts the membership gives the node, a delta against the committed global r-1, the run's codec), and the
error an upload that does not fit is set aside with. Reading the tensors themselves is the aggregator's."""
from __future__ import annotations

from typing import Optional

from spes.errors import IntegrityError, NotCommitted, RecordError
from spes.run.layout import RunLayout
from spes.run.records import Membership, UploadMeta
from spes.storage.store import Store


class BadUpload(Exception):
    """An upload found unusable while its tensors were read: its node and why (internal to the aggregator)."""

    def __init__(self, node: int, msg: str):
        self.node, self.msg = node, msg


def misfit(m: UploadMeta, r: int, node: int, base_sha: str, codec: str, experts: list[int],
           sparse: bool) -> Optional[str]:
    """Why upload meta `m` does not belong in round r as node `node`'s, or None when it does."""
    if m.round != r or m.node != node:
        return f"upload says round {m.round} node {m.node}"
    if sparse and sorted(m.experts) != sorted(experts):
        return f"it trained experts {m.experts}, round {r}'s ownership gives node {node} experts {experts}"
    if m.base_sha256 != base_sha:
        return (f"its delta is against global {m.base_round} ({m.base_sha256[:12]}), not the committed global "
                f"{r - 1} ({base_sha[:12]})")
    if m.codec != codec:
        return f"codec {m.codec!r}, the run uses {codec!r}"
    return None


def committed_uploads(store: Store, layout: RunLayout, r: int, base_sha: str, membership: Membership, codec: str,
                      sparse: bool, rejected: dict[int, str]) -> tuple[dict[int, dict], dict[int, UploadMeta]]:
    """The committed uploads of round r's members that fit, as (manifests, their parsed metas); the others
    go to `rejected` with the reason (a member that has not committed is neither)."""
    uploads, metas = {}, {}
    for i in membership.members:
        rel = layout.node_dir(r, i)
        try:
            m = store.read_manifest(rel)
            meta = UploadMeta.from_json(m["meta"], f"{store.url}/{rel}")
        except NotCommitted:
            continue
        except (IntegrityError, RecordError) as e:
            rejected[i] = str(e)
            continue
        why = misfit(meta, r, i, base_sha, codec, membership.owners[i], sparse)
        if why:
            rejected[i] = f"{store.url}/{rel}: {why}"
        else:
            uploads[i], metas[i] = m, meta
    return uploads, metas
