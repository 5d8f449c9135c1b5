"""A run's state on shared storage: identity, committed rounds, where to resume, retention, round records.

A run is identified by a fingerprint of the settings that change its maths and by its initial model (the
sha256 of round 0's model file: spes/run/identity.py). Committed rounds are reused only by a run with the
same identity. Rounds are committed in order (round r needs global r-1), so the committed rounds are
0..latest. Every committed global carries the run's index (records.RunIndex), so a round's retention and a
resume read a bounded number of manifests, whatever the round number.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Optional, Union

from spes.config.renamed import new_name
from spes.errors import IntegrityError, NotCommitted, ProtocolError, RecordError, RunMismatch
from spes.run.identity import FINGERPRINT_VERSION, InitModel
from spes.run.layout import MODEL_FILE
from spes.run.records import GlobalMeta, RunIndex, StateRef
from spes.run.rounds import RunRounds

log = logging.getLogger("spes.run")

LocalStateCheck = Callable[[int, StateRef], bool]
"""(node, state ref) -> whether that node's state is in its own folder (process executor: visible here)."""


class Run(RunRounds):
    """A run: its identity (info, ensure), where a resume starts, and retention; the committed rounds
    themselves, their records and moving rounds aside are RunRounds' (spes/run/rounds.py)."""

    # -- identity ----------------------------------------------------------------------------------
    def info(self) -> Optional[dict]:
        try:
            meta = self.store.read_manifest(self.layout.info)["meta"]
        except NotCommitted:
            return None
        if not all(isinstance(meta.get(k), str) for k in ("fingerprint", "run_id")):
            raise RecordError(f"{self.store.url}/{self.layout.info}/manifest.json: a run info needs fingerprint and "
                              "run_id")
        return meta

    def _write_info(self, fingerprint: str, init_sha: str, run_id: str, settings: Optional[dict] = None) -> None:
        self.store.write_bundle(self.layout.info, {}, {"fingerprint": fingerprint, "init_sha256": init_sha,
                                                       "fingerprint_version": FINGERPRINT_VERSION,
                                                       "run_id": run_id, "created_at": time.time(),
                                                       "settings": settings or {}})

    def _rebuild_info(self) -> Optional[dict]:
        """A run with committed rounds whose info bundle is gone keeps its identity: the latest global carries
        its run id and fingerprint. Without them (a run from before globals carried them) it stops, naming
        the file, rather than taking a new identity its nodes' states would not match."""
        latest = self.latest_round()
        if latest is None or latest == 0:
            return None
        meta = self.global_meta(latest)
        if not (meta.run_id and meta.fingerprint):
            raise ProtocolError(f"{self.store.url}/{self.layout.info} is missing, and global {latest} does not record "
                                "the run's identity; restore the info bundle (or start another run_name)")
        log.warning("run %s: %s/%s was missing; rebuilt from global %d (run id %s)", self.name, self.store.url,
                    self.layout.info, latest, meta.run_id[:12])
        self.store.write_bundle(self.layout.info, {}, {"fingerprint": meta.fingerprint, "init_sha256": self._round0_sha(),
                                                       "fingerprint_version": FINGERPRINT_VERSION,
                                                       "run_id": meta.run_id, "created_at": time.time(),
                                                       "rebuilt_from_round": latest})
        return self.info()

    def _round0_sha(self) -> Optional[str]:
        try:
            return self.store.read_manifest(self.layout.global_dir(0))["files"][MODEL_FILE]["sha256"]
        except NotCommitted:
            return None

    def ensure(self, fingerprint: str, init: Optional[InitModel], on_mismatch: str = "error",
               legacy: Optional[str] = None, fresh: bool = False, settings: Optional[dict] = None) -> None:
        """Make the run exist with this identity: round 0 from `init` (or already committed by whoever
        started the run), the info bundle; refuse, or with on_mismatch='restart' set aside, a run made with
        other settings or another initial model. `legacy`: the fingerprint a run made before fingerprint
        versions would have recorded for these settings (identity.legacy_fingerprint)."""
        init_sha = init.sha256 if init is not None else None
        info = self.info() or self._rebuild_info()
        if info is not None:
            same_settings = info["fingerprint"] == fingerprint or (
                "fingerprint_version" not in info and legacy is not None and info["fingerprint"] == legacy)
            same = same_settings and init_sha in (None, info.get("init_sha256"))
            if same and not fresh:
                return
            if not same and on_mismatch != "restart":
                what = "settings" if not same_settings else "initial model"
                old = info.get("settings") or {}
                diff = [f"{new_name(k) or k}: {old.get(k)!r} -> {(settings or {}).get(k)!r}"  # stored under former names
                        for k in sorted(set(old) | set(settings or {}))
                        if old.get(k) != (settings or {}).get(k)] if old and settings else []
                hint = ("; the cosine schedule depends on sync.rounds: with train.optim.schedule=wsd a run can be "
                        "extended" if any(d.startswith("sync.rounds:") for d in diff) else "")
                raise RunMismatch(f"run {self.name!r} on {self.store.url} was made with another {what} "
                                  + (f"({', '.join(diff[:5])}{', ...' if len(diff) > 5 else ''})" if diff else
                                     f"(fingerprint {info['fingerprint']}, now {fingerprint})")
                                  + "; choose another orchestration.run_name, or set orchestration.supersede=true to "
                                  f"set its rounds aside and start it anew{hint}")
            moved = self.supersede_after(-1, include_info=True)
            log.warning("run %s: %s; its rounds %s were moved to %s/superseded/", self.name,
                        "started anew (orchestration.fresh)" if same else "made with other settings or another "
                        "initial model (orchestration.supersede)", moved, self.layout.base)
        run_id = uuid.uuid4().hex
        if self._round0_sha() is None:
            if init is None:
                raise ProtocolError(f"run {self.name!r} does not exist on {self.store.url} and no init model was "
                                    "given")
            meta = GlobalMeta(round=0, step=0, model_config=init.model_config, source=init.source, index=RunIndex(),
                              run_id=run_id, fingerprint=fingerprint)
            self.store.write_bundle(self.layout.global_dir(0), {MODEL_FILE: init.tensors}, meta.to_json())
        else:
            run_id = self.global_meta(0).run_id or run_id  # a round 0 committed by whoever started the run
        round0_sha = self._round0_sha()
        assert round0_sha is not None  # committed just above, or by whoever started the run
        self._write_info(fingerprint, round0_sha, run_id, settings)

    def set_aside_damaged(self) -> list[int]:
        """While the latest committed round is damaged (its manifest, meta or model file), move it to
        superseded/ (never deleted): the run continues from the latest intact round. Round 0 is never set
        aside. Reads one model at a flow's start. Returns the rounds set aside."""
        moved: list[int] = []
        while True:
            latest = self.latest_round()
            if not latest:
                return moved
            try:
                self.verify_global(latest)
                return moved
            except (IntegrityError, RecordError) as e:
                moved += self.supersede_after(latest - 1)
                log.warning("run %s: committed round %d is damaged (%s); set aside to %s/superseded/, the run "
                            "continues after round %d", self.name, latest, e, self.layout.base, latest - 1)

    def last_checkpointed_state(self, node: int, at_or_before: int) -> tuple[int, Optional[StateRef]]:
        """(K, ref): the latest round K <= at_or_before from which a resume needs nothing but shared storage
        (the run's index) and whose global still names `node`'s checkpointed state `ref` (None: K is 0, or the
        node had no state yet: it starts fresh)."""
        latest = self.latest_round()
        index = self.index(latest) if latest is not None else RunIndex()
        for k in sorted((k for k in index.storage_resumable if k <= at_or_before), reverse=True):
            if k == 0:
                return 0, None
            try:
                ref = self.global_meta(k).node_states.get(node)
            except (NotCommitted, IntegrityError):  # retired: an older one
                continue
            if ref is None or self.has_checkpointed_state(node, ref):
                return k, ref
        return 0, None

    def has_checkpointed_state(self, node: int, ref: StateRef) -> bool:
        """Whether the node state `ref` names is checkpointed on shared storage."""
        return ref.checkpoint and self.store.is_committed(self.layout.state_dir(ref.round, node))

    def missing_states(self, r: int, has_local_state: Optional[LocalStateCheck] = None) -> list[str]:
        """The node states a resume after round r needs that are neither committed on shared storage nor
        (when `has_local_state` can tell) in the node's folder: one storage call per checkpointed node state."""
        missing = []
        for i, ref in sorted(self.node_states(r).items()) if r > 0 else ():
            if self.has_checkpointed_state(i, ref):
                continue
            if has_local_state is None and not ref.checkpoint:
                continue  # nodes elsewhere keep their own state; they say so if they lack it
            if has_local_state is None or not has_local_state(i, ref):
                missing.append(self.layout.state_dir(ref.round, i))
        return missing

    def resumable_rounds(self, has_local_state: Optional[LocalStateCheck] = None) -> list[int]:
        """Committed rounds every node can continue from: each node's state that round's global was built
        with is checkpointed on shared storage (the latest global's index says which), or (when
        `has_local_state` can tell) in the node's own folder. Without `has_local_state` (nodes on other
        machines) the latest round counts as resumable: nodes keep their latest state; one that lacks it fails
        with a message naming what is missing. Read at a resume: one manifest per committed round."""
        latest = self.latest_round()
        if latest is None:
            return []
        from_storage = set(self.index(latest).storage_resumable)
        out = []
        for r in self.committed_rounds():
            if r in from_storage:
                out.append(r)
            elif has_local_state is None:
                if r == latest:
                    out.append(r)
            elif all(self.has_checkpointed_state(i, ref) or has_local_state(i, ref) for i, ref in self.node_states(r).items()):
                out.append(r)
        return out

    def resolve_start(self, resume_round: Union[int, str, None],
                      has_local_state: Optional[LocalStateCheck] = None) -> int:
        """The first round to run: after the latest resumable round (None / 'latest'), or after
        `resume_round`; later committed rounds are set aside so they are recomputed."""
        latest = self.latest_round()
        if latest is None:
            raise ProtocolError(f"run {self.name!r} has no committed round on {self.store.url}")
        if resume_round in (None, "latest"):
            if has_local_state is None:
                k = latest  # nodes elsewhere keep their latest state
            else:
                resumable = self.resumable_rounds(has_local_state)
                # the index says which states were checkpointed; check the ones the chosen round needs are
                # still there (a deleted state falls back to an older round): a few calls, whatever the run length
                k = next((k for k in reversed(resumable) if not self.missing_states(k, has_local_state)), 0)
                if k != latest:
                    log.warning("run %s: continuing from round %d, the latest resumable one (rounds %d-%d lack node "
                                "states: not checkpointed, not on the nodes, or deleted)", self.name, k, k + 1, latest)
        else:
            try:
                k = int(resume_round)
            except (TypeError, ValueError):
                raise ProtocolError(f"resume_round must be 'latest' or a round number, got {resume_round!r}") from None
            committed = self.committed_rounds()
            if k not in committed:
                if 0 < k < latest:
                    raise ProtocolError(f"run {self.name!r}: round {k} was pruned by retention (storage.keep_rounds, "
                                        f"checkpoint.keep_last); rounds a resume can start from: "
                                        f"{self.resumable_rounds(has_local_state)}")
                raise ProtocolError(f"run {self.name!r}: round {k} is not committed (committed: {committed})")
            resumable = self.resumable_rounds(has_local_state)
            if k not in resumable:
                raise ProtocolError(f"run {self.name!r}: round {k} is not resumable: some node's state after it is "
                                    f"neither checkpointed nor on its node (resumable: {resumable})")
            missing = self.missing_states(k, has_local_state)
            if missing:
                raise ProtocolError(f"run {self.name!r}: round {k} is not resumable: its node states {missing} are "
                                    f"gone from {self.store.url} and from the nodes")
        moved = self.supersede_after(k)
        if moved:
            log.warning("resuming from round %d: rounds %s moved to %s/superseded/", k, moved, self.layout.base)
        log.info("run %s: resuming after round %d", self.name, k)
        return k + 1

    # -- retention ---------------------------------------------------------------------------------
    def retire(self, r: int, keep_rounds: Optional[int], keep_checkpoints: Optional[int] = None,
               keep_global_before_checkpoints: bool = False) -> list[int]:
        """Retention after round r committed (storage.keep_rounds, checkpoint.keep_last): the last
        `keep_rounds` rounds stay whole (their deltas refer to the node uploads of the round); round 0 and
        the last `keep_checkpoints` (or all) rounds a resume can start from from shared storage keep their
        global and the node states they need; every other round keeps only its record. Touches only the
        round leaving the window and the checkpoint round leaving `keep_checkpoints`: a bounded number of
        storage calls, whatever r. With `keep_global_before_checkpoints` (sync.overlap: a node resuming after
        round c starts from global c-1 plus its own delta) a kept checkpoint round's previous global stays too.
        Returns the rounds whose model was deleted."""
        if keep_rounds is None:
            return []
        index = self.index(r)
        ckpts = [c for c in index.storage_resumable if c > 0]
        kept_ckpts = set(ckpts[-keep_checkpoints:] if keep_checkpoints else ckpts) | {0}
        window = range(max(1, r - keep_rounds + 1), r + 1)
        leaving = [q for q in (r - keep_rounds,) if q >= 1]
        if keep_checkpoints and len(ckpts) > keep_checkpoints:
            gone = [c for c in ckpts[-keep_checkpoints - 1:-keep_checkpoints] if c not in window]
            leaving += gone + ([c - 1 for c in gone if c > 1] if keep_global_before_checkpoints else [])
        if not leaving:
            return []
        keep = set(window) | kept_ckpts
        if keep_global_before_checkpoints:
            keep |= {c - 1 for c in kept_ckpts if c >= 1}
        # a state of round q can be needed only by globals from q on: a bounded set (window, kept checkpoints)
        needed = {(ref.round, i) for g in sorted(keep) if g >= min(leaving)
                  for i, ref in self._refs(g).items() if ref.checkpoint}
        dropped = []
        for q in sorted(set(leaving)):
            if q not in window:
                self.store.remove(self.layout.delta_dir(q))
                self.store.remove(f"{self.layout.round_dir(q)}/nodes")
                for name in self.store.list_names(f"{self.layout.round_dir(q)}/states"):
                    if name.isdigit() and (q, int(name)) not in needed:
                        self.store.remove(self.layout.state_dir(q, int(name)))
            if q not in keep and self.store.exists(self.layout.global_dir(q)):
                self.forget_global(q)
                self.store.remove(self.layout.global_dir(q))
                dropped.append(q)
        return dropped

    def _refs(self, r: int) -> dict[int, StateRef]:
        try:
            return self.node_states(r)
        except NotCommitted:  # a checkpoint round whose global retention already removed
            return {}
