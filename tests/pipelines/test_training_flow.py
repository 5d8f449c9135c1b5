"""The training flow through real Prefect, node processes and storage: resume, faults, quorum, locks, S3."""
import glob

import pytest
import torch
import yaml

from spes.config import load_params
from spes.rounds import load_global
from spes.store import RunLocked, Store
from tests.pipelines.tiny_project import assert_same, final_weights, init_run, make_project


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("proj")
    make_project(root)
    return root


def params_file(project, **storage):
    if not storage:
        return str(project / "params.yaml")
    d = yaml.safe_load((project / "params.yaml").read_text())
    d["storage"] = storage
    f = project / f"params-{abs(hash(str(storage)))}.yaml"
    f.write_text(yaml.safe_dump(d))
    return str(f)


def train(pfile, run, **kw):
    from pipelines.training import spes_training

    return spes_training(params_path=pfile, run_name=run, **kw)


@pytest.fixture(scope="module")
def reference(project, prefect_server):
    pfile = params_file(project)
    init_run(pfile, "ref")
    out = train(pfile, "ref")
    assert out["latest_committed"] == 3
    return final_weights(pfile, "ref")


def test_resume_equals_uninterrupted(project, reference):
    pfile = params_file(project)
    init_run(pfile, "resumed")
    assert train(pfile, "resumed", stage="warmup")["latest_committed"] == 2
    train(pfile, "resumed", stage="train", resume_round="latest")
    assert_same(final_weights(pfile, "resumed"), reference)
    # resume from an earlier committed round: later rounds are set aside, recomputed identically
    out = train(pfile, "resumed", resume_round=1)
    assert out["first_round"] == 2
    assert_same(final_weights(pfile, "resumed"), reference)
    assert glob.glob(str(project / "storage/runs/resumed/superseded/*/000003"))


def test_sigkilled_node_is_retried_and_result_unchanged(project, reference, monkeypatch):
    pfile = params_file(project)
    init_run(pfile, "killed")
    monkeypatch.setenv("SPES_FAULT_PLAN", '{"kill": {"round": 2, "node": 1, "after_step": 1}}')
    out = train(pfile, "killed")
    assert out["rounds"][1]["aggregate"]["contributors"] == [0, 1]
    assert_same(final_weights(pfile, "killed"), reference)


def test_straggler_left_out_with_quorum(project, prefect_server, monkeypatch):
    pfile = params_file(project)
    init_run(pfile, "straggler")
    monkeypatch.setenv("SPES_FAULT_PLAN", '{"slow": {"round": 2, "node": 1, "seconds": 20}}')
    out = train(pfile, "straggler", overrides=["orchestration.round_timeout_s=12", "orchestration.min_nodes=1",
                                                 "spes.merge.enabled=false"])
    agg2 = out["rounds"][1]["aggregate"]
    assert agg2["contributors"] == [0] and agg2["missing"] == [1]
    p = load_params(pfile)
    store = Store(p.storage.url)
    p = load_params(pfile, ["spes.merge.enabled=false"])
    store = Store(p.storage.url)
    r1 = load_global(store, "straggler", 1)[0].canonical_state_dict()
    r2 = load_global(store, "straggler", 2)[0].canonical_state_dict()
    node0 = store.read_bundle(store.node_dir("straggler", 2, 0)).files["upload.safetensors"]
    for k in r2:
        if ".experts." in k:
            assert torch.equal(r2[k][2:], r1[k][2:])  # node 1's experts keep their previous values
            assert torch.equal(r2[k][:2], node0[k])
        else:
            assert torch.equal(r2[k], node0[k])  # shared params: mean over the nodes present (only node 0)
    assert out["rounds"][2]["aggregate"]["contributors"] == [0, 1]  # node 1 rejoins in round 3


def test_second_writer_is_refused(project, prefect_server):
    pfile = params_file(project)
    init_run(pfile, "locked")
    p = load_params(pfile)
    Store(p.storage.url).acquire_lock("locked", ttl_s=600)
    with pytest.raises(RunLocked, match="being written by"):
        train(pfile, "locked")


def test_s3_storage_with_resume(project, reference, monkeypatch):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        opts = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
        import s3fs

        s3fs.S3FileSystem(**opts).mkdir("spes-test")
        pfile = params_file(project, url="s3://spes-test/shared", options=opts)
        init_run(pfile, "s3run")
        train(pfile, "s3run", stage="warmup")
        train(pfile, "s3run", stage="train", resume_round="latest")
        assert_same(final_weights(pfile, "s3run"), reference)
        p = load_params(pfile)
        assert Store(p.storage.url, p.storage.options).committed_rounds("s3run") == [0, 1, 2, 3]
    finally:
        server.stop()
