"""Round metadata read from storage is checked as a whole, not only field by field: a membership that gives
an expert no owner or two, or a member no data slot, names the file instead of training on."""
import pytest

from spes.errors import RecordError
from spes.run.records import GlobalMeta, Membership, RoundRecord

WHERE = "storage/runs/r/rounds/000003/global"


def _meta(owners, slots, experts=4):
    m = GlobalMeta(round=3, step=30, model_config={"num_experts": experts}, membership=Membership(owners, slots))
    return m.to_json()


def test_a_sound_membership_reads_back():
    for owners in ({0: [0, 1], 1: [2, 3]}, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, {0: [3, 0, 1, 2]}):
        slots = {n: i for i, n in enumerate(owners)}
        assert GlobalMeta.from_json(_meta(owners, slots), WHERE).membership.owners == owners
    assert GlobalMeta.from_json(_meta({0: [], 1: []}, {0: 0, 1: 1}, experts=0), WHERE).membership.members == [0, 1]


@pytest.mark.parametrize("owners,slots,message", [
    ({0: [0, 1], 1: [2]}, {0: 0, 1: 1}, r"by nobody: \[3\]"),
    ({0: [0, 1, 2], 1: [2, 3]}, {0: 0, 1: 1}, r"owned twice: \[2\]"),
    ({0: [0, 1], 1: [2, 3, 4]}, {0: 0, 1: 1}, r"not an expert: \[4\]"),
    ({0: [0, 1], 1: [2, 3]}, {0: 0}, r"members \[1\] no data slot"),
    ({}, {}, r"no members"),
])
def test_a_damaged_membership_names_the_file(owners, slots, message):
    with pytest.raises(RecordError, match=rf"^{WHERE}: .*{message}"):
        GlobalMeta.from_json(_meta(owners, slots), WHERE)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("round"), r"GlobalMeta lacks 'round'"),
    (lambda d: d.update(round="3"), r"round: input should be a valid integer, got '3'"),
    (lambda d: d.update(round=True), r"round: input should be a valid integer, got True"),
    (lambda d: d.update(merge_alpha="0.1"), r"merge_alpha: input should be a valid number"),
    (lambda d: d["membership"]["owners"].update({"x": [1]}), r"membership.owners.x: input should be a valid integer"),
    (lambda d: d["node_states"].update({"0": {"round": 2, "digest": "d"}}), r"StateRef lacks|checkpoint"),
    (lambda d: d.update(version=99), r"record version 99 is newer than this code's"),
])
def test_a_record_of_the_wrong_shape_names_the_file_and_the_key(change, message):
    d = _meta({0: [0, 1], 1: [2, 3]}, {0: 0, 1: 1})
    d["node_states"] = {"1": {"round": 2, "digest": "d", "checkpoint": False}}
    assert GlobalMeta.from_json(d, WHERE).node_states[1].round == 2  # JSON's string keys: the int keys declared
    change(d)
    with pytest.raises(RecordError, match=rf"^{WHERE}: .*{message}"):
        GlobalMeta.from_json(d, WHERE)


def test_a_record_inside_a_record_is_checked_as_a_whole_too():
    """RoundRecord.aggregate is a GlobalMeta: its membership is checked when the round record is read."""
    rec = RoundRecord(round=3, wall_s=1.0, max_node_compute_s=0.5, nodes=[],
                      aggregate=GlobalMeta.from_json(_meta({0: [0, 1], 1: [2, 3]}, {0: 0, 1: 1}), WHERE)).to_json()
    assert RoundRecord.from_json(rec, WHERE).aggregate.membership.members == [0, 1]
    rec["aggregate"]["membership"]["owners"]["1"] = [2]
    with pytest.raises(RecordError, match=rf"^{WHERE}: .*by nobody: \[3\]"):
        RoundRecord.from_json(rec, WHERE)
