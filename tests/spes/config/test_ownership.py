import pytest

from spes.config.ownership import Ownership, ownership_for
from spes.errors import OwnershipError


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
    assert ownership_for("spes", 4, 2, None).owned(1) == (2, 3)
    assert ownership_for("spes", 4, 2, [[3], [0, 1, 2]]).owned(0) == (3,)
    assert ownership_for("diloco", 4, 2, None).owned(1) == (0, 1, 2, 3)
    with pytest.raises(OwnershipError, match="lists 3 nodes but spes.num_nodes is 2"):
        ownership_for("spes", 4, 2, [[0], [1, 2], [3]])
