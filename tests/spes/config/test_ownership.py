import pytest

from spes.config.ownership import Ownership
from spes.config.schema import SpesConfig
from spes.errors import OwnershipError
from spes.sync.methods import sync_method


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
    assert sync_method(SpesConfig(num_nodes=2)).owned(1, 4) == (2, 3)
    assert sync_method(SpesConfig(num_nodes=2, ownership=[[3], [0, 1, 2]])).owned(0, 4) == (3,)
    assert sync_method(SpesConfig(method="diloco", num_nodes=2)).owned(1, 4) == (0, 1, 2, 3)
    with pytest.raises(OwnershipError, match="lists 3 nodes but spes.num_nodes is 2"):
        sync_method(SpesConfig(num_nodes=2, ownership=[[0], [1, 2], [3]])).ownership(4)
