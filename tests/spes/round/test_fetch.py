"""How a node gets the global: rebuilt from the deltas since the one it holds, or, whenever that chain cannot
be trusted, the committed global downloaded whole; never a silently different model."""
import hashlib
import logging

import pytest

from spes.data.tokens import TokenData
from spes.round.context import RoundContext
from spes.round.fetch import Chain, fetch_global
from spes.run.layout import MODEL_FILE
from spes.storage.tensorio import tensors_sha256
from tests.spes.round.test_round import do_round, make_params, start


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory, tiny_tokens):
    tmp = tmp_path_factory.mktemp("fetch")
    p = make_params(tmp)
    p.merge.enabled = False  # steady state: the deltas refer to the owners' uploads
    run = start(p)
    data = TokenData.open(tiny_tokens)
    for r in (1, 2, 3):
        do_round(p, run, data, r)
    return p, run


def _global(run, r):
    m = run.store.read_manifest(run.layout.global_dir(r))
    return run.store.read_bundle(run.layout.global_dir(r), [MODEL_FILE], m).files[MODEL_FILE], m


def _fetch(p, run, base_round=1, base_sha=None, tamper=False):
    g1, m1 = _global(run, base_round)
    if tamper:
        g1 = {k: v + (1e-3 if k == "model.norm.weight" else 0) for k, v in g1.items()}
    base = (base_round, base_sha or m1["files"][MODEL_FILE]["sha256"])
    manifest = run.store.read_manifest(run.layout.global_dir(3))
    whole = []
    read_bundle = run.store.read_bundle
    run.store.read_bundle = lambda rel, *a, **k: whole.append(rel) or read_bundle(rel, *a, **k)
    try:
        tensors, sha = fetch_global(RoundContext.build(p, run.name, run.store), 3, manifest,
                                    Chain(base, lambda: dict(g1)))
    finally:
        del run.store.read_bundle
    assert sha == manifest["files"][MODEL_FILE]["sha256"] == tensors_sha256(tensors)  # the committed model
    return run.layout.global_dir(3) in whole


def test_rebuilt_from_deltas_without_downloading_the_model(three_rounds):
    assert not _fetch(*three_rounds)


@pytest.mark.parametrize("case", ["base sha differs", "rebuilt sha differs"])
def test_an_untrustworthy_chain_downloads_the_global_whole(three_rounds, case, caplog):
    p, run = three_rounds
    with caplog.at_level(logging.WARNING, logger="spes.round.fetch"):
        assert _fetch(p, run, base_sha="0" * 64 if case == "base sha differs" else None,
                      tamper=case == "rebuilt sha differs")
    if case == "rebuilt sha differs":
        assert "differs from the committed one" in caplog.text


@pytest.mark.parametrize("case", ["broken chain", "referenced upload pruned", "damaged delta manifest"])
def test_a_missing_link_downloads_the_global_whole(tmp_path, tiny_tokens, case, caplog):
    p = make_params(tmp_path)
    p.merge.enabled = False
    run = start(p)
    data = TokenData.open(tiny_tokens)
    for r in (1, 2, 3):
        do_round(p, run, data, r)
    if case == "broken chain":
        run.store.remove(run.layout.delta_dir(2))
    elif case == "referenced upload pruned":
        run.store.remove(run.layout.node_dir(2, 1))
    else:
        (tmp_path / "s-storage/runs/r/rounds/000002/delta/manifest.json").write_text("{not json")
        (tmp_path / "s-storage/runs/r/rounds/000002/delta/COMMIT").write_text(
            hashlib.sha256(b"{not json").hexdigest())
    with caplog.at_level(logging.WARNING, logger="spes.round.fetch"):
        assert _fetch(p, run)
    if case != "broken chain":
        assert "unusable" in caplog.text and "downloading global 3 whole" in caplog.text
