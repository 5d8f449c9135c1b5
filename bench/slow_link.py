"""Slow links on one machine: each node machine in a Linux network namespace of its own, joined to this one by
a veth pair whose two ends are rate-limited by `tc ... tbf` (uploads leave the namespace's end, downloads the
host's end), and every service it reaches (the S3-compatible server, the Prefect server, both listening on
loopback here) through a relay on the host's end of its veth that adds the link's latency and loss.

This kernel has no netem, so latency and loss come from the relay, a small asyncio TCP proxy: every chunk it
forwards waits `rtt / 2` in each direction (so a request and its answer take one RTT more), and each
1448-byte segment is "lost" with probability `loss`: it is held for a retransmission timeout (200 ms,
Linux's minimum RTO) before it goes on, which is what a lost segment costs a TCP stream. A cut is real:
the veth is set down (packets dropped, connections stall and time out as on a broken link) and up again.

Only addresses of the namespaces made here are used (a free 10.213.<k>.0/30 per node, taken under a lock), every
relay accepts a bounded number of connections, and everything (the namespaces' processes, the namespaces,
their veths, the relays) is removed on exit, also on failure. Needs root and `ip`/`tc`: `available()` says
why not where they are missing, and the tests skip with that reason.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

SUBNET = "10.213"
SEGMENT = 1448
RTO_S = 0.2
MAX_CONNECTIONS = 512
"""Connections a relay accepts over its life (the test's and the bench's runs open a few dozen)."""
IN_FLIGHT = 16
"""Chunks (of up to 64 KiB) a relay holds per direction of a connection."""
LOCK = "/tmp/spes-slow-link.lock"


def available() -> Optional[str]:
    """None where namespaces can be made here, else why not (a test skips with it)."""
    if os.geteuid() != 0:
        return "slow links need root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"slow links need `{tool}` (iproute2)"
    probe = f"spes-probe-{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
    except RuntimeError as e:
        return f"network namespaces are not permitted here: {e}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def service(url: str) -> tuple[str, int]:
    """(host, port) of a server's URL (http://127.0.0.1:4200/api -> ('127.0.0.1', 4200)): a relay's target."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"{url}: a relay needs a URL with a host and a port")
    return parts.hostname, parts.port


def _sh(*args: str, check: bool = True) -> str:
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out.stdout


