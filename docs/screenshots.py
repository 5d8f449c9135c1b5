"""The README's pictures of a run, taken by a script in a real browser (issue 31, item 3).

It starts a Prefect server and TensorBoard on loopback (free ports, a temporary PREFECT_HOME), runs a short
training of the embedded default through the real stages (tokenize -> dense -> upcycle -> warmup -> train,
fewer rounds and steps: `--rounds`, `--sync-steps`), then saves screenshots with headless Chromium
(`chromium --headless --screenshot`, the Debian package: `apt-get install -y chromium`) of:

    prefect-flow-run.png           the train stage's flow run (its round tasks on the timeline)
    prefect-round-table.png        the last round's table artifact
    prefect-round-progress.png     the last round's progress artifact (a row per node)
    prefect-heldout-artifact.png   the held-out artifact: its curve and each node's train loss
    tensorboard-scalars.png        TensorBoard's scalars of the run: held-out loss, train loss per node

Each page is taken once its rendered text shows what it is for (the run's name, a column of the round table,
...) and no error (Prefect's UI draws "Can't connect to Server API" inside an otherwise normal page); each
picture's path and size are printed; a JSON line with the date closes the output. Everything it started is stopped and its temporary folder
removed at the end, also on failure or when killed.

    python docs/screenshots.py [--out docs] [--rounds 4] [--sync-steps 20] [--chromium /usr/bin/chromium]
                               [--tokens DIR] [key=value ...]   # a test: given shards, a smaller model
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.cleanup import exit_on_termination, stop_process_group  # noqa: E402
from pipelines.prefect_api import free_port, wait_for_http  # noqa: E402
from spes.cli import run_command  # noqa: E402
from spes.errors import UsageError  # noqa: E402

RUN = "default"
WINDOW = "1680,1000"


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    """Until `url` answers 200, or the server process died, or `timeout_s` passed (each named)."""
    wait_for_http(url, proc, str(proc.args[0]), timeout_s)


def stage(args: list[str], env: dict, log) -> None:
    """One DVC stage's command, as `dvc repro` runs it, on the run's params file."""
    cmd = [sys.executable, "-m", *args]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if out.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} failed ({out.returncode}); its output is in {log.name}")


PROFILE = ""
"""Chromium's profile and temporary folder: short and under /tmp (its singleton socket's path must fit in a
Unix socket address, which a deep TMPDIR exceeds), made and removed by main()."""


def chromium(binary: str, url: str, output: str, budget_ms: int = 15000) -> subprocess.CompletedProcess:
    """Headless Chromium on `url` after `budget_ms` of the page's own time (the UI loads its data first);
    `output`: --screenshot=<path> or --dump-dom (the rendered page's HTML on stdout)."""
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={PROFILE}", f"--window-size={WINDOW}", f"--virtual-time-budget={budget_ms}", output, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, TMPDIR=PROFILE))
    if out.returncode:
        raise RuntimeError(f"chromium could not open {url}: {out.stderr[-1500:]}")
    return out


def take(binary: str, url: str, path: str, expect: Optional[str]) -> None:
    """The page's picture, once its rendered text shows `expect` (so neither an error page nor a page still
    loading is taken for it: Prefect's UI says "Can't connect to Server API" in an otherwise drawn page).
    None: the page's text is not in its DOM (TensorBoard draws inside shadow roots); checked otherwise."""
    if expect is not None:
        dom = chromium(binary, url, "--dump-dom").stdout
        for bad in ("Can't connect to Server API", "Something went wrong"):
            if bad in dom:
                raise RuntimeError(f"{url} shows {bad!r}")
        if expect not in dom:
            raise RuntimeError(f"{url}: the rendered page lacks {expect!r}")
    chromium(binary, url, f"--screenshot={path}")
    if not os.path.exists(path):
        raise RuntimeError(f"chromium wrote no picture of {url}")


def tensorboard_pages(base: str, proc: subprocess.Popen, runs: tuple[str, ...]) -> dict[str, str]:
    """TensorBoard's scalars dashboard filtered to the loss curves (a TensorBoard run per node and the run's
    global one overlaid) and its images dashboard with the expert-load heat maps, once its server has read
    every run's events (it loads them in the background after it answers: a picture taken before would show
    no chart). The time-series dashboard draws its lines on a canvas that headless Chromium leaves empty;
    the scalars one is SVG."""
    want = {(f"{run}/global", "loss/heldout") for run in runs} | {(f"{run}/node{i}", "loss/train")
                                                                   for run in runs for i in (0, 1)}
    deadline = time.time() + 120
    while True:
        wait_http(f"{base}/", 60, proc)
        with urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=5) as r:
            found = {(run, tag) for run, tags in json.load(r).items() for tag in tags}
        if want <= found:
            return {"tensorboard-scalars": f"{base}/?darkMode=false#scalars&tagFilter=" + urllib.parse.quote("^loss/"),
                    "tensorboard-expert-load": f"{base}/?darkMode=false#images&tagFilter="
                    + urllib.parse.quote("^routing/expert_load_layer[01]$")}
        if time.time() > deadline:
            raise RuntimeError(f"TensorBoard did not load {sorted(want - found)} within 120 s")
        time.sleep(1)


