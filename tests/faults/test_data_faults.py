"""Damaged token data is named, never used; a huge document is encoded in pieces (issue 18, items 1, 7, 8)."""
import json
import shutil

import numpy as np
import pytest

from spes.data.tokenization import load_tokenizer, tokenize_corpus
from spes.data.tokens import TokenData
from spes.errors import DataError
from tests.conftest import json_documents


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


def test_a_huge_document_is_encoded_in_pieces_and_stays_one_document(tmp_path, monkeypatch):
    """Issue 18, item 8: a document longer than MAX_PIECE_CHARS is encoded piece by piece (cut at whitespace),
    across encoding batches, and is still one document: its ids decode to it, one EOS at its end, and the
    other documents' ids are the ones an unsplit run gives."""
    from spes.data import tokenization

    docs = json_documents()
    huge = " ".join(f"word{i % 97}" for i in range(3000))  # ~20k characters, one line
    corpus = docs[:3] + [huge] + docs[3:]
    plain = tmp_path / "plain"
    tokenize_corpus(iter(corpus), str(plain), 512, None, 0.2, 0)
    monkeypatch.setattr(tokenization, "MAX_PIECE_CHARS", 1000)
    monkeypatch.setattr(tokenization, "BATCH_CHARS", 1500)  # the huge document's pieces span several batches
    assert max(len(p) for p in tokenization.pieces(huge)) <= 1000 and "".join(tokenization.pieces(huge)) == huge
    cut = tmp_path / "cut"
    stats = tokenize_corpus(iter(corpus), str(cut), 512, str(plain / "tokenizer.json"), 0.2, 0)
    assert stats["documents"] == len(corpus)
    data = TokenData.open(str(cut))
    tok = load_tokenizer(str(plain / "tokenizer.json")).tokenizer
    decoded = []
    for split in (data.train, data.val):
        ids = np.asarray(split)
        for d in np.split(ids, np.flatnonzero(ids == data.eos_id) + 1)[:-1]:  # one EOS per document
            decoded.append((tok.decode(d[:-1].tolist()), d[:-1].tolist()))
    assert sorted(text for text, _ in decoded) == sorted(corpus)  # every document whole, the huge one too
    for text, ids in decoded:
        if len(text) <= 1000:  # not cut: the ids of an unsplit encoding
            assert ids == tok.encode(text, add_special_tokens=False).ids
