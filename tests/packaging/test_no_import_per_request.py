"""An async HTTP request must not import anything: httpcore imports ``sniffio`` on every
request and lock, and when the package is missing each attempt fails only after searching
the whole ``sys.path`` (a third of the operator's CPU per Kubernetes request)."""

from __future__ import annotations

import asyncio
import sys
from importlib.abc import MetaPathFinder

import httpx

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class CountingFinder(MetaPathFinder):
    """First on ``sys.meta_path``: sees every import that is not already in sys.modules."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        self.names.append(fullname)
        return None  # let the real finders do the work


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if not head:
                return
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _requests(finder: CountingFinder) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        for _ in range(3):  # warm: first use may import lazily, once
            (await client.get("/")).raise_for_status()
        sys.meta_path.insert(0, finder)
        try:
            await asyncio.gather(*(client.get("/") for _ in range(20)))
        finally:
            sys.meta_path.remove(finder)


def test_async_requests_import_nothing():
    finder = CountingFinder()
    asyncio.run(_requests(finder))
    assert finder.names == [], f"imports attempted per request: {sorted(set(finder.names))}"
