"""A round's wall time and its parts over slow links, against the link's rate (bench/slow_link.py: each node
machine in its own network namespace, rate by tbf, latency and loss by a relay).

Starts an S3-compatible server (moto) and a Prefect server on loopback; per rate, two node machines
(`python -m pipelines.node_flow --nodes i`, each in its namespace, reaching both servers only through its
link) and the orchestrator here (deployment executor) run the same few rounds of the embedded default's
model and round (50 steps of 8 x 128 tokens per node, merging off: the steady state). From the round
records of the middle rounds (round 1 pays the processes' start and the token fetch, the last round
checkpoints every node's state to shared storage): per round the wall time and
its parts: the slowest node's download (reading global r-1 and its state), train and upload (its files), the
aggregation, and what is left (idle: the manifests and commit markers, the heartbeats, the orchestrator's and
Prefect's share), and the ratio of wall time to compute, side by side per rate; and the bytes each round put
on the node's interface (its veth's counters, read at each global's commit) beside what the storage layer
counted for the round (MB up/down: the files and manifests a node read and wrote).

With `--overlap none,one_round` each rate runs once per sync.overlap setting; the steady round time is then
read as the time between successive globals' commits (with overlap a node's compute of round r+1 happens
before round r+1's task starts, so the round record's own wall time no longer contains it), and set beside
the compute of a round.

    python bench/wan_round.py [--rates 100,20,4] [--overlap none] [--rtt-ms 40] [--loss 0.001] [--rounds 4] [--json]

Needs root (namespaces); says why not and exits 2 elsewhere.
"""
from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.cleanup import exit_on_termination, stop_process_group  # noqa: E402
from bench.deployment_overhead import PARAMS, _get, _wait  # noqa: E402
from bench.slow_link import Link, SlowLinks, available, service  # noqa: E402
from pipelines.prefect_api import free_port  # noqa: E402

CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def parts_of(records) -> dict:
    """Mean over rounds of the wall time and its parts (seconds), and wall / compute."""
    rows = []
    for rec in records:
        ok = [n for n in rec.nodes if n.ok]
        load = max(n.upload.seconds_read for n in ok)
        compute = max(n.seconds_compute for n in ok)
        upload = max(n.upload.seconds_upload for n in ok)
        aggregate = rec.aggregate.seconds_aggregate
        node_path = max(n.upload.seconds_read + n.upload.seconds_load + n.seconds_compute + n.upload.seconds_upload
                        for n in ok)
        rows.append({"wall_s": rec.wall_s, "download_s": load, "train_s": compute, "upload_s": upload,
                     "aggregate_s": aggregate, "idle_s": max(0.0, rec.wall_s - node_path - aggregate),
                     "bytes_up": max(n.bytes_up for n in ok), "bytes_down": max(n.bytes_down for n in ok)})
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    mean["wall_over_compute"] = mean["wall_s"] / mean["train_s"]
    mean["transfer_over_compute"] = (mean["download_s"] + mean["upload_s"]) / mean["train_s"]
    return mean


