"""Frames over a Unix stream socket: the engine's connections to its fronts, and a front's
one connection to the engine.

A frame is a mark byte, its length (4 bytes, little-endian), then its bytes
(``wire.encode``'s MessagePack). One ``recv`` takes every frame that has arrived, however
many (a front's burst of requests, an engine's answers of a batch); one ``send`` puts a
frame out, and what the peer's buffer cannot take yet waits here until the socket is
writable again (``flush``). No thread of its own: the thread that owns the socket (the
engine's loop, a front's link) polls it with its other work, so a frame costs one system
call each way and no wake-up of a third thread.

Both ends are processes of the same install, run by the same user, through a socket in a
private directory (place.py). The reader still checks what it reads: a length past its
``limit`` (the engine's: the largest frame a request can make), or no mark where a frame
begins (bytes that are not frames, or a reader that lost their bounds), ends the
connection at once (``broken``), instead of a wait for bytes that never come; what a frame
holds is ``wire``'s to check.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections import deque

_HEADER = struct.Struct("<BI")
_HEAD = _HEADER.size
_MARK = 0xE5
# One read: a burst of a few thousand small frames, or part of a large one. Read into a
# buffer each stream keeps: a ``recv`` of this size allocated a buffer past the C library's
# mmap threshold at every read, an mmap and an munmap each time (17 us against 4 us a read,
# most reads carrying a few hundred bytes).
_RECV_BYTES = 1 << 18
# A send that fails with one of these: the peer has closed its end, which the reads will see
_PEER_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN})


class Stream:
    """One end of a connection, non-blocking. ``closed``: the stream has ended (read to its
    end, or the connection failed on a read), or what came is not frames (``broken`` says
    why: a length past ``limit``, no mark where a frame begins), and the connection cannot
    be read on. A send that fails because the peer has gone drops what waits to go and
    every later send (``unsent``), but leaves the stream open: what the peer sent before it
    went is still read, and its end closes the stream. A send that fails otherwise (no
    buffer space, no memory) closes it too, as a failed read does: the peer is still there
    and no end would come, so its owner closes the connection and connects again, where a
    stream that only stopped sending left both ends waiting on each other for good."""

    __slots__ = ("sock", "limit", "closed", "broken", "unsent", "waiting", "_in", "_out",
                 "_fd", "_buf", "_view")

    _IOV = 64  # buffers handed to one ``sendmsg`` at most

    def __init__(self, sock: socket.socket, limit: int | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.limit = limit
        self.closed = False
        self.broken: str | None = None
        self.unsent = False  # a send failed: the peer takes nothing more
        self._in = bytearray()  # the start of a frame not whole yet
        self._buf = bytearray(_RECV_BYTES)  # what one read takes in, before its frames
        self._view = memoryview(self._buf)
        # what the peer could not take yet: frames, the first perhaps begun (each sent
        # without copying what waits behind it)
        self._out: deque[memoryview] = deque()
        self.waiting = 0  # the bytes in ``_out``
        self._fd = sock.fileno()

    def fileno(self) -> int:
        return self._fd

    @property
    def pending(self) -> bool:
        """Bytes wait to go out: poll for the socket being writable, then ``flush``."""
        return bool(self._out)

    def read(self) -> list[bytes | bytearray]:
        """Every whole frame that has arrived (one ``recv``: poll again for the rest); sets
        ``closed`` at the end of the stream, and ``broken`` too where what came is not a
        frame (the frames before it are returned)."""
        try:
            got = self.sock.recv_into(self._buf)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            self.closed = True
            return []
        if not got:
            self.closed = True
            return []
        chunk = self._view[:got]
        if self._in:  # a frame begun in an earlier read (a large one takes many)
            self._in += chunk
            data: memoryview | bytearray = self._in
        else:
            data = chunk
        frames: list[bytes | bytearray] = []
        pos, end = 0, len(data)
        while end - pos >= _HEAD:
            mark, size = _HEADER.unpack_from(data, pos)
            if mark != _MARK:
                self.broken = f"no frame mark where a frame begins (byte {mark:#x})"
            elif self.limit is not None and size > self.limit:
                self.broken = f"a frame of {size} bytes (at most {self.limit})"
            if self.broken is not None:
                self.closed = True
                self._in.clear()
                return frames
            stop = pos + _HEAD + size
            if stop > end:
                break
            # a copy: the next read reuses the buffer (from ``_in``, a bytearray already)
            frames.append(data[pos + _HEAD:stop] if data is self._in
                          else bytes(data[pos + _HEAD:stop]))
            pos = stop
        if data is self._in:
            del self._in[:pos]
        elif pos < end:
            self._in += data[pos:]
        return frames

    def send(self, data: bytes) -> None:
        """``data`` as one frame: sent now as far as the socket takes it, the rest kept."""
        if self.closed or self.unsent:  # the peer has gone: nobody reads it
            return
        data = _HEADER.pack(_MARK, len(data)) + data
        if self._out:
            self._out.append(memoryview(data))
            self.waiting += len(data)
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._failed_out(exc)
            return
        if sent < len(data):
            self._out.append(memoryview(data)[sent:])
            self.waiting += len(data) - sent

    def flush(self) -> None:
        """Send what waits, as far as the socket takes it."""
        out = self._out
        while out and not self.closed:
            try:
                sent = self.sock.sendmsg([out[i] for i in range(min(len(out), self._IOV))])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._failed_out(exc)
                return
            self.waiting -= sent
            while sent and sent >= len(out[0]):
                sent -= len(out.popleft())
            if sent:
                out[0] = out[0][sent:]

    def _failed_out(self, exc: OSError) -> None:
        """A send failed: nothing more goes out; the stream is read on to the peer's end
        where the peer has gone, and ends now otherwise."""
        self._out.clear()
        self.waiting = 0
        if exc.errno in _PEER_GONE:
            self.unsent = True
        else:
            self.closed = True

    def close(self) -> None:
        self.closed = True
        self._out.clear()
        self.waiting = 0
        self.sock.close()


def socket_path(address: str) -> str:
    """The filesystem path of an engine address (``ipc://PATH``, place.py's)."""
    return address.removeprefix("ipc://")


def connect(address: str, limit: int | None = None) -> Stream:
    """A connection to the engine at ``address``; ``OSError`` when none listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # a full backlog fails at once (EAGAIN) on a Unix socket; this bounds any other wait
    sock.settimeout(1.0)
    try:
        sock.connect(socket_path(address))
    except OSError:
        sock.close()
        raise
    return Stream(sock, limit)