@dataclass
class Link:
    """One node machine's link: rate each way (bits/s), round-trip latency added, segment loss probability."""

    rate_bps: float
    rtt_s: float = 0.0
    loss: float = 0.0

    def tbf(self) -> list[str]:
        # burst: at least one MTU and ~4 ms of the rate; latency bounds the queue (a real link's buffer)
        burst = max(16_000, int(self.rate_bps / 8 * 0.004))
        return ["tbf", "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "latency", "400ms"]


class Relay:
    """An asyncio TCP proxy from (listen_host, listen_port) to (target_host, target_port) adding the link's
    latency and loss, on its own event loop thread. `bytes_up`/`bytes_down`: what it forwarded."""

    def __init__(self, listen_host: str, target: tuple[str, int], link: Link, seed: int):
        self.listen_host, self.target, self.link = listen_host, target, link
        self.rng = random.Random(seed)
        self.bytes_up = self.bytes_down = 0
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: Optional[asyncio.base_events.Server] = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, name=f"relay-{listen_host}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or not self.port:
            raise RuntimeError(f"relay on {listen_host} did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._serve, self.listen_host, 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def _delay_of(self, n: int) -> float:
        """Extra hold for a chunk of n bytes: one RTO per lost segment in it."""
        if self.link.loss <= 0:
            return 0.0
        lost = sum(1 for _ in range(max(1, n // SEGMENT)) if self.rng.random() < self.link.loss)
        return lost * RTO_S

    async def _pump(self, reader, writer, up: bool) -> None:
        """Forward one direction: each chunk leaves rtt/2 (plus any loss stall) after it arrived, in order.
        At most IN_FLIGHT chunks wait in the relay: a fast sender is held back (as by a link's buffer), so a
        large download does not pile up here in memory."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=IN_FLIGHT)

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
            writer.close()

        sender = asyncio.ensure_future(send())
        last = 0.0
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                # in order: a chunk never overtakes the one before it (a stall delays what follows, as in TCP)
                last = max(last, self.loop.time() + self.link.rtt_s / 2 + self._delay_of(len(data)))
                await queue.put((last, data))
        except (ConnectionError, OSError):
            pass
        finally:
            if not sender.done():  # cancelled at close(): its sender is gone, nobody would take the end mark
                await queue.put((0.0, None))
            try:
                await sender
            except (ConnectionError, OSError):
                pass

    async def _serve(self, client_reader, client_writer) -> None:
        if self.connections >= MAX_CONNECTIONS:  # bounded: a run away client cannot open without end
            client_writer.close()
            return
        self.connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pump(client_reader, server_writer, up=True),
                             self._pump(server_reader, client_writer, up=False), return_exceptions=True)

    def close(self) -> None:
        async def shutdown() -> None:  # cancel every connection's tasks and wait for them to end
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=10)
        except Exception:  # a loop that is already gone has nothing left to cancel
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class NodeLink:
    """Node i's namespace, its veth ends and the relays it reaches the services by."""

    index: int
    """The node's number (its position in the links given)."""
    subnet: int
    """Its addresses: 10.213.<subnet>.0/30, the first free one when it was made."""
    namespace: str
    host_if: str
    node_if: str
    link: Link
    relays: dict[str, Relay] = field(default_factory=dict)

    @property
    def host_ip(self) -> str:
        return f"{SUBNET}.{self.subnet}.1"

    @property
    def node_ip(self) -> str:
        return f"{SUBNET}.{self.subnet}.2"

    def url(self, service: str) -> str:
        """How this node reaches a service: its relay on the host's end of the veth."""
        return f"http://{self.host_ip}:{self.relays[service].port}"

    def machine_env(self) -> dict[str, str]:
        """A node machine's environment for the services named "prefect" and "s3": its Prefect API and its
        own endpoint to the bucket (botocore reads AWS_ENDPOINT_URL_S3), both through its link."""
        env = {}
        if "prefect" in self.relays:
            env["PREFECT_API_URL"] = self.url("prefect") + "/api"
        if "s3" in self.relays:
            env["AWS_ENDPOINT_URL_S3"] = self.url("s3")
        return env

    def exec_args(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def interface_bytes(self) -> tuple[int, int]:
        """(up, down) bytes the host's end of the veth has seen (rx = from the node, tx = to it)."""
        base = f"/sys/class/net/{self.host_if}/statistics"
        with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:
            return int(rx.read()), int(tx.read())


class SlowLinks:
    """`with SlowLinks([Link(20e6, 0.04, 0.001)] * 2, {"s3": ("127.0.0.1", 9000)}) as net:` makes one
    namespace per link; `net.nodes[i]` says how node i runs (`exec_args`) and reaches each service (`url`)."""

    def __init__(self, links: list[Link], services: dict[str, tuple[str, int]], seed: int = 0):
        self.links, self.services, self.seed = links, services, seed
        self.tag = f"{os.getpid() % 100000}"
        self.nodes: list[NodeLink] = []

    def __enter__(self) -> "SlowLinks":
        why = available()
        if why:
            raise RuntimeError(why)
        try:
            for i, link in enumerate(self.links):
                self._make(i, link)
        except BaseException:
            self.close()
            raise
        return self

    def _make(self, i: int, link: Link) -> None:
        # under a lock shared by every harness on this machine (tests on two workers, a bench beside them):
        # the first free subnet, taken before the next one looks
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = _sh("ip", "-4", "addr")
            subnet = next((k for k in range(256) if f"{SUBNET}.{k}." not in used), None)
            if subnet is None:
                raise RuntimeError(f"no free {SUBNET}.<k>.0/30 subnet on this machine")
            node = NodeLink(i, subnet, f"spes-wan-{self.tag}-{i}", f"sw{self.tag}h{i}", f"sw{self.tag}n{i}", link)
            self._make_in_lock(node)

    def _make_in_lock(self, node: NodeLink) -> None:
        link = node.link
        ns = ["ip", "netns", "exec", node.namespace]
        _sh("ip", "netns", "add", node.namespace)
        self.nodes.append(node)  # from here on close() removes it, whatever fails next
        _sh("ip", "link", "add", node.host_if, "type", "veth", "peer", "name", node.node_if)
        _sh("ip", "link", "set", node.node_if, "netns", node.namespace)
        _sh("ip", "addr", "add", f"{node.host_ip}/30", "dev", node.host_if)
        _sh("ip", "link", "set", node.host_if, "up")
        _sh(*ns, "ip", "addr", "add", f"{node.node_ip}/30", "dev", node.node_if)
        _sh(*ns, "ip", "link", "set", node.node_if, "up")
        _sh(*ns, "ip", "link", "set", "lo", "up")
        _sh("tc", "qdisc", "add", "dev", node.host_if, "root", *link.tbf())
        _sh(*ns, "tc", "qdisc", "add", "dev", node.node_if, "root", *link.tbf())
        for k, (name, target) in enumerate(sorted(self.services.items())):
            node.relays[name] = Relay(node.host_ip, target, link, seed=self.seed * 1000 + node.index * 10 + k)

    def cut(self, i: int, seconds: float) -> None:
        """Node i's link down for `seconds` (packets dropped both ways), then up again."""
        node = self.nodes[i]
        _sh("ip", "link", "set", node.host_if, "down")
        try:
            time.sleep(seconds)
        finally:
            _sh("ip", "link", "set", node.host_if, "up")

    def close(self) -> None:
        for node in self.nodes:
            for relay in node.relays.values():
                relay.close()
            for pid in _sh("ip", "netns", "pids", node.namespace, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "link", "del", node.host_if, check=False)  # deletes its peer too
            _sh("ip", "netns", "del", node.namespace, check=False)
        self.nodes = []

    def __exit__(self, *exc) -> None:
        self.close()
