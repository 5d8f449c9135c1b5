"""The run's writer lease, kept alive in the background while a flow runs.

`Store.acquire_lock` grants a lease of `ttl_s`; a round can take longer than that (big models, slow
nodes), so a thread refreshes it every ttl/3. If the lease is lost anyway (another writer took it over
after a stall), `check()` raises and the flow stops before it writes another round.
"""
from __future__ import annotations

import threading
from typing import Optional

from spes.store import RunLocked, Store


class RunLease:
    def __init__(self, store: Store, run: str, ttl_s: float):
        self.store, self.run, self.ttl_s = store, run, ttl_s
        self.owner: Optional[str] = None
        self._lost: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "RunLease":
        self.owner = self.store.acquire_lock(self.run, self.ttl_s)
        self._thread = threading.Thread(target=self._keep, name=f"lease-{self.run}", daemon=True)
        self._thread.start()
        return self

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.store.refresh_lock(self.run, self.owner, self.ttl_s)
            except RunLocked as e:
                self._lost = e
                return
            except Exception:  # storage hiccup: try again next period; the lease still has 2/3 of its time
                continue

    def check(self) -> None:
        if self._lost is not None:
            raise RunLocked(f"run {self.run!r}: stopped, the writer lease was lost ({self._lost})")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lost is None:
            self.store.release_lock(self.run, self.owner)
