"""Streaming safetensors: real safetensors files, deterministic bytes, every byte verified."""
import io

import pytest
import torch
from safetensors.torch import load as st_load

from spes.errors import IntegrityError
from spes.storage.tensorio import TensorReader, TensorWriter, spec_of, tensors_sha256, write_tensors


def _tensors():
    torch.manual_seed(0)
    return {"b.w": torch.randn(3, 5), "a.q": torch.randint(-127, 127, (7,), dtype=torch.int8),
            "a.q#scale": torch.rand(2), "c": torch.randn(4).bfloat16(), "empty": torch.zeros(0, 3)}


def test_written_files_are_safetensors_and_deterministic():
    t = _tensors()
    buf = io.BytesIO()
    sha, n = write_tensors(buf, t)
    blob = buf.getvalue()
    assert n == len(blob) and sha == tensors_sha256(t)
    loaded = st_load(blob)
    assert loaded.keys() == t.keys() and all(torch.equal(loaded[k], t[k]) for k in t)
    again = io.BytesIO()
    write_tensors(again, {k: v.clone() for k, v in reversed(list(t.items()))})
    assert again.getvalue() == blob  # same tensors, same bytes, whatever the dict order


def test_reader_streams_in_file_order_and_verifies():
    t = _tensors()
    buf = io.BytesIO()
    sha, n = write_tensors(buf, t)
    r = TensorReader(io.BytesIO(buf.getvalue()), "f", sha, n)
    assert r.order == sorted(t)
    assert all(torch.equal(r.read(k), t[k]) for k in sorted(t))
    r.finish()
    r = TensorReader(io.BytesIO(buf.getvalue()), "f", sha, n)
    with pytest.raises(IntegrityError, match="'b.w' is not the next tensor"):
        r.read("b.w")
    flipped = bytearray(buf.getvalue())
    flipped[-1] ^= 1
    with pytest.raises(IntegrityError, match="f: sha256/size mismatch"):
        TensorReader(io.BytesIO(bytes(flipped)), "f", sha, n).read_all()
    with pytest.raises(IntegrityError, match="f: truncated"):
        TensorReader(io.BytesIO(buf.getvalue()[:-9]), "f", sha, n).read_all()


def test_writer_insists_on_its_specs():
    w = TensorWriter(io.BytesIO(), [spec_of("a", torch.zeros(2)), spec_of("b", torch.zeros(1))])
    with pytest.raises(ValueError, match="expected"):
        w.write("b", torch.zeros(1))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="1 tensors not written"):
        w.close()
