"""The front <-> engine round trip by transport, on the frames embedsvc sends.

    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/transport.py --seconds 3 --rounds 3

What embedsvc uses (``embedsvc.remote.stream``: marked, length-prefixed frames over an
``AF_UNIX`` ``SOCK_STREAM`` socket) against what it used before (pyzmq: DEALER sockets, one
ROUTER in the engine, over ``ipc://``; the ``zmq`` arm needs the bench extra,
``pip install '.[bench]'``), the standard library's ``multiprocessing.connection`` over a Unix
socket and a plain ``AF_UNIX`` ``SOCK_SEQPACKET`` socket, all four carrying the same
``embedsvc.remote.wire`` frames: the front builds a ``Submit`` of one sentence's ids (or 32
sentences'), the engine decodes it and answers a ``Rows`` of 384 float32 per input. Each side
follows the code's own pattern: the front sends, then waits in ticks (poll, then receive);
the engine polls its socket and a wake-up pipe, reads what is there and answers at once (no
model, no batcher: the transport and the frames alone).

The engine is a spawned process; the front is this one. ``depth`` is the round trips kept in
flight by the front (1: one at a time, as a lone request; 32: pipelined, as 32 request
threads' frames crowd the engine's socket). ``idle`` is how many other front connections the
engine holds open meanwhile (every request thread of every front keeps one: 2 fronts x 64
threads is 128). CPU per round trip is each side's own: the front's Python thread
(``time.thread_time``) and its whole process (with ZeroMQ's I/O thread), the engine's loop
thread and its whole process (``/proc/PID/task/*/schedstat``, nanoseconds). The transports
alternate within each round, in reversed order every other round, and every case of a
round runs on one engine process per transport.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import select
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from embedsvc.remote import wire
from embedsvc.remote.stream import Stream, connect

WIDTH = 384
TOKENS = 13  # one 10-word sentence of the benchmarks with its special tokens
TICK_MS = 100  # the front's and the engine's poll tick (remote/client.py, remote/server.py)
STOP = -1  # a Cancel of this id ends the engine
BIGGEST = 1 << 20  # the largest answer read in one receive (32 rows are 49 KB)


def receive_packet(sock: socket.socket, buffer: bytearray) -> bytes:
    """One datagram, read into ``buffer`` (a ``recv(BIGGEST)`` would map and unmap a
    megabyte at each call) and copied out once."""
    size = sock.recv_into(buffer)
    return bytes(memoryview(buffer)[:size])


# -- the engine side, in its own process ----------------------------------------------------


def answer(payload: bytes, rows: bytes) -> bytes | None:
    """The engine's answer to one frame: its ``Answer`` (rows), or None for the stop frame."""
    frame = wire.decode_to_engine(payload)
    if isinstance(frame, wire.Cancel):
        return None
    n = len(frame.lengths) // 4
    return wire.encode(wire.Answer(frame.id, [rows[:n * WIDTH * 4]], ["<f4"], [(n, WIDTH)],
                                   0.0, 0.0))


def zmq_engine(address: str, conns: int, rows: bytes) -> None:
    """remote/server.py's loop: a ROUTER and a wake-up pipe under one poller, frames read
    until none is left (at most 512), each answered on the ROUTER."""
    import zmq  # the bench extra's: embedsvc itself no longer uses it

    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    wake_r, _ = os.pipe()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)
    while True:
        if sock not in dict(poller.poll(TICK_MS)):
            continue
        for _ in range(512):
            try:
                peer, payload = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            out = answer(payload, rows)
            if out is None:
                context.destroy(linger=0)
                return
            sock.send_multipart([peer, out], zmq.NOBLOCK)


def conn_engine(address: str, conns: int, rows: bytes) -> None:
    """The same over ``multiprocessing.connection``: ``wait`` on every front connection
    (and the wake-up pipe), each ready one read and answered."""
    listener = connection.Listener(address, family="AF_UNIX")
    clients = [listener.accept() for _ in range(conns)]
    wake_r, _ = os.pipe()
    while True:
        for ready in connection.wait([*clients, wake_r], TICK_MS / 1000):
            assert isinstance(ready, connection.Connection)
            out = answer(ready.recv_bytes(), rows)
            if out is None:
                return
            ready.send_bytes(out)


