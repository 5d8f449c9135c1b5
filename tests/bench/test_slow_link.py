"""The slow-link harness itself: a namespace's link has the rate and the latency asked for, a cut stops it,
and nothing of it is left after the block (also when the block fails)."""
import http.server
import subprocess
import threading
import time

import pytest

from bench.slow_link import Link, SlowLinks, available

WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
MIB = 2**20


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    folder = tmp_path_factory.mktemp("web")
    (folder / "blob").write_bytes(bytes(range(256)) * (2 * MIB // 256))

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(folder), **k)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield ("127.0.0.1", server.server_address[1])
    server.shutdown()


def _fetch(node, url: str, timeout: float = 30) -> tuple[int, float]:
    code = ("import sys, time, urllib.request\nt = time.time()\ntry:\n    n = len(urllib.request.urlopen(sys.argv[1], "
            "timeout=8).read())\nexcept Exception:\n    n = -1\nprint(n, time.time() - t)")
    out = subprocess.run(node.exec_args() + ["python3", "-c", code, url], capture_output=True, text=True,
                         timeout=timeout)
    n, seconds = out.stdout.split()
    return int(n), float(seconds)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_link_has_its_rate_and_latency_and_a_cut_stops_it(web):
    with SlowLinks([Link(16e6, rtt_s=0.1)], {"web": web}) as net:
        node = net.nodes[0]
        n, small = _fetch(node, node.url("web") + "/missing")  # a 404: about one round trip (two with connect)
        assert n == -1 and 0.1 <= small < 1.0
        n, seconds = _fetch(node, node.url("web") + "/blob")
        assert n == 2 * MIB
        rate = n * 8 / (seconds - small)
        assert 0.6 * 16e6 < rate < 1.1 * 16e6, rate
        up, down = node.interface_bytes()
        assert down >= 2 * MIB and node.relays["web"].bytes_down >= 2 * MIB
        cut = threading.Thread(target=net.cut, args=(0, 3.0))
        cut.start()
        time.sleep(0.5)
        n, during = _fetch(node, node.url("web") + "/missing")  # waits for the link to come back
        cut.join()
        assert during > 2.0
        names = (net.nodes[0].namespace, net.nodes[0].host_if)
    assert names[0] not in _namespaces()
    assert subprocess.run(["ip", "link", "show", names[1]], capture_output=True).returncode != 0


def test_everything_is_removed_when_the_block_fails(web):
    with pytest.raises(RuntimeError, match="boom"):
        with SlowLinks([Link(8e6), Link(8e6)], {"web": web}) as net:
            made = [n.namespace for n in net.nodes]
            raise RuntimeError("boom")
    assert all(m not in _namespaces() for m in made)
