"""Peak memory of tokenization with one huge single-line document (issue 18, item 8).

    python bench/huge_document.py [--mb 24]

Tokenizes the stdlib json sources plus one document of `--mb` MB on a single line, each case in a fresh
process (peak resident memory, ru_maxrss), and prints one JSON line: peak MiB without the document, with
a 2 MB one and with the huge one, and the ratio huge / none. Documents longer than
spes.data.tokenization.MAX_PIECE_CHARS are encoded in pieces, so the ratio stays near 1 (the document's own
string, held by this script, is part of what is measured).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.cleanup import exit_on_termination  # noqa: E402

CASE = """
import glob, json, os, resource, sys, sysconfig
sys.path.insert(0, {root!r})
from spes.data.tokenization import tokenize_corpus
docs = [open(f).read() for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))]
if {doc!r}:
    docs.append(open({doc!r}).read())
tokenize_corpus(iter(docs), {out!r}, 4096, None, 0.13, 0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def peak_mib(doc: str, out: str) -> float:
    code = CASE.format(root=ROOT, doc=doc, out=out)
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=24.0)
    a = ap.parse_args()
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "import", "class", "self", "value"]
    exit_on_termination()  # a kill still removes the temporary folder
    with tempfile.TemporaryDirectory() as tmp:
        text = " ".join(rng.choice(words) + str(rng.randint(0, 999)) for _ in range(int(a.mb * 115_000)))
        huge, small = os.path.join(tmp, "huge.txt"), os.path.join(tmp, "small.txt")
        open(huge, "w").write(text[: int(a.mb * 1e6)])
        open(small, "w").write(text[:2_000_000])
        none, two, big = (peak_mib(d, os.path.join(tmp, f"out{i}")) for i, d in enumerate(("", small, huge)))
    print(json.dumps({"peak_mib_no_document": none, "peak_mib_2mb_document": two,
                      f"peak_mib_{a.mb:g}mb_document": big, "ratio_huge_to_none": big / none}))


if __name__ == "__main__":
    main()
