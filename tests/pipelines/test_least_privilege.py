"""One S3 key per role, each holding only the policy `python -m spes.policy` prints for it, on an S3 server
that checks every request against it (tests/iam_s3.py): the orchestrator's key and two node machines' keys
(machine A trains node 0, machine B node 1, as in test_many_machines). The run completes and ends bitwise
equal to the session's tiny reference run (one machine, one key that may do anything); afterwards machine
A's key is refused a global, node 1's upload and the lease, each in one line naming its role and the object."""
import json
import subprocess
import sys
import time

import pytest

from spes.config.loader import load_params
from spes.errors import StorageError
from spes.run.layout import RunLayout
from spes.run.run import Run
from spes.storage.store import Store
from tests.iam_s3 import IamS3
from tests.pipelines.conftest import ROOT, services
from tests.pipelines.test_deployment import _wait_for
from tests.pipelines.test_many_machines import ROUNDS, Machine, _orchestrate, _params, _ready
from tests.pipelines.tiny_project import assert_same, init_run

RUN = "least"


def _printed_policy(pfile: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "spes.policy", *args, "--params", pfile, "--run", RUN], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def iam_cluster(tmp_path_factory, tiny_tokens, prefect_db):
    root = tmp_path_factory.mktemp("least")
    with IamS3(str(root / "moto.log")) as s3:
        with services(root, s3.endpoint, tiny_tokens, prefect_db, {}) as c:
            yield dict(c, s3=s3)


@pytest.mark.s3
@pytest.mark.slow
def test_a_run_with_one_least_privilege_key_per_role_ends_bitwise_equal(iam_cluster, tiny_reference, monkeypatch):
    c, s3 = iam_cluster, iam_cluster["s3"]
    pfile = _params(c["orch"], c["endpoint"], "deployment", "team", bucket=s3.bucket)
    keys = {"orchestrator": s3.principal("orchestrator", _printed_policy(pfile, "orchestrator")),
            "a": s3.principal("machine-a", _printed_policy(pfile, "node", "--nodes", "0")),
            "b": s3.principal("machine-b", _printed_policy(pfile, "node", "--nodes", "1"))}
    s3.enforce()
    for k, v in keys["orchestrator"].items():
        monkeypatch.setenv(k, v)
    init_run(pfile, RUN)
    since = time.time()
    a = Machine(c, "machine-a", "--nodes", "0").start(**keys["a"])
    b = Machine(c, "machine-b", "--nodes", "1").start(**keys["b"])
    try:
        _wait_for("node deployments", lambda: _ready(c["api"], ["spes-node/spes-node-0", "spes-node/spes-node-1"],
                                                     since), 120, [a.proc, b.proc])
        flow, flow_log = _orchestrate(pfile, RUN, c["env"]("orchestrator", **keys["orchestrator"]), c["orch"])
        rc = flow.wait(timeout=400)
        assert rc == 0, flow_log.read_text()[-6000:] + (c["root"] / "machine-a.log").read_text()[-3000:]
    finally:
        a.stop()
        b.stop()
    out = flow_log.read_text() + (c["root"] / "machine-a.log").read_text() + (c["root"] / "machine-b.log").read_text()
    assert "access denied" not in out
    p = load_params(pfile)
    run = Run(Store.from_config(p.storage), RUN)
    assert run.committed_rounds()[-1] == ROUNDS
    assert_same(run.load_model(ROUNDS)[0].canonical_state_dict(), tiny_reference["weights"])
    assert all(n.status == "ok" for r in run.records(1, ROUNDS) for n in r.nodes)

    # machine A's key, as its node process holds it, on what is not its own
    opts = dict(p.storage.options, key=keys["a"]["AWS_ACCESS_KEY_ID"], secret=keys["a"]["AWS_SECRET_ACCESS_KEY"])
    node_store, layout = Store(p.storage.url, opts, retries=0, role="node machine"), RunLayout(RUN)
    for what, call in {"a global": lambda: node_store.write_bytes(f"{layout.global_dir(ROUNDS)}/COMMIT", b"x"),
                       "node 1's upload": lambda: node_store.write_bytes(f"{layout.node_dir(ROUNDS, 1)}/x", b"x"),
                       "the lease": lambda: node_store.create_exclusive(layout.lease_file(999), b"{}")}.items():
        with pytest.raises(StorageError) as e:
            call()
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and "access denied to the node machine's key" in msg, (what, msg)
    assert_same(run.load_model(ROUNDS)[0].canonical_state_dict(), tiny_reference["weights"])
