"""A forward proxy for https, as a corporate network has one: `CONNECT host:port` opens a tunnel.

    with ConnectProxy(resolve={"gcs.ckptio.test": "127.0.0.1"}) as proxy:
        env["https_proxy"] = proxy.url            # http://127.0.0.1:PORT
        ...
        proxy.tunnels                              # ["gcs.ckptio.test:443", ...]: what clients asked for

Names are resolved by the proxy (a client behind one never resolves them itself); `resolve` maps
test names to addresses. Anything but CONNECT gets 405. Listens on 127.0.0.1 only.
"""
from __future__ import annotations

import asyncio
import threading


class ConnectProxy:
    def __init__(self, resolve: dict[str, str] | None = None):
        self.resolve = dict(resolve or {})
        self.tunnels: list[str] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pipe(self, reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _client(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        if method != "CONNECT":
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        host, port = target.rsplit(":", 1)
        self.tunnels.append(target)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.resolve.get(host, host), int(port))
        except OSError:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def __enter__(self) -> "ConnectProxy":
        def run():
            self._loop = asyncio.new_event_loop()
            server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            self._loop.run_forever()
            server.close()
            self._loop.close()

        self._thread = threading.Thread(target=run, name="connect-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
