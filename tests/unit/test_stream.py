"""remote/stream.py: the frames between the engine and its fronts, over a real socket pair."""

from __future__ import annotations

import errno
import select
import socket

from embedsvc.remote.stream import Stream


def _pair(limit: int | None = None) -> tuple[Stream, Stream]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Stream(a), Stream(b, limit)


def _read_all(stream: Stream, count: int) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < count:
        assert select.select([stream], [], [], 5)[0], f"{len(got)} of {count} frames"
        got.extend(bytes(f) for f in stream.read())
    return got


def test_frames_cut_anywhere_by_the_socket_come_out_whole_and_in_order():
    """Bytes arrive as the kernel hands them: a read may end inside a length or a frame."""
    frames = [b"", b"x", b"y" * 3, bytes(range(256)) * 40, b"z" * 70_000]
    wire = b"".join(b"\xe5" + len(f).to_bytes(4, "little") + f for f in frames)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader = Stream(b)
    got: list[bytes] = []
    try:
        for step in (1, 3, 7, 4096):
            for i in range(0, len(wire), step):
                a.sendall(wire[i:i + step])
                select.select([reader], [], [], 5)
                got.extend(bytes(f) for f in reader.read())
            got.extend(_read_all(reader, len(frames) - len(got)) if len(got) < len(frames)
                       else [])
            assert got == frames, step
            got.clear()
    finally:
        a.close()
        reader.close()


def test_a_frame_past_the_limit_is_refused_once_its_length_is_read():
    """The engine closes such a sender's connection before taking the frame's bytes in;
    the frames before it still count."""
    writer, reader = _pair(limit=1000)
    try:
        writer.send(b"a" * 1000)  # at the limit: taken
        assert _read_all(reader, 1) == [b"a" * 1000]
        writer.send(b"before")
        writer.sock.sendall(b"\xe5" + (1001).to_bytes(4, "little"))  # the length alone
        assert _read_all(reader, 1) == [b"before"]
        assert reader.closed and reader.broken == "a frame of 1001 bytes (at most 1000)"
    finally:
        writer.close()
        reader.close()


def test_bytes_that_are_not_a_frame_break_the_connection_instead_of_stalling_it():
    """A reader that lost the frames' bounds would read a length from the middle of a frame
    and wait for bytes that never come (a front's requests to their deadlines); the mark
    byte says so at the first frame that lacks it."""
    writer, reader = _pair()
    try:
        writer.send(b"whole")
        writer.sock.sendall(b"POST /embed HTTP/1.1\r\n")
        assert _read_all(reader, 1) == [b"whole"]
        assert reader.closed and reader.broken is not None and "mark" in reader.broken
    finally:
        writer.close()
        reader.close()


def test_what_a_slow_reader_cannot_take_yet_waits_and_goes_in_order():
    """A peer that does not read: the sender never blocks, keeps the rest, and sends it
    when the socket can take it, after what went before and before what comes after."""
    writer, reader = _pair()
    frames = [bytes([i % 251]) * 50_000 for i in range(40)]  # 2 MB: past the socket's buffer
    try:
        for frame in frames:
            writer.send(frame)
        assert writer.pending and 0 < writer.waiting < 2_000_000 + 5 * len(frames)
        got: list[bytes] = []
        while len(got) < len(frames):
            assert writer.waiting == sum(map(len, writer._out))  # the bytes kept, counted
            writable = [writer] if writer.pending else []
            readable, ready, _ = select.select([reader], writable, [], 5)
            assert readable or ready, f"{len(got)} of {len(frames)} frames"
            if ready:
                writer.flush()
            got.extend(bytes(f) for f in reader.read())
        assert got == frames and not writer.pending and writer.waiting == 0
    finally:
        writer.close()
        reader.close()


def test_the_end_of_the_stream_closes_it_after_what_came_before():
    writer, reader = _pair()
    writer.send(b"last words")
    writer.close()
    assert _read_all(reader, 1) == [b"last words"]
    select.select([reader], [], [], 5)
    assert reader.read() == [] and reader.closed
    reader.send(b"to nobody")  # dropped, never kept
    assert not reader.pending
    reader.close()


def test_a_frame_read_keeps_its_bytes_after_the_next_read():
    """A read takes its bytes into a buffer the stream keeps and reuses: each frame handed
    out is a copy, unchanged by the reads after it (a frame whole in one read, and one put
    together over several)."""
    writer, reader = _pair()
    try:
        writer.send(b"first" * 10)
        first = reader.read() if select.select([reader], [], [], 5)[0] else []
        writer.sock.sendall(b"\xe5" + (6).to_bytes(4, "little") + b"sec")
        assert select.select([reader], [], [], 5)[0] and reader.read() == []
        writer.sock.sendall(b"ond")
        second = reader.read() if select.select([reader], [], [], 5)[0] else []
        writer.send(b"x" * 100)
        assert _read_all(reader, 1) == [b"x" * 100]
        assert first == [b"first" * 10] and second == [b"second"]
    finally:
        writer.close()
        reader.close()


def test_a_failed_send_leaves_what_the_peer_sent_before_to_be_read():
    """A peer that sent its last frames and closed (a stopping engine, its answers out):
    a send that fails on it meanwhile (the front's ping, another request) must not end the
    reading. It did (``closed`` at once), and the front's reader stopped before those
    frames: their requests got 503 engine_gone for answers that had come. The stream now
    ends at the end of what came; the failed send and later ones go nowhere."""
    front, engine = _pair()
    for i in range(3):
        engine.send(b"answer %d" % i)
    engine.close()
    front.send(b"ping")  # EPIPE: the peer has gone
    front.send(b"and another")
    assert not front.closed and not front.pending
    assert _read_all(front, 3) == [b"answer 0", b"answer 1", b"answer 2"]
    assert select.select([front], [], [], 5)[0]
    assert front.read() == [] and front.closed


class _NoBufferSpace:
    """A socket whose sends fail as a full kernel buffer pool does (ENOBUFS: routine on
    macOS for local sockets, under memory pressure on Linux) while the peer is there."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, data: bytes) -> int:
        raise OSError(errno.ENOBUFS, "No buffer space available")

    sendmsg = send

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def test_a_send_that_fails_with_the_peer_still_there_ends_the_stream():
    """Only a peer that has gone leaves the stream to be read to its end (above). A send
    that fails otherwise did the same, and no end ever came: the link and the engine each
    kept a connection on which nothing went out, the front answered 503 ``loading`` until
    it was restarted. The stream now ends, so that its owner closes it and connects again."""
    front, engine = _pair()
    try:
        front.sock = _NoBufferSpace(front.sock)  # type: ignore[assignment]
        front.send(b"ping")
        assert front.closed and not front.unsent and not front.pending
    finally:
        front.close()
        engine.close()


def test_a_flush_that_fails_with_the_peer_still_there_ends_the_stream():
    front, engine = _pair()
    try:
        while not front.pending:  # the peer reads nothing: the rest waits to be flushed
            front.send(b"x" * 65536)
        front.sock = _NoBufferSpace(front.sock)  # type: ignore[assignment]
        front.flush()
        assert front.closed and not front.pending and front.waiting == 0
    finally:
        front.close()
        engine.close()
