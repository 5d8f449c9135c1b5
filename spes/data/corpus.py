"""Documents from a corpus, streamed: never the whole corpus in memory.

Sources (spes.config.TokenizeConfig):
- files: a path, glob or fsspec URL (`s3://bucket/prefix/*.jsonl.gz`), or several separated by commas.
  By extension (or `corpus_format`): text (each file one document), json/jsonl (one object per line, or a
  JSON array; `.gz`/`.zst` etc. decompressed on the fly), parquet (read in row batches, one column).
- a Hugging Face hub dataset by id (`dataset`, with `dataset_name`, `dataset_split`, `streaming`).
- nothing: the Python standard library's source (real text on every machine), its first `max_files` files.
- `python:stdlib` (the standard library's source without its tests), `python:stdlib-tests` (its test
  suites), `python:<package>` (an installed package's .py files, e.g. `python:torch`): larger real corpora
  that every machine with that Python and those packages has, in a corpus spec beside files (commas).

A file that cannot be read or decoded stops the stage with its name, or with `skip_bad_files` is skipped
and counted. Empty documents are skipped.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from typing import Iterator, Optional

import fsspec

from spes.errors import CorpusError, DataError

log = logging.getLogger("spes.data.corpus")


@dataclass
class CorpusStats:
    files: int = 0
    bad_files: list[str] = field(default_factory=list)
    documents: int = 0
    empty: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    """The version of each Python source a `python:` spec read (the corpus is that version's text)."""


def default_corpus_files(max_files: int) -> list[str]:
    return python_source_files("stdlib")[:max_files]


PYTHON = "python:"


def python_source_files(name: str, versions: Optional[dict[str, str]] = None) -> list[str]:
    """The .py files of `python:<name>`, sorted: the stdlib without its tests ('stdlib'), its tests
    ('stdlib-tests') or an installed package; `versions` gets the version of what was read."""
    if name in ("stdlib", "stdlib-tests"):
        root = sysconfig.get_paths()["stdlib"]
        tests = name == "stdlib-tests"
        files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                       if "site-packages" not in f and (os.sep + "test" in f[len(root):]) == tests)
        version = platform.python_version()
    else:
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError(f"corpus {PYTHON}{name}: no installed package {name!r} (python:stdlib, "
                              "python:stdlib-tests or an installed package's name)")
        files = sorted(f for d in spec.submodule_search_locations
                       for f in glob.glob(os.path.join(d, "**", "*.py"), recursive=True))
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # a package of the stdlib (python:json): Python's version
            version = platform.python_version()
    if not files:
        raise CorpusError(f"corpus {PYTHON}{name}: no .py files found")
    if versions is not None:
        versions[name] = version
    return files


def _format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    p = path.lower().split("?")[0]
    for comp in (".gz", ".bz2", ".xz", ".zst", ".lz4"):
        p = p.removesuffix(comp)
    if p.endswith((".jsonl", ".json", ".ndjson")):
        return "json"
    if p.endswith(".parquet"):
        return "parquet"
    return "text"


def expand(spec: str | list[str], storage_options: Optional[dict] = None,
           versions: Optional[dict[str, str]] = None) -> list[str]:
    """Every file a corpus spec names, in a stable order; a pattern that matches nothing is an error."""
    specs = spec if isinstance(spec, list) else [s.strip() for s in spec.split(",") if s.strip()]
    out = []
    for s in specs:
        if s.startswith(PYTHON):
            out += python_source_files(s[len(PYTHON):], versions)
            continue
        fs, _, paths = fsspec.get_fs_token_paths(s, storage_options=storage_options or {})
        paths = sorted(p for p in paths if not fs.isdir(p))
        if not paths:
            raise CorpusError(f"corpus not found: {s!r} matches no file")
        proto = s.split("://")[0] + "://" if "://" in s else ""
        out += [p if p.startswith(proto) else proto + p for p in paths]
    return out


