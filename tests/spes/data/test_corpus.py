"""Corpus sources, streamed: formats, compression, globs, S3, clear errors naming the file or the field."""
import gzip
import json

import pytest

from spes.config.schema import TokenizeConfig
from spes.data.corpus import CorpusStats, iter_documents
from spes.errors import CorpusError


def docs_of(**kw):
    stats = CorpusStats()
    return list(iter_documents(TokenizeConfig(**kw), None, stats)), stats


def test_text_json_jsonl_gz_and_parquet(tmp_path):
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["x", "", "y"])))
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "zipped"}) + "\n")
    (tmp_path / "d.json").write_text(json.dumps([{"text": "in an array"}]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p1", "p2"], "n": [1, 2]}), tmp_path / "e.parquet")
    docs, stats = docs_of(corpus=f"{tmp_path}/*.txt,{tmp_path}/*.json*,{tmp_path}/*.parquet")
    assert docs == ["first document\n", "x", "y", "zipped", "in an array", "p1", "p2"]
    assert (stats.files, stats.documents, stats.empty) == (5, 7, 1)


def test_missing_field_or_column_names_it(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(CorpusError, match=r"a.jsonl: row 1 has no 'text' field \(has \['body'\]\); set tokenize.text_field"):
        docs_of(corpus=str(tmp_path / "a.jsonl"))
    assert docs_of(corpus=str(tmp_path / "a.jsonl"), text_field="body")[0] == ["hello"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(CorpusError, match=r"b.parquet: no 'text' column \(columns: \['body'\]\)"):
        docs_of(corpus=str(tmp_path / "b.parquet"))


def test_an_unreadable_file_in_the_middle_is_named_or_skipped_and_counted(tmp_path):
    for i, body in enumerate([b"good one", b"\xff\xfe not utf-8 \xc3", b"good two"]):
        (tmp_path / f"{i}.txt").write_bytes(body)
    (tmp_path / "3.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(CorpusError, match=r"cannot read corpus file .*1.txt: UnicodeDecodeError.*skip_bad_files"):
        docs_of(corpus=f"{tmp_path}/*.txt")
    with pytest.raises(CorpusError, match=r"cannot read corpus file .*3.jsonl: DataError: line 2 is not JSON"):
        docs_of(corpus=f"{tmp_path}/3.jsonl")
    docs, stats = docs_of(corpus=f"{tmp_path}/*.txt,{tmp_path}/*.jsonl", skip_bad_files=True)
    assert docs == ["good one", "good two", "ok"]
    assert [f.rsplit("/", 1)[-1] for f in stats.bad_files] == ["1.txt", "3.jsonl"]


def test_nothing_to_read(tmp_path):
    with pytest.raises(CorpusError, match="matches no file"):
        docs_of(corpus=str(tmp_path / "nothing*.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(CorpusError, match="has no non-empty documents"):
        docs_of(corpus=str(tmp_path / "empty.txt"))


def test_an_unreachable_hub_dataset_fails_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(CorpusError, match="cannot load dataset 'no-such-org/no-such-data' .* from the Hugging Face hub"):
        docs_of(dataset="no-such-org/no-such-data")


@pytest.mark.s3
def test_s3_corpus(monkeypatch):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(k, "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        host, port = server.get_host_and_port()
        opts = {"endpoint_url": f"http://{host}:{port}"}
        import s3fs

        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("corpus")
        fs.pipe("corpus/part-0.jsonl", b'{"text": "from s3"}\n{"text": "again"}\n')
        fs.pipe("corpus/part-1.txt", b"a text file")
        stats = CorpusStats()
        docs = list(iter_documents(TokenizeConfig(corpus="s3://corpus/part-*"), opts, stats))
        assert docs == ["from s3", "again", "a text file"] and stats.files == 2
    finally:
        server.stop()


def test_python_sources_as_a_corpus():
    import platform
    import sysconfig

    from spes.data.corpus import default_corpus_files, expand, python_source_files

    versions: dict = {}
    stdlib, tests = python_source_files("stdlib", versions), python_source_files("stdlib-tests", versions)
    root = sysconfig.get_paths()["stdlib"]
    assert stdlib and tests and not set(stdlib) & set(tests) and all(f.startswith(root) for f in stdlib + tests)
    assert any(f.endswith("/json/decoder.py") for f in stdlib) and all("/test" in f[len(root):] for f in tests)
    assert default_corpus_files(400) == stdlib[:400]  # the default corpus, as before the python: specs
    assert versions == {"stdlib": platform.python_version(), "stdlib-tests": platform.python_version()}
    got = expand("python:json," + stdlib[0], None, versions)
    assert got[-1] == stdlib[0] and any(f.endswith("/json/decoder.py") for f in got) and versions["json"] == versions["stdlib"]
    import torch

    assert expand("python:torch", None, versions) and versions["torch"] == torch.__version__
    with pytest.raises(CorpusError, match="corpus python:no_such_package: no installed package 'no_such_package'"):
        expand("python:no_such_package")
