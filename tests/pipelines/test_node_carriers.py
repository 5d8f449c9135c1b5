"""Conformance of the node carriers: the same round asked through each way a node's round travels (the
process pool's pipe, the node host's socket that a `spes-node` deployment uses, a node of two ranks whose
torchrun job answers through a file) gives the same report and upload, progress read by field, and the
node's own error with its retry advice. A new executor's carrier joins CARRIERS."""
import pytest

from pipelines.node_host import NodeHost, host_round
from pipelines.node_pool import NodeProcess
from pipelines.request import NodeRequest
from spes.config.loader import params_from_dict, to_dict
from spes.errors import NodeFailed
from spes.run.layout import RunLayout
from tests.spes.round.test_round import make_params, start

CARRIERS = ("pipe", "socket", "ranks")


def _params(tmp, carrier):
    p = make_params(tmp, carrier)
    p.orchestration.log_every_steps = 1
    p.orchestration.threads_per_node = 1  # a host's node has more cores than a pool's: the same here
    if carrier == "ranks":
        p.orchestration.gpus_per_node, p.train.micro_batch_size = 2, 1
    return params_from_dict(to_dict(p))  # as a node reads it


class _Carrier:
    """One carrier, its process started once for the requests it is asked (as a pool or a host keeps it)."""

    def __init__(self, carrier: str):
        self.carrier = carrier
        self.host = NodeHost([0]) if carrier == "socket" else None
        self.proc = None if self.host else NodeProcess(0)

    def ask(self, req, events):
        if self.host is not None:
            return host_round(self.host.path, req, events.append)
        status, report = self.proc.run_round(req, 300.0, events.append)
        assert status == "ok"
        return report

    def close(self):
        if self.host is not None:
            self.host.close()
        else:
            self.proc.close()


@pytest.fixture(scope="module")
def answers(tmp_path_factory, tiny_tokens):
    """Per carrier: node 0's round 1 (report, events, upload's file hashes), then its round 3 (no global 2),
    and the carrier's folder."""
    out = {}
    for carrier in CARRIERS:
        tmp = tmp_path_factory.mktemp(carrier)
        p = _params(tmp, carrier)
        run = start(p)
        events: list = []
        way = _Carrier(carrier)
        try:
            report = way.ask(NodeRequest(to_dict(p), "r", 1, 0, tokens_dir=tiny_tokens), events)
            files = run.store.read_manifest(RunLayout("r").node_dir(1, 0))["files"]
            try:
                way.ask(NodeRequest(to_dict(p), "r", 3, 0, tokens_dir=tiny_tokens), [])
                error = None
            except NodeFailed as e:
                error = e
        finally:
            way.close()
        out[carrier] = report, events, {k: v["sha256"] for k, v in files.items()}, error, tmp
    return out


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_round_comes_back_as_its_report_with_progress_by_field(answers, carrier):
    report, events, _, _, _ = answers[carrier]
    pipe_report = answers["pipe"][0]
    assert (report.node, report.upload.round, report.tokens) == (0, 1, pipe_report.tokens)
    assert report.upload.losses == pytest.approx(pipe_report.upload.losses, rel=1e-5)
    progress = [e.progress for e in events if e.progress is not None]
    assert [(x.node, x.round, x.done, x.steps) for x in progress] == [(0, 1, 1, 2), (0, 1, 2, 2)]
    assert all(e.kind in ("log", "progress") for e in events)


def test_one_rank_carriers_commit_the_same_upload_bit_for_bit(answers):
    assert answers["socket"][2] == answers["pipe"][2]


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_failed_round_carries_the_nodes_own_error(answers, carrier):
    error = answers[carrier][3]
    assert error is not None and str(error).startswith("node 0 round 3: ")
    pipe_error = answers["pipe"][3]
    # the same words (the storage folder is the carrier's own, numbered by the tests before it)
    def words(c):
        return str(answers[c][3]).replace(str(answers[c][4]), "<tmp>").replace(c, "X")

    assert words(carrier) == words("pipe")
    assert "NotCommitted: " in str(error) and "global is not committed" in str(error)
    assert error.retryable == pipe_error.retryable