def _json_rows(f):
    text = io.TextIOWrapper(f, encoding="utf-8", errors="strict")
    first = text.read(1)
    while first and first.isspace():
        first = text.read(1)
    if first == "[":  # a JSON array: not streamable, but such files are small by nature
        rows = json.loads(first + text.read())
        yield from enumerate(rows, 1)
        return
    line_no, pending = 0, first
    for line in text:
        line_no += 1
        line, pending = pending + line, ""
        if line.strip():
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:  # a damaged file: skippable like an unreadable one
                raise DataError(f"line {line_no} is not JSON ({e.msg})") from None


def _json_documents(f, text_field: str, where: str) -> Iterator[str]:
    for n, row in _json_rows(f):
        if not isinstance(row, dict) or text_field not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise CorpusError(f"{where}: row {n} has no {text_field!r} field (has {keys}); set tokenize.text_field")
        yield row[text_field]


def _parquet_documents(f, text_field: str, where: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    if text_field not in pf.schema_arrow.names:
        raise CorpusError(f"{where}: no {text_field!r} column (columns: {pf.schema_arrow.names}); set "
                          "tokenize.text_field")
    for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
        yield from batch.column(0).to_pylist()


def file_documents(url: str, fmt: str, text_field: str, storage_options: Optional[dict] = None) -> Iterator[str]:
    """The documents of one file, streamed (compression inferred from the name)."""
    kind = _format_of(url, fmt)
    with fsspec.open(url, "rb", compression="infer", **(storage_options or {})) as f:
        if kind == "text":
            yield f.read().decode("utf-8")
        elif kind == "json":
            yield from _json_documents(f, text_field, url)
        elif kind == "parquet":
            yield from _parquet_documents(f, text_field, url)
        else:
            raise CorpusError(f"unknown corpus format {kind!r}")


def hub_documents(dataset: str, name: Optional[str], split: str, streaming: bool, text_field: str) -> Iterator[str]:
    import datasets

    try:
        ds = datasets.load_dataset(dataset, name, split=split, streaming=streaming)
    except Exception as e:  # unreachable hub, unknown id or config: many exception types
        raise CorpusError(f"cannot load dataset {dataset!r} (name {name!r}, split {split!r}) from the Hugging Face "
                          f"hub: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    cols = getattr(ds, "column_names", None)
    if cols is not None and text_field not in cols:
        raise CorpusError(f"dataset {dataset!r} has no {text_field!r} column (columns: {cols}); set tokenize.text_field")
    for row in ds:
        yield row[text_field]


def iter_documents(t, storage_options: Optional[dict] = None, stats: Optional[CorpusStats] = None) -> Iterator[str]:
    """Every non-empty document of the corpus `t` (a TokenizeConfig) describes, in a stable order."""
    stats = stats if stats is not None else CorpusStats()
    if t.dataset:
        sources: list[tuple[str, Optional[Iterator[str]]]] = [(t.dataset, hub_documents(t.dataset, t.dataset_name, t.dataset_split, t.streaming, t.text_field))]
    else:
        files = expand(t.corpus, storage_options, stats.versions) if t.corpus else default_corpus_files(t.max_files)
        sources = [(f, None) for f in files]
    for where, docs in sources:
        stats.files += 1
        docs = docs if docs is not None else file_documents(where, t.corpus_format, t.text_field, storage_options)
        try:
            for doc in docs:
                if not isinstance(doc, str) or not doc.strip():
                    stats.empty += 1
                    continue
                stats.documents += 1
                yield doc
        except CorpusError:
            raise
        except (OSError, UnicodeDecodeError, ValueError, EOFError) as e:
            if not t.skip_bad_files:
                raise CorpusError(f"cannot read corpus file {where}: {type(e).__name__}: {e} (set "
                                  "tokenize.skip_bad_files=true to skip and count such files)") from None
            log.warning("skipping unreadable corpus file %s: %s: %s", where, type(e).__name__, e)
            stats.bad_files.append(where)
    if stats.documents == 0:
        raise CorpusError(f"corpus {t.dataset or t.corpus or 'python-stdlib'!r} has no non-empty documents")
