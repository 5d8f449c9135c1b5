"""Documents -> tokenizer -> token shards, streamed and encoded on all cores.

- Tokenizer: a byte-level BPE trained on the first `bpe_sample_docs` documents (a bounded sample, held in
  memory once), or a pretrained one (tokenizer.json file, local folder or hub id). Its EOS token ends
  every document; a tokenizer without one is refused.
- Encoding: a reader thread pulls documents from the source while the `tokenizers` library encodes the
  previous batch on every core (its batch encoding runs in Rust threads, without the GIL).
- Held-out split by document hash (keyed by `seed`): a document is held out iff its hash falls below
  `val_fraction`, so the split is stable under streaming and re-runs and needs no corpus size.
- Output: bounded-size shards per split (spes/data/shards.py) and the index (spes/data/tokens.py `meta.json`), written
  last. Callers write into a temporary folder and swap it in when complete (`replace_folder`).
"""
from __future__ import annotations

import hashlib
import itertools
import os
import queue
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from spes.data.shards import ShardWriter
from spes.data.tokens import token_dtype, write_index
from spes.errors import CorpusError

EOS = "<|endoftext|>"
EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BATCH_CHARS = 1 << 20
"""Characters per encoding batch: enough to keep every core busy; small, since the library holds several
times the batch in its encodings (4 MiB batches let the peak memory creep up with the corpus size)."""


@dataclass
class LoadedTokenizer:
    tokenizer: Any  # tokenizers.Tokenizer or a transformers tokenizer's backend
    eos_id: int
    vocab: int
    """Every id is below this (added tokens included)."""


