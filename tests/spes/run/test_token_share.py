import os
import shutil

import numpy as np
import pytest

from spes.data.tokens import TokenData
from spes.errors import DataError, IntegrityError
from spes.run.layout import tokens_dir
from spes.run.token_share import fetch_tokens, publish_tokens
from spes.storage.store import Store


@pytest.fixture
def tokens(tiny_tokens):
    return tiny_tokens


def test_publish_then_fetch_gives_the_same_tokens(tokens, tmp_path):
    store = Store(str(tmp_path / "shared"))
    key = publish_tokens(store, tokens)
    assert publish_tokens(store, tokens) == key  # same content: published once, same key
    assert len(os.listdir(tmp_path / "shared/data/tokens")) == 1
    got = fetch_tokens(store, key, str(tmp_path / "cache"))
    want = TokenData.open(tokens)
    assert np.array_equal(got.train, want.train) and np.array_equal(got.val, want.val)
    assert (got.vocab_size, got.eos_id) == (want.vocab_size, want.eos_id)
    assert sorted(os.listdir(tmp_path / "cache/tokens" / key)) == ["COMPLETE", "meta.json", "tokenizer.json",
                                                                    "train-000000.bin", "val-000000.bin"]
    store.fs.rm(store.path(tokens_dir(key)), recursive=True)  # later rounds read the node's cache only
    assert np.array_equal(fetch_tokens(store, key, str(tmp_path / "cache")).train, want.train)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_shard_on_storage_is_refused_and_not_cached(tokens, tmp_path, damage):
    store = Store(str(tmp_path / "shared"))
    key = publish_tokens(store, tokens)
    f = tmp_path / "shared" / tokens_dir(key) / "train-000000.bin"
    blob = f.read_bytes()
    f.write_bytes(blob[:-2] if damage == "truncate" else blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])
    with pytest.raises(IntegrityError, match="train-000000.bin: sha256/size mismatch"):
        fetch_tokens(store, key, str(tmp_path / "cache"))
    left = os.listdir(tmp_path / "cache/tokens" / key)
    assert "COMPLETE" not in left and "train-000000.bin" not in left and not [x for x in left if x.endswith(".part")]


def test_inconsistent_token_folder_is_not_published(tokens, tmp_path):
    bad = tmp_path / "tokens"
    shutil.copytree(tokens, bad)
    shard = bad / "train-000000.bin"
    blob = shard.read_bytes()
    shard.write_bytes(blob[:-2])
    store = Store(str(tmp_path / "shared"))
    with pytest.raises(DataError, match="truncated or foreign"):
        publish_tokens(store, str(bad))
    assert not store.fs.exists(store.path("data"))
    shard.write_bytes(blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])  # same size, other bytes than indexed
    with pytest.raises(DataError, match="train-000000.bin: sha256 .* differs from its index"):
        publish_tokens(store, str(bad))  # opening the folder verifies every shard against its index
    assert not [d for d in store.list_names("data/tokens") if store.is_committed(f"data/tokens/{d}")]


def test_raw_bundle_is_not_read_as_safetensors(tokens, tmp_path):
    store = Store(str(tmp_path / "shared"))
    key = publish_tokens(store, tokens)
    with pytest.raises(IntegrityError, match="raw file, not safetensors"):
        store.read_bundle(tokens_dir(key))
