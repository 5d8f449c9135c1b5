"""Storage that stops answering, and paths that would leave the storage root."""
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pipelines.prefect_api import free_port
from spes.config.loader import load_params
from spes.errors import ConfigError, StorageError, StoreUnavailable, UnsafePath
from spes.storage.store import Store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def _moto_server(monkeypatch, key: str = "testing", **env):
    """An S3 server in its own process (so it can be paused, SIGSTOP, like a hung endpoint), and credentials."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=dict(os.environ, **env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for k, v in (("AWS_ACCESS_KEY_ID", key), ("AWS_SECRET_ACCESS_KEY", key), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


@pytest.fixture
def moto_process(monkeypatch):
    with _moto_server(monkeypatch) as server:
        yield server


@pytest.mark.s3
def test_a_paused_s3_endpoint_fails_in_bounded_time_with_each_retry_logged(moto_process, caplog):
    endpoint, proc = moto_process
    import s3fs

    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("hang")
    store = Store("s3://hang/spes", {"endpoint_url": endpoint}, timeout_s=1.0, retries=2, backoff_s=0.1)
    store.write_bytes("x", b"payload")
    assert store.read_bytes("x") == b"payload"
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.time()
    with caplog.at_level(logging.WARNING, logger="spes.storage.store"):
        with pytest.raises(StoreUnavailable, match="read x failed after 3 tries"):
            store.read_bytes("x")
    took = time.time() - t0
    retries = [r.message for r in caplog.records if "retry" in r.message]
    assert len(retries) == 2 and "retry 1/2" in retries[0] and "retry 2/2" in retries[1]
    assert took < 15, took  # 3 tries x 1 s timeouts + backoff, not forever
    os.kill(proc.pid, signal.SIGCONT)
    assert store.read_bytes("x") == b"payload"  # and it recovers


def test_no_write_leaves_the_storage_root(tmp_path):
    params = os.path.join(ROOT, "params.yaml")
    root = tmp_path / "storage"
    with pytest.raises(ConfigError, match="orchestration.run_name"):
        load_params(params, ["orchestration.run_name=../../../x", f"storage.url={root}"])
    store = Store(str(root))
    for rel in ("../x", "runs/../../x", "/abs", "runs/./x"):
        with pytest.raises(UnsafePath):
            store.write_bytes(rel, b"x")
    outside = [p for p in tmp_path.rglob("*") if not str(p).startswith(str(root))]
    assert outside == []


def test_no_read_write_or_delete_goes_through_a_link_out_of_the_root(tmp_path):
    """A run folder, or a lease file, that is a symbolic link to a folder outside the storage root: every
    write, read and delete through it is refused, naming the path (issue 18, item 6)."""
    from spes.run.lease import WriterLease
    from spes.run.run import Run

    root, outside = tmp_path / "storage", tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "victim").write_text("keep me")
    store = Store(str(root))
    (root / "runs").mkdir()
    os.symlink(outside, root / "runs" / "default")
    with pytest.raises(UnsafePath, match="outside the storage root"):
        store.write_bytes("runs/default/info/manifest.json", b"x")
    with pytest.raises(UnsafePath, match="outside the storage root"):
        store.read_bytes("runs/default/victim")
    with pytest.raises(UnsafePath, match="outside the storage root"):
        store.remove("runs/default/victim")
    with pytest.raises(UnsafePath):
        Run(store, "default").info()
    os.makedirs(root / "runs" / "r2")
    os.symlink(outside, root / "runs" / "r2" / "lease")
    with pytest.raises(UnsafePath):
        WriterLease(store, "r2", 60).acquire()
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_text() == "keep me"
    store.write_bytes("runs/r3/x", b"inside")  # an ordinary path still works
    assert store.read_bytes("runs/r3/x") == b"inside"


@pytest.mark.s3
def test_s3_with_wrong_credentials_is_one_line_naming_endpoint_and_bucket(monkeypatch):
    """Issue 18, item 9: a denied request is not retried and names where it went, not a traceback."""
    with _moto_server(monkeypatch, key="wrong", INITIAL_NO_AUTH_ACTION_COUNT="0") as (endpoint, _):  # moto checks keys
        store = Store("s3://my-bucket/spes", {"endpoint_url": endpoint}, retries=4)
        t0 = time.time()
        with pytest.raises(StorageError) as e:
            store.write_bytes("runs/x", b"1")
        assert time.time() - t0 < 10  # not retried
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and "'my-bucket'" in msg and endpoint in msg and "access denied" in msg


class DroppingProxy:
    """A loopback TCP proxy in front of `port` that counts the bytes each way ('up': to the server) and, once
    `drop_after` bytes have gone the `way` it watches (all connections together), cuts the connection that
    carries them: a dropped connection in the middle of a transfer, once."""

    def __init__(self, port: int, way: str, drop_after: int):
        import threading

        self.port, self.way, self.drop_after = port, way, drop_after
        self.bytes = {"up": 0, "down": 0}
        self.dropped, self.lock = False, threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            for src, dst, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, way, (client, server)), daemon=True).start()

    def _pump(self, src, dst, way, pair) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.bytes[way] += len(data)
                    cut = way == self.way and not self.dropped and self.bytes[way] >= self.drop_after
                    self.dropped |= cut
                if cut:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in pair:  # a cut or a closed side: the other side sees the connection end
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.s3
@pytest.mark.parametrize("way", ["up", "down"])
def test_a_dropped_connection_costs_one_part_not_the_file(moto_process, way):
    """A bundle of 17 MiB moved in parts of 5 MiB through a connection that drops once in its middle: the
    transfer resumes at the part in flight, so the bytes sent are at most the file plus one part (plus the
    requests' headers); the bundle reads back bit for bit, and no partial object was ever visible."""
    import s3fs
    import torch

    endpoint, _ = moto_process
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("parts")
    part, size = 5 * 2**20, 17 * 2**20
    tensor = torch.arange(size // 4, dtype=torch.int32)
    direct = Store("s3://parts/spes", {"endpoint_url": endpoint}, part_bytes=part)
    if way == "down":
        direct.write_bundle("b", {"big.safetensors": {"t": tensor}}, {})
    proxy = DroppingProxy(int(endpoint.rsplit(":", 1)[1]), way, drop_after=12 * 2**20)
    try:
        store = Store("s3://parts/spes", {"endpoint_url": proxy.endpoint}, timeout_s=5.0, retries=3, backoff_s=0.1,
                      part_bytes=part)
        if way == "up":
            store.write_bundle("b", {"big.safetensors": {"t": tensor}}, {})
            got = direct.read_bundle("b").files["big.safetensors"]["t"]
        else:
            got = store.read_bundle("b").files["big.safetensors"]["t"]
            with store.open_reader("b", "big.safetensors", store.read_manifest("b")["files"]["big.safetensors"]) as r:
                assert torch.equal(r.read("t"), tensor)  # the streamed reader takes the same ranged reads
    finally:
        proxy.close()
    assert proxy.dropped
    assert torch.equal(got, tensor)
    moved = proxy.bytes[way] - (size if way == "down" else 0)  # the streamed read above moved the file once more
    assert size < moved <= size + part + 256 * 2**10, (moved, size)
    assert direct.fs.ls("parts/spes/b", detail=False) and not direct.fs.list_multipart_uploads("parts")
