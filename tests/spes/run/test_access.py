"""Least privilege on storage (spes/run/access.py): the grants of each role as patterns of the run's layout,
and, against an S3 server that checks each request against its key's IAM policy (tests/iam_s3.py), every
call a node machine makes in a round allowed and what is not its own refused in one line naming the role
and the object. The whole run with one key per role: tests/pipelines/test_least_privilege.py."""
import re

import pytest
import torch

from spes.errors import ConfigError, StorageError
from spes.run.access import iam_policy, node_grants, orchestrator_grants, split_s3_url
from spes.run.layout import RunLayout, tokens_dir
from spes.run.token_share import fetch_tokens, publish_tokens
from spes.storage.store import BundleWriter, Store

RUN = "least"
LAYOUT = RunLayout(RUN)


def _allowed(patterns, key: str) -> bool:
    """IAM's matching of an object key against resource patterns ('*' any run of characters)."""
    return any(re.fullmatch(re.escape(p).replace(r"\*", ".*"), key) for p in patterns)


def test_a_node_machine_writes_only_its_own_nodes_files_and_reads_what_a_round_needs():
    g = node_grants(LAYOUT, [1, 3])
    own = [f"{LAYOUT.node_dir(7, 1)}/COMMIT", f"{LAYOUT.state_dir(7, 3)}/model.safetensors", LAYOUT.heartbeat(3),
           LAYOUT.request_file("join", 1), LAYOUT.request_file("leave", 3)]
    others = [f"{LAYOUT.node_dir(7, 0)}/COMMIT", f"{LAYOUT.state_dir(7, 2)}/manifest.json", LAYOUT.heartbeat(0),
              LAYOUT.request_file("join", 2), f"{LAYOUT.global_dir(7)}/model.safetensors",
              f"{LAYOUT.delta_dir(7)}/COMMIT", f"{LAYOUT.record_dir(7)}/COMMIT", LAYOUT.lease_file(4),
              f"{LAYOUT.info}/COMMIT", f"{LAYOUT.rejected_dir(7, 1, 'x')}/COMMIT", f"{tokens_dir('abc')}/COMMIT",
              f"{RunLayout('other').node_dir(7, 1)}/COMMIT", f"{LAYOUT.superseded_dir('x')}/000007/global/COMMIT"]
    assert all(_allowed(g.write, k) for k in own)
    assert not any(_allowed(g.write, k) for k in others)
    reads = [f"{LAYOUT.global_dir(7)}/model.safetensors", f"{LAYOUT.delta_dir(7)}/COMMIT", f"{LAYOUT.info}/COMMIT",
             f"{tokens_dir('abc')}/shard-000.bin", f"{LAYOUT.membership_dir}/join-00002.json",
             f"{LAYOUT.node_dir(7, 0)}/experts.safetensors", *own]
    assert all(_allowed(g.read, k) for k in reads)
    secret = [f"{LAYOUT.node_dir(7, 0)}/shared.safetensors", f"{LAYOUT.node_dir(7, 0)}/manifest.json", f"{LAYOUT.state_dir(7, 2)}/optim.safetensors",
              LAYOUT.lease_file(4), f"{RunLayout('other').global_dir(7)}/COMMIT", LAYOUT.heartbeat(0)]
    assert not any(_allowed(g.read, k) for k in secret)
    assert g.role == "node machine (nodes 1,3)"


def test_the_orchestrator_owns_its_run_and_the_token_data_only():
    g = orchestrator_grants(LAYOUT)
    for k in (LAYOUT.lease_file(4), f"{LAYOUT.node_dir(7, 0)}/COMMIT", f"{tokens_dir('abc')}/COMMIT"):
        assert _allowed(g.write, k) and _allowed(g.read, k)
    assert not _allowed(g.write, f"{RunLayout('other').global_dir(1)}/COMMIT")


def test_the_iam_policy_names_the_bucket_and_prefix_and_bad_input_is_one_line():
    pol = iam_policy(node_grants(LAYOUT, [0]), *split_s3_url("s3://bkt/team/exp1/"))
    read, write, listing = pol["Statement"]
    assert write["Action"] == ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    assert "arn:aws:s3:::bkt/team/exp1/runs/least/rounds/*/nodes/000/*" in write["Resource"]
    assert "arn:aws:s3:::bkt/team/exp1/runs/least/rounds/*/global/*" in read["Resource"]
    assert listing["Resource"] == ["arn:aws:s3:::bkt"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["team/exp1/runs/least/*", "team/exp1/data/tokens/*"]}}
    at_root = iam_policy(orchestrator_grants(LAYOUT), *split_s3_url("s3://bkt"))
    assert at_root["Statement"][1]["Resource"] == ["arn:aws:s3:::bkt/runs/least/*", "arn:aws:s3:::bkt/data/tokens/*"]
    for url in ("artifacts/storage", "s3://", "gs://bkt/x"):
        with pytest.raises(ConfigError, match="storage.url must be s3://BUCKET"):
            split_s3_url(url)
    with pytest.raises(ConfigError, match="node ids"):
        node_grants(LAYOUT, [])


