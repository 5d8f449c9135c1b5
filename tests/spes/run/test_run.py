"""A run's identity and rounds on storage: fingerprint, creation, mismatch, resume resolution, records."""
import copy
import os

import pytest
import torch

from spes.config.loader import to_dict
from spes.config.schema import Params
from spes.errors import ProtocolError, RunMismatch
from spes.model.transformer import CausalLM
from spes.run import identity
from spes.run.identity import InitModel, fingerprint_of, legacy_fingerprint, settings_fingerprint
from spes.run.layout import MODEL_FILE
from spes.run.records import RECORD_VERSION, GlobalMeta, NodeReport, RoundRecord, RunIndex, StateRef
from spes.run.rounds import next_index
from spes.run.run import Run
from spes.storage.store import Store
from tests.conftest import tiny_config


def test_new_settings_at_their_neutral_value_keep_runs_resumable(monkeypatch):
    p = Params()
    p.sync.every_steps = 77
    now = to_dict(p)
    older = copy.deepcopy(now)
    del older["train"]["autocast"], older["merge"]["top_k"]  # as written by a release without them
    assert fingerprint_of(older) != settings_fingerprint(p)  # every resolved key counts ...
    monkeypatch.setattr(identity, "ADDED_LATER", {"train.autocast": None, "merge.top_k": 4})
    assert fingerprint_of(older) == settings_fingerprint(p)  # ... but a key added later, at its neutral value
    p.merge.top_k = 2
    assert fingerprint_of(older) != settings_fingerprint(p)


def test_fedadams_settings_leave_earlier_runs_fingerprints_alone():
    """outer.beta2 and outer.eps came with FedAdam: a run written before them hashes the same."""
    p = Params()
    older = to_dict(p)
    del older["outer"]["beta2"], older["outer"]["eps"]
    assert fingerprint_of(older) == settings_fingerprint(p)
    p.outer.eps = 1e-4
    assert fingerprint_of(older) != settings_fingerprint(p)


def test_keys_added_with_the_outer_step_on_experts_and_the_upload_bound_leave_earlier_fingerprints_alone():
    """outer.experts and sync.max_delta_norm_ratio came later: at their neutral values a run written before
    them hashes the same; set, they make another run."""
    p = Params()
    older = to_dict(p)
    del older["outer"]["experts"], older["sync"]["max_delta_norm_ratio"]
    assert fingerprint_of(older) == settings_fingerprint(p)
    p.outer.experts = "nesterov"
    assert fingerprint_of(older) != settings_fingerprint(p)
    q = Params()
    q.sync.max_delta_norm_ratio = 100.0
    assert fingerprint_of(older) != settings_fingerprint(q)


def test_a_run_from_before_fingerprint_versions_stays_resumable(tmp_path):
    """Such a run hashed only what differed from the schema defaults of its time."""
    p = Params()
    p.sync.every_steps = 20  # the old default: not in its fingerprint
    run = Run(Store(str(tmp_path)), "r")
    run.ensure("x", _init())
    info = run.store.read_manifest(run.layout.info)["meta"]
    run.store.remove(run.layout.info)  # rewrite it as an old release did: no fingerprint_version
    run.store.write_bundle(run.layout.info, {}, {k: v for k, v in info.items() if k != "fingerprint_version"}
                           | {"fingerprint": legacy_fingerprint(p)})
    run.ensure(settings_fingerprint(p), None, legacy=legacy_fingerprint(p))
    p.sync.every_steps = 21
    with pytest.raises(RunMismatch):
        run.ensure(settings_fingerprint(p), None, legacy=legacy_fingerprint(p))


def test_fingerprint_tracks_what_changes_the_run():
    base = settings_fingerprint(Params())
    for section, key, value in (("sync", "every_steps", 3), ("model", "top_k", 1), ("train", "autocast", "bfloat16")):
        p = Params()
        setattr(getattr(p, section), key, value)
        assert settings_fingerprint(p) != base, key
    p = Params()
    p.orchestration.min_nodes, p.storage.url, p.model.experts_impl = 1, "s3://elsewhere", "loop"
    assert settings_fingerprint(p) == base  # placement and implementation, not the run's maths


