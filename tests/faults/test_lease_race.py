"""Two processes racing to take over an expired writer lease: exactly one wins, every time, and the loser
gets RunLocked (never a raw error)."""
import json
import multiprocessing as mp
import time

from spes.errors import RunLocked
from spes.run.lease import WriterLease
from spes.storage.store import Store

TRIALS = 100


def _contender(root, barrier, done, out):
    barrier.wait()
    try:
        WriterLease(Store(root), "r", 60).acquire()
        out.put("won")
    except RunLocked:
        out.put("locked")
    except Exception as e:  # noqa: BLE001 - the point is to see anything else
        out.put(f"error: {type(e).__name__}: {e}")
    done.wait()  # the winner stays alive until both tried: a holder whose process is gone frees the lease


def test_racing_takeovers_never_both_win(tmp_path):
    ctx = mp.get_context("fork")
    outcomes = []
    for trial in range(TRIALS):
        root = tmp_path / f"t{trial}"
        (root / "runs/r/lease").mkdir(parents=True)
        expired = {"owner": "dead-host:1:x", "host": "dead-host", "expires_at": time.time() - 1, "released": False}
        (root / "runs/r/lease/0000000000.json").write_text(json.dumps(expired))
        barrier, done, out = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_contender, args=(str(root), barrier, done, out)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        outcomes.append(sorted(out.get(timeout=5) for _ in procs))
    assert outcomes == [["locked", "won"]] * TRIALS