def _tensors(v: float) -> dict:
    return {"model.safetensors": {"w": torch.full((4, 4), v)}}


@pytest.mark.s3
def test_against_iam_a_node_key_does_its_round_and_nothing_that_is_not_its_own(tmp_path, tiny_tokens):
    from tests.iam_s3 import IamS3

    with IamS3(str(tmp_path / "moto.log")) as s3:
        url = f"s3://{s3.bucket}/team"
        bucket, prefix = split_s3_url(url)
        orch_key = s3.principal("orchestrator", iam_policy(orchestrator_grants(LAYOUT), bucket, prefix))
        node_key = s3.principal("node0", iam_policy(node_grants(LAYOUT, [0]), bucket, prefix))
        s3.enforce()
        orch = Store(url, s3.options(orch_key), retries=0, role="orchestrator")
        node = Store(url, s3.options(node_key), retries=0, role="node machine")

        # the orchestrator: identity, tokens, round 1's global and delta, the lease; a rejected upload moved aside
        orch.write_bundle(LAYOUT.info, {}, {"fingerprint": "f", "run_id": "r"})
        key = publish_tokens(orch, tiny_tokens)
        orch.write_bundle(LAYOUT.global_dir(1), _tensors(1.0), {})
        orch.write_bundle(LAYOUT.delta_dir(1), _tensors(0.5), {})
        orch.create_exclusive(LAYOUT.lease_file(1), b"{}")

        # a node's round: what it reads and writes, a crashed upload redone, its state, heartbeat, a request
        assert node.read_manifest(LAYOUT.info)["meta"]["run_id"] == "r"
        assert node.is_committed(LAYOUT.global_dir(1)) and not node.is_committed(LAYOUT.global_dir(2))
        assert torch.equal(node.read_bundle(LAYOUT.global_dir(1)).files["model.safetensors"]["w"], torch.ones(4, 4))
        node.read_bundle(LAYOUT.delta_dir(1))
        assert fetch_tokens(node, key, str(tmp_path / "cache")).folder
        crashed = BundleWriter(node, LAYOUT.node_dir(2, 0))
        crashed.add("model.safetensors", {"w": torch.zeros(2)})  # never committed: the retry replaces it
        node.write_bundle(LAYOUT.node_dir(2, 0), _tensors(2.0), {"node": 0})
        node.write_bundle(LAYOUT.state_dir(2, 0), _tensors(3.0), {})
        node.remove(LAYOUT.state_dir(2, 0))
        node.write_bundle(LAYOUT.state_dir(2, 0), _tensors(3.0), {})
        node.read_bundle(LAYOUT.state_dir(2, 0))
        node.write_bytes(LAYOUT.heartbeat(0), b'{"beat": 1}')
        node.write_bytes(LAYOUT.request_file("join", 0), b"{}")
        assert orch.read_bytes(LAYOUT.heartbeat(0)) == b'{"beat": 1}'

        # refused, each in one line naming the role and the object; nothing of the orchestrator's changed
        refused = {
            "write a global": lambda: node.write_bundle(LAYOUT.global_dir(2), _tensors(9.0), {}),
            "write another node's upload": lambda: node.write_bundle(LAYOUT.node_dir(2, 1), _tensors(9.0), {}),
            "take the lease": lambda: node.create_exclusive(LAYOUT.lease_file(2), b"{}"),
            "overwrite the lease": lambda: node.write_bytes(LAYOUT.lease_file(1), b"{}"),
            "delete a global": lambda: node.remove(LAYOUT.global_dir(1)),
            "read another node's state": lambda: node.read_bytes(f"{LAYOUT.state_dir(2, 1)}/manifest.json"),
            "write a record": lambda: node.write_bundle(LAYOUT.record_dir(1), {}, {}),
        }
        for what, call in refused.items():
            with pytest.raises(StorageError) as e:
                call()
            msg = str(e.value)
            assert len(msg.splitlines()) == 1 and "access denied to the node machine's key" in msg, (what, msg)
            assert re.search(r"runs/least/(rounds/\d+/(global|nodes/001|states/001|record)|lease/)", msg), (what, msg)
        assert torch.equal(orch.read_bundle(LAYOUT.global_dir(1)).files["model.safetensors"]["w"], torch.ones(4, 4))
        assert not orch.exists(LAYOUT.global_dir(2)) and not orch.exists(LAYOUT.node_dir(2, 1))

        # the orchestrator sets an upload aside and performs retention
        orch.move(LAYOUT.node_dir(2, 0), LAYOUT.rejected_dir(2, 0, "t"))
        orch.remove(LAYOUT.round_dir(1))
        assert orch.is_committed(LAYOUT.rejected_dir(2, 0, "t")) and not orch.exists(LAYOUT.round_dir(1))
