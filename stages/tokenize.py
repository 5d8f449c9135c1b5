"""DVC stage `tokenize`: corpus -> tokenizer + token shards (train/val) + stats, streamed.

The output is written into a temporary folder beside `artifacts/tokens` and swapped in only when complete,
so an interrupted or failed run leaves the previous tokens (and their tokenizer) as they were.

Reads the corpus (tokenize.corpus / tokenize.dataset; the Python stdlib's source by default); writes
artifacts/tokens (shards, meta.json, tokenizer.json), artifacts/tokenize/metrics.json and invocation.json.
Example: python -m stages.tokenize tokenize.corpus='data/*.jsonl.gz'
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from stages.common import out_dir, parse, run, write_metrics


def main() -> None:
    _, p = parse(__doc__)
    from spes.data.corpus import CorpusStats, iter_documents
    from spes.data.tokenization import replace_folder, tokenize_corpus

    t = p.tokenize
    t0 = time.time()
    final = os.path.join(p.artifacts_dir, "tokens")
    os.makedirs(p.artifacts_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tokens-", dir=p.artifacts_dir)  # same filesystem: renames are atomic
    corpus = CorpusStats()
    try:
        docs = iter_documents(t, p.storage.options or None, corpus)
        stats = tokenize_corpus(docs, work, p.model.vocab_size, t.tokenizer, t.val_fraction, t.seed, t.shard_tokens,
                                t.bpe_sample_docs, t.eos_token, progress=sys.stderr.isatty())
        stats.update(seconds=round(time.time() - t0, 2), corpus=t.dataset or t.corpus or "python-stdlib",
                     files=corpus.files, bad_files=len(corpus.bad_files), empty_documents=corpus.empty,
                     **({"python_sources": corpus.versions} if corpus.versions else {}))
        replace_folder(work, final)  # only a complete folder replaces the old one
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_metrics(out_dir(p, "tokenize"), stats)
    skipped = f", {len(corpus.bad_files)} unreadable files skipped" if corpus.bad_files else ""
    print(f"tokenize: {stats['documents']} documents from {corpus.files} files{skipped}: {stats['train_tokens']} "
          f"train / {stats['val_tokens']} held-out tokens ({stats['val_documents']} documents) in "
          f"{stats['train_shards'] + stats['val_shards']} shards, {stats['tokens_per_s']:.0f} tokens/s, "
          f"{stats['seconds']}s")


if __name__ == "__main__":
    run(main)
