import copy

from pipelines.training import fingerprint_of, run_fingerprint
from spes.config import Params, to_dict


def test_new_settings_at_their_default_keep_runs_resumable():
    p = Params()
    p.spes.sync_steps = 77
    now = to_dict(p)
    older = copy.deepcopy(now)
    del older["spes"]["autocast"], older["spes"]["merge"]["top_k"]  # as written by a release without them
    assert fingerprint_of(older, "abc") == run_fingerprint(p, "abc")


def test_fingerprint_tracks_what_changes_the_run():
    base = run_fingerprint(Params(), "abc")
    assert run_fingerprint(Params(), "abd") != base  # another init model
    for section, key, value in (("spes", "sync_steps", 3), ("model", "top_k", 1), ("spes", "autocast", "bfloat16")):
        p = Params()
        setattr(getattr(p, section), key, value)
        assert run_fingerprint(p, "abc") != base, key
    p = Params()
    p.orchestration.min_nodes, p.storage.url = 1, "s3://elsewhere"  # placement, not the run's maths
    assert run_fingerprint(p, "abc") == base
