"""Damaged token data is named, never used (issue 18, items 1 and 7)."""
import json
import shutil

import numpy as np
import pytest

from spes.data.tokens import TokenData
from spes.errors import DataError


@pytest.fixture
def tokens(tmp_path, tiny_tokens):
    d = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, d)
    return d


def test_ids_changed_in_place_are_caught_by_the_shard_sha256(tokens):
    shard = tokens / json.loads((tokens / "meta.json").read_text())["splits"]["train"]["shards"][0]["file"]
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[:10] = (ids[:10] + 1) % 512  # other valid ids, same size
    ids.tofile(shard)
    with pytest.raises(DataError, match=f"token shard {shard}: sha256 .* differs from its index"):
        TokenData.open(str(tokens))


@pytest.mark.parametrize("content", [b"\x00garbage{", b'{"format": "spes-tokens/2"}', b"[1, 2]",
                                     b'{"format": "spes-tokens/2", "splits": {"train": {"shards": []}, "val": {"shards": []}}}'])
def test_a_damaged_index_names_the_file(tokens, content):
    (tokens / "meta.json").write_bytes(content)
    with pytest.raises(DataError, match="meta.json: (not a token index|damaged token index)"):
        TokenData.open(str(tokens))
