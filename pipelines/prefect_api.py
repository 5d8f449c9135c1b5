"""The Prefect API a stage talks to: `PREFECT_API_URL` when set (a real server, the UI), else a temporary
local server started here and tied to this process.

Prefect's own ephemeral server outlives a SIGKILLed parent; this one is started with PR_SET_PDEATHSIG
(pipelines/node_pool.py), so the kernel ends it with the stage however the stage ends, like the node
processes. It listens on a free loopback port and keeps its database under PREFECT_HOME, as Prefect's does.
"""
from __future__ import annotations

import base64
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator

from pipelines.node_pool import spawn
from spes.errors import OrchestrationError

TEMPORARY_API_ENV = "SPES_TEMPORARY_PREFECT_API"
"""Set while PREFECT_API_URL points at the temporary server started here (no other machine can reach it)."""


def free_port() -> int:
    """A loopback port nobody listens on now (for a server started here: Prefect's, tests' S3)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def wait_for_http(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 180.0, poll_s: float = 0.3) -> None:
    """Until `url` answers 200; `proc` (the server) dying first, or `timeout_s` passing, is one line naming
    `what`."""
    deadline = time.time() + timeout_s
    while not _answers(url):
        if proc.poll() is not None:
            raise OrchestrationError(f"{what} exited with {proc.returncode} before it answered on {url}")
        if time.time() > deadline:
            raise OrchestrationError(f"{what} did not answer on {url} within {timeout_s:.0f} s")
        time.sleep(poll_s)


def drain_prefect_workers() -> None:
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=10)
        except Exception:  # best effort: the run itself is already committed on storage
            pass


AUTH_ENV = "PREFECT_API_AUTH_STRING"
"""A Prefect server started with PREFECT_SERVER_API_AUTH_STRING answers only clients that send the same
string (HTTP basic auth): set it on the orchestrator and on every node machine."""


def check_api_access(url: str) -> None:
    """One authenticated call to the API (the health probe is open even on a protected server): a 401 or a
    server that does not answer is one line naming the setting to fix, not a traceback inside the flow."""
    req = urllib.request.Request(f"{url.rstrip('/')}/admin/version")
    secret = os.environ.get(AUTH_ENV)
    if secret:
        req.add_header("Authorization", "Basic " + base64.b64encode(secret.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10):
            return
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise OrchestrationError(
                f"the Prefect API at {url} answered 401 Unauthorized: "
                + (f"it refused this machine's {AUTH_ENV}; set it to the server's PREFECT_SERVER_API_AUTH_STRING"
                   if secret else f"the server requires an auth string; set {AUTH_ENV} on this machine to its "
                   "PREFECT_SERVER_API_AUTH_STRING")) from None
        raise OrchestrationError(f"the Prefect API at {url} answered {e.code} {e.reason} to /admin/version") from None
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        raise OrchestrationError(f"the Prefect API at {url} does not answer ({getattr(e, 'reason', e)}); check "
                                 "PREFECT_API_URL and that the server runs") from None


@contextlib.contextmanager
def prefect_api(startup_timeout_s: float = 180.0) -> Iterator[str]:
    """Yield the API URL; a server started here is stopped on exit (and dies with this process)."""
    if os.environ.get("PREFECT_API_URL"):
        check_api_access(os.environ["PREFECT_API_URL"])  # before the lease and any round
        yield os.environ["PREFECT_API_URL"]
        return
    # where prefect lives, without importing it: its settings are read at import, after PREFECT_API_URL is set
    app_dir = os.path.dirname(os.path.dirname(importlib.util.find_spec("prefect").origin))
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = spawn([sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory",
                  "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
                  "--log-level", "error", "--lifespan", "on"], env=env)
    try:
        wait_for_http(f"{url}/health", proc, "the local Prefect server", startup_timeout_s, poll_s=0.2)
        os.environ["PREFECT_API_URL"] = url
        os.environ[TEMPORARY_API_ENV] = url
        # the temporary server has no UI and dies with the stage: no "View at http://..." link to a 404
        os.environ.setdefault("PREFECT_UI_URL", "")
        yield url
    finally:
        drain_prefect_workers()  # send the last logs and events while the server still listens
        os.environ.pop("PREFECT_API_URL", None)
        os.environ.pop(TEMPORARY_API_ENV, None)
        if os.environ.get("PREFECT_UI_URL") == "":
            os.environ.pop("PREFECT_UI_URL")
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
