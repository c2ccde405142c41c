"""The pod network of the pod runner: one bridge, a network namespace per pod, forwarders.

Layout (all on the bridge `bh-pods` in the host's network namespace):
  10.200.0.1/16       gateway; pods get 10.200.x.y/16 and a default route through it
  10.201.0.N/32       node IPs (status.hostIP): hostPorts of that node's pods listen there
  10.96.x.y/32        Service ClusterIPs (10.96.0.1 is the API server)
The host owns the node and Service addresses, so a pod's packet to one of them is delivered
to the host, where a TCP forwarder (asyncio, one thread) relays it: the API server's
127.0.0.1 port, a Service's ready endpoint pod, a hostPort's pod. No iptables needed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import subprocess
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

BRIDGE = "bh-pods"
GATEWAY = "10.200.0.1"
POD_NET = ipaddress.ip_network("10.200.0.0/16")
NODE_NET = ipaddress.ip_network("10.201.0.0/16")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip <args>`; failures raise with what ip printed."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


NETNS_PREFIX = "bhp-"


def setup_bridge() -> None:
    """The bridge, after removing pod namespaces a killed runner left behind."""
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(NETNS_PREFIX):
            delete_pod_netns(name)
    if ip("link", "show", BRIDGE, check=False).returncode != 0:
        ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "replace", f"{GATEWAY}/{POD_NET.prefixlen}", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")


def teardown_bridge() -> None:
    ip("link", "del", BRIDGE, check=False)


def add_host_address(address: str) -> None:
    """A node IP or ClusterIP owned by the host (on the bridge, so pods route to it)."""
    ip("addr", "replace", f"{address}/32", "dev", BRIDGE)


class AddressPool:
    """Pod IPs from POD_NET, handed out in order and reused after release."""

    def __init__(self) -> None:
        self._free = (str(a) for a in POD_NET.hosts() if str(a) != GATEWAY)
        self._released: list[str] = []
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            return self._released.pop(0) if self._released else next(self._free)

    def release(self, address: str) -> None:
        with self._lock:
            self._released.append(address)


def create_pod_netns(name: str, address: str) -> None:
    """Network namespace `name` with lo up and a veth to the bridge holding `address`."""
    host_end, pod_end = f"bh{name[-9:]}", "eth0"
    ip("netns", "add", name)
    ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end, "netns", name)
    ip("link", "set", host_end, "master", BRIDGE, "up")
    ns = ("-n", name)
    ip(*ns, "link", "set", "lo", "up")
    ip(*ns, "addr", "add", f"{address}/{POD_NET.prefixlen}", "dev", pod_end)
    ip(*ns, "link", "set", pod_end, "up")
    ip(*ns, "route", "add", "default", "via", GATEWAY)


def delete_pod_netns(name: str) -> None:
    ip("link", "del", f"bh{name[-9:]}", check=False)  # removes both veth ends
    ip("netns", "del", name, check=False)


Target = Callable[[], "tuple[str, int] | None"]


class Forwarders:
    """TCP relays listening on host addresses; the target is chosen per connection."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._servers: dict[tuple[str, int], asyncio.base_events.Server] = {}
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fwd")
        self._thread.start()

    def listen(self, address: str, port: int, target: Target) -> None:
        """Relay address:port to target() (None: refuse); idempotent per address:port."""
        if (address, port) in self._servers:
            return
        future = asyncio.run_coroutine_threadsafe(self._start(address, port, target), self._loop)
        self._servers[(address, port)] = future.result(timeout=10)

    def close(self, address: str, port: int) -> None:
        server = self._servers.pop((address, port), None)
        if server is not None:
            self._loop.call_soon_threadsafe(server.close)

    def stop(self) -> None:
        async def close_all() -> None:
            for server in self._servers.values():
                server.close()
            self._servers.clear()
            # Relayed connections end here, while the loop can still close their sockets.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _start(self, address: str, port: int, target: Target) -> asyncio.base_events.Server:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            where = target()
            if where is None:
                writer.close()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*where)
            except OSError as error:
                log.debug("forward %s:%d -> %s: %s", address, port, where, error)
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

        return await asyncio.start_server(handle, address, port, reuse_address=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