def seqpacket_engine(address: str, conns: int, rows: bytes) -> None:
    """The same over ``socket``'s ``SOCK_SEQPACKET`` (one frame a datagram, no length
    prefix), every connection registered once in one ``select.poll``."""
    clients, poller = _accept_all(address, socket.SOCK_SEQPACKET, conns, lambda c: c)
    buffer = bytearray(BIGGEST)
    while True:
        for fd, _ in poller.poll(TICK_MS):
            client = clients[fd]
            out = answer(receive_packet(client, buffer), rows)
            if out is None:
                return
            client.sendall(out)


def stream_engine(address: str, conns: int, rows: bytes) -> None:
    """What embedsvc uses (remote/server.py): ``remote.stream`` connections (marked, length-prefixed
    frames over ``SOCK_STREAM``), every one registered once in one ``select.poll``, each
    read taking every frame that has arrived."""
    clients, poller = _accept_all(address, socket.SOCK_STREAM, conns, Stream)
    while True:
        for fd, _ in poller.poll(TICK_MS):
            stream = clients[fd]
            for payload in stream.read():
                out = answer(payload, rows)
                if out is None:
                    return
                stream.send(out)
            while stream.pending:  # the front reads all it asked for: never long
                select.select([], [stream], [], 1)
                stream.flush()


def _accept_all(address: str, kind: int, conns: int, wrap: Callable[[socket.socket], Any]
                ) -> tuple[dict[int, Any], Any]:
    """Every front connection to ``address`` accepted and wrapped, by descriptor, and one
    ``select.poll`` with each of them and a wake-up pipe registered once."""
    listener = socket.socket(socket.AF_UNIX, kind)
    listener.bind(address)
    listener.listen(conns)
    clients = {}
    poller = select.poll()
    for _ in range(conns):
        client, _ = listener.accept()
        conn = wrap(client)
        clients[conn.fileno()] = conn
        poller.register(conn.fileno(), select.POLLIN)
    wake_r, _ = os.pipe()
    poller.register(wake_r, select.POLLIN)
    return clients, poller


# -- the front side, in this process ----------------------------------------------------------


class Front:
    """One request thread's connection (``send``, ``receive``) and the engine's idle ones."""

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def receive(self) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ZmqFront(Front):
    """remote/client.py: a DEALER with IMMEDIATE, a NOBLOCK send retried until connected,
    a poll of one tick, then the receive."""

    def __init__(self, address: str, idle: int) -> None:
        import zmq

        self.zmq = zmq
        self.context = zmq.Context()
        self.socks = []
        for _ in range(1 + idle):
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(address)
            self.socks.append(sock)
        self.sock = self.socks[0]

    def send(self, data: bytes) -> None:
        while True:
            try:
                self.sock.send(data, self.zmq.NOBLOCK)
                return
            except self.zmq.Again:
                time.sleep(0.001)

    def receive(self) -> bytes:
        while not self.sock.poll(TICK_MS):
            pass
        return bytes(self.sock.recv())

    def close(self) -> None:
        self.context.destroy(linger=0)


class ConnFront(Front):
    def __init__(self, address: str, idle: int) -> None:
        self.conns = [_retry(lambda: connection.Client(address, family="AF_UNIX"))
                      for _ in range(1 + idle)]
        self.conn = self.conns[0]

    def send(self, data: bytes) -> None:
        self.conn.send_bytes(data)

    def receive(self) -> bytes:
        while not self.conn.poll(TICK_MS / 1000):
            pass
        return self.conn.recv_bytes()

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


class SeqpacketFront(Front):
    def __init__(self, address: str, idle: int) -> None:
        self.socks = [_retry(lambda: _seqpacket(address)) for _ in range(1 + idle)]
        self.sock = self.socks[0]
        self.poller = select.poll()
        self.poller.register(self.sock, select.POLLIN)
        self.buffer = bytearray(BIGGEST)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self) -> bytes:
        while not self.poller.poll(TICK_MS):
            pass
        return receive_packet(self.sock, self.buffer)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


