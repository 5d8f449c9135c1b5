"""Documents -> tokenizer -> token shards: streamed, split by document hash, sharded; a failed run leaves
the old folder as it was; pretrained tokenizers (OLMo's) work end to end."""
import os
import re

import numpy as np
import pytest

from spes.data.tokenization import held_out, load_tokenizer, replace_folder, tokenize_corpus
from spes.data.tokens import TokenData
from spes.errors import CorpusError
from tests.conftest import SHARED, json_documents

OLMO_TOKENIZER = os.path.join(SHARED, "tokenizers", "gpt-neox-olmo-dolma-v1_5.json")


def test_tokenize_writes_a_consistent_sharded_folder(tmp_path):
    docs = json_documents()
    stats = tokenize_corpus(iter(docs), str(tmp_path / "t"), 512, None, 0.2, 0, shard_tokens=4000)
    data = TokenData.open(str(tmp_path / "t"))
    assert len(data.train) == stats["train_tokens"] and len(data.val) == stats["val_tokens"]
    assert stats["train_shards"] > 1 and all(s["tokens"] <= 4000 or s["documents"] == 1
                                             for s in data.meta["splits"]["train"]["shards"])
    val_docs = [d for d in docs if held_out(d, 0, 0.2)]
    assert stats["val_documents"] == len(val_docs) >= 1 and stats["train_documents"] == len(docs) - len(val_docs)
    train = np.asarray(data.train)
    assert (train == data.eos_id).sum() == stats["train_documents"]  # one EOS after every document
    # the held-out split is exactly the held-out documents, encoded, each followed by EOS
    tok = load_tokenizer(str(tmp_path / "t" / "tokenizer.json"), "<|endoftext|>").tokenizer
    want = np.concatenate([tok.encode(d, add_special_tokens=False).ids + [data.eos_id] for d in val_docs])
    assert np.array_equal(np.asarray(data.val), want)
    # the same corpus, one shard: the same token sequence
    tokenize_corpus(iter(docs), str(tmp_path / "one"), 512, None, 0.2, 0)
    assert np.array_equal(np.asarray(TokenData.open(str(tmp_path / "one")).train), train)
    assert not [f for f in os.listdir(tmp_path / "t") if f.endswith(".part")]


def test_the_bpe_is_trained_on_a_bounded_sample(tmp_path):
    docs = json_documents()
    a = tokenize_corpus(iter(docs), str(tmp_path / "a"), 512, None, 0.2, 0, bpe_sample_docs=2)
    b = tokenize_corpus(iter(docs), str(tmp_path / "b"), 512, None, 0.2, 0)
    assert a["documents"] == b["documents"] == len(docs)  # every document is encoded either way
    assert (tmp_path / "a/tokenizer.json").read_bytes() != (tmp_path / "b/tokenizer.json").read_bytes()


def test_vocab_and_split_errors(tmp_path):
    docs = json_documents()
    with pytest.raises(CorpusError, match="tokenizer has .* tokens but model.vocab_size is 64"):
        tokenize_corpus(iter(docs), str(tmp_path / "u"), 64, None, 0.2, 0)
    with pytest.raises(CorpusError, match="no held-out documents: the corpus is too small"):
        tokenize_corpus(iter(docs[:1]), str(tmp_path / "v"), 512, None, 0.01, 0)
    assert not (tmp_path / "v" / "meta.json").exists()  # never looks complete (the stage drops the folder)


@pytest.mark.skipif(not os.path.exists(OLMO_TOKENIZER), reason="shared tokenizer not present")
def test_the_olmo_tokenizer_end_to_end(tmp_path):
    docs = json_documents()
    stats = tokenize_corpus(iter(docs), str(tmp_path / "o"), 50304, OLMO_TOKENIZER, 0.2, 0)
    data = TokenData.open(str(tmp_path / "o"))
    assert stats["dtype"] == "uint16" and data.vocab_size == 50280 and data.eos_id == 50279
    from tokenizers import Tokenizer

    first_train = next(d for d in docs if not held_out(d, 0, 0.2))
    ids = Tokenizer.from_file(OLMO_TOKENIZER).encode(first_train, add_special_tokens=False).ids
    assert np.asarray(data.train)[: len(ids) + 1].tolist() == ids + [50279]
    with pytest.raises(CorpusError, match="has 50280 tokens but model.vocab_size is 50000"):
        tokenize_corpus(iter(docs), str(tmp_path / "small"), 50000, OLMO_TOKENIZER, 0.2, 0)


def test_a_tokenizer_without_eos_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "noeos.json"))
    with pytest.raises(CorpusError, match="has no EOS token .*set tokenize.eos_token"):
        tokenize_corpus(iter(["a b"]), str(tmp_path / "t"), 512, str(tmp_path / "noeos.json"), 0.2, 0)
    stats = tokenize_corpus(iter(["a b", "b a a"] * 20), str(tmp_path / "t2"), 512, str(tmp_path / "noeos.json"),
                            0.3, 0, eos_token="[UNK]")
    assert stats["eos_id"] == 2


def test_an_unreachable_hub_tokenizer_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read at import: else it waits on the network
    with pytest.raises(CorpusError, match="cannot load tokenizer 'no-such-org/no-such-tokenizer'"):
        load_tokenizer("no-such-org/no-such-tokenizer")


@pytest.mark.parametrize("name", ["/no/such/tokenizer.json", "./missing-folder", "missing.json"])
def test_a_missing_local_tokenizer_is_named_not_taken_for_a_hub_id(name):
    with pytest.raises(CorpusError, match=f"tokenizer file not found: {re.escape(name)}$"):
        load_tokenizer(name)


def test_replace_folder_swaps_only_complete_output(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "a").write_text("old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "a").write_text("new")
    replace_folder(str(tmp_path / "new"), str(tmp_path / "final"))
    assert (tmp_path / "final" / "a").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["final"]