def _init(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config()
    return InitModel.from_state(CausalLM(cfg).canonical_state_dict(), cfg, "scratch")


def test_ensure_creates_round_zero_and_refuses_other_settings_or_init(tmp_path):
    run = Run(Store(str(tmp_path)), "r")
    with pytest.raises(ProtocolError, match="does not exist .* no init model"):
        run.ensure("fp1", None)
    run.ensure("fp1", _init())
    info = run.info()
    assert run.committed_rounds() == [0] and info["fingerprint"] == "fp1"
    assert info["init_sha256"] == run.store.read_manifest(run.layout.global_dir(0))["files"][MODEL_FILE]["sha256"]
    run.ensure("fp1", _init())  # same identity: nothing to do
    run.ensure("fp1", None)  # a resume that does not bring the init
    with pytest.raises(RunMismatch, match="another settings"):
        run.ensure("fp2", None)
    with pytest.raises(RunMismatch, match="another initial model"):
        run.ensure("fp1", _init(seed=1))
    run.ensure("fp2", _init(seed=1), on_mismatch="restart")
    assert run.info()["fingerprint"] == "fp2" and run.committed_rounds() == [0]
    (old,) = (tmp_path / "runs/r/superseded").iterdir()
    assert sorted(p.name for p in old.iterdir()) == ["000000", "info"]  # set aside, not deleted


def test_resolve_start_and_supersede(tmp_path):
    run = Run(Store(str(tmp_path)), "r")
    run.ensure("fp", _init())
    for r in (1, 2, 3):
        run.store.write_bundle(run.layout.global_dir(r), {MODEL_FILE: {"w": torch.zeros(1)}},
                               GlobalMeta(r, r, {}).to_json())
    assert run.resolve_start("latest") == 4 and run.resolve_start(None) == 4
    with pytest.raises(ProtocolError, match=r"round 7 is not committed \(committed: \[0, 1, 2, 3\]\)"):
        run.resolve_start(7)
    with pytest.raises(ProtocolError, match="resume_round must be"):
        run.resolve_start("soon")
    assert run.resolve_start(1) == 2
    assert run.committed_rounds() == [0, 1]
    (moved,) = (tmp_path / "runs/r/superseded").iterdir()
    assert sorted(p.name for p in moved.iterdir()) == ["000002", "000003"]


def test_records(tmp_path):
    run = Run(Store(str(tmp_path)), "r")
    def record(wall):
        return RoundRecord(2, wall, 1.0, [NodeReport(0, "timeout")], GlobalMeta(2, 4, {}))

    run.write_record(2, record(1.5))
    run.write_record(2, record(9.9))  # a retried round task keeps the first record
    assert run.records(1, 3) == [record(1.5)]
    assert run.records(1, 3)[0].to_json()["version"] == RECORD_VERSION


def _synthetic_run(tmp_path, refs_by_round, retain=None):
    """Globals 0..n with the given node_states; {round: {node: (state round, checkpoint)}}."""
    from spes.run.node_state import state_digest

    run = Run(Store(str(tmp_path)), "r")
    run.ensure("fp", _init())
    digests, index = {}, RunIndex()
    for r in sorted(refs_by_round):
        states = {}
        for node, (sr, ckpt) in refs_by_round[r].items():
            if (sr, node) not in digests:
                meta = {"run_id": "id", "node": node, "round": sr, "data_position": sr}
                files = {"optim.safetensors": {"x": torch.full((2,), float(sr))}}
                if ckpt:
                    m = run.store.write_bundle(run.layout.state_dir(sr, node), files, meta)
                else:
                    m = {"meta": meta, "files": {"optim.safetensors": {"sha256": f"local-{sr}-{node}"}}}
                digests[(sr, node)] = state_digest(m)
            states[node] = StateRef(sr, digests[(sr, node)], ckpt)
        index = next_index(index, r, states)
        run.store.write_bundle(run.layout.node_dir(r, 0), {"shared.safetensors": {"d": torch.zeros(1)}}, {})
        run.store.write_bundle(run.layout.global_dir(r), {MODEL_FILE: {"w": torch.zeros(1)}},
                               GlobalMeta(r, r, {}, node_states=states, index=index).to_json())
        run.write_record(r, RoundRecord(r, 1.0, 1.0, [], GlobalMeta(r, r, {})))
        if retain is not None:
            run.retire(r, *retain)
    return run


def test_resumable_rounds_and_resume_resolution(tmp_path):
    run = _synthetic_run(tmp_path, {1: {0: (1, False), 1: (1, False)}, 2: {0: (2, True), 1: (2, True)},
                                    3: {0: (3, False), 1: (2, True)}, 4: {0: (4, False), 1: (4, False)}})
    assert run.resumable_rounds(lambda i, ref: False) == [0, 2]
    assert run.resumable_rounds(lambda i, ref: ref.round >= 3) == [0, 2, 3, 4]
    assert run.resumable_rounds(None) == [0, 2, 4]  # nodes elsewhere: the latest counts (they keep it)
    with pytest.raises(ProtocolError, match=r"round 3 is not resumable.*\(resumable: \[0, 2\]\)"):
        run.resolve_start(3, lambda i, ref: False)
    assert run.resolve_start("latest", lambda i, ref: False) == 3  # says which, sets 3 and 4 aside
    assert run.committed_rounds() == [0, 1, 2]


def test_a_resume_checks_the_states_it_needs_are_still_there(tmp_path):
    import shutil
    run = _synthetic_run(tmp_path, {r: {0: (r, True), 1: (r, True)} for r in (1, 2)}
                         | {3: {0: (3, False), 1: (3, False)}})
    shutil.rmtree(tmp_path / run.layout.state_dir(2, 0))  # the index still lists round 2 as resumable
    with pytest.raises(ProtocolError, match=r"round 2 is not resumable: its node states \['runs/r/.*000"):
        run.resolve_start(2, lambda i, ref: False)
    assert run.missing_states(1, lambda i, ref: False) == [] and run.missing_states(1, None) == []
    assert run.resolve_start("latest", lambda i, ref: False) == 2  # falls back by itself
    assert run.committed_rounds() == [0, 1]


def test_retention_keeps_what_a_resume_needs(tmp_path):
    # node 1 misses rounds 4-6: the later globals still need its checkpointed round-3 state
    refs = {1: {0: (1, False), 1: (1, False)}, 2: {0: (2, True), 1: (2, True)},
            3: {0: (3, False), 1: (3, True)}, 4: {0: (4, False), 1: (3, True)},
            5: {0: (5, False), 1: (3, True)}, 6: {0: (6, False), 1: (3, True)}}
    before = _synthetic_run(tmp_path / "all", refs).resumable_rounds(lambda i, ref: False)
    run = _synthetic_run(tmp_path, refs, retain=(2, None))  # rounds 1, 3, 4 dropped as they left the window
    assert run.committed_rounds() == [0, 2, 5, 6]
    assert run.resumable_rounds(lambda i, ref: False) == before == [0, 2]
    assert run.store.is_committed(run.layout.state_dir(3, 1))  # needed by rounds 5 and 6
    assert run.store.is_committed(run.layout.state_dir(2, 0))
    assert [r for r in range(1, 7) if run.store.list_names(f"{run.layout.round_dir(r)}/nodes")] == [5, 6]
    assert [rec.round for rec in run.records(1, 6)] == [1, 2, 3, 4, 5, 6]  # records stay
    assert run.retire(6, None) == []


def test_retention_of_checkpoint_rounds_can_be_bounded(tmp_path):
    refs = {r: {i: (r, True) for i in (0, 1)} for r in range(1, 7)}
    assert _synthetic_run(tmp_path / "all", refs).resumable_rounds(lambda i, ref: False) == [0, 1, 2, 3, 4, 5, 6]
    run = _synthetic_run(tmp_path, refs, retain=(1, 2))
    assert run.committed_rounds() == [0, 5, 6]
    assert [r for r in range(1, 7) if run.store.list_names(f"{run.layout.round_dir(r)}/states")] == [5, 6]


def test_superseding_a_run_is_an_explicit_choice_and_superseded_rounds_are_bounded(tmp_path):
    run = Run(Store(str(tmp_path)), "r")
    run.ensure("fp1", _init())
    with pytest.raises(RunMismatch, match="choose another orchestration.run_name, or set orchestration.supersede=true"):
        run.ensure("fp2", None)  # the default: nothing is set aside behind the user's back
    assert run.info()["fingerprint"] == "fp1"
    first_id = run.info()["run_id"]
    run.ensure("fp1", _init(), fresh=True)  # the same settings, deliberately anew (e.g. after a code change)
    assert run.info()["run_id"] != first_id and run.committed_rounds() == [0]
    for _ in range(3):
        run.ensure("fp1", _init(), fresh=True)
    stamps = sorted(p.name for p in (tmp_path / "runs/r/superseded").iterdir())
    assert len(stamps) == 4
    assert run.prune_superseded(2) == stamps[:2]
    assert sorted(p.name for p in (tmp_path / "runs/r/superseded").iterdir()) == stamps[2:]
    assert run.prune_superseded(None) == []


BEFORE_THE_SPLIT = {  # fingerprint, legacy fingerprint: computed by the code before the `spes` section's split (1bff7d4)
    (): ("14c6390c7ccf5865", "31692fc329ba8953"),
    ("sync.method=diloco", "outer.lr=0.5"): ("9161f9c24540ad40", "01d062529b9b91c9"),
    ("train.optim.schedule=wsd", "outer.shared=nesterov", "merge.top_k=2", "sync.codec=int8"):
        ("ff9350e2f5182fdf", "7e5b96f64823055b"),
    ("sync.num_nodes=4", "train.batch_size=4", "sync.ownership=[[0,1],[2,3],[4,5],[6,7]]", "train.seed=3"):
        ("13976057d5df6cd2", "3b0c0772e9db12f3"),
    ("sync.method=fedadam", "outer.lr=0.01", "outer.beta2=0.9", "outer.eps=0.01", "sync.token_weighted=true"):
        ("68b96bce6359d94a", "5e93bc637d6da407"),
}


@pytest.mark.parametrize("overrides", list(BEFORE_THE_SPLIT))
def test_the_split_of_the_spes_section_changed_no_fingerprint(overrides):
    """Runs made before `spes` became sync, train, outer and merge keep their identity: the fingerprint hashes
    every key under its former name (spes/config/renamed.py), so the same settings give the same hash."""
    from spes.config.loader import load_params
    from tests.conftest import ROOT

    p = load_params(os.path.join(ROOT, "params.yaml"), list(overrides))
    assert (settings_fingerprint(p), legacy_fingerprint(p)) == BEFORE_THE_SPLIT[overrides]
