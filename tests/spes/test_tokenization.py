"""Corpus -> tokenizer -> token shards; a failed run leaves the old folder as it was."""
import json
import os

import pytest

from spes.data import TokenData
from spes.tokenization import CorpusError, load_corpus, replace_folder, tokenize_corpus
from tests.conftest import json_sources


def test_tokenize_writes_a_consistent_folder(tmp_path):
    docs = list(load_corpus(json_sources()))
    stats = tokenize_corpus(docs, str(tmp_path / "t"), 512, None, 0.2, 0)
    data = TokenData.open(str(tmp_path / "t"))
    assert len(data.train) == stats["train_tokens"] and len(data.val) == stats["val_tokens"]
    assert stats["train_documents"] + stats["val_documents"] == len(docs) and stats["val_documents"] >= 1
    assert (data.train == data.eos_id).sum() == stats["train_documents"]  # one EOS after every document
    with pytest.raises(CorpusError, match="tokenizer has .* tokens but model.vocab_size is 64"):
        tokenize_corpus(docs, str(tmp_path / "u"), 64, None, 0.2, 0)


def test_replace_folder_swaps_only_complete_output(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "a").write_text("old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "a").write_text("new")
    replace_folder(str(tmp_path / "new"), str(tmp_path / "final"))
    assert (tmp_path / "final" / "a").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["final"]


def test_corpus_errors(tmp_path):
    with pytest.raises(CorpusError, match="corpus not found|cannot read corpus"):
        list(load_corpus(str(tmp_path / "nothing*.txt")))
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(CorpusError, match="has no 'text' column"):
        list(load_corpus(str(f)))