def prefect_pages(api: str, ui: str) -> dict[str, tuple[str, Optional[str]]]:
    """The pages to take, each with a text its rendered page must show: the train flow run and the artifacts
    of its last round, looked up by the API."""
    os.environ["PREFECT_API_URL"] = api
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"{RUN}-train"])))
        if not runs:
            raise RuntimeError(f"no flow run named {RUN}-train on {api}")
        pages = {"prefect-flow-run": (f"{ui}/runs/flow-run/{runs[0].id}", f"{RUN}-train")}
        keys = {"prefect-heldout-artifact": (f"{RUN}-heldout", "held-out")}
        tables = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=f"{RUN}-round-")))
        rounds = sorted({int(a.key.split("-")[2]) for a in tables if a.key and a.key.split("-")[2].isdigit()})
        if not rounds:
            raise RuntimeError(f"no round artifacts of {RUN} on {api}")
        keys["prefect-round-table"] = (f"{RUN}-round-{rounds[-1]}", "expert load max/mean")
        keys["prefect-round-progress"] = (f"{RUN}-round-{rounds[-1]}-progress", "local steps done")
        for name, (key, expect) in keys.items():  # by id: this Prefect renders an empty body at /artifacts/key/<key>
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                          sort=ArtifactSort.CREATED_DESC)  # a key's versions: the latest
            if not found:
                raise RuntimeError(f"no artifact {key} on {api}")
            pages[name] = (f"{ui}/artifacts/artifact/{found[0].id}", expect)
    return pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"), help="where the PNGs go (default: docs/)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the run (half of them warm-up)")
    ap.add_argument("--sync-steps", type=int, default=20, help="local steps per round")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    ap.add_argument("--tokens", default=None, help="token shards to use instead of tokenizing the corpus")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of params.yaml for the run (e.g. a smaller model)")
    a = ap.parse_intermixed_args()
    if not a.chromium:
        raise UsageError("no chromium on PATH: `apt-get install -y chromium`, or --chromium PATH")
    exit_on_termination()  # a kill still runs the finally below
    global PROFILE
    tmp = tempfile.mkdtemp(prefix="spes-screenshots-")
    PROFILE = tempfile.mkdtemp(prefix="spes-chromium-", dir="/tmp" if os.path.isdir("/tmp") else None)
    procs: list[subprocess.Popen] = []
    try:
        port, tb_port = free_port(), free_port()
        ui, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
        # the UI's own calls go to PREFECT_UI_API_URL (default: port 4200), not to the port it was served from
        env = dict(os.environ, PREFECT_HOME=os.path.join(tmp, "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_LOGGING_LEVEL="INFO", PREFECT_UI_API_URL=api, PREFECT_SERVER_UI_API_URL=api)
        env.pop("PREFECT_API_URL", None)
        server_log = open(os.path.join(tmp, "server.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                       "--port", str(port)], env=env, stdout=server_log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        artifacts = os.path.join(tmp, "artifacts")
        overrides = [f"artifacts_dir={artifacts}", f"storage.url={os.path.join(tmp, 'storage')}",
                     f"orchestration.node_cache_dir={os.path.join(tmp, 'node-cache')}", f"orchestration.run_name={RUN}",
                     f"sync.rounds={a.rounds}", f"sync.warmup_rounds={max(1, a.rounds // 2)}",
                     f"sync.every_steps={a.sync_steps}", "dense.steps=40", "checkpoint.every_rounds=2", *a.overrides]
        first = [["stages.dense"], ["stages.upcycle"]]
        if a.tokens:
            shutil.copytree(a.tokens, os.path.join(artifacts, "tokens"))
        else:
            first.insert(0, ["stages.tokenize"])
        t0 = time.time()
        with open(os.path.join(tmp, "stages.log"), "w") as log:
            for args in first:  # none of these needs Prefect: they run while its server starts
                stage([*args, *overrides], env, log)
            wait_http(f"{api}/health", 180, procs[0])
            env["PREFECT_API_URL"] = api
            for args in (["stages.rounds", "warmup"], ["stages.rounds", "train"]):
                stage([*args, *overrides], env, log)
        trained_s = time.time() - t0
        procs.append(subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir",
                                       os.path.join(artifacts, "tensorboard"), "--host", "127.0.0.1", "--port",
                                       str(tb_port)], env=dict(env, TMPDIR=tmp),  # its .tensorboard-info too
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        pages = prefect_pages(api, ui)
        for name, url in tensorboard_pages(f"http://127.0.0.1:{tb_port}", procs[1], (RUN,)).items():
            pages[name] = (url, None)
        os.makedirs(a.out, exist_ok=True)
        taken = {}
        for name, (url, expect) in pages.items():
            path = os.path.join(a.out, f"{name}.png")
            take(a.chromium, url, path, expect)
            taken[name] = {"path": path, "bytes": os.path.getsize(path), "url": url, "shows": expect}
            print(f"{path}: {os.path.getsize(path):,} bytes ({url}" + (f", showing {expect!r})" if expect else ")"))
        print(json.dumps({"date": datetime.date.today().isoformat(), "train_s": round(trained_s, 1),
                          "screenshots": taken}))
    finally:
        for proc in procs:
            stop_process_group(proc, 20)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(PROFILE, ignore_errors=True)


if __name__ == "__main__":
    run_command(main)
