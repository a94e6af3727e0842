"""A stream's writer: SSE events, keep-alive comments, and the cut for a client that stops
reading. Every stream, one choice or several, writes through one.

A client that stops reading takes nothing from its socket: once its receive buffer is full,
what is written stays unsent (asyncio's buffer, then the kernel's send queue), and a write
waits once asyncio's buffer passes its mark. The writer counts the bytes it wrote that have not
left this host (asyncio's buffer plus the socket's send queue, where the system says: Linux's
SIOCOUTQ, macOS's SO_NWRITE). A stream is cut (ClientStalled: its requests cancelled, its rows
freed, a log line, the connection dropped) when those bytes pass `stall_bytes`, or when bytes
are waiting and none has left for `stall_s`, a write included. Bytes the client's kernel took
count as read: a client that never reads is seen once its receive buffer is full (a few
hundred KB on loopback at most).

Like vLLM's bound on a request's queued outputs and llama.cpp's write timeout, the cut frees
what the client holds rather than buffering for it without end.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import socket
import struct
import sys
import termios
import time
from typing import Optional

from aiohttp import web

STALL_BYTES = 1 << 20  # unsent bytes a stream may leave behind before it is cut
SO_NWRITE = 0x1024  # macOS: bytes in a socket's send queue


class ClientStalled(Exception):
    """The client stopped reading its stream (the message says how)."""


def _send_queue(sock: Optional[socket.socket]) -> int:
    """Bytes the kernel holds unsent (or unacknowledged) for this socket; 0 where unknown."""
    if sock is None:
        return 0
    try:
        if sys.platform == "darwin":
            return sock.getsockopt(socket.SOL_SOCKET, SO_NWRITE)
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


class SseWriter:
    def __init__(self, request: web.Request, resp: web.StreamResponse, stall_s: float,
                 stall_bytes: int = STALL_BYTES):
        self.resp, self.stall_s, self.stall_bytes = resp, stall_s, stall_bytes
        self.transport = request.transport
        self.sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        self.written = 0  # bytes handed to the transport
        self.left = 0  # of them, the most seen to have left this host
        self.moved_at = time.monotonic()  # when bytes were last seen leaving (or none waited)

    def pending(self) -> int:
        """Bytes written that have not left this host."""
        if self.transport is None or self.transport.is_closing():
            return 0
        return self.transport.get_write_buffer_size() + _send_queue(self.sock)

    def check(self) -> None:
        """Raises ClientStalled past either bound."""
        pending, now = self.pending(), time.monotonic()
        if pending == 0 or self.written - pending > self.left:
            self.left, self.moved_at = self.written - pending, now
        if pending > self.stall_bytes:
            raise ClientStalled(f"{pending} bytes written are unread (the bound: {self.stall_bytes})")
        if now - self.moved_at > self.stall_s:
            raise ClientStalled(f"no byte of {pending} waiting was read for {now - self.moved_at:.1f} s "
                                f"(the bound: {self.stall_s:g} s)")

    async def write(self, data: bytes) -> None:
        self.check()
        try:
            async with asyncio.timeout(self.stall_s):  # a write waits while asyncio's buffer is past its mark
                await self.resp.write(data)
        except TimeoutError:
            raise ClientStalled(f"a write waited {self.stall_s:g} s for the client to read") from None
        self.written += len(data)

    async def event(self, obj: dict) -> None:
        await self.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    async def keepalive(self) -> None:
        await self.write(b": keep-alive\n\n")

    async def done(self) -> None:
        await self.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()

    def drop(self) -> None:
        """Closes the connection at once (nothing more can be written to this client)."""
        if self.transport is not None:
            self.transport.abort()
