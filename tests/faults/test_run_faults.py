"""A run's identity survives the loss of its info bundle (issue 18, item 2)."""
import pytest

from spes.data.tokens import TokenData
from spes.errors import ProtocolError
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
