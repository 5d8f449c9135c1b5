"""One writer per run: a lease on shared storage, taken over atomically, kept alive in the background.

The lease is a sequence of generation files `runs/<run>/lease/<gen>.json`; the highest generation is the
current one. Taking the lease (fresh, or over an expired or released one) is an exclusive create of the
next generation, so of two processes racing for it exactly one wins, on local files and on S3 (conditional
put) alike. The holder refreshes its own file's expiry every ttl/3 (`RunLease`); it has lost the lease as
soon as a higher generation exists. A lease whose holder is a process of this machine that no longer
exists (same host and boot id, pid gone or reused) is free at once, so a rerun after a crash does not
wait out the TTL.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

import psutil

from spes.errors import ConfigError, RunLocked, StorageError
from spes.run.layout import RunLayout
from spes.storage.store import Store


def _boot_id() -> str:
    """This machine's boot (a pid is only meaningful within one)."""
    return f"{psutil.boot_time():.0f}"


def _started(pid: int) -> Optional[float]:
    """When process `pid` started (to tell a reused pid from the original), or None if it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _process_gone(held: dict) -> bool:
    """True only when the holder ran on this very machine (host and boot) and its process is gone."""
    if held.get("host") != socket.gethostname() or not held.get("boot_id") or held.get("boot_id") != _boot_id():
        return False
    pid = int(held.get("pid", -1))
    if pid <= 0:
        return False
    started = _started(pid)
    if started is None:
        return True
    return held.get("started") is not None and abs(started - float(held["started"])) > 0.01


log = logging.getLogger("spes.run.lease")


class WriterLease:
    """Acquire, refresh, check and release the lease of one run."""

    def __init__(self, store: Store, run: str, ttl_s: float):
        if not ttl_s > 0:
            raise ConfigError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.store, self.layout, self.ttl_s = store, RunLayout(run), ttl_s
        self.gen: Optional[int] = None
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def _body(self, released: bool = False) -> bytes:
        pid = os.getpid()
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "boot_id": _boot_id(), "pid": pid,
                           "started": _started(pid), "expires_at": time.time() + self.ttl_s,
                           "released": released}).encode()

    def _top(self) -> tuple[int, Optional[dict]]:
        """(highest generation, its content) or (-1, None); a file removed meanwhile means: look again."""
        for attempt in range(5):
            gens = [int(n[:-5]) for n in self.store.list_names(self.layout.lease_dir)
                    if n.endswith(".json") and n[:-5].isdigit()]
            if not gens:
                return -1, None
            top = max(gens)
            try:
                return top, json.loads(self.store.read_bytes(self.layout.lease_file(top)))
            except FileNotFoundError:
                continue
            except ValueError:  # lease files are written whole, except where the filesystem has no hard links
                if attempt < 4:  # (Store.create_exclusive): a new one may show empty for a moment
                    time.sleep(0.05)
                    continue
                raise RunLocked(f"{self.store.url}/{self.layout.lease_file(top)} is not a readable lease; if no "
                                "writer is active, delete it and run again") from None
        raise RunLocked(f"run {self.layout.run!r}: the lease folder keeps changing; another writer is active")

    def _locked_error(self, held: dict) -> RunLocked:
        until = time.strftime("%H:%M:%S", time.localtime(held.get("expires_at", 0)))
        return RunLocked(f"run {self.layout.run!r} on {self.store.url} is being written by {held.get('owner')} "
                         f"(lease until {until}); wait for it to finish or let its lease expire")

    def acquire(self) -> "WriterLease":
        for _ in range(5):
            top, held = self._top()
            if held is not None and not held.get("released") and held.get("expires_at", 0) > time.time() \
                    and not _process_gone(held):
                raise self._locked_error(held)
            try:
                self.store.create_exclusive(self.layout.lease_file(top + 1), self._body())
            except FileExistsError:
                continue  # someone else took generation top+1 first: look at theirs
            self.gen = top + 1
            for old in range(max(0, top - 8), top):  # tidy up; keep the one we took over for the record
                try:
                    self.store.remove_file(self.layout.lease_file(old))
                except StorageError:
                    pass
            return self
        raise RunLocked(f"could not acquire the lease of run {self.layout.run!r} on {self.store.url}")

    def check(self) -> None:
        """Raise RunLocked unless this lease is still the current generation."""
        top, held = self._top()
        if self.gen is None or top != self.gen or (held or {}).get("owner") != self.owner:
            raise RunLocked(f"lost the lease of run {self.layout.run!r} to {(held or {}).get('owner')} "
                            f"(generation {top}, ours {self.gen})")

    def refresh(self) -> None:
        self.check()
        assert self.gen is not None  # check() raised otherwise
        self.store.write_bytes(self.layout.lease_file(self.gen), self._body())

    def release(self) -> None:
        try:
            self.check()
        except RunLocked:
            return  # not ours any more: leave the current holder's file alone
        assert self.gen is not None
        self.store.write_bytes(self.layout.lease_file(self.gen), self._body(released=True))


class RunLease:
    """Context manager: hold the run's lease while a flow runs, refreshed by a thread every ttl/3.

    If the lease is lost anyway (taken over after a long stall), `check()` raises and the flow stops
    before it writes another round."""

    def __init__(self, store: Store, run: str, ttl_s: float):
        self.lease = WriterLease(store, run, ttl_s)
        self.run, self.ttl_s = run, ttl_s
        self._lost: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def owner(self) -> str:
        return self.lease.owner

    def __enter__(self) -> "RunLease":
        self.lease.acquire()
        self._thread = threading.Thread(target=self._keep, name=f"lease-{self.run}", daemon=True)
        self._thread.start()
        return self

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.lease.refresh()
            except RunLocked as e:
                self._lost = e
                return
            except Exception as e:  # storage hiccup: try again next period; the lease still has 2/3 of its time
                log.warning("run %s: could not refresh the writer lease (%s: %s); trying again in %.0fs",
                            self.run, type(e).__name__, e, self.ttl_s / 3)
                continue

    def check(self) -> None:
        """Raise if the lease was lost (seen by the refresh thread, or now on storage)."""
        if self._lost is None:
            try:
                self.lease.check()
            except RunLocked as e:
                self._lost = e
        if self._lost is not None:
            raise RunLocked(f"run {self.run!r}: stopped, the writer lease was lost ({self._lost})")

    def explain(self, error: BaseException) -> None:
        """Raise RunLocked when `error` stopped the writer after it lost the lease: a stalled writer that
        resumes finds its rounds set aside by the new holder (NotCommitted ...), and the cause is the lease."""
        if isinstance(error, RunLocked):
            return
        try:
            self.check()
        except RunLocked as lost:
            raise RunLocked(f"{lost}; what stopped it then: {type(error).__name__}: {error}") from error
        except Exception:  # noqa: BLE001 - storage unreachable: the original error says enough
            return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lost is None:
            self.lease.release()