class StreamFront(Front):
    def __init__(self, address: str, idle: int) -> None:
        self.streams = [_retry(lambda: connect(address)) for _ in range(1 + idle)]
        self.stream = self.streams[0]
        self.poller = select.poll()
        self.poller.register(self.stream.fileno(), select.POLLIN)
        self.frames: deque[bytes] = deque()

    def send(self, data: bytes) -> None:
        self.stream.send(data)
        while self.stream.pending:
            select.select([], [self.stream], [], 1)
            self.stream.flush()

    def receive(self) -> bytes:
        while not self.frames:
            if self.poller.poll(TICK_MS):
                self.frames.extend(self.stream.read())
        return self.frames.popleft()

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def _seqpacket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(address)
    return sock


def _retry(connect: Callable[[], object]) -> object:
    """Connect once the engine's listener is there."""
    for _ in range(500):
        try:
            return connect()
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.01)
    raise RuntimeError("the engine process did not listen within 5 s")


@dataclass(frozen=True)
class Transport:
    name: str
    engine: Callable[[str, int, bytes], None]
    front: Callable[[str, int], Front]
    address: Callable[[Path], str]


TRANSPORTS = {
    "zmq": Transport("pyzmq DEALER/ROUTER, ipc://", zmq_engine, ZmqFront,
                     lambda d: f"ipc://{d / 'engine.sock'}"),
    "conn": Transport("multiprocessing.connection, AF_UNIX", conn_engine, ConnFront,
                      lambda d: str(d / "engine.sock")),
    "seqpacket": Transport("socket AF_UNIX SOCK_SEQPACKET", seqpacket_engine, SeqpacketFront,
                           lambda d: str(d / "engine.sock")),
    "stream": Transport("remote.stream: AF_UNIX SOCK_STREAM, marked frames", stream_engine,
                        StreamFront, lambda d: str(d / "engine.sock")),
}


# -- measuring ------------------------------------------------------------------------------


@dataclass
class Figure:
    transport: str
    inputs: int
    depth: int
    idle: int
    trips: int
    seconds: float
    front_thread_s: float
    front_process_s: float
    engine_thread_s: float
    engine_process_s: float

    def per_trip_us(self, seconds: float) -> float:
        return seconds / self.trips * 1e6


def on_cpu_s(pid: int, thread: int | None = None) -> float:
    """CPU seconds of ``pid``'s threads (or only ``thread``), from the scheduler's own
    nanosecond counts."""
    tasks = [thread] if thread is not None else [int(t.name) for t in
                                                 Path(f"/proc/{pid}/task").iterdir()]
    total = 0
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total / 1e9


def submit(request_id: int, inputs: int) -> bytes:
    """A front's frame for ``inputs`` sentences, built as ``RemotePort.submit`` builds it."""
    ids = [[101, *range(2000 + i, 2000 + i + TOKENS - 2), 102] for i in range(inputs)]
    frame = wire.Submit(request_id, "embed", *wire.pack_ids(ids), timeout=30.0, front=1)
    return wire.encode(frame)


def measure(front: Front, engine_pid: int, name: str, inputs: int, depth: int, idle: int,
            seconds: float) -> Figure:
    """Round trips for ``seconds``, ``depth`` in flight, after a third of that unmeasured."""
    ids = itertools.count(1)
    for _ in range(depth):
        front.send(submit(next(ids), inputs))
    state = {}

    def mark() -> None:
        state.update(at=time.perf_counter(), thread=time.thread_time(),
                     process=time.process_time(), engine_thread=on_cpu_s(engine_pid, engine_pid),
                     engine=on_cpu_s(engine_pid), trips=trips)

    trips, until, marked = 0, time.perf_counter() + seconds / 3, False
    while True:
        frame = wire.decode_to_front(front.receive())
        assert isinstance(frame, wire.Answer) and frame.shapes == [(inputs, WIDTH)], frame
        trips += 1
        front.send(submit(next(ids), inputs))
        if trips % 64 == 0 and time.perf_counter() >= until:
            if marked:
                break
            mark()
            before, marked = dict(state), True
            until = time.perf_counter() + seconds
    mark()
    for _ in range(depth):  # what is still in flight
        front.receive()
    return Figure(name, inputs, depth, idle, state["trips"] - before["trips"],
                  state["at"] - before["at"], state["thread"] - before["thread"],
                  state["process"] - before["process"],
                  state["engine_thread"] - before["engine_thread"],
                  state["engine"] - before["engine"])


