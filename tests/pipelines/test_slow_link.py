"""A run over slow links (bench/slow_link.py): each node machine in its own network namespace, reaching the
S3-compatible server and the Prefect server on this machine through a 20 Mbit/s link with 40 ms of round
trip and 0.1% segment loss, the orchestrator on loopback. The run ends bitwise equal to the same run over
loopback (the session's tiny reference, process executor), with a link cut for longer than a retry mid-run:
the round completes (or the node is declared lost and retried) within the heartbeat bound, and no partial
upload is ever visible."""
import json
import threading
import time

import pytest
import yaml

from bench.slow_link import Link, SlowLinks, available, service
from spes.config.loader import load_params
from spes.run.run import Run
from spes.storage.store import Store
from tests.pipelines.conftest import CREDS
from tests.pipelines.test_deployment import _wait_for
from tests.pipelines.test_many_machines import ROUNDS, Machine, _orchestrate, _ready
from tests.pipelines.tiny_project import PARAMS, assert_same, init_run

WHY_NOT = available()
pytestmark = [pytest.mark.s3, pytest.mark.slow,
              pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]
LINK = Link(rate_bps=20e6, rtt_s=0.04, loss=0.001)


def _params(root, name: str) -> str:
    """The tiny reference run's maths; storage named by bucket only: each machine reaches the S3 server by
    its own endpoint (AWS_ENDPOINT_URL_S3), as real machines on other networks do."""
    p = json.loads(json.dumps(PARAMS))
    p.update(artifacts_dir=str(root / "artifacts"), storage={"url": f"s3://spes-many/{name}", "keep_rounds": 2},
             checkpoint={"every_rounds": 100})
    p["orchestration"] = dict(PARAMS["orchestration"], executor="deployment", threads_per_node=1,
                              heartbeat_timeout_s=20, node_retries=4, round_timeout_s=300)
    f = root / f"params-{name}.yaml"
    f.write_text(yaml.safe_dump(p))
    return str(f)


class NetMachine(Machine):
    """A node machine inside node i's namespace, reaching the services through its slow link."""

    def __init__(self, cluster, net: SlowLinks, i: int):
        super().__init__(cluster, f"wan-{i}", "--nodes", str(i))
        self.node = net.nodes[i]
        self.prefix = self.node.exec_args()

    def start(self, **env) -> "Machine":
        return super().start(**self.node.machine_env(), **env)


@pytest.fixture
def wan(cluster):
    with SlowLinks([LINK, LINK], {"s3": service(cluster["endpoint"]), "prefect": service(cluster["api"])}) as net:
        yield net


def _run(cluster, net, name: str, monkeypatch, during=None):
    root, orch, api = cluster["root"], cluster["orch"], cluster["api"]
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", cluster["endpoint"])
    orch_env = dict(cluster["env"]("orchestrator"), AWS_ENDPOINT_URL_S3=cluster["endpoint"])
    pfile = _params(orch, name)
    init_run(pfile, name)
    machines = [NetMachine(cluster, net, i).start() for i in range(2)]
    try:
        _wait_for("node deployments over the slow links",
                  lambda: _ready(api, ["spes-node/spes-node-0", "spes-node/spes-node-1"]), 180,
                  [m.proc for m in machines])
        flow, flow_log = _orchestrate(pfile, name, orch_env, orch)
        store = Store.from_config(load_params(pfile).storage)
        side = threading.Thread(target=during, args=(store,), daemon=True) if during else None
        if side:
            side.start()
        rc = flow.wait(timeout=500)
        out = flow_log.read_text()
        assert rc == 0, out[-6000:] + "".join((root / f"wan-{i}.log").read_text()[-3000:] for i in range(2))
        if side:
            side.join(timeout=60)
    finally:
        for m in machines:
            m.stop()
    return Run(store, name), out


def test_a_run_over_slow_links_with_a_cut_ends_bitwise_equal_to_one_over_loopback(cluster, wan, tiny_reference,
                                                                                  monkeypatch):
    """One run shows both (a run of its own per property would double the suite's longest test): the slow
    links change no bit, and a 20 s cut of node 1's link in round 2 is survived with nothing partial seen."""
    seen_partial = []
    before = [n.interface_bytes() for n in wan.nodes]
    cut_at = []

    def cut_node_1_mid_run(store):
        beat = "runs/wancut/heartbeats/001.json"
        deadline = time.time() + 300
        while time.time() < deadline:  # node 1 training round 2: cut its link for 20 s
            if store.exists(beat) and json.loads(store.read_bytes(beat)).get("round") == 2:
                break
            time.sleep(0.2)
        cut_at.append(time.time())
        stop = threading.Event()

        def watch():  # nothing partial is ever visible: a committed upload always has every file whole
            while not stop.is_set():
                for r in (2, 3):
                    d = f"runs/wancut/rounds/{r:06d}/nodes/001"
                    try:
                        if store.is_committed(d):
                            for fname, entry in store.read_manifest(d)["files"].items():
                                if store.size_of(f"{d}/{fname}") != entry["bytes"]:
                                    seen_partial.append(f"{d}/{fname}")
                    except Exception as e:  # storage unreachable from here too: not a partial bundle
                        if "IntegrityError" in type(e).__name__:
                            seen_partial.append(f"{d}: {e}")
                stop.wait(0.5)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        wan.cut(1, 20.0)
        time.sleep(5)
        stop.set()
        w.join()

    run, out = _run(cluster, wan, "wancut", monkeypatch, during=cut_node_1_mid_run)
    assert cut_at, "node 1 never reached round 2"
    assert run.committed_rounds()[-1] == ROUNDS
    assert_same(run.load_model(ROUNDS)[0].canonical_state_dict(), tiny_reference["weights"])
    rec = run.records(2, 2)[0]
    assert [n.status for n in rec.nodes] == ["ok", "ok"] and rec.wall_s < 300
    assert rec.wall_s > 15  # the cut hit the round: node 1's upload waited for its link
    assert seen_partial == [], seen_partial
    # the nodes' traffic went over their links: the interfaces carried at least what the relays forwarded
    for node, (up0, down0) in zip(wan.nodes, before):
        up, down = node.interface_bytes()
        relayed_up = sum(r.bytes_up for r in node.relays.values())
        relayed_down = sum(r.bytes_down for r in node.relays.values())
        assert up - up0 >= relayed_up > 0 and down - down0 >= relayed_down > 0