def train_bpe(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def _eos_of(tok, eos_token: Optional[str], hf_eos: Optional[str], where: str) -> int:
    names = [eos_token] if eos_token else [n for n in (hf_eos, *EOS_CANDIDATES) if n]
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise CorpusError(f"tokenizer {where!r} has no EOS token (tried {names}); set tokenize.eos_token")


def load_tokenizer(name_or_file: str, eos_token: Optional[str] = None) -> LoadedTokenizer:
    """A pretrained tokenizer: a tokenizer.json file, a local folder or a hub id."""
    from tokenizers import Tokenizer

    hf_eos = None
    name_or_file = os.path.expanduser(name_or_file)  # a hub id has no leading ~: unchanged
    looks_local = name_or_file.endswith(".json") or name_or_file.startswith(("/", "./", "../"))
    if looks_local and not os.path.exists(name_or_file):  # else the hub client's "repo id" error hides it
        raise CorpusError(f"tokenizer file not found: {name_or_file}")
    if name_or_file.endswith(".json") and os.path.isfile(name_or_file):
        try:
            tok = Tokenizer.from_file(name_or_file)
        except Exception as e:
            raise CorpusError(f"cannot read tokenizer file {name_or_file}: {e}") from None
    else:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(name_or_file)
        except Exception as e:  # unreachable hub, unknown id: OSError, ValueError, HTTP errors
            raise CorpusError(f"cannot load tokenizer {name_or_file!r}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
        if not getattr(hf, "is_fast", False):
            raise CorpusError(f"tokenizer {name_or_file!r} has no fast (tokenizers) backend")
        tok, hf_eos = hf.backend_tokenizer, hf.eos_token
    return LoadedTokenizer(tok, _eos_of(tok, eos_token, hf_eos, name_or_file), tok.get_vocab_size(with_added_tokens=True))


def hf_tokenizer(tokenizer_file: str):
    """A transformers tokenizer for a token folder's tokenizer.json, with its EOS token set (from the
    folder's meta.json when there is one) so an exported model generates and pads correctly."""
    import json

    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    meta = os.path.join(os.path.dirname(tokenizer_file), "meta.json")
    if os.path.exists(meta):
        with open(meta) as f:
            eos = tok.convert_ids_to_tokens(int(json.load(f)["eos_id"]))
    else:
        eos = tok.convert_ids_to_tokens(_eos_of(tok.backend_tokenizer, None, None, tokenizer_file))
    tok.eos_token = eos
    return tok


def held_out(doc: str, seed: int, val_fraction: float) -> bool:
    """Whether a document is in the held-out split: its keyed hash, as a fraction of 2^64."""
    h = hashlib.blake2b(doc.encode("utf-8", "surrogatepass"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") < val_fraction * 2.0**64


MAX_PIECE_CHARS = 1 << 18
"""Documents longer than this are encoded in pieces of at most this many characters, each cut after the last
whitespace of its second half (or hard, where there is none): the tokenizer's memory grows far faster than
a document (a 24 MB line took 5.8 GB), a piece's does not. The pieces' ids are joined into one document
(one EOS, at its end); tokens only differ from a whole-document encoding at the cuts."""


def pieces(doc: str, limit: Optional[int] = None) -> list[str]:
    """`doc` cut into pieces of at most `limit` (MAX_PIECE_CHARS) characters; [doc] when it fits."""
    limit = limit or MAX_PIECE_CHARS
    if len(doc) <= limit:
        return [doc]
    out, start = [], 0
    while len(doc) - start > limit:
        end = start + limit
        cut = max(doc.rfind(" ", start + limit // 2, end), doc.rfind("\n", start + limit // 2, end))
        end = cut + 1 if cut >= 0 else end
        out.append(doc[start:end])
        start = end
    out.append(doc[start:])
    return out


def _batches(docs: Iterable[str], seed: int, val_fraction: float) -> Iterator[tuple[list[str], list[bool], list[bool]]]:
    """Batches of (pieces, held out, ends its document): a long document's pieces follow each other, maybe
    across batches."""
    batch, flags, ends, chars = [], [], [], 0
    for d in docs:
        flag = held_out(d, seed, val_fraction)
        parts = pieces(d)
        for k, piece in enumerate(parts):
            batch.append(piece)
            flags.append(flag)
            ends.append(k == len(parts) - 1)
            chars += len(piece)
            if chars >= BATCH_CHARS:
                yield batch, flags, ends
                batch, flags, ends, chars = [], [], [], 0
    if batch:
        yield batch, flags, ends


def _prefetch(it: Iterator, depth: int = 2) -> Iterator:
    """Run `it` on a helper thread, `depth` items ahead (reading and hashing overlap the encoding)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def work():
        try:
            for item in it:
                q.put(item)
            q.put(done)
        except BaseException as e:  # re-raised in the consumer
            q.put(e)

    threading.Thread(target=work, daemon=True).start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def ids_with_eos(encodings, eos_id: int, dtype: np.dtype, ends: Optional[list[bool]] = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The pieces' ids as one array, EOS after each piece that ends its document (every piece, by default),
    and the end offset of each document in it."""
    ids = [e.ids for e in encodings]
    ends_K = np.ones(len(ids), dtype=bool) if ends is None else np.asarray(ends, dtype=bool)
    lens = np.fromiter(map(len, ids), np.int64, len(ids)) + ends_K
    out = np.empty(int(lens.sum()), dtype=dtype)
    eos_at = (np.cumsum(lens) - 1)[ends_K]
    body = np.ones(len(out), dtype=bool)
    body[eos_at] = False
    out[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype, count=int(body.sum()))
    out[eos_at] = eos_id
    return out, eos_at + 1


def _tokenizer_for(docs: Iterator[str], vocab_size: int, tokenizer: Optional[str], eos_token: Optional[str],
                   bpe_sample_docs: int) -> tuple[LoadedTokenizer, Iterator[str]]:
    """The given tokenizer, or a byte-level BPE trained on the corpus' first `bpe_sample_docs` documents (then
    the documents again from the first): refused when it has more tokens than the model's vocabulary."""
    if tokenizer is None:
        sample = list(itertools.islice(docs, bpe_sample_docs))
        tok = LoadedTokenizer(train_bpe([p for d in sample for p in pieces(d)], vocab_size), 0, 0)
        tok.eos_id, tok.vocab = tok.tokenizer.token_to_id(EOS), tok.tokenizer.get_vocab_size()
        docs = itertools.chain(sample, docs)
    else:
        tok = load_tokenizer(tokenizer, eos_token)
    if tok.vocab > vocab_size:
        raise CorpusError(f"tokenizer has {tok.vocab} tokens but model.vocab_size is {vocab_size}; raise "
                          "model.vocab_size")
    return tok, docs


def tokenize_corpus(docs: Iterable[str], out_dir: str, vocab_size: int, tokenizer: Optional[str] = None,
                    val_fraction: float = 0.12, seed: int = 0, shard_tokens: int = 1 << 28,
                    bpe_sample_docs: int = 20000, eos_token: Optional[str] = None, progress: bool = False) -> dict:
    """Write tokenizer.json, the shards of both splits and meta.json into `out_dir`; return the stats."""
    os.makedirs(out_dir, exist_ok=True)
    tok, docs = _tokenizer_for(iter(docs), vocab_size, tokenizer, eos_token, bpe_sample_docs)
    tok.tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    dtype = token_dtype(vocab_size)
    writers = {s: ShardWriter(out_dir, s, dtype, shard_tokens) for s in ("train", "val")}
    encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)
    bar = _progress(progress)
    t0, n_tokens = time.perf_counter(), 0
    carry = {"train": np.zeros(0, dtype), "val": np.zeros(0, dtype)}  # a long document's pieces so far
    try:
        for batch, flags, ends in _prefetch(_batches(docs, seed, val_fraction)):
            encs = encode(batch, add_special_tokens=False)
            for split, want in (("train", False), ("val", True)):
                sel = [(e, end) for e, f, end in zip(encs, flags, ends) if f == want]
                if sel:
                    arr, doc_ends = ids_with_eos([e for e, _ in sel], tok.eos_id, dtype, [end for _, end in sel])
                    if len(carry[split]):
                        arr, doc_ends = np.concatenate([carry[split], arr]), doc_ends + len(carry[split])
                    done = int(doc_ends[-1]) if len(doc_ends) else 0
                    carry[split] = arr[done:]
                    if len(doc_ends):
                        writers[split].add(arr[:done], doc_ends)
                    n_tokens += len(arr) - len(carry[split])
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(tokens=n_tokens, tok_per_s=f"{n_tokens / (time.perf_counter() - t0):.3g}")
        shards = {s: w.finish() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    for split, kind in (("train", "training"), ("val", "held-out")):
        if not shards[split]:
            raise CorpusError(f"no {kind} documents: the corpus is too small for tokenize.val_fraction="
                              f"{val_fraction} (documents are split by hash)")
    meta = write_index(out_dir, shards, dtype, vocab_size, tok.vocab, tok.eos_id)
    seconds = time.perf_counter() - t0
    stats = {"documents": sum(sp["documents"] for sp in meta["splits"].values()), "vocab_size": vocab_size,
             "tokenizer_vocab": tok.vocab, "eos_id": tok.eos_id, "dtype": dtype.name, "encode_seconds": seconds,
             "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0}
    for split, sp in meta["splits"].items():
        stats.update({f"{split}_tokens": sp["tokens"], f"{split}_documents": sp["documents"],
                      f"{split}_shards": len(sp["shards"])})
    return stats


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit=" docs", desc="tokenize", mininterval=2.0, dynamic_ncols=True)


def replace_folder(new: str, final: str) -> None:
    """Swap a completely written folder in for `final` (two renames; the old one is removed after), so a
    failed run never leaves `final` half-written or with a tokenizer that does not match its shards."""
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(new, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)