def one_engine(key: str, cases: list[tuple[int, int]], idle: int, seconds: float
               ) -> list[Figure]:
    """Every case (inputs, depth) on one engine process of transport ``key``."""
    transport = TRANSPORTS[key]
    rows = np.random.default_rng(0).standard_normal((32, WIDTH)).astype("<f4").tobytes()
    with tempfile.TemporaryDirectory(prefix="transport-") as tmp:
        address = transport.address(Path(tmp))
        spawn = multiprocessing.get_context("spawn")
        proc = spawn.Process(target=transport.engine, args=(address, 1 + idle, rows),
                             daemon=True)
        proc.start()
        assert proc.pid is not None
        front = transport.front(address, idle)
        try:
            return [measure(front, proc.pid, key, inputs, depth, idle, seconds)
                    for inputs, depth in cases]
        finally:
            front.send(wire.encode(wire.Cancel(STOP)))
            proc.join(5)
            if proc.is_alive():
                proc.kill()
            front.close()


def table(figures: list[Figure]) -> str:
    """Per transport and case: medians over the rounds of the rate and each side's CPU."""
    groups: dict[tuple[str, int, int, int], list[Figure]] = {}
    for f in figures:
        groups.setdefault((f.transport, f.inputs, f.depth, f.idle), []).append(f)
    lines = ["| transport | inputs | in flight | idle conns | round trips/s | front thread "
             "us/rt | front process us/rt | engine thread us/rt | engine process us/rt |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (key, inputs, depth, idle), runs in sorted(groups.items(),
                                                   key=lambda kv: (kv[0][1:], kv[0][0])):
        def mid(pick: Callable[[Figure], float], runs: list[Figure] = runs) -> float:
            return median(pick(f) for f in runs)

        lines.append(
            f"| {TRANSPORTS[key].name} | {inputs} | {depth} | {idle} | "
            f"{mid(lambda f: f.trips / f.seconds):,.0f} | "
            f"{mid(lambda f: f.per_trip_us(f.front_thread_s)):.1f} | "
            f"{mid(lambda f: f.per_trip_us(f.front_process_s)):.1f} | "
            f"{mid(lambda f: f.per_trip_us(f.engine_thread_s)):.1f} | "
            f"{mid(lambda f: f.per_trip_us(f.engine_process_s)):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(TRANSPORTS), help="comma-separated: "
                        + ", ".join(TRANSPORTS))
    parser.add_argument("--idle", type=int, default=0, help="idle connections to the engine")
    parser.add_argument("--inputs", default="1,32", help="inputs per frame, comma-separated")
    parser.add_argument("--depths", default="1,32", help="round trips in flight")
    args = parser.parse_args(argv)
    keys = args.only.split(",")
    cases = [(int(i), int(d)) for i in args.inputs.split(",") for d in args.depths.split(",")]
    figures: list[Figure] = []
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            got = one_engine(key, cases, args.idle, args.seconds)
            for f in got:
                print(f"round {r + 1} {key:9s} inputs {f.inputs:2d} depth {f.depth:2d}: "
                      f"{f.trips / f.seconds:8,.0f}/s front "
                      f"{f.per_trip_us(f.front_process_s):5.1f} us engine "
                      f"{f.per_trip_us(f.engine_process_s):5.1f} us", flush=True)
            figures += got
    print("\n" + table(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
