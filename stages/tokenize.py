"""DVC stage `tokenize`: corpus -> tokenizer + token shards (train/val) + stats."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from stages.common import parse, run, write_json


def main() -> None:
    _, p = parse(__doc__)
    from spes.tokenization import CorpusError, default_corpus_files, load_corpus, replace_folder, tokenize_corpus

    t = p.tokenize
    t0 = time.time()
    final = os.path.join(p.artifacts_dir, "tokens")
    os.makedirs(p.artifacts_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tokens-", dir=p.artifacts_dir)  # same filesystem: renames are atomic
    try:
        corpus = t.corpus if t.corpus is not None else default_corpus_files(t.max_files)
        docs = list(load_corpus(corpus, t.corpus_format, t.text_field, p.storage.options or None
                                if t.corpus and t.corpus.startswith("s3://") else None))
        stats = tokenize_corpus(docs, work, p.model.vocab_size, t.tokenizer, t.val_fraction, t.seed)
        stats["seconds"] = round(time.time() - t0, 2)
        stats["corpus"] = t.corpus or "python-stdlib"
        write_json(os.path.join(work, "stats.json"), stats)
        replace_folder(work, final)  # only a complete folder replaces the old one
    except CorpusError as e:
        raise SystemExit(f"tokenize: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"tokenize: {stats['documents']} documents, {stats['train_tokens']} train / {stats['val_tokens']} "
          f"held-out tokens in {stats['seconds']}s")


if __name__ == "__main__":
    run(main)
