"""DVC stage `tokenize`: corpus -> tokenizer + token shards (train/val) + stats."""
from __future__ import annotations

import os
import time

from stages.common import out_dir, parse, write_json


def main() -> None:
    _, p = parse(__doc__)
    from spes.tokenization import CorpusError, default_corpus_files, load_corpus, tokenize_corpus

    t = p.tokenize
    t0 = time.time()
    try:
        corpus = t.corpus if t.corpus is not None else default_corpus_files(t.max_files)
        docs = list(load_corpus(corpus, t.corpus_format, t.text_field, p.storage.options or None
                                if t.corpus and t.corpus.startswith("s3://") else None))
        stats = tokenize_corpus(docs, out_dir(p, "tokens"), p.model.vocab_size, t.tokenizer, t.val_fraction, t.seed)
    except CorpusError as e:
        raise SystemExit(f"tokenize: {e}")
    stats["seconds"] = round(time.time() - t0, 2)
    stats["corpus"] = t.corpus or "python-stdlib"
    write_json(os.path.join(p.artifacts_dir, "tokens", "stats.json"), stats)
    print(f"tokenize: {stats['documents']} documents, {stats['train_tokens']} train / {stats['val_tokens']} "
          f"held-out tokens in {stats['seconds']}s")


if __name__ == "__main__":
    main()