def _machines(net: SlowLinks, env: dict, tmp: str) -> list[subprocess.Popen]:
    procs = []
    for node in net.nodes:
        home = os.path.join(tmp, f"node-machine-{node.index}")
        os.makedirs(home, exist_ok=True)
        menv = dict(env, HOME=home, PREFECT_HOME=os.path.join(home, ".prefect"), **node.machine_env())
        with open(os.path.join(home, "node.log"), "a") as log:  # the machine keeps its own copy of the file
            procs.append(subprocess.Popen(node.exec_args() + [sys.executable, "-m", "pipelines.node_flow", "--nodes",
                                                              str(node.index)], cwd=home, env=menv, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def run_name(rate_mbit: float, overlap: str) -> str:
    return f"wan-{rate_mbit:g}mbit" + ("" if overlap == "none" else f"-overlap-{overlap}")


def run_at(rate_mbit: float, overlap: str, a, env: dict, api: str, endpoint: str, pfile: str, tmp: str) -> dict:
    """One run of a.rounds rounds with both nodes on links of `rate_mbit`; its parts per round."""
    from spes.config.loader import load_params
    from spes.run.run import Run
    from spes.storage.store import Store

    services = {"s3": service(endpoint), "prefect": service(api)}
    store = Store.from_config(load_params(pfile).storage)
    link = Link(rate_mbit * 1e6, a.rtt_ms / 1000, a.loss)
    run = run_name(rate_mbit, overlap)
    with SlowLinks([link, link], services) as net:
        procs = _machines(net, env, tmp)
        try:
            _wait("the node deployments", lambda: all(
                _get(f"{api}/deployments/name/spes-node/spes-node-{i}").get("status") == "READY" for i in (0, 1)), 180)
            before = [n.interface_bytes() for n in net.nodes]
            code = ("import sys; from pipelines.training import spes_training; "
                    "spes_training(params_path=sys.argv[1], stage='all', run_name=sys.argv[2], "
                    "overrides=[f'sync.overlap={sys.argv[3]}'])")
            t = time.time()
            with RoundCounters(Run(store, run), net, a.rounds) as counters:
                out = subprocess.run([sys.executable, "-c", code, pfile, run, overlap],
                                     env=dict(env, AWS_ENDPOINT_URL_S3=endpoint), capture_output=True, text=True,
                                     timeout=60 * (5 + 3 * a.rounds))
            if out.returncode:
                raise SystemExit(f"wan_round: the {run} run failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
            iface = [tuple(x - y for x, y in zip(n.interface_bytes(), b)) for n, b in zip(net.nodes, before)]
        finally:
            for proc in procs:
                stop_process_group(proc, 15)
    res = parts_of(Run(store, run).records(2, a.rounds - 1))
    res.update(rate_mbit=rate_mbit, overlap=overlap, flow_s=time.time() - t,
               interface_bytes_up=max(u for u, _ in iface), interface_bytes_down=max(d for _, d in iface),
               **counters.per_round(2, a.rounds - 1))
    return res


class RoundCounters:
    """Each node's interface byte counters (up, down) read when each global is committed (polled from here,
    over loopback: the polling crosses no node's link), so a round's bytes on the wire can be set beside
    what the storage layer counted for it. Round r's share: from global r-1's commit to global r's."""

    def __init__(self, run, net: SlowLinks, rounds: int):
        import threading

        self.run, self.net, self.rounds = run, net, rounds
        self.at: dict[int, list[tuple[int, int]]] = {}
        self.when: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "RoundCounters":
        self.at[0] = [n.interface_bytes() for n in self.net.nodes]
        self.when[0] = time.time()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)

    def _watch(self) -> None:
        r = 1
        while r <= self.rounds and not self.stop.is_set():
            if self.run.store.is_committed(self.run.layout.global_dir(r)):
                self.at[r] = [n.interface_bytes() for n in self.net.nodes]
                self.when[r] = time.time()
                r += 1
            else:
                time.sleep(0.1)

    def per_round(self, first: int, last: int) -> dict:
        """The mean over rounds first..last of the largest node's bytes up and down on its interface."""
        rounds = [r for r in range(first, last + 1) if r in self.at and r - 1 in self.at]
        if not rounds:
            return {}
        up = [max(now[0] - then[0] for now, then in zip(self.at[r], self.at[r - 1])) for r in rounds]
        down = [max(now[1] - then[1] for now, then in zip(self.at[r], self.at[r - 1])) for r in rounds]
        gaps = [self.when[r] - self.when[r - 1] for r in rounds]
        return {"interface_bytes_up_per_round": sum(up) / len(up), "interface_bytes_down_per_round": sum(down) / len(down),
                "commit_interval_s": sum(gaps) / len(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100,20,4", help="link rates in Mbit/s, each way")
    ap.add_argument("--overlap", default="none", help="sync.overlap settings to run at each rate, e.g. none,one_round")
    ap.add_argument("--rtt-ms", type=float, default=40.0)
    ap.add_argument("--loss", type=float, default=0.001)
    ap.add_argument("--rounds", type=int, default=4, help="at least 3: rounds 2 .. rounds-1 are measured")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.rounds < 3:
        print("wan_round: --rounds must be at least 3 (rounds 2 .. rounds-1 are measured)", file=sys.stderr)
        sys.exit(2)
    why = available()
    if why:
        print(f"wan_round: {why}", file=sys.stderr)
        sys.exit(2)
    import yaml
    from moto.server import ThreadedMotoServer

    from spes.data.tokenization import tokenize_corpus

    exit_on_termination()
    tmp = tempfile.mkdtemp(prefix="spes-wan-")
    atexit.register(shutil.rmtree, tmp, True)
    docs = [open(f, encoding="utf-8").read()
            for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))]
    tokenize_corpus(docs, os.path.join(tmp, "artifacts", "tokens"), 512, None, 0.2, 0)
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    host, port = s3.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(CREDS, AWS_ENDPOINT_URL_S3=endpoint)  # this machine's way to the bucket (nodes: their link)
    import s3fs

    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("spes-wan")
    p = json.loads(json.dumps(PARAMS))
    p["sync"]["rounds"], p["merge"] = a.rounds, {"enabled": False}
    p["orchestration"].update(executor="deployment", threads_per_node=1, heartbeat_timeout_s=60,
                              round_timeout_s=600)
    p.update(artifacts_dir=os.path.join(tmp, "artifacts"), storage={"url": "s3://spes-wan/runs"})
    pfile = os.path.join(tmp, "params.yaml")
    with open(pfile, "w") as f:
        yaml.safe_dump(p, f)
    api = f"http://127.0.0.1:{free_port()}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_ENDPOINT"))}
    env.update(CREDS, PYTHONPATH=ROOT, PREFECT_API_URL=api, PREFECT_HOME=os.path.join(tmp, "prefect"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               api.split(":")[2].split("/")[0], "--no-ui"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait("the Prefect server", lambda: _get(api + "/health") is True, 180)
        cases = [(float(r), o) for r in a.rates.split(",") for o in a.overlap.split(",")]
        _init_runs(pfile, cases)
        results = [run_at(r, o, a, env, api, endpoint, pfile, tmp) for r, o in cases]
    finally:
        stop_process_group(server, 15)
        s3.stop()
    print(f"{'Mbit/s':>7} {'overlap':>9} {'commits every s':>15} {'/ compute':>9} {'wall s':>7} {'down s':>7} {'train s':>8} {'up s':>6} {'agg s':>6} {'idle s':>7} "
          f"{'transfer/compute':>17} {'wall/compute':>13} {'MB up':>6} {'MB down':>8} {'wire MB up':>11} "
          f"{'wire MB down':>13}")
    for r in results:
        gap = r.get("commit_interval_s", float("nan"))
        print(f"{r['rate_mbit']:>7g} {r['overlap']:>9} {gap:>15.1f} {gap / r['train_s']:>9.2f} {r['wall_s']:>7.1f} {r['download_s']:>7.1f} {r['train_s']:>8.1f} "
              f"{r['upload_s']:>6.1f} {r['aggregate_s']:>6.1f} {r['idle_s']:>7.1f} {r['transfer_over_compute']:>17.2f} "
              f"{r['wall_over_compute']:>13.2f} {r['bytes_up'] / 1e6:>6.2f} {r['bytes_down'] / 1e6:>8.2f} "
              f"{r.get('interface_bytes_up_per_round', 0) / 1e6:>11.2f} "
              f"{r.get('interface_bytes_down_per_round', 0) / 1e6:>13.2f}")
    if a.json:
        print(json.dumps({"rtt_ms": a.rtt_ms, "loss": a.loss, "rounds": a.rounds, "cases": results}))


def _init_runs(pfile: str, cases: list[tuple[float, str]]) -> None:
    """Round 0 of each run: the same seeded model."""
    import torch

    from spes.config.loader import load_params
    from spes.model.transformer import CausalLM
    from spes.run.identity import InitModel, settings_fingerprint
    from spes.run.run import Run
    from spes.storage.store import Store

    for rate, overlap in cases:
        p = load_params(pfile, [f"sync.overlap={overlap}"])
        store = Store.from_config(p.storage)
        torch.manual_seed(0)
        Run(store, run_name(rate, overlap)).ensure(settings_fingerprint(p), InitModel.from_state(CausalLM(p.model).canonical_state_dict(),
                                                                              p.model, "bench"))


if __name__ == "__main__":
    main()
