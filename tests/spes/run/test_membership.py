"""The membership of the next round from this one's, the requests and the eviction threshold (pure
arithmetic; the rounds themselves are in tests/spes/round/test_elastic.py)."""
import json

import pytest

from spes.errors import RecordError
from spes.run.layout import RunLayout
from spes.run.membership import Request, initial_membership, next_membership, read_requests
from spes.storage.store import Store
from spes.sync.methods import sync_method
from tests.conftest import params_of

SPES = sync_method(params_of("sync.num_nodes=3", "model.num_experts=6"))


def test_initial_membership_is_the_params_plan():
    m = initial_membership(SPES, 6)
    assert m.owners == {0: [0, 1], 1: [2, 3], 2: [4, 5]} and m.slots == {0: 0, 1: 1, 2: 2} and m.members == [0, 1, 2]


def test_misses_are_counted_in_a_row_and_evict_at_the_threshold():
    m = initial_membership(SPES, 6)
    c = next_membership(m, SPES, 6, 1, [0, 1], [], evict_after=2)
    assert c.membership.missed == {0: 0, 1: 0, 2: 1} and c.changes == [] and c.departed == []
    back = next_membership(c.membership, SPES, 6, 2, [0, 1, 2], [], evict_after=2)
    assert back.membership.missed[2] == 0  # a round back resets the count
    c2 = next_membership(c.membership, SPES, 6, 2, [0, 1], [], evict_after=2)
    assert c2.departed == [2] and c2.membership.owners == {0: [0, 1, 4], 1: [2, 3, 5]}
    assert c2.membership.slots == {0: 0, 1: 1}
    assert next_membership(c.membership, SPES, 6, 2, [0, 1], [], evict_after=0).departed == []  # 0: never


def test_requests_apply_once_at_their_round_and_a_refusal_is_recorded():
    m = initial_membership(SPES, 6)
    reqs = [Request("leave", 1), Request("join", 4), Request("join", 5, at_round=1)]
    c = next_membership(m, SPES, 6, 3, [0, 1, 2], reqs, evict_after=0)
    assert [(q.kind, q.node, q.at_round) for q in c.stamped] == [("leave", 1, 3), ("join", 4, 3)]
    assert c.membership.members == [0, 2, 4] and c.membership.slots[4] == 1  # the leaver's slot, now free
    again = next_membership(m, SPES, 6, 3, [0, 1, 2], c.stamped, evict_after=0)  # a retried round 3
    assert again.membership == c.membership
    assert next_membership(m, SPES, 6, 4, [0, 1, 2], c.stamped, evict_after=0).membership == \
        next_membership(m, SPES, 6, 4, [0, 1, 2], [], evict_after=0).membership  # applied at 3, not again at 4
    one = initial_membership(sync_method(params_of("sync.num_nodes=1")), 2)
    r = next_membership(one, SPES, 2, 2, [0], [Request("leave", 0)], evict_after=0)
    assert r.membership.members == [0] and r.stamped[0].refused.startswith("node 0 is the run's last member")
    assert r.changes == [f"leave of node 0 refused: {r.stamped[0].refused}"]


def test_a_file_that_is_not_a_request_is_named(tmp_path):
    store, layout = Store(str(tmp_path)), RunLayout("r")
    store.write_bytes(f"{layout.membership_dir}/join-00003.json", json.dumps({"kind": "join", "node": 3}).encode())
    assert [q.node for q in read_requests(store, layout)] == [3]
    store.write_bytes(f"{layout.membership_dir}/notes.txt", b"hello")
    with pytest.raises(RecordError, match=r"membership/notes.txt: not a membership request .*remove it"):
        read_requests(store, layout)
