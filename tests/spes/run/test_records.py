"""Round metadata read from storage is checked as a whole, not only field by field: a membership that gives
an expert no owner or two, or a member no data slot, names the file instead of training on."""
import pytest

from spes.errors import RecordError
from spes.run.records import GlobalMeta, Membership

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
