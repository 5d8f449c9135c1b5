"""A run's identity survives the loss of its info bundle (issue 18, item 2); a damaged latest round is set
aside (item 1)."""
import glob
import hashlib
import json
import logging

import pytest

from spes.data.tokens import TokenData
from spes.errors import IntegrityError, ProtocolError, RecordError
from spes.run.identity import settings_fingerprint
from spes.run.layout import MODEL_FILE
from spes.run.records import GlobalMeta
from tests.spes.round.test_round import do_round, make_params, start


def test_a_deleted_info_is_rebuilt_from_the_latest_global_and_the_run_goes_on(tmp_path, tiny_tokens):
    p = make_params(tmp_path)
    run = start(p)
    data = TokenData.open(tiny_tokens)
    for r in (1, 2):
        do_round(p, run, data, r)
    before = run.info()
    run.store.remove(run.layout.info)
    run.ensure(settings_fingerprint(p), None)  # what a rerun of the stage does
    after = run.info()
    assert after["run_id"] == before["run_id"] and after["fingerprint"] == before["fingerprint"]
    assert after["rebuilt_from_round"] == 2
    do_round(p, run, data, 3)  # the nodes accept their states: same run id
    ref = make_params(tmp_path, name="ref")
    ref_run = start(ref)
    for r in (1, 2, 3):
        do_round(ref, ref_run, data, r)
    sha = [x.store.read_manifest(x.layout.global_dir(3))["files"][MODEL_FILE]["sha256"] for x in (run, ref_run)]
    assert sha[0] == sha[1]


def test_without_a_recorded_identity_the_run_stops_naming_the_missing_info(tmp_path, tiny_tokens):
    p = make_params(tmp_path)
    run = start(p)
    do_round(p, run, TokenData.open(tiny_tokens), 1)
    b = run.store.read_bundle(run.layout.global_dir(1))
    meta = GlobalMeta.from_json(b.meta, "g1")
    meta.run_id = meta.fingerprint = ""  # as written before globals carried the identity
    run.store.remove(run.layout.global_dir(1))
    run.store.write_bundle(run.layout.global_dir(1), b.files, meta.to_json())
    run.store.remove(run.layout.info)
    with pytest.raises(ProtocolError, match=r"runs/r/info is missing, and global 1 does not record the run's identity"):
        run.ensure(settings_fingerprint(p), None)
    assert run.info() is None  # no new identity was made up


def _damage(tmp_path, kind):
    g = tmp_path / "s-storage/runs/r/rounds/000003/global"
    if kind == "garbage manifest":
        (g / "manifest.json").write_bytes(b"\x00 not json")
    elif kind == "manifest without files":
        (g / "manifest.json").write_text('{"format": "spes-bundle/1", "meta": {}}')
    else:  # the model replaced by a pickle, manifest and COMMIT made to match it
        import pickle

        blob = pickle.dumps({"w": [1, 2, 3]})
        (g / "model.safetensors").write_bytes(blob)
        m = json.loads((g / "manifest.json").read_text())
        m["files"]["model.safetensors"].update(sha256=hashlib.sha256(blob).hexdigest(), bytes=len(blob))
        (g / "manifest.json").write_text(json.dumps(m))
    (g / "COMMIT").write_text(hashlib.sha256((g / "manifest.json").read_bytes()).hexdigest())


@pytest.mark.parametrize("kind", ["garbage manifest", "manifest without files", "a pickle for the model"])
def test_a_damaged_latest_round_is_set_aside_and_recomputed_bitwise(tmp_path, tiny_tokens, kind, caplog):
    """Issue 18, item 1: the run continues from the latest intact round, with one warning naming what was set
    aside, and ends bitwise equal to an uninterrupted run."""
    p = make_params(tmp_path)
    run = start(p)
    data = TokenData.open(tiny_tokens)
    for r in (1, 2, 3):
        do_round(p, run, data, r)
    want = run.store.read_manifest(run.layout.global_dir(3))["files"][MODEL_FILE]["sha256"]
    _damage(tmp_path, kind)
    with pytest.raises((IntegrityError, RecordError), match="runs/r/rounds/000003/global"):
        run.verify_global(3)  # every reader names the file
    with caplog.at_level(logging.WARNING, logger="spes.run"):
        assert run.set_aside_damaged() == [3]
    assert "committed round 3 is damaged" in caplog.text and "000003/global" in caplog.text
    if kind == "a pickle for the model":  # an operator learns that storage held a file nothing here wrote
        assert "000003/global/model.safetensors: a Python pickle, not safetensors: never loaded" in caplog.text
    assert run.set_aside_damaged() == []
    assert glob.glob(str(tmp_path / "s-storage/runs/r/superseded/*/000003/global"))  # kept, not deleted
    assert run.resolve_start("latest") == 3
    do_round(p, run, data, 3)
    assert run.store.read_manifest(run.layout.global_dir(3))["files"][MODEL_FILE]["sha256"] == want
