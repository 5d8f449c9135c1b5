"""A node's own state, kept on the node's machine between rounds (`orchestration.node_state_dir`).

    <root>/<storage key>/<run>-<run id>/node-<i:03d>/
        base/               the latest global model this node holds (model.safetensors + its round, sha256)
        rounds/<r:06d>/     the node's state after training round r: optimizer (optim.safetensors), encoding
                            residual (residual.safetensors), its own experts' last encoded upload
                            (experts.safetensors), data position; with sync.overlap its own exact delta
                            of the round (sent.safetensors) and the global that delta goes on top of

Both are bundles in the store format (a local Store), so a truncated or altered file is caught by its
sha256 like anything on shared storage. A state is identified by its *digest* (the run id, node, round,
data position and file hashes): the global round a node continues from records the digest of every
node's state it was built with, and a node uses exactly that state, from here or from a checkpoint on
shared storage (`runs/<run>/rounds/<r>/states/<i>`), or fails; it never falls back to another one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Optional

import torch

from spes.errors import IntegrityError, NodeStateError, NotCommitted
from spes.run.records import StateRef
from spes.storage.store import Store

OPTIM_FILE, RESIDUAL_FILE, EXPERTS_FILE, MODEL_FILE = ("optim.safetensors", "residual.safetensors",
                                                       "experts.safetensors", "model.safetensors")
log = logging.getLogger("spes.run.node_state")
SENT_FILE = "sent.safetensors"
"""sync.overlap: the node's exact delta of the round; the next round starts from `sent_base` + it."""


def state_digest(manifest: dict) -> str:
    m = manifest["meta"]
    try:
        ident = {"run_id": m["run_id"], "node": m["node"], "round": m["round"], "data_position": m["data_position"],
                 "files": {f: e["sha256"] for f, e in sorted(manifest["files"].items())}}
    except (KeyError, TypeError) as e:
        raise IntegrityError(f"a node state manifest without {e}: not a node state") from None
    if "sent_base" in m:  # sync.overlap: the global its delta goes on top of is part of what the state is
        ident["sent_base"] = m["sent_base"]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


@dataclass
class NodeState:
    """What a node carries from one round to its next: optimizer tensors, residual, data position."""

    round: int
    data_position: int
    optim: dict[str, torch.Tensor]
    residual: dict[str, torch.Tensor]
    experts_upload: dict[str, torch.Tensor]
    experts_sha256: str
    digest: str
    source: str
    owned: Optional[tuple[int, ...]] = None
    """The experts the node trained in that round (the rows of its residual); None: states written before
    ownership could change."""
    sent: Optional[dict[str, torch.Tensor]] = None
    """sync.overlap: what the node trained in that round (its exact delta, the trained part of the model)."""
    sent_base: Optional[tuple[int, str]] = None
    """sync.overlap: (round, sha256) of the global that round's delta was taken against."""


def run_folder(run: str, run_id: str) -> str:
    """A run's folder on a node's machine: its name and run id (the same name may be started anew)."""
    return f"{run}-{run_id[:12]}"


def storage_key(location: str) -> str:
    """The folder of one storage location's runs: a hash of the location exactly (`FileStore.location`: the
    real path of a local folder; endpoint, bucket and prefix on S3), so copies of a repository that write
    `storage.url: artifacts/storage` each get their own (before, the URL as written was hashed)."""
    return hashlib.sha256(location.encode()).hexdigest()[:12]


def node_folder(root: str, storage_location: str, run: str, run_id: str, node: int) -> str:
    return os.path.join(os.path.expanduser(root), storage_key(storage_location), run_folder(run, run_id),
                        f"node-{node:03d}")


