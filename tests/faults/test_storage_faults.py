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


@pytest.mark.s3
def test_s3_bucket_that_does_not_exist_is_one_line_and_is_not_created(monkeypatch):
    """Nothing creates a bucket (a node's key may not; a typo must not make a new one): one line naming it."""
    with _moto_server(monkeypatch) as (endpoint, _):
        store = Store("s3://no-such-bucket/spes", {"endpoint_url": endpoint}, retries=4)
        with pytest.raises(StorageError) as e:
            store.write_bundle("runs/x/info", {}, {})
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and "the bucket 'no-such-bucket' does not exist" in msg, msg
        assert not store.fs.exists("no-such-bucket")


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


@pytest.mark.s3
def test_moving_a_round_on_s3_copies_then_deletes_and_finishes_when_retried(moto_process):
    """S3 has no folders: s3fs's recursive mv asked for folder keys and failed (a resume after an interrupted
    round). The move copies each object, markers last, then deletes, markers first; cut between the copies and
    the deletes, a second try finishes it, and no half-moved bundle ever reads as committed."""
    import s3fs
    import torch

    from spes.errors import NotCommitted

    endpoint, _ = moto_process
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("moves")
    store = Store("s3://moves/spes", {"endpoint_url": endpoint}, retries=1, backoff_s=0.01)
    for node in (0, 1):
        store.write_bundle(f"rounds/000003/nodes/{node}", {"m.safetensors": {"w": torch.full((4,), float(node))}},
                           {"node": node})
    store.write_bytes("info", b"{}")
    copies, real_rm = [], store.fs.rm_file

    def cut_after_one_delete(path):  # the first delete lands, the process dies at the second
        copies.append(path)
        if len(copies) == 2:
            raise KeyboardInterrupt
        return real_rm(path)

    store.fs.rm_file = cut_after_one_delete
    with pytest.raises(KeyboardInterrupt):
        store.move("rounds/000003", "superseded/s1/000003")
    assert [p.rsplit("/", 1)[1] for p in copies] == ["COMMIT", "COMMIT"]  # markers go first
    for node in (0, 1):  # the destination is whole; the source no longer counts as committed
        assert store.read_bundle(f"superseded/s1/000003/nodes/{node}").files["m.safetensors"]["w"][0] == node
    with pytest.raises(NotCommitted):
        store.read_manifest("rounds/000003/nodes/1")
    store.fs.rm_file = real_rm
    store.move("rounds/000003", "superseded/s2/000003")  # the retry (a new stamp, as supersede_after does)
    assert store.list_names("rounds") == [] and store.list_names("superseded/s1/000003/nodes") == ["0", "1"]
    store.move("info", "superseded/s2/info")  # a single object
    assert not store.exists("info") and store.read_bytes("superseded/s2/info") == b"{}"
    store.move("rounds/000009", "superseded/s3/000009")  # nothing there: nothing to do


@pytest.mark.s3
def test_an_object_shorter_than_its_manifest_by_whole_parts_is_an_integrity_error_naming_it(moto_process):
    """Read part by part, the last ranged GET of a short object starts past its end (S3 answers 416): the
    same integrity error as a size or sha256 mismatch, naming the file, not a bare OSError."""
    import s3fs
    import torch

    from spes.errors import IntegrityError

    endpoint, _ = moto_process
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("short")
    Store("s3://short/spes", {"endpoint_url": endpoint}).write_bundle("b", {"m.safetensors": {"w": torch.arange(4096, dtype=torch.float32)}}, {})
    store = Store("s3://short/spes", {"endpoint_url": endpoint}, retries=1, backoff_s=0.01, part_bytes=1024)
    path = store.path("b/m.safetensors")
    store.fs.pipe_file(path, store.fs.cat_file(path)[:4096])  # 3 of its 16 kB parts gone
    with pytest.raises(IntegrityError, match=r"s3://short/spes/b/m.safetensors: .*(size|truncated)"):
        store.read_bundle("b")
    with pytest.raises(IntegrityError, match=r"b/m.safetensors: sha256/size mismatch"):
        store.read_verified("b", "m.safetensors", store.read_manifest("b")["files"]["m.safetensors"])


def test_a_storage_location_is_exact_whatever_the_url_as_written(tmp_path, monkeypatch):
    """Two copies of a repository both write storage.url: artifacts/storage; their storages are not one."""
    for clone in ("a", "b"):
        (tmp_path / clone).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    a = Store("artifacts/storage")
    monkeypatch.chdir(tmp_path / "b")
    b = Store("artifacts/storage")
    assert a.url == b.url and a.location != b.location
    assert a.location == f"file://{os.path.realpath(tmp_path / 'a' / 'artifacts' / 'storage')}"
    os.symlink(tmp_path / "a" / "artifacts", tmp_path / "link")
    assert Store(str(tmp_path / "link" / "storage")).location == a.location
    s3 = [Store("s3://bucket/runs", {"endpoint_url": e}).location for e in ("http://127.0.0.1:9000", "http://h:1/")]
    assert s3 == ["s3://http://127.0.0.1:9000/bucket/runs", "s3://http://h:1/bucket/runs"]
