"""The flow-run registry (pipelines/flow_runs.py): each flow run's tasks find the session its flow opened
(context, aggregator, executor), two flow runs in one process do not share one, a task outside a flow
opens its own, and the registry survives Prefect's pickling of a served flow as the process's own."""
import pickle

from pipelines import flow_runs
from pipelines.executors import ProcessExecutor
from pipelines.flow_runs import FLOW_RUNS, FlowRuns
from tests.conftest import tiny_params


def _params(tmp_path, run: str):
    p = tiny_params(vocab_size=512)
    p.storage.url, p.orchestration.run_name = str(tmp_path / "storage"), run
    return p


def test_each_flow_run_finds_its_own_session(tmp_path, monkeypatch):
    runs, now = FlowRuns(), {"id": "flow-a"}
    monkeypatch.setattr(flow_runs, "_current_flow_run", lambda: now["id"])
    pa, pb = _params(tmp_path, "a"), _params(tmp_path, "b")
    a = runs.open(pa, "a", ProcessExecutor())
    now["id"] = "flow-b"
    b = runs.open(pb, "b")
    assert runs.current(pb, "b") is b and b.ctx.name == "b" and b.aggregator is not a.aggregator
    now["id"] = "flow-a"
    assert runs.current(pa, "a") is a and a.ctx.run.store is a.aggregator.store
    runs.close()
    now["id"] = "flow-b"
    assert runs.current(pb, "b") is b  # the other flow run's session stays
    now["id"] = None  # a task called outside a flow: its own session, reopened when its settings change
    outside = runs.current(pa, "a")
    assert outside is not a and runs.current(pa, "a") is outside
    pa2 = _params(tmp_path, "a")
    pa2.sync.every_steps += 1
    assert runs.current(pa2, "a") is not outside


def test_the_registry_unpickles_as_the_processs_own():
    assert pickle.loads(pickle.dumps(FLOW_RUNS)) is FLOW_RUNS