class NodeStateDir:
    def __init__(self, root: str, storage_location: str, run: str, run_id: str, node: int):
        self.run, self.run_id, self.node = run, run_id, node
        self.path = node_folder(root, storage_location, run, run_id, node)
        self.local = Store(self.path, retries=0)
        self._base_manifest: Optional[dict] = None

    @staticmethod
    def state_rel(r: int) -> str:
        return f"rounds/{r:06d}"

    # -- node state after a round ------------------------------------------------------------------
    def save_state(self, r: int, data_position: int, optim, residual, experts_upload, owned=None, sent=None,
                   sent_base: Optional[tuple[int, str]] = None) -> dict:
        files = {OPTIM_FILE: optim, RESIDUAL_FILE: residual, EXPERTS_FILE: experts_upload}
        meta = {"run_id": self.run_id, "node": self.node, "round": r, "data_position": data_position}
        if owned is not None:
            meta["owned"] = [int(e) for e in owned]
        if sent is not None and sent_base is not None:
            files[SENT_FILE] = sent
            meta["sent_base"] = {"round": int(sent_base[0]), "sha256": sent_base[1]}
        rel = self.state_rel(r)
        if self.local.is_committed(rel):  # a state of a round no global used (see discard_after): replace it
            self.local.remove(rel)
        manifest = self.local.write_bundle(rel, files, meta)
        return {"digest": state_digest(manifest), "manifest": manifest, "files": files, "meta": meta}

    def _check_identity(self, manifest: dict, where: str) -> None:
        m = manifest["meta"]
        if m.get("run_id") != self.run_id or m.get("node") != self.node:
            raise NodeStateError(f"{where}: state of run {m.get('run_id')} node {m.get('node')}, not of run "
                                 f"{self.run_id} node {self.node}; refusing to use it")

    def _load(self, store: Store, rel: str, where: str, digest: str) -> Optional[NodeState]:
        try:
            manifest = store.read_manifest(rel)
        except NotCommitted:
            return None
        self._check_identity(manifest, where)
        if state_digest(manifest) != digest:
            return None
        b = store.read_bundle(rel, manifest=manifest)  # the manifest just read and checked, not a second read
        owned, sent_base = manifest["meta"].get("owned"), manifest["meta"].get("sent_base")
        if (SENT_FILE in b.files) != (sent_base is not None):
            raise IntegrityError(f"{where}: {SENT_FILE} and the meta's sent_base come together; this state has one")
        return NodeState(manifest["meta"]["round"], int(manifest["meta"]["data_position"]), b.files[OPTIM_FILE],
                         b.files[RESIDUAL_FILE], b.files[EXPERTS_FILE], manifest["files"][EXPERTS_FILE]["sha256"],
                         digest, where, tuple(owned) if owned is not None else None, b.files.get(SENT_FILE),
                         (int(sent_base["round"]), str(sent_base["sha256"])) if sent_base is not None else None)

    def load_state(self, ref: StateRef, shared: Store, checkpoint_rel: str) -> NodeState:
        """The state `ref` names: from this machine, else the checkpoint on shared storage; anything else is
        an error naming what is missing."""
        r, digest = ref.round, ref.digest
        where = os.path.join(self.path, self.state_rel(r))
        try:
            state = self._load(self.local, self.state_rel(r), where, digest)
        except IntegrityError as e:
            state, damaged = None, e
        else:
            damaged = None  # type: ignore[assignment]  # no damage: the local copy was read
        if state is None and ref.checkpoint:
            state = self._load(shared, checkpoint_rel, f"{shared.url}/{checkpoint_rel}", digest)
            if state is not None and damaged is not None:  # the committed twin stands in; the bad copy goes
                log.warning("node %d: its local state after round %d is damaged (%s); dropped, read from the "
                            "checkpoint on shared storage instead", self.node, r, damaged)
                self.local.remove(self.state_rel(r))
        if state is None:
            why = f" (the local copy is damaged: {damaged})" if damaged else ""
            raise NodeStateError(f"node {self.node}: its state after round {r} (digest {digest[:12]}) that the "
                                 f"committed global was built with is not in {where}{why}"
                                 + (" nor in the checkpoint on shared storage" if ref.checkpoint else
                                    " and round {r} is no checkpoint round".format(r=r))
                                 + "; resume from a resumable round")
        return state

    def has_state(self, ref: StateRef) -> bool:
        try:
            m = self.local.read_manifest(self.state_rel(ref.round))
        except (NotCommitted, IntegrityError):
            return False
        return state_digest(m) == ref.digest

    def discard_after(self, r: int) -> None:
        """States of rounds > r belong to no committed global yet (a crash after saving, or a superseded
        resume): drop them before round r+1 rewrites one."""
        for name in self.local.list_names("rounds"):
            if name.isdigit() and int(name) > r:
                self.local.remove(f"rounds/{name}")

    def prune_before(self, r: int) -> None:
        """Drop states of rounds < r (kept: the ones a resume from a recent round can still need)."""
        for name in self.local.list_names("rounds"):
            if name.isdigit() and int(name) < r:
                self.local.remove(f"rounds/{name}")

    def adopt(self, older: str) -> bool:
        """Take over the folder `older` of this same run and node (same run id: a uuid, so it can be no other
        copy's run) when this one holds nothing yet: a state kept under a former key survives the upgrade."""
        if older == self.path or not os.path.isdir(older) or os.listdir(self.path):
            return False
        os.rmdir(self.path)  # the empty folder the local store made
        os.rename(older, self.path)
        run_dir = os.path.dirname(older)
        if not os.listdir(run_dir):
            os.rmdir(run_dir)
        return True

    def sibling_runs(self) -> list[tuple[str, str]]:
        """(run, run id prefix) of the other runs on this storage location of which this machine holds this
        node's state (never those of another location, whatever their names: their storage decides for them)."""
        parent, mine = os.path.split(os.path.dirname(self.path))  # <root>/<storage key>, <run>-<id>
        out = []
        for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
            run, _, id12 = name.rpartition("-")
            if name != mine and re.fullmatch(r"[0-9a-f]{12}", id12) and \
                    os.path.isdir(os.path.join(parent, name, f"node-{self.node:03d}")):
                out.append((run, id12))
        return out

    def keep_only(self, rounds: set) -> bool:
        """Drop the global model held here and every state but those of `rounds` (all of this node's folder
        when none); whether anything was removed."""
        if not rounds:
            if not os.path.isdir(self.path):
                return False
            self.remove_all()
            return True
        drop = [n for n in self.local.list_names("rounds") if not (n.isdigit() and int(n) in rounds)]
        for name in drop:
            self.local.remove(f"rounds/{name}")
        had_base = os.path.isdir(os.path.join(self.path, "base"))
        self.local.remove("base")
        return bool(drop) or had_base

    def remove_all(self) -> str:
        """Remove this node's folder of this run (and the run's folder when no other node of it is here)."""
        shutil.rmtree(self.path, ignore_errors=True)
        run_dir = os.path.dirname(self.path)
        if os.path.isdir(run_dir) and not os.listdir(run_dir):
            os.rmdir(run_dir)
        return self.path

    # -- the global model this node holds -------------------------------------------------------------
    def base(self) -> Optional[tuple[int, str]]:
        """(round, sha256) of the global model held here, or None. Its manifest is kept for `load_base`."""
        try:
            m = self.local.read_manifest("base")
        except (NotCommitted, IntegrityError):
            self._base_manifest = None
            return None
        self._base_manifest = m
        return int(m["meta"]["round"]), m["files"][MODEL_FILE]["sha256"]

    def load_base(self) -> dict[str, torch.Tensor]:
        """The global model held here (its manifest as `base()` last read it; read now if it was not)."""
        return self.local.read_bundle("base", manifest=self._base_manifest).files[MODEL_FILE]

    def drop_base(self) -> None:
        self.local.remove("base")
        self._base_manifest = None

    def save_base(self, r: int, model: dict[str, torch.Tensor]) -> str:
        """Keep global round r here; returns its file's sha256 (to compare with the committed one)."""
        self.local.remove("base")
        manifest = self.local.write_bundle("base", {MODEL_FILE: model}, {"round": r, "run_id": self.run_id})
        return manifest["files"][MODEL_FILE]["sha256"]
