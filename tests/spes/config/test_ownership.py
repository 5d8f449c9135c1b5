import pytest

from spes.config.ownership import Ownership
from spes.errors import OwnershipError
from spes.sync.methods import sync_method
from tests.conftest import params_of


def test_contiguous_blocks():
    o = Ownership.contiguous(8, 4)
    assert o.experts_per_node == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert o.owned(1) == (2, 3) and o.owner_of(7) == 3
    with pytest.raises(OwnershipError, match="cannot be split evenly"):
        Ownership.contiguous(6, 4)


def test_explicit_map_is_checked():
    assert Ownership.from_lists([[0, 3], [1, 2]], 4).owner_of(3) == 0
    with pytest.raises(OwnershipError, match="owned by nodes 0 and 1"):
        Ownership.from_lists([[0, 1], [1, 2, 3]], 4)
    with pytest.raises(OwnershipError, match=r"experts \[3\] have no owner"):
        Ownership.from_lists([[0, 1], [2]], 4)
    with pytest.raises(OwnershipError, match="outside"):
        Ownership.from_lists([[0, 1], [2, 9]], 4)


def test_ownership_for_methods():
    assert sync_method(params_of("sync.num_nodes=2")).owned(1, 4) == (2, 3)
    four = ("model.num_experts=4", "merge.top_k=2")
    assert sync_method(params_of(*four, "sync.num_nodes=2", "sync.ownership=[[3],[0,1,2]]")).owned(0, 4) == (3,)
    assert sync_method(params_of("sync.method=diloco", "sync.num_nodes=2")).owned(1, 4) == (0, 1, 2, 3)
    spes = sync_method(params_of("sync.num_nodes=2"))
    spes.sync.ownership = [[0], [1, 2], [3]]  # changed after the checks: the method's own check still holds
    with pytest.raises(OwnershipError, match="lists 3 nodes but sync.num_nodes is 2"):
        spes.ownership(4)


def test_a_leavers_experts_go_to_the_least_loaded_survivors():
    from spes.config.ownership import without_node

    owners, moved = without_node({0: (0, 1), 1: (2, 3), 2: (4, 5)}, 2)
    assert owners == {0: (0, 1, 4), 1: (2, 3, 5)} and moved == {4: 0, 5: 1}
    assert without_node({0: (0,), 3: (1, 2, 3)}, 0)[0] == {3: (0, 1, 2, 3)}
    with pytest.raises(OwnershipError, match="node 1 is the run's last member"):
        without_node({1: (0, 1)}, 1)
    with pytest.raises(OwnershipError, match=r"node 4 is not a member \(members: \[0, 1\]\)"):
        without_node({0: (0,), 1: (1,)}, 4)


def test_a_joiner_takes_from_the_most_loaded_until_counts_are_even():
    from spes.config.ownership import with_node

    owners, taken = with_node({0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)}, 3)
    assert owners == {0: (0, 1), 1: (3, 4), 2: (6, 7), 3: (2, 5)} and taken == {2: 0, 5: 1}
    assert with_node({0: (0, 1, 2, 3)}, 9)[0] == {0: (0, 1), 9: (2, 3)}
    assert with_node({0: (0,), 1: (1,)}, 2)[0] == {0: (0,), 1: (1,), 2: ()}  # more nodes than experts: shared part only
    with pytest.raises(OwnershipError, match="node 0 is already a member"):
        with_node({0: (0,)}, 0)


def test_baselines_members_train_every_expert():
    m = sync_method(params_of("sync.method=fedavg", "sync.num_nodes=2"))
    assert m.with_node({0: (0, 1), 1: (0, 1)}, 5, 2)[0] == {0: (0, 1), 1: (0, 1), 5: (0, 1)}
    assert m.without_node({0: (0, 1), 1: (0, 1)}, 0, 2)[0] == {1: (0, 1)}


def test_a_membership_plan_is_checked_up_front():
    from spes.config.ownership import planned_changes

    assert planned_changes(["join 2 after 66%", "leave 1 after 3"], 10, 2) == [(3, "leave", 1), (6, "join", 2)]
    for entry, msg in [(["leave 1 at 3"], "is not '<join|leave> <node> after"),
                       (["join 1 after 2"], "node 1 joins after round 2 but is a member then"),
                       (["leave 4 after 2"], "node 4 leaves after round 2 but is not a member then"),
                       (["leave 0 after 2", "leave 1 after 3"], "node 1 would leave after round 3 as the last member"),
                       (["leave 1 after 10"], "falls at round 10, outside \\[1, 9\\]"),
                       (["leave 1 after x%"], "is not a round or a percentage")]:
        with pytest.raises(OwnershipError, match=msg):
            planned_changes(entry, 10, 2)


def test_memory_caps_bound_what_a_node_takes():
    from spes.config.ownership import with_node, without_node

    assert with_node({0: (0, 1, 2, 3, 4, 5)}, 1, cap=1)[0] == {0: (0, 1, 2, 3, 4), 1: (5,)}
    owners, moved = without_node({0: (0,), 1: (1, 2), 2: (3, 4, 5)}, 2, caps={0: 1})
    assert owners == {0: (0,), 1: (1, 2, 3, 4, 5)} and moved == {3: 1, 4: 1, 5: 1}  # node 0 is full
    with pytest.raises(OwnershipError, match="node 1's expert 1 fits no other member"):
        without_node({0: (0,), 1: (1,)}, 1, caps={0: 1})
