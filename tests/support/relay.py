"""A TCP relay on 127.0.0.1 that can go quiet: it stops forwarding in both directions while
keeping every socket open (a link that drops packets, a proxy that hangs: nothing closes,
nothing arrives), and forwards again when told. Runs its own asyncio loop on a thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from specdecode_stack.local import free_port


class Relay:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.host, self.target_port = host, target_port
        self.port = free_port()
        self.connections = 0  # accepted so far
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relay",
                                        daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Relay:
        self._thread.start()
        self._call(self._start())
        return self

    def quiet(self) -> None:
        """Stop forwarding (sockets stay open; bytes wait in the kernel's buffers)."""
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.set)

    def close(self) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, self.host, self.port)

    async def _close(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await asyncio.sleep(0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward reader -> writer while flowing; a quiet relay reads nothing more."""
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()  # what was read as it went quiet waits too
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.transport.abort()
