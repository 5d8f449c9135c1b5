"""The aggregator on its own, on in-memory storage (fsspec's memory://), seconds each: what it keeps between
rounds and what it never does twice. Its arithmetic is tested in test_round.py, the round around it in
test_driver.py."""
import uuid

import pytest

from spes.data.tokens import TokenData
from spes.round.aggregator import Aggregator, aggregate_round
from spes.round.context import RoundContext
from spes.round.node import NodeRound
from spes.run.layout import MODEL_FILE
from spes.storage.store import Store
from tests.conftest import start_run
from tests.spes.round.test_round import make_params


@pytest.fixture(scope="module")
def data(tiny_tokens):
    return TokenData.open(tiny_tokens)


@pytest.fixture
def in_memory(tmp_path):
    """A run on a storage root of its own in the process's memory filesystem, removed after the test."""
    p = make_params(tmp_path)
    p.storage.url = f"memory://spes-{uuid.uuid4().hex[:8]}"
    p.merge.enabled = False
    run = start_run(p)
    yield p, run
    run.store.fs.rm(run.store.root, recursive=True)


def _nodes(p, run, data, r):
    for i in (0, 1):  # each node with a context of its own, as a node process has
        NodeRound(RoundContext.build(p, run.name, run.store), r, i, data).run()


def _reads(monkeypatch) -> list[str]:
    """Every tensor file the aggregator streams, by path."""
    seen: list[str] = []
    open_reader = Store.open_reader

    def counted(self, rel, fname, entry):
        seen.append(f"{rel}/{fname}")
        return open_reader(self, rel, fname, entry)

    monkeypatch.setattr(Store, "open_reader", counted)
    return seen


def test_the_aggregator_keeps_the_global_it_committed_and_the_result_is_the_same(in_memory, data, monkeypatch):
    """Round 2 after round 1 in one aggregator reads no byte of global 1's model (it holds it); a fresh
    aggregator, which reads it from storage, commits the same global 2 bit for bit."""
    p, run = in_memory
    agg = Aggregator(RoundContext.build(p, run.name, run.store, writer=True))
    _nodes(p, run, data, 1)
    agg.aggregate(1)
    _nodes(p, run, data, 2)
    reads = _reads(monkeypatch)
    agg.aggregate(2)
    global1 = f"{run.layout.global_dir(1)}/{MODEL_FILE}"
    assert global1 not in reads and any("/nodes/" in f for f in reads), reads
    held = run.store.read_manifest(run.layout.global_dir(2))["files"][MODEL_FILE]["sha256"]
    for rel in (run.layout.global_dir(2), run.layout.delta_dir(2)):  # recompute round 2 from its uploads
        run.store.move(rel, rel + ".held")
    reads.clear()
    aggregate_round(RoundContext.build(p, run.name, run.store), 2)
    assert global1 in reads
    assert run.store.read_manifest(run.layout.global_dir(2))["files"][MODEL_FILE]["sha256"] == held


def test_a_committed_round_is_returned_not_aggregated_again(in_memory, data, monkeypatch):
    """A retried aggregation of a committed round (its task retried after the commit) reads its meta, streams
    no tensor and writes nothing."""
    p, run = in_memory
    agg = Aggregator(RoundContext.build(p, run.name, run.store, writer=True))
    _nodes(p, run, data, 1)
    first = agg.aggregate(1)
    reads, written = _reads(monkeypatch), run.store.bytes_written
    again = agg.aggregate(1)
    assert again == first and reads == [] and run.store.bytes_written == written
