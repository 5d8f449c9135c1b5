"""Tokenization at scale, measured side by side in one run:

1. speed: the tokenize pipeline (stream the corpus files, split by hash, encode on all cores, write shards)
   vs the raw `tokenizers` batch encoding on all cores of the same documents already in memory (the
   library's own speed; nothing read, split or written), on the small corpus -> `ratio_vs_raw`;
2. memory: the pipeline's peak resident memory on a small and a 10x larger generated corpus (same tokenizer,
   each run in a fresh process) -> flat if the corpus is streamed.

The corpora are real text: the Python standard library's source, cycled into jsonl files (each copy of a
file tagged so that documents differ). The tokenizer is a byte-level BPE trained once on a sample.

    python bench/tokenization.py [--small-mb 30] [--large-mb 300] [--vocab 4096] [--json]

The default finishes in minutes on 2 cores; the README's table was measured at --small-mb 100 --large-mb 1000.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.cleanup import exit_on_termination  # noqa: E402
from spes.data.tokenization import BATCH_CHARS, train_bpe  # noqa: E402

FILE_MB = 64


def stdlib_texts() -> list[str]:
    files = sorted(f for f in glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)
                   if "site-packages" not in f)
    out = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                out.append(fh.read())
        except (UnicodeDecodeError, OSError):
            continue
    return [t for t in out if t.strip()]


def make_corpus(folder: str, texts: list[str], megabytes: int) -> int:
    """jsonl files of about FILE_MB each, `megabytes` in all; returns the number of documents."""
    os.makedirs(folder, exist_ok=True)
    target, written, docs, part, copy = megabytes << 20, 0, 0, 0, 0
    f = open(os.path.join(folder, f"part-{part:04d}.jsonl"), "w")
    while written < target:
        for t in texts:
            line = json.dumps({"text": f"# copy {copy}\n{t}"}) + "\n"
            f.write(line)
            written, docs = written + len(line), docs + 1
            if f.tell() >= FILE_MB << 20:
                f.close()
                part += 1
                f = open(os.path.join(folder, f"part-{part:04d}.jsonl"), "w")
            if written >= target:
                break
        copy += 1
    f.close()
    return docs


PIPELINE = """
import json, sys, time
sys.path.insert(0, {root!r})
from spes.config.schema import TokenizeConfig
from spes.data.corpus import iter_documents
from spes.data.tokenization import tokenize_corpus
t = TokenizeConfig(corpus={corpus!r})
t0 = time.perf_counter()
stats = tokenize_corpus(iter_documents(t), {out!r}, {vocab}, {tokenizer!r}, 0.05, 0)
secs = time.perf_counter() - t0
print(json.dumps({{"tokens": stats["train_tokens"] + stats["val_tokens"], "seconds": secs,
                  "documents": stats["documents"], "shards": stats["train_shards"] + stats["val_shards"]}}))
"""

RAW = """
import glob, json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file({tokenizer!r})
docs = [json.loads(line)["text"] for f in sorted(glob.glob({corpus!r})) for line in open(f)]
batches, batch, chars = [], [], 0
for d in docs:
    batch.append(d)
    chars += len(d)
    if chars >= {batch_chars}:
        batches.append(batch)
        batch, chars = [], 0
batches.append(batch)
t0 = time.perf_counter()
tokens = sum(sum(len(e.ids) for e in tok.encode_batch_fast(b, add_special_tokens=False)) for b in batches)
print(json.dumps({{"tokens": tokens + len(docs), "seconds": time.perf_counter() - t0}}))
"""


def run_child(code: str) -> tuple[dict, int]:
    """Run `code` in a fresh interpreter; (its last stdout line as JSON, its own peak resident bytes)."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's rusage alone
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(err.read()[-3000:])
    return json.loads(out.strip().splitlines()[-1]), usage.ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small-mb", type=int, default=30)
    ap.add_argument("--large-mb", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    exit_on_termination()  # a kill still runs the finally below
    root = tempfile.mkdtemp(prefix="spes-tok-bench-")
    try:
        texts = stdlib_texts()
        tokenizer = os.path.join(root, "tokenizer.json")
        train_bpe(texts[:2000], a.vocab).save(tokenizer)
        sizes = {"small": a.small_mb, "large": a.large_mb}
        corpora = {k: os.path.join(root, k) for k in sizes}
        docs = {k: make_corpus(corpora[k], texts, mb) for k, mb in sizes.items()}
        pattern = {k: os.path.join(corpora[k], "*.jsonl") for k in sizes}
        raw, _ = run_child(RAW.format(tokenizer=tokenizer, corpus=pattern["small"], batch_chars=BATCH_CHARS))
        res, peak = {}, {}
        for k in ("small", "large"):
            res[k], peak[k] = run_child(PIPELINE.format(root=ROOT, corpus=pattern[k], out=os.path.join(root, f"out-{k}"),
                                                           vocab=a.vocab, tokenizer=tokenizer))
            shutil.rmtree(os.path.join(root, f"out-{k}"))
        raw_tps = raw["tokens"] / raw["seconds"]
        ours_tps = res["small"]["tokens"] / res["small"]["seconds"]
        print(f"{os.cpu_count()} cores; byte-level BPE of {a.vocab}; corpora of stdlib source as jsonl")
        print(f"small corpus {a.small_mb} MB ({docs['small']} docs, {res['small']['tokens']:,} tokens): pipeline "
              f"{ours_tps:,.0f} tokens/s vs raw encode_batch {raw_tps:,.0f} tokens/s = {ours_tps / raw_tps:.2f}x")
        print(f"large corpus {a.large_mb} MB ({docs['large']} docs, {res['large']['tokens']:,} tokens, "
              f"{res['large']['shards']} shards): {res['large']['tokens'] / res['large']['seconds']:,.0f} tokens/s")
        print(f"peak resident memory: small {peak['small'] / 2**20:.0f} MiB, large {peak['large'] / 2**20:.0f} MiB "
              f"= {peak['large'] / peak['small']:.2f}x for {a.large_mb / a.small_mb:.0f}x the corpus")
        if a.json:
            print(json.dumps({"ratio_vs_raw": ours_tps / raw_tps, "peak_rss_small": peak["small"],
                              "peak_rss_large": peak["large"], "tokens_per_s": ours_tps,
                              "tokens_per_s_large": res["large"]["tokens"] / res["large"]["seconds"],
                              "raw_tokens_per_s": raw_tps}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
