"""Benchmarks clean up after themselves also when killed: SIGTERM (a `timeout`, a CI runner, kill) and SIGHUP
become SystemExit, so their `finally:` removes their temporary folders (Python's default for SIGTERM ends
the process without running it: a killed tokenization bench left 1.4 GB in the temp folder); the servers
they start go down with their whole process group."""
import os
import signal
import subprocess


def exit_on_termination() -> None:
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def stop_process_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """End a child started with start_new_session=True and all it started (a server's workers outlive their
    leader): SIGTERM to its group, SIGKILL after `timeout_s`; a group already gone is no error."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
