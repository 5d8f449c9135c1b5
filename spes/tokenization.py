"""Corpus -> tokenizer -> token shards.

Corpora are read with `datasets` (text/json/jsonl/parquet; local paths, globs or fsspec URLs such as
s3://). The default corpus is the Python standard library's source, present on every machine.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
import uuid
from typing import Iterator, Optional

import numpy as np

from spes.data import token_dtype, write_shard

EOS = "<|endoftext|>"


class CorpusError(ValueError):
    pass


def default_corpus_files(max_files: int) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
                   if "site-packages" not in f and os.sep + "test" not in f)
    if not files:
        raise CorpusError(f"no .py files found under the stdlib at {stdlib}")
    return files[:max_files]


def _format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    p = path.lower().split("?")[0]
    for suffix, f in ((".jsonl", "json"), (".json", "json"), (".jsonl.gz", "json"), (".parquet", "parquet")):
        if p.endswith(suffix):
            return f
    return "text"


def load_corpus(files_or_pattern: str | list[str], fmt: str = "auto", text_field: str = "text",
                storage_options: Optional[dict] = None) -> Iterator[str]:
    """Yield documents. Text files are one document each; json/parquet rows carry `text_field`."""
    import datasets

    files = files_or_pattern if isinstance(files_or_pattern, list) else [files_or_pattern]
    builder = _format_of(files[0], fmt)
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train", storage_options=storage_options,
                                   **kwargs)
    except FileNotFoundError as e:
        raise CorpusError(f"corpus not found: {files_or_pattern!r} ({e})") from None
    except Exception as e:  # datasets raises many types for unreadable files
        raise CorpusError(f"cannot read corpus {files_or_pattern!r} as {builder}: {type(e).__name__}: {e}") from None
    if text_field not in ds.column_names:
        raise CorpusError(f"corpus {files_or_pattern!r} has no {text_field!r} column (columns: {ds.column_names})")
    n = 0
    for row in ds:
        text = row[text_field]
        if isinstance(text, str) and text.strip():
            n += 1
            yield text
    if n == 0:
        raise CorpusError(f"corpus {files_or_pattern!r} has no non-empty {text_field!r} documents")


def train_bpe(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def load_hf_tokenizer(name_or_file: str):
    """A HF fast tokenizer from a tokenizer.json file, a local folder or a hub id."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if name_or_file.endswith(".json") and os.path.isfile(name_or_file):
        tok = PreTrainedTokenizerFast(tokenizer_file=name_or_file)
        if tok.eos_token is None:
            eos = EOS if EOS in tok.get_vocab() else None
            if eos:
                tok.eos_token = eos
        return tok
    return AutoTokenizer.from_pretrained(name_or_file)


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


def tokenize_corpus(docs: list[str], out_dir: str, vocab_size: int, tokenizer: Optional[str],
                    val_fraction: float, seed: int) -> dict:
    """Write tokenizer.json, train.bin, val.bin, meta.json; return stats. Held-out split is by document."""
    os.makedirs(out_dir, exist_ok=True)
    if tokenizer is None:
        tok = train_bpe(docs, vocab_size)
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        encode = lambda batch: [e.ids for e in tok.encode_batch(batch)]  # noqa: E731
        eos_id, n_vocab = tok.token_to_id(EOS), tok.get_vocab_size()
    else:
        hf_tok = load_hf_tokenizer(tokenizer)
        hf_tok.backend_tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
        encode = lambda batch: hf_tok(batch, add_special_tokens=False)["input_ids"]  # noqa: E731
        eos_id, n_vocab = hf_tok.eos_token_id, len(hf_tok)
        if eos_id is None:
            raise CorpusError(f"tokenizer {tokenizer!r} has no EOS token")
    if n_vocab > vocab_size:
        raise CorpusError(f"tokenizer has {n_vocab} tokens but model.vocab_size is {vocab_size}")
    order = np.random.default_rng(seed).permutation(len(docs))
    n_val = max(1, int(round(len(docs) * val_fraction)))
    if len(docs) - n_val < 1:
        raise CorpusError(f"corpus has {len(docs)} documents: too few for a train/held-out split")
    splits = {"val": order[:n_val], "train": order[n_val:]}
    dtype = token_dtype(vocab_size)
    stats = {"documents": len(docs), "vocab_size": vocab_size, "tokenizer_vocab": n_vocab, "eos_id": eos_id,
             "dtype": dtype.name}
    for split, idx in splits.items():
        ids: list[int] = []
        batch = [docs[i] for i in idx]
        for start in range(0, len(batch), 256):
            for seq in encode(batch[start:start + 256]):
                ids.extend(seq)
                ids.append(eos_id)
        write_shard(os.path.join(out_dir, f"{split}.bin"), np.asarray(ids, dtype=dtype))
        stats[f"{split}_tokens"] = len(ids)
        stats[f"{split}_documents"] = len(idx)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(stats, f, indent=2)
    return stats
