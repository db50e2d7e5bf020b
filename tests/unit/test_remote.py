"""remote/: the engine's loop and a front's port over a real ipc:// socket, in this process,
on the fake encoder: answers equal the in-process engine's, errors come back as their own
class, and a front imports nothing of PyTorch (so it never touches a device)."""

from __future__ import annotations

import collections
import contextlib
import errno
import gc
import os
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from embedsvc.errors import (
    DeadlineExceeded,
    EngineGone,
    InvalidRequest,
    Overloaded,
    QuotaExceeded,
    Unavailable,
)
from embedsvc.metrics import Metrics, thread_waiting_seconds
from embedsvc.model.fake import FakeEncoder
from embedsvc.model.text import describe, text_spec
from embedsvc.remote import client as client_module
from embedsvc.remote import server as server_module
from embedsvc.remote import wake as wake_module
from embedsvc.remote import wire
from embedsvc.remote.client import embedded, error_of
from embedsvc.remote.place import engine_address, private_dir
from embedsvc.remote.server import EngineServer, answer_frame, failed
from embedsvc.service import Service
from embedsvc.settings import Settings
from embedsvc.work import EMBED, SPARSE, TOKENS, Embedded, Work

from ..frames import FrameSocket, answers_in
from ..waiting import soon


@pytest.fixture
def pair(served):
    """(the engine's service, a front's service) around one fake encoder."""
    return served[:3]


@pytest.fixture
def served(tmp_path, registry):
    """(the engine's service, a front's service, the fake encoder, the engine's loop)."""
    with serving(tmp_path, registry) as (engine, front, encoder, server, _):
        yield engine, front, encoder, server


@contextlib.contextmanager
def serving(tmp_path, registry, encoder=None):
    """``served``'s four, and the event that ends the engine's loop once nothing is in it."""
    encoder = encoder or FakeEncoder(dimension=6, max_input_tokens=16)
    engine = Service(Settings(), encoder=encoder, metrics=Metrics(registry))
    engine.start(background=False)
    runner = engine.runner
    address = engine_address(private_dir(tmp_path / "run"))
    server = EngineServer(runner, address, state=lambda: engine.state, metrics=engine.metrics,
                          card={"info": describe(runner.info), "text": text_spec(encoder)})
    stop = threading.Event()
    loop = threading.Thread(target=server.run, args=(stop,), name="test-engine-loop")
    loop.start()
    front = Service(Settings(), engine_address=address)
    front.start(background=True)
    try:
        assert front.ready(10) is not None
        yield engine, front, encoder, server, stop
    finally:
        front.drain(2)
        engine.drain(2)
        stop.set()
        loop.join(5)


def test_rows_through_the_engine_equal_the_encoders(pair):
    engine, front, encoder = pair
    texts = ["hello world", "a second text", "x " * 40]
    out = front.ready().run(Work(EMBED, texts, deadline=time.monotonic() + 5))
    want = np.stack([encoder.expected(t) for t in texts[:2]])
    np.testing.assert_allclose(out.vectors[:2], want, rtol=1e-6)
    assert out.tokens == sum(map(len, front.ready().tokens(texts)))
    tokens = front.ready().run(Work(TOKENS, ["a b c"], deadline=time.monotonic() + 5))
    assert [t.shape for t in tokens.token_vectors] == [(5, 6)]
    assert front.engine_pid == engine.pid and front.state == "ready"


def _signal_pending(server: EngineServer) -> bool:
    """Whether the loop's next poll will see a wake-up (a byte in its pipe)."""
    return bool(select.select([server._wake], [], [], 0)[0])


def test_a_wake_up_during_the_drain_leaves_the_next_one_written(tmp_path, registry, monkeypatch):
    """A batcher thread that signals while the loop drains its pipe must not leave the flag
    set with the pipe empty: then no later signal writes, and every answer waits for the
    loop's tick."""
    encoder = FakeEncoder(dimension=4)
    engine = Service(Settings(), encoder=encoder, metrics=Metrics(registry))
    engine.start(background=False)
    server = EngineServer(engine.runner, engine_address(private_dir(tmp_path / "run")),
                          card={}, state=lambda: "ready", metrics=engine.metrics)
    try:
        drain = wake_module.drain

        def drain_with_a_signal_in_between(fd: int) -> None:
            server._wake.wake()  # the batcher's thread, between the loop's wake-up and its drain
            drain(fd)

        server._wake.wake()  # a finished job: the byte the loop's poll sees
        monkeypatch.setattr(wake_module, "drain", drain_with_a_signal_in_between)
        server._wake.woken()
        monkeypatch.setattr(wake_module, "drain", drain)
        server._wake.wake()  # the next finished job, after the loop read the deques
        assert _signal_pending(server), "a signal after the wake-up wrote nothing"
    finally:
        server.close()
        engine.drain(2)


def test_answers_keep_waking_the_loop_after_a_signal_during_its_drain(served, monkeypatch):
    engine, front, encoder, server = served
    drain, interleaved = wake_module.drain, []

    def drain_with_a_signal_in_between(fd: int) -> None:
        if not interleaved:
            interleaved.append(fd)
            server._wake.wake()
        drain(fd)

    monkeypatch.setattr(wake_module, "drain", drain_with_a_signal_in_between)
    for text in ("one", "two", "three"):
        out = front.ready().run(Work(EMBED, [text], deadline=time.monotonic() + 5))
        np.testing.assert_allclose(out.vectors[0], encoder.expected(text), rtol=1e-6)
    assert interleaved
    # Idle now: a flag still set must have its byte in the pipe, or no signal will wake it.
    assert not server._wake.pending or _signal_pending(server)


def test_the_engine_reports_its_loops_busy_time_and_its_cpu(served):
    engine, front, encoder, server = served
    read = engine.metrics.registry.get_sample_value
    busy = read("embedsvc_engine_loop_busy_seconds_total")
    for text in ("one", "two", "three"):
        front.ready().run(Work(EMBED, [text], deadline=time.monotonic() + 5))
    assert read("embedsvc_engine_loop_busy_seconds_total") > busy
    assert read("embedsvc_engine_cpu_seconds_total") > 0
    # the loop's own thread's wait for a CPU, as its schedstat tells it (Linux)
    waited = read("embedsvc_engine_loop_waiting_seconds_total")
    assert waited is not None and waited >= 0
    assert waited == pytest.approx(thread_waiting_seconds(server._loop_tid), abs=0.05)
    assert server._loop_tid != threading.get_native_id()  # the loop's, not this thread's
    # In a process without an engine loop (a front, or one process) there is no sample.
    assert front.metrics.registry.get_sample_value("embedsvc_engine_cpu_seconds_total") is None


def test_the_batch_size_comes_back_from_the_engine_as_in_one_process(pair):
    engine, front, encoder = pair
    texts = ["one", "two", "three"]
    for service in (engine, front):
        out = service.ready().run(Work(EMBED, texts, deadline=time.monotonic() + 5))
        assert out.batch_size == 3
        tokens = service.ready().run(Work(TOKENS, texts, deadline=time.monotonic() + 5))
        assert tokens.batch_size == 3  # /embed_all's largest slice


@pytest.mark.parametrize("kind", [EMBED, SPARSE, TOKENS])
def test_every_answer_frame_carries_the_batch_size(kind):
    out = Embedded(np.ones((2, 3), np.float32), 0, queue_s=0.5, inference_s=0.25, batch_size=7,
                   sparse=[(np.array([1]), np.array([0.5], np.float32))] * 2,
                   token_vectors=[np.ones((2, 3), np.float32)] * 2)
    back = embedded(wire.decode_to_front(wire.encode(answer_frame(9, kind, out))), kind)
    assert (back.batch_size, back.queue_s, back.inference_s) == (7, 0.5, 0.25)


def test_an_error_of_the_model_side_is_raised_in_the_front_as_its_own_class():
    err = error_of(failed(3, Overloaded("busy", retry_after_s=4)))
    assert isinstance(err, Overloaded) and err.headers == {"Retry-After": "4"}
    err = error_of(failed(3, InvalidRequest("bad", param="input", code="x")))
    assert type(err) is InvalidRequest and (err.param, err.code) == ("input", "x")
    # Classes that share a status, type and reason stay themselves: a quota refusal is
    # not a plain Overloaded, a 404 not a plain 400 of the same family.
    err = error_of(failed(3, QuotaExceeded("over", wait_s=2.5, spent=True)))
    assert type(err) is QuotaExceeded and err.code == "quota_exceeded"
    assert err.empty_s == 2.5 and err.headers == {"Retry-After": "3"}
    err = error_of(failed(3, DeadlineExceeded("late", code="timeout")))
    assert type(err) is DeadlineExceeded


def test_ids_the_model_cannot_take_are_refused_in_the_engine(pair, tmp_path):
    engine, front, _ = pair
    sock = FrameSocket(front.engine_address)
    try:
        # past the vocabulary, the limit; an input of no ids (a front always sends at least
        # one: the API refuses an empty input, and the template wraps each), alone and
        # beside one that has some
        for ids in ([[1, 5000, 2]], [[1, -3, 2]], [[1, 7, 2], [1, -1]], [[1, *range(3, 30), 2]],
                    [[]], [[1, 7, 2], []]):
            sock.send(wire.encode(wire.Submit(1, "embed", *wire.pack_ids(ids))))
            answer = wire.decode_to_front(sock.recv())
            assert isinstance(answer, wire.Failed) and answer.status == 400, answer
            assert answer.code == "invalid_frame", answer
    finally:
        sock.close()


@pytest.mark.parametrize(("flat", "lengths", "why"), [
    ([1, -3, 2], [3], "outside the vocabulary"),
    ([1, 2, 3], [-1, 4], "do not add up"),  # adds up, signed
    ([1, 2, 3], [4], "do not add up"),
    ([1, *range(3, 30), 2], [29], "longer than the model's limit"),
    ([1, 2, 3], [1, 1, 1, 1], "do not add up"),
])
def test_ids_that_do_not_add_up_or_fit_the_model_are_refused_as_they_are_read(flat, lengths,
                                                                               why):
    with pytest.raises(ValueError, match=why):
        wire.unpack_ids(struct.pack(f"<{len(flat)}i", *flat),
                        struct.pack(f"<{len(lengths)}i", *lengths), vocab=100, longest=16)
    ok = wire.unpack_ids(struct.pack("<5i", 1, 7, 2, 99, 0), struct.pack("<2i", 3, 2),
                         vocab=100, longest=16)
    assert ok == [[1, 7, 2], [99, 0]]


def _swapped(array: np.ndarray) -> np.ndarray:
    """``array``'s values in the other byte order than this host's (the wire's little-endian
    arrays, as a big-endian host reads them)."""
    return array.astype(array.dtype.newbyteorder("S"))


def test_an_answers_arrays_keep_their_values_and_kinds_whatever_their_byte_order():
    vectors = np.array([[1.5, -2.25, 3.0]], dtype=np.float32)
    sparse = [np.array([7, 9], dtype=np.int32), np.array([0.5, 0.25], dtype=np.float32)]
    for arrays in ([vectors], [_swapped(vectors)], sparse, [_swapped(a) for a in sparse]):
        frame = wire.answer(3, arrays, 0.0, 0.0, 1)
        got = wire.arrays(wire.decode_to_front(wire.encode(frame)))
        assert [a.dtype for a in got] == [np.dtype(a.dtype.kind + "4") for a in arrays]
        for a, b in zip(got, arrays, strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_wires_little_endian_arrays_are_read_in_the_hosts_order():
    # a big-endian host reads the wire's arrays as this host reads swapped ones: in its own
    # order they pass the checks that want float32 (``Kind.unpack``) and keep their values
    wire_order = _swapped(np.array([[1.5, -2.25]], dtype=np.float32))
    assert wire_order.dtype != np.float32
    native = wire.host_order(wire_order)
    assert native.dtype == np.float32
    np.testing.assert_array_equal(native, [[1.5, -2.25]])
    ids = np.array([4, 5], dtype=np.int32)
    assert wire.host_order(_swapped(ids)).dtype == np.int32
    same = np.array([1.0], dtype=np.float32)
    assert wire.host_order(same) is same  # the host's order already: no copy


@contextlib.contextmanager
def _raw(front):
    """A raw connection to the engine's socket, as a front's."""
    sock = FrameSocket(front.engine_address)
    try:
        yield sock
    finally:
        sock.close()


def _burst(front, texts) -> bytes:
    """One ``Submits`` frame of an embedding request a text, numbered from 1."""
    tokenizer = front.ready()
    return wire.encode(wire.Submits([
        wire.Submit(i + 1, "embed", *wire.pack_ids(tokenizer.tokens([t])), timeout=5.0)
        for i, t in enumerate(texts)]))


def test_an_answer_waits_for_a_front_that_reads_late_and_is_never_dropped(pair):
    """A front whose thread is held up (a large body parsing holds the interpreter) reads
    late: the frames for it wait in the engine's socket. ZeroMQ's ROUTER drops what passes
    its high-water mark (1,000 frames each side) without a word, and an answer dropped left
    its request to a 504 two seconds past its deadline; the engine's frames for a front are
    bounded by what admission lets in, so they need no mark. Here 2,500 pongs are not read,
    then a request's answer must still come."""
    engine, front, _ = pair
    with _raw(front) as sock:
        for _ in range(2500):
            sock.send(wire.encode(wire.Ping(0)))
        sock.send(_burst(front, ["read late"]))
        time.sleep(1.0)  # the engine has answered all of it, into the socket
        frames = []
        while sock.poll(2000):
            frames.append(wire.decode_to_front(sock.recv()))
    assert sum(isinstance(f, wire.Pong) for f in frames) == 2500
    assert [a.id for f in frames for a in answers_in(f) if isinstance(a, wire.Row)] == [1]


def test_a_peer_that_pings_and_never_reads_grows_the_engine_no_further_than_its_bound(
        served, monkeypatch):
    """Pongs are the one frame a peer can have the engine queue for it without bound (its
    answers are bounded by admission): past ``_PONG_BACKLOG`` bytes waiting for a peer, a
    ping gets one only once a ``_PONG_EVERY_S`` (a front slow to read still hears which of
    its requests the engine holds). Unbounded, a same-user peer that pinged and never read
    grew the engine from 90 to 908 MB in 20 s. The peer's answer still comes, after the
    pongs queued."""
    engine, front, _, server = served
    monkeypatch.setattr(server_module, "_PONG_BACKLOG", 64 << 10)
    before = set(server._streams)
    most = 0
    with _raw(front) as sock:
        for i in range(20_000):
            sock.send(wire.encode(wire.Ping(0)))
            if i % 500 == 0:
                peers = set(server._streams) - before
                most = max([most, *(server._streams[p].waiting for p in peers
                                    if p in server._streams)])
        sock.send(_burst(front, ["read at last"]))
        time.sleep(1.0)  # the engine has taken every ping
        (peer,) = set(server._streams) - before
        most = max(most, server._streams[peer].waiting)
        frames = []
        while sock.poll(2000):
            frames.append(wire.decode_to_front(sock.recv()))
    pongs = sum(isinstance(f, wire.Pong) for f in frames)
    assert 0 < most <= (64 << 10) + 4096, most  # the bound, a pong a second and an answer
    assert 0 < pongs < 20_000, pongs
    assert [a.id for f in frames for a in answers_in(f) if isinstance(a, wire.Row)] == [1]


def test_a_burst_of_submits_in_one_frame_gets_each_request_its_own_rows(pair):
    """``Submits`` carries several requests; each answer, in whichever frames the engine
    sends them, holds its own request's rows."""
    engine, front, encoder = pair
    texts = [f"text number {i}" for i in range(7)]
    with _raw(front) as sock:
        sock.send(_burst(front, texts))
        got: dict[int, wire.Row] = {}
        while len(got) < len(texts):
            assert sock.poll(5000), f"answers for {sorted(got)} only"
            for item in answers_in(wire.decode_to_front(sock.recv())):
                assert isinstance(item, wire.Row), item  # one-input: a row of a ``Rows``
                assert item.id not in got, f"{item.id} answered twice"
                got[item.id] = item
        for i, text in enumerate(texts):
            row = embedded(got[i + 1], EMBED).vectors[0]  # the model's rows, unnormalised
            np.testing.assert_allclose(row / np.linalg.norm(row), encoder.expected(text),
                                       rtol=1e-6)


def test_the_answers_of_one_batch_reach_their_front_in_one_frame(pair):
    """A burst of one front's one-input requests computed in one batch comes back as one
    ``Rows`` frame (one send, one wake-up of the front's reader, one copy of the batch's
    rows), each request with its own row; they came back as one ``Answer`` frame each, then
    as an ``Answer`` each in one ``Answers``."""
    engine, front, encoder = pair
    batcher = engine.runner.batcher
    texts = [f"text number {i}" for i in range(7)]
    with _raw(front) as sock:
        batcher.device_lock.acquire()  # held: the burst waits, queued, for the device
        try:
            sock.send(_burst(front, texts))
            deadline = time.monotonic() + 5
            while len(batcher._current) < len(texts):  # one batch, taken, waiting
                assert time.monotonic() < deadline, "the burst did not form one batch"
                time.sleep(0.005)
        finally:
            batcher.device_lock.release()
        assert sock.poll(5000), "no answer"
        frame = wire.decode_to_front(sock.recv())
        assert isinstance(frame, wire.Rows), type(frame).__name__
        assert sorted(frame.ids) == list(range(1, len(texts) + 1))
        assert frame.batch_size == len(texts) and len(frame.queue_s) == len(texts)
        for item in answers_in(frame):
            answer = embedded(item, EMBED)
            row = answer.vectors[0]  # the model's rows, unnormalised
            np.testing.assert_allclose(row / np.linalg.norm(row),
                                       encoder.expected(texts[item.id - 1]), rtol=1e-6)
            assert answer.vectors.shape == (1, encoder.info.dimension)
            assert answer.batch_size == len(texts)
        assert not sock.poll(100), "an answer came again in a frame of its own"


def test_a_submit_that_asks_its_row_at_unit_length_gets_it_normalised_with_its_batch(pair):
    """``Submit.unit``: where two or more one-input requests of a batch ask, the engine
    answers each its row normalised with the batch (``Batcher.unit``) and says so
    (``Answer.unit``); a lone one, or one that does not ask (no normalising, or a cut to
    ``dimensions``), gets the raw row, which its front normalises. Through a front the
    answers are the ones one process gives, to the bit."""
    from embedsvc.service import local_client
    from embedsvc.work_kinds import l2_normalize

    engine, front, encoder = pair
    tokens = front.ready().tokens(["hello world"])
    raw = encoder.vector(tokens[0])[None, :]

    def submit(request_id: int, unit: bool) -> wire.Submit:
        return wire.Submit(request_id, "embed", *wire.pack_ids(tokens), timeout=5.0, unit=unit)

    with _raw(front) as sock:
        for frame, asked in ((wire.Submits([submit(1, True), submit(2, True)]), (1, 2)),
                             (submit(3, True), ()), (submit(4, False), ())):
            sock.send(wire.encode(frame))
            answers: list = []
            while len(answers) < (2 if asked else 1):
                assert sock.poll(5000), "no answer"
                got = wire.decode_to_front(sock.recv())
                answers += answers_in(got)
            for answer in answers:
                assert isinstance(answer, wire.Row), answer  # one-input: a row of a ``Rows``
                assert answer.frame.unit is (answer.id in asked)
                rows = embedded(answer, EMBED)
                want = l2_normalize(raw) if answer.frame.unit else raw
                np.testing.assert_array_equal(rows.vectors, want)
                assert (rows.units is rows.vectors) if answer.frame.unit \
                    else rows.units is None
    alone = local_client(Settings(), encoder)
    try:
        for options in ({}, {"normalize": False}, {"dimensions": 3}):
            np.testing.assert_array_equal(front.ready().embed(["hello world"], **options).vectors,
                                          alone.embed(["hello world"], **options).vectors)
    finally:
        alone.shutdown(timeout=1)


class _FreeDevice(FakeEncoder):
    """A device that says it costs nothing, and records the threads that computed on it."""

    free = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.threads: set[str] = set()

    def encode(self, batch):
        self.threads.add(threading.current_thread().name)
        return super().encode(batch)


def test_a_device_that_costs_nothing_is_run_by_the_engines_loop(tmp_path, registry):
    """``free`` (the simulated device): the loop computes each burst's batches itself, with
    the same answers, the same deadlines and the same one frame a front; the batcher's
    thread computes nothing (no hand-off of the interpreter lock to it and back)."""
    encoder = _FreeDevice(dimension=6, max_input_tokens=16)
    with serving(tmp_path, registry, encoder) as (engine, front, _, server, _):
        texts = ["hello world", "a second text", "x " * 40]
        out = front.ready().run(Work(EMBED, texts, deadline=time.monotonic() + 5))
        want = np.stack([encoder.expected(t) for t in texts[:2]])
        np.testing.assert_allclose(out.vectors[:2], want, rtol=1e-6)
        tokens = front.ready().run(Work(TOKENS, ["a b c"], deadline=time.monotonic() + 5))
        assert [t.shape for t in tokens.token_vectors] == [(5, 6)]
        assert encoder.threads == {"test-engine-loop"}
        assert engine.runner.batcher.here
    assert not engine.runner.batcher.here  # the loop ended: the thread computes again


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_front_serves_without_importing_pytorch(tmp_path, device):
    """The front side of every kind of work imports no torch, so fronts never hold a CUDA
    context (the engine process holds the only one): also when the engine's card says its
    model is on a GPU (a stand-in here), which /info and /metrics then report without
    touching torch.cuda."""
    code = textwrap.dedent(f"""
        import dataclasses, sys, threading, time
        from pathlib import Path
        from embedsvc.model.fake import FakeEncoder
        from embedsvc.model.text import describe, text_spec
        from embedsvc.remote.place import engine_address, private_dir
        from embedsvc.remote.server import EngineServer
        from embedsvc.service import Service
        from embedsvc.settings import Settings
        from embedsvc.api.wsgi import create_app
        enc = FakeEncoder(dimension=4)
        engine = Service(Settings(), encoder=enc)
        engine.start(background=False)
        address = engine_address(private_dir(Path({str(tmp_path)!r}) / "run"))
        server = EngineServer(engine.runner, address, state=lambda: engine.state,
                              metrics=engine.metrics,
                              card={{"info": describe(dataclasses.replace(
                                  enc.info, device={device!r})), "text": text_spec(enc)}})
        stop = threading.Event()
        threading.Thread(target=server.run, args=(stop,), daemon=True).start()
        settings = Settings(cache_dir={str(tmp_path / "cache")!r})
        front = Service(settings, engine_address=address)
        app = create_app(settings, service=front)
        front.start()
        front.ready(10)
        client = app.test_client()
        for path, body in (("/embed", {{"inputs": "hi"}}), ("/tokenize", {{"inputs": "hi"}}),
                           ("/v2/embed", {{"texts": ["hi"], "embedding_types": ["int8"]}})):
            assert client.post(path, json=body).status_code == 200, path
        assert client.get("/metrics").status_code == 200
        assert client.get("/info").get_json()["device"] == {device!r}
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_sockets_directory_is_one_whose_path_a_unix_socket_can_take(tmp_path, monkeypatch):
    """A Unix socket's path holds 104-108 bytes: under a long XDG_RUNTIME_DIR (a test's
    temporary directory, a deep home) binding failed with "File name too long" and the fronts
    waited for an engine for ever. The base falls back to a shorter directory."""
    from embedsvc.remote.place import SOCKET_PATH_MAX, fresh_dir, owner_dir

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    for directory in (fresh_dir(), owner_dir(4194304)):
        address = engine_address(directory)
        assert len(address.removeprefix("ipc://").encode()) <= SOCKET_PATH_MAX
        assert not directory.is_relative_to(deep)
        assert directory.stat().st_mode & 0o777 == 0o700
        directory.rmdir()


def test_a_socket_path_too_long_is_refused_with_what_to_do(tmp_path):
    deep = private_dir(tmp_path / ("d" * 120))
    with pytest.raises(RuntimeError, match="shorter directory"):
        engine_address(deep)


@pytest.mark.parametrize("families", [
    [["demo", "counter", "h", [["demo_total", {}, "not a number"]]]],  # the shape
    [["demo", "bogus", "h", []]],  # a type no exposition has
    [["demo", "gauge", "h", [["demo", {"bad-label": "x"}, 1.0]]]],
    [["demo", "gauge", "h", [["demo", {}, float("nan")]]]],
])
def test_a_malformed_snapshot_is_dropped_and_a_scrape_then_answers(pair, families):
    """One such Snapshot, then any scrape, stopped the engine's loop: every front's
    request in it got 503, and the engine exited."""
    import msgspec

    engine, front, encoder = pair
    sock = FrameSocket(front.engine_address)
    try:
        sock.send(msgspec.msgpack.encode({"frame": "Snapshot", "pid": 4242, "origin": 1,
                                          "seq": 1, "families": families}))
        sock.send(wire.encode(wire.Ping(4242)))  # answered after the snapshot: it was read
        assert isinstance(wire.decode_to_front(sock.recv()), wire.Pong)
    finally:
        sock.close()
    assert b"embedsvc_requests_total" in front.exposition()
    out = front.ready().run(Work(EMBED, ["after"], deadline=time.monotonic() + 5))
    np.testing.assert_allclose(out.vectors[0], encoder.expected("after"), rtol=1e-6)


def test_a_scrape_through_any_front_never_reads_fewer_requests(pair):
    """Each front merged its own live counts with the others' last snapshots (a second old):
    the same requests read 14, 21, 14 through different fronts."""
    engine, front, _ = pair
    other = Service(Settings(), engine_address=front.engine_address)
    other.start(background=True)
    try:
        assert other.ready(10) is not None
        seen = []
        for _ in range(20):
            front.metrics.count_request("/embed", 200, 0.01)
            other.metrics.count_request("/embed", 200, 0.01)
            for service in (front, other, front):
                seen.append(_requests(service.exposition()))
        assert seen == sorted(seen) and seen[-1] == 40, seen
    finally:
        other.drain(2)


def _requests(text: bytes) -> float:
    return sum(float(line.rsplit(b" ", 1)[1]) for line in text.splitlines()
               if line.startswith(b'embedsvc_requests_total{route="/embed"'))


def test_a_sockets_directory_made_by_someone_else_is_never_used(monkeypatch):
    """Another local user can make $TMPDIR/embedsvc-<uid> first (or leave it open to
    others): `--workers` stopped with a traceback. It uses a private one of its own; where
    gunicorn's workers (which must all find the same one) find none, they refuse in one
    line."""
    import os
    import shutil
    import tempfile

    from embedsvc.remote.place import fresh_dir, owner_dir

    short = Path(tempfile.mkdtemp(prefix="es-", dir="/tmp"))  # room for a socket's path
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    taken = short / f"embedsvc-{os.getuid()}"
    taken.mkdir()
    taken.chmod(0o777)
    try:
        directory = fresh_dir()
        assert not directory.is_relative_to(taken)
        assert directory.stat().st_mode & 0o777 == 0o700
        assert directory.stat().st_uid == os.getuid()
        directory.rmdir()
        try:
            shared = owner_dir(4194303)
        except RuntimeError as refused:
            assert "\n" not in str(refused) and "XDG_RUNTIME_DIR or TMPDIR" in str(refused)
        else:
            assert not shared.is_relative_to(taken)
            assert shared.stat().st_mode & 0o777 == 0o700
            shared.rmdir()
        assert list(taken.iterdir()) == []
    finally:
        shutil.rmtree(short)


def _swallowing(server, monkeypatch) -> tuple[list[wire.Reserve | wire.Submit], list[int]]:
    """The engine takes every request and answers none: the reservations and submits it
    took, and the ids of the cancels it got."""
    taken: list[wire.Reserve | wire.Submit] = []
    cancelled: list[int] = []

    def swallow(burst) -> None:  # its frames, each reservation before its request's ids
        taken.extend(frame for _, frame in filter(None, burst.reserves))
        for _, frame, reserve in burst.submits:
            taken.extend([reserve, frame] if reserve is not None else [frame])

    monkeypatch.setattr(server, "_reserve", lambda burst: None)
    monkeypatch.setattr(server, "_submit", swallow)
    monkeypatch.setattr(server, "_cancel",
                        lambda peer, request_id, dropped="": cancelled.append(request_id))
    return taken, cancelled


def _submits(frames: list) -> int:
    return sum(isinstance(f, wire.Submit) for f in frames)


def test_a_request_the_engine_never_answers_ends_past_its_deadline(served, monkeypatch):
    """The front's wait has a deadline of its own: an engine that takes a request and never
    answers (a bug, a frame lost) costs the request 504 shortly after its deadline, not a
    thread forever, and the engine is told to drop it."""
    engine, front, _, server = served
    from embedsvc.remote import client as client_module

    taken, cancelled = _swallowing(server, monkeypatch)
    monkeypatch.setattr(client_module, "ANSWER_GRACE_S", 0.3)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="did not answer in time"):
        front.ready().run(Work(EMBED, ["never answered"], deadline=started + 0.5))
    assert time.monotonic() - started >= 0.8  # its deadline and the grace, not sooner
    # the reservation went with the ids, so the ids went alone, admitted on arrival
    assert [type(frame) for frame in taken] == [wire.Submit], taken
    assert not taken[0].reserved
    assert soon(lambda: cancelled == [taken[0].id]), cancelled
    monkeypatch.undo()  # the engine answers again, on the same port
    out = front.ready().run(Work(EMBED, ["answered"], deadline=time.monotonic() + 5))
    assert out.vectors.shape == (1, 6)


def _in_threads(target, args: list) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(a,)) for a in args]
    for thread in threads:
        thread.start()
    return threads


def test_requests_queued_while_a_send_is_under_way_share_one_frame_and_get_their_own_rows(
        served, monkeypatch):
    """A request thread sends its frames itself unless another thread is sending (a request
    thread, the link's): what is submitted meanwhile goes to the engine as one ``Submits``
    (sent by the link, woken for it), not a send each, and each request gets its own rows."""
    engine, front, encoder, server = served
    frames: list[wire.Frame] = []
    decoded = server._decoded

    def counted(parts):
        frame = decoded(parts)
        if isinstance(frame, (wire.Submit, wire.Submits)):
            frames.append(frame)
        return frame

    monkeypatch.setattr(server, "_decoded", counted)
    port, submitted = front.ready().port, threading.Semaphore(0)
    submit = port.submit

    def counted_submit(work, ticket):
        pending = submit(work, ticket)
        submitted.release()
        return pending

    monkeypatch.setattr(port, "submit", counted_submit)
    texts = [f"request number {i}" for i in range(8)]
    rows: dict[str, np.ndarray] = {}

    def request(text: str) -> None:
        work = Work(EMBED, [text], deadline=time.monotonic() + 10)
        rows[text] = front.ready().run(work).vectors[0]

    with port.link._send_lock:  # a send under way
        threads = _in_threads(request, texts)
        assert all(submitted.acquire(timeout=10) for _ in texts)
    for thread in threads:
        thread.join(10)
    sizes = [sum(isinstance(i, wire.Submit) for i in f.items) if isinstance(f, wire.Submits)
             else 1 for f in frames]  # each request's ids: its reservation went before
    sizes = [size for size in sizes if size]
    assert sum(sizes) == len(texts) and len(sizes) < len(texts), sizes
    for text in texts:
        np.testing.assert_allclose(rows[text], encoder.expected(text), rtol=1e-6)


def test_a_lost_engine_fails_every_waiting_request_at_once_from_the_link(
        tmp_path, registry, monkeypatch):
    """Requests waiting in an engine that goes away each get 503 ``engine_gone`` with
    Retry-After, set on their futures by the link's thread when it sees the loss (no
    request thread looks for it on a tick of its own)."""
    from embedsvc.remote import client as client_module

    with serving(tmp_path, registry) as (engine, front, encoder, server, stop):
        taken, _ = _swallowing(server, monkeypatch)
        settled: list[tuple[str, type]] = []
        settle = client_module._Call.settle

        def recorded(call, answer=None, error=None):
            settled.append((threading.current_thread().name, type(error)))
            settle(call, answer, error)

        monkeypatch.setattr(client_module._Call, "settle", recorded)
        errors: list[Exception] = []

        def request(i: int) -> None:
            try:
                front.ready().run(Work(EMBED, [f"held {i}"], deadline=time.monotonic() + 30))
            except Exception as exc:  # noqa: BLE001 - the test reads what each one got
                errors.append(exc)

        threads = _in_threads(request, list(range(6)))
        assert soon(lambda: _submits(taken) == 6), taken
        stop.set()  # nothing admitted: the engine's loop ends and its socket closes
        for thread in threads:
            thread.join(10)
        assert [type(e) for e in errors] == [EngineGone] * 6, errors
        assert all(e.status == 503 and e.code == "engine_gone" and
                   e.headers == {"Retry-After": "1"} for e in errors)
        assert settled == [("embedsvc-engine-link", EngineGone)] * 6


def test_a_departed_clients_request_is_cancelled_in_the_engine_then_499(served, monkeypatch):
    engine, front, _, server = served
    from embedsvc.errors import ClientDisconnected

    taken, cancelled = _swallowing(server, monkeypatch)
    work = Work(EMBED, ["gone"], deadline=time.monotonic() + 30, disconnected=lambda: True)
    with pytest.raises(ClientDisconnected):
        front.ready().run(work)
    # its room was reserved, then given back: it was never tokenized, so no ids were sent
    assert soon(lambda: len(cancelled) == 1), (taken, cancelled)
    assert [type(f) for f in taken] == [wire.Reserve] and cancelled == [taken[0].id], taken


def test_a_post_during_the_links_drain_is_sent_and_the_next_one_wakes_it(monkeypatch):
    """The flag-then-pipe wake-up of the link's thread, drained before it is cleared: a
    request thread that posts while the link drains its pipe has its frame sent by that
    turn, and the next post writes again (cleared first, the flag stayed set with the pipe
    empty, and no later post woke the link)."""
    from embedsvc.remote import client as client_module

    link = client_module.Link("ipc:///nonexistent")
    sent: list[bytes] = []
    here, there = socket.socketpair()  # a number for the link's poll

    class Socket:
        pending = closed = False

        def send(self, data: bytes) -> None:
            sent.append(data)

        def read(self) -> list[bytes]:
            return []

        def fileno(self) -> int:
            return here.fileno()

    drain = wake_module.drain
    during = wire.Cancel(2)

    def drain_with_a_post_in_between(fd: int) -> None:
        link.post(during)
        drain(fd)

    try:
        link.post(wire.Cancel(1))
        monkeypatch.setattr(wake_module, "drain", drain_with_a_post_in_between)
        link._stream = Socket()  # type: ignore[assignment]
        link._poller.register(here.fileno(), 0)
        link._turn([(link._wake.fileno(), select.POLLIN)])
        monkeypatch.setattr(wake_module, "drain", drain)
        assert wire.encode(during) in sent
        link.post(wire.Cancel(3))
        assert select.select([link._wake], [], [], 0)[0], "a post after the turn wrote nothing"
    finally:
        link.close()
        here.close()
        there.close()


def test_a_request_still_waiting_when_the_front_closes_its_link_gets_503_draining(
        served, monkeypatch):
    """Past the drain's wait, the link closes: a request still in the engine gets the
    drain's 503, not a link that is gone from under it."""

    engine, front, _, server = served
    taken, _ = _swallowing(server, monkeypatch)
    errors: list[Exception] = []

    def request(_: int) -> None:
        try:
            front.ready().run(Work(EMBED, ["held"], deadline=time.monotonic() + 30))
        except Exception as exc:  # noqa: BLE001 - the test reads what it got
            errors.append(exc)

    (thread,) = _in_threads(request, [0])
    assert soon(lambda: _submits(taken) == 1)
    front._link.close()
    thread.join(10)
    assert [type(e) for e in errors] == [Unavailable] and errors[0].code == "draining", errors


def test_a_request_that_comes_as_the_front_drains_is_refused_not_lost(served, monkeypatch):
    """A front's drain counts the requests it waits for. A request that had passed the
    front's look at its state as the drain began, and was not yet counted, was neither
    refused nor waited for: the drain found nothing in flight, closed the link, and the
    request was listed on a link gone from under it, to wait out its deadline. The look
    and the count are now one step under the drain's lock, and a closed link lists
    nothing more."""

    _, front, _, _ = served
    port = front._client.port
    reports = []
    next_id = port.link.next_id

    def drained_meanwhile() -> int:  # the drain runs between the request's look and count
        reports.append(port.shutdown(1.0))
        port.link.close()
        return next_id()

    monkeypatch.setattr(port.link, "next_id", drained_meanwhile)
    work = Work(EMBED, ["late"], deadline=time.monotonic() + 30)
    started = time.monotonic()
    with pytest.raises(Unavailable) as refused:
        call = port.admit(work, 3)
        port.submit(work, call).result()
    assert time.monotonic() - started < 5
    assert refused.value.code in ("draining", "engine_gone"), refused.value
    assert [r.clean for r in reports] == [True]
    with pytest.raises(Unavailable):  # and after the drain, at once
        port.link.send_call(wire.Reserve(99, "embed", 1, 3, timeout=30.0), None)


@pytest.mark.parametrize("kind", [wire.Submit, wire.Reserve])
def test_a_burst_of_many_small_requests_stays_within_the_engines_frame_limit(kind):
    """The link's burst cap counts each ``Submit``'s encoding, not only its ids: thousands
    of one-input requests (a front of many threads) used to go out as one frame of 160-odd
    bytes a request counted as 12, past the engine's limit where requests are small, whose
    connection the engine then closed (every request of the front 503). A run of
    ``Reserve``s is cut the same way (8,000 went out as one frame of 1.48 MB)."""
    own = {"ids": wire.pack_ids([[101, 7, 102]])} if kind is wire.Submit else {}
    queued = [(0.0, kind(i, "embed", *own.get("ids", (1, 3)), timeout=29.5,
                         tenant="tenant-with-a-name-of-forty-characters!!",
                         flow="('tenant-with-a-name-of-forty-characters!!', 1)",
                         front=4194304))
              for i in range(1, 8001)]
    count = client_module._burst(queued)
    frame = wire.encode(wire.Submits([f for _, f in queued[:count]]))
    assert 1 < count < len(queued)
    assert len(frame) <= wire.max_frame_bytes(inputs=1, tokens=3), (count, len(frame))


class _Recorder:
    """A connection that takes every frame at once and keeps what it decodes to."""

    pending = closed = False

    def __init__(self) -> None:
        self.sent: list[wire.Frame] = []

    def send(self, data: bytes) -> None:
        self.sent.append(wire.decode_to_engine(data))


def test_a_departed_clients_cancel_goes_after_its_submit_in_the_same_turn():
    """A request whose client has left by the link's turn that sends its ``Submit``: the
    ``Cancel`` goes after the ``Submit``. It used to go first, where the engine ignored it
    (no such request yet) and then computed the request to the end."""
    link = client_module.Link("ipc:///nonexistent")
    link.state = "ready"
    try:
        submit = wire.Submit(link.next_id(), "embed", *wire.pack_ids([[101, 7, 102]]))
        link.send_call(submit, lambda: True)  # listed and queued; its client gone already
        link._sweep_departed(time.monotonic())  # the turn's tick, before its flush
        sock = link._stream = _Recorder()  # type: ignore[assignment]
        link._flush()
        assert [type(f).__name__ for f in sock.sent] == ["Submit", "Cancel"], sock.sent
        assert sock.sent[1].id == submit.id
    finally:
        link.close()


def _next(sock, timeout_ms: int = 5000) -> list:
    """The items of the engine's next frame to this socket."""
    assert sock.poll(timeout_ms), "no frame from the engine"
    return answers_in(wire.decode_to_front(sock.recv()))


def _reserved(sock, request_id: int, inputs: int) -> None:
    """Room for ``inputs`` asked on ``sock`` as a front asks it, and granted."""
    sock.send(wire.encode(wire.Reserve(request_id, "embed", inputs, 10 * inputs, timeout=5.0,
                                       tell=True)))
    assert [type(f) for f in _next(sock)] == [wire.Granted]


def test_a_reservation_holds_room_before_its_ids_come_and_they_are_computed_under_it(pair):
    """Room is reserved before a request is tokenized, as in one process: a ``Reserve`` that
    asks is told ``Granted`` and holds its inputs in the engine's admission; its ``Submit``
    (reserved) is computed under it, its room given back with the answer."""
    engine, front, encoder = pair
    admission = engine.runner.admission
    ids = front.ready().tokens(["reserved first"])
    with _raw(front) as sock:
        _reserved(sock, 5, 1)
        assert admission.used_inputs == 1  # held while the front tokenizes
        sock.send(wire.encode(wire.Submit(5, "embed", *wire.pack_ids(ids), timeout=5.0,
                                          reserved=True)))
        (answer,) = _next(sock)
        assert isinstance(answer, wire.Row) and answer.id == 5, answer
        row = embedded(answer, EMBED).vectors[0]
        np.testing.assert_allclose(row / np.linalg.norm(row), encoder.expected("reserved first"),
                                   rtol=1e-6)
    assert soon(lambda: admission.used_inputs == 0)


def test_a_reservation_given_back_or_refused_frees_its_room_and_its_ids_are_dropped(pair):
    """A front whose request ends before its ids are sent (its client left, a 400 while
    tokenizing) cancels the reservation: its room is freed at once, 499. A refused one
    (more inputs than a request may have) is answered at once, and ids sent under it are
    dropped, not admitted on arrival; ids that are not the inputs reserved are a 400, and
    the room is freed."""
    engine, front, _ = pair
    admission = engine.runner.admission
    ids = front.ready().tokens(["dropped"])
    with _raw(front) as sock:
        _reserved(sock, 1, 2)
        sock.send(wire.encode(wire.Cancel(1)))
        (gone,) = _next(sock)
        assert isinstance(gone, wire.Failed) and gone.status == 499, gone
        assert admission.used_inputs == 0
        too_many = engine.runner.settings.max_inputs_per_request + 1
        sock.send(wire.encode(wire.Reserve(2, "embed", too_many, too_many, timeout=5.0,
                                           tell=True)))
        (refused,) = _next(sock)
        assert isinstance(refused, wire.Failed) and refused.status == 400, refused
        sock.send(wire.encode(wire.Submit(2, "embed", *wire.pack_ids(ids), timeout=5.0,
                                          reserved=True)))
        assert not sock.poll(500), "ids under a refused reservation were computed"
        _reserved(sock, 3, 3)
        sock.send(wire.encode(wire.Submit(3, "embed", *wire.pack_ids(ids), timeout=5.0,
                                          reserved=True)))  # 1 input where 3 were reserved
        (mismatch,) = _next(sock)
        assert isinstance(mismatch, wire.Failed) and mismatch.status == 400, mismatch
    assert admission.used_inputs == 0


def test_a_reservation_whose_ids_never_come_ends_at_its_deadline(pair):
    """A front that reserved and then went silent (a bug, a frame lost) holds the room
    until the reservation's deadline only: then 504, and the room is free."""
    engine, front, _ = pair
    admission = engine.runner.admission
    with _raw(front) as sock:
        sock.send(wire.encode(wire.Reserve(9, "embed", 4, 40, timeout=0.3)))
        assert soon(lambda: admission.used_inputs == 4)
        (late,) = _next(sock, 3000)
        assert isinstance(late, wire.Failed) and late.status == 504 and late.id == 9, late
    assert admission.used_inputs == 0


def test_a_requests_frames_go_out_from_its_own_thread_without_waking_the_link():
    """A request thread sends what is queued itself (its reservation and its ids in one
    frame: the ids alone, as a request admitted on arrival), where the link's thread used to
    be woken through its pipe to send it: one wake-up less for each request. Where another
    thread is sending at that moment, the link is woken instead, so that no frame waits for
    a later send."""
    link = client_module.Link("ipc:///nonexistent")  # its thread never started
    link.state = "ready"
    sock = link._stream = _Recorder()  # type: ignore[assignment]
    try:
        ids = wire.pack_ids([[101, 7, 102]])
        first = link.next_id()
        call = link.send_call(wire.Reserve(first, "embed", 1, 3), None)
        assert sock.sent == []  # a reservation that does not wait goes with its ids
        link.send_ids(call, wire.Submit(first, "embed", *ids, reserved=True))
        assert [(type(f).__name__, f.id, f.reserved) for f in sock.sent] == [
            ("Submit", first, False)], sock.sent
        assert not select.select([link._wake], [], [], 0)[0], "the link was woken"
        with link._send_lock:  # another thread is sending
            link.send_call(wire.Submit(link.next_id(), "embed", *ids), None)
        assert len(sock.sent) == 1
        assert select.select([link._wake], [], [], 0)[0], "the link was not woken"
        link._flush()  # the link's turn
        assert [type(f).__name__ for f in sock.sent] == ["Submit", "Submit"], sock.sent
    finally:
        link.close()


def test_a_reservation_sent_with_its_ids_is_left_out_and_the_others_stay():
    """In one send, a reservation and its request's ids become the ids alone, admitted on
    arrival (the engine took the pair so already); a reservation that asked to be told, or
    one sent earlier, stays, and its ids say they are reserved; the order is kept."""
    ids = wire.pack_ids([[101, 7, 102]])
    told = wire.Reserve(6, "embed", 300, 900, tell=True)  # its ids wait for the grant
    frames = [wire.Submit(1, "embed", *ids, reserved=True),  # its reservation went before
              told,
              wire.Reserve(2, "embed", 1, 3),
              wire.Submit(3, "embed", *ids),  # no reservation
              wire.Reserve(4, "embed", 1, 3),  # its ids come in a later send
              wire.Submit(2, "embed", *ids, reserved=True)]
    sent = client_module._fused(frames)
    assert [(type(f).__name__, f.id, getattr(f, "reserved", None)) for f in sent] == [
        ("Submit", 1, True), ("Reserve", 6, None), ("Submit", 3, False),
        ("Reserve", 4, None), ("Submit", 2, False)]
    assert sent[1] is told
    assert len(frames) == 6 and frames[5].reserved  # the queued frames are as they were
    alone = [wire.Submit(5, "embed", *ids, reserved=True)]
    assert client_module._fused(alone) == alone and alone[0].reserved
    twice = [wire.Reserve(7, "embed", 1, 3), wire.Reserve(7, "embed", 1, 3),
             wire.Submit(7, "embed", *ids, reserved=True)]  # a front's bug: sent as it is
    assert client_module._fused(twice) == twice


def test_a_send_that_fails_before_it_goes_leaves_its_frames_queued_as_they_were(monkeypatch):
    """The frames a send takes stay queued, unchanged, until they have gone: a send that
    fails while it encodes them (an error of the encoder, memory) is retried whole, the
    reservation and its ids leaving as one request then. Had the ids been changed in the
    queue to go alone, the retry sent the reservation and the ids as another request under
    the same id, which the engine drops: the request waited for its deadline."""
    link = client_module.Link("ipc:///nonexistent")  # its thread never started
    link.state = "ready"
    sock = link._stream = _Recorder()  # type: ignore[assignment]
    encode, failures = wire.encode, [MemoryError("once")]

    def failing_once(frame):
        if failures:
            raise failures.pop()
        return encode(frame)

    monkeypatch.setattr(wire, "encode", failing_once)
    try:
        call = link.send_call(wire.Reserve(link.next_id(), "embed", 1, 3), None)
        with pytest.raises(MemoryError):
            link.send_ids(call, wire.Submit(call.id, "embed", *wire.pack_ids([[101, 7, 102]]),
                                            reserved=True))
        assert [(type(f).__name__, getattr(f, "reserved", None)) for _, f in link._unsent] \
            == [("Reserve", None), ("Submit", True)]
        link._flush()
        assert [(type(f).__name__, f.id, f.reserved) for f in sock.sent] == [
            ("Submit", call.id, False)], sock.sent
        assert not link._unsent
    finally:
        link.close()


def test_a_stopping_engine_sends_the_answers_its_fronts_have_not_taken_yet(tmp_path, registry):
    """An engine stopping as its last request was answered closed its connections at once,
    dropping what a front had not read yet: an answer larger than the socket's buffer was
    cut off, and its request got 503 ``engine_gone`` though it had been computed. The loop
    now sends such answers first (for at most ``_LINGER_S``)."""
    encoder = FakeEncoder(dimension=384, max_input_tokens=16)
    with serving(tmp_path, registry, encoder) as (engine, front, _, server, stop):
        texts = [f"text number {i}" for i in range(1024)]  # 1.5 MB of rows
        ids = front.ready().tokens(texts)
        with _raw(front) as sock:
            sock.send(wire.encode(wire.Submit(1, "embed", *wire.pack_ids(ids), timeout=30.0)))
            assert soon(lambda: not server.in_flight and any(
                s.pending for s in server._streams.values()), 10), "no answer waiting"
            stop.set()
            time.sleep(0.3)  # the loop has seen the stop, and nothing in flight
            frame = wire.decode_to_front(sock.recv())
        assert isinstance(frame, wire.Answer) and frame.id == 1, frame
        rows = embedded(frame, EMBED).vectors
        assert rows.shape == (len(texts), 384)
        for i in (0, 517, len(texts) - 1):
            np.testing.assert_allclose(rows[i] / np.linalg.norm(rows[i]),
                                       encoder.expected(texts[i]), rtol=1e-5)


def _frames_of(stream, kind: type, count: int = 1, timeout: float = 5.0) -> list:
    """The next ``count`` frames of type ``kind`` that ``stream`` (the engine's end) reads
    (others are dropped)."""
    found: list = []
    until = time.monotonic() + timeout
    while len(found) < count and time.monotonic() < until:
        select.select([stream], [], [], 0.05)
        found += [f for f in map(wire.decode_to_engine, stream.read()) if isinstance(f, kind)]
    assert len(found) == count, f"{len(found)} of {count} {kind.__name__} from the link"
    return found


@contextlib.contextmanager
def _carded_link(tmp_path, wake: bool = True):
    """A front's link to a stand-in engine (the test's end of the socket, a ``Stream``),
    its hello answered with a card: (the link, the engine's end). The hello goes at the
    link's first tick; ``wake`` posts a frame to wake it for that at once (a test may have
    set the tick long), which the engine's end then reads too."""
    from embedsvc.remote.stream import Stream

    address = engine_address(private_dir(tmp_path / "run"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address.removeprefix("ipc://"))
    listener.listen(1)
    listener.settimeout(5)
    link = client_module.Link(address)
    link.start()
    try:
        engine = Stream(listener.accept()[0])
        if wake:
            link.post(wire.Ping(1))
        _frames_of(engine, wire.Hello)
        engine.send(wire.encode(wire.Card(info={}, text={}, pid=4242, state="ready",
                                          queue_limit=8)))
        assert link.wait_card(5) is not None
        yield link, engine
    finally:
        link.close()
        listener.close()


def test_a_lone_request_reads_its_own_answer_and_hands_the_link_the_others(
        tmp_path, monkeypatch):
    """A front's only request in the engine reads the engine's connection itself: its
    answer wakes no link thread first. A reader that leaves while another request waits
    wakes the link's thread, which reads for that one (with the link's tick out of the way,
    nothing else would read it for 30 seconds)."""
    monkeypatch.setattr(client_module, "_TICK_S", 30.0)
    settled: list[tuple[int, str]] = []
    settle = client_module._Call.settle

    def recorded(call, answer=None, error=None):
        settled.append((call.id, threading.current_thread().name))
        settle(call, answer, error)

    monkeypatch.setattr(client_module._Call, "settle", recorded)
    with _carded_link(tmp_path) as (link, engine):
        assert soon(lambda: not link._reading), "the link kept reading with nothing waiting"

        def answer(request_id: int) -> None:
            engine.send(wire.encode(wire.Failed(request_id, 400, "invalid_request_error",
                                                "invalid_request", f"answer {request_id}")))

        waited: dict[str, bool] = {}

        def wait(name: str, call) -> threading.Thread:
            thread = threading.Thread(target=lambda: waited.update({name: link.wait(call, 10)}),
                                      name=name)
            thread.start()
            return thread

        first = link.send_call(wire.Submit(1, EMBED, b"", b""), None)
        reader = wait("request-1", first)
        assert soon(link._reader.locked), "the lone request did not read"
        second = link.send_call(wire.Submit(2, EMBED, b"", b""), None)
        other = wait("request-2", second)
        assert [f.id for f in _frames_of(engine, wire.Submit, 2)] == [1, 2]
        answer(1)
        reader.join(5)
        assert waited == {"request-1": True} and settled == [(1, "request-1")]
        assert soon(lambda: link._reading, 5), "the reader left and no thread reads"
        answer(2)
        other.join(5)
        assert waited == {"request-1": True, "request-2": True}
        assert settled == [(1, "request-1"), (2, "embedsvc-engine-link")]
        assert first.answer.message == "answer 1" and second.answer.message == "answer 2"
        assert soon(lambda: not link._reading), "the link kept reading with nothing waiting"


def test_lone_requests_through_the_engine_read_their_own_answers(served, monkeypatch):
    """One client at a time through a live engine: the requests' own threads read nearly
    every answer (the link's tick may take one that arrives as it looks), each the right
    rows."""
    engine, front, encoder, server = served
    readers: list[str] = []
    settle = client_module._Call.settle

    def recorded(call, answer=None, error=None):
        if call.id:  # a request's, not a scrape's
            readers.append(threading.current_thread().name)
        settle(call, answer, error)

    monkeypatch.setattr(client_module._Call, "settle", recorded)
    for i in range(20):
        out = front.ready().run(Work(EMBED, [f"lone {i}"], deadline=time.monotonic() + 5))
        np.testing.assert_allclose(out.vectors[0], encoder.expected(f"lone {i}"), rtol=1e-6)
    mine = threading.current_thread().name
    assert len(readers) == 20 and readers.count(mine) >= 15, readers


def test_a_reader_leaving_after_the_link_closed_writes_into_no_reused_descriptor(tmp_path):
    """A lone request reading when its front closes the link leaves after ``close`` closed
    the link's wake pipe; its wake-up for the link must go nowhere, not into the file or
    socket that took the pipe's number since."""
    taken: list[tuple[int, int]] = []
    with _carded_link(tmp_path) as (link, _), contextlib.ExitStack() as closing:
        closing.callback(lambda: [os.close(fd) for fds in taken for fd in fds])
        assert soon(lambda: not link._reading)
        call = link.send_call(wire.Submit(1, EMBED, b"", b""), None)
        reader = threading.Thread(target=link.wait, args=(call, 10), name="request-1")
        reader.start()
        assert soon(link._reader.locked), "the lone request did not read"
        wake_w = link._wake._w
        link.close()  # the reader is in its poll, for up to a tick
        taken += [os.pipe() for _ in range(16)]  # files opened meanwhile take the numbers
        reader.join(5)
        assert wake_w in [w for _, w in taken], "the test lost its race for the number"
        for r, _ in taken:
            assert not select.select([r], [], [], 0)[0], f"a byte went into fd {wake_w}"


def test_a_pause_of_the_front_is_discounted_but_never_past_what_it_heard_since():
    """The front's own pause is not the engine's silence; but a frame read as the process
    ran again was heard then, not later: the pause added on top of it would leave a silent
    engine unnoticed for as long again."""
    link = client_module.Link("ipc:///nonexistent")
    try:
        now = time.monotonic()
        link._looked_at, link._heard_at = now - 10.0, now - 10.0  # paused for 10 s
        link._discount_stall(now)
        assert now - 1.0 < link._heard_at <= now  # silent for none of it
        link._looked_at, link._heard_at = now - 10.0, now  # a pong read as it woke
        link._discount_stall(now)
        assert link._heard_at == now
    finally:
        link.close()


def test_a_link_pings_at_once_after_the_card_and_reads_its_pong_as_it_comes(
        tmp_path, monkeypatch):
    """The engine's list of fronts (/info's ``front_pids``) comes with its pongs: a front's
    first ping goes at the link's next tick after the card, not a ping interval later, and
    the link reads while a ping awaits its pong, then lets go."""
    monkeypatch.setattr(client_module, "_PING_S", 30.0)
    with _carded_link(tmp_path, wake=False) as (link, engine):
        assert link.fronts == []
        _frames_of(engine, wire.Ping, timeout=2.0)
        assert soon(lambda: link._reading, 2), "the link does not read for its pong"
        engine.send(wire.encode(wire.Pong(4242, "ready", 8, fronts=[11, 12])))
        assert soon(lambda: link.fronts == [11, 12], 2)
        assert soon(lambda: not link._reading, 2), "the link kept reading after its pong"


def test_a_request_answered_as_it_takes_the_reader_does_not_wait_on_the_connection(
        tmp_path, monkeypatch):
    """The link's thread can read a lone request's answer (its tick, its pong) between the
    request's look at its future and its taking the reader: the request then has its
    answer and must not wait on the connection for more (with the tick at 30 s, a poll
    slice would hold it for the whole wait)."""
    monkeypatch.setattr(client_module, "_TICK_S", 30.0)
    with _carded_link(tmp_path) as (link, _):
        assert soon(lambda: not link._reading)  # its first ping waits for its next tick
        call = link.send_call(wire.Submit(1, EMBED, b"", b""), None)
        reader = link._reader

        class AnsweredMeanwhile:  # the link's read of the answer, just before the take
            def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
                link._settle([wire.Failed(1, 400, "invalid_request_error",
                                          "invalid_request", "answered")])
                return reader.acquire(blocking, timeout)

            def __getattr__(self, name: str):
                return getattr(reader, name)

        monkeypatch.setattr(link, "_reader", AnsweredMeanwhile())
        waited: list[bool] = []
        thread = threading.Thread(target=lambda: waited.append(link.wait(call, 10)))
        thread.start()
        thread.join(5)
        assert waited == [True] and call.answer.message == "answered"
        assert not reader.locked()


def test_a_late_answer_to_a_scrape_that_gave_up_answers_no_other(tmp_path):
    """A scrape that times out leaves the front; its answer may still come. It went to the
    next scrape waiting, whose own answer then went to the one after or nowhere: /metrics
    showed numbers a scrape old, for as long as scrapes overlapped. Each answer now carries
    its scrape's ``seq``."""

    with _carded_link(tmp_path) as (link, engine):
        with pytest.raises(Unavailable):
            link.ask(wire.Scrape(1, 0, 1, []), wire.Exposition, timeout=0.2)
        (first,) = _frames_of(engine, wire.Scrape)
        got: list = []
        (thread,) = _in_threads(lambda _: got.append(
            link.ask(wire.Scrape(1, 0, 2, []), wire.Exposition, timeout=5)), [0])
        (second,) = _frames_of(engine, wire.Scrape)
        assert (first.seq, second.seq) == (1, 2)
        engine.send(wire.encode(wire.Exposition([["late"]], seq=1)))  # the first's, late
        engine.send(wire.encode(wire.Exposition([["own"]], seq=2)))
        thread.join(5)
        assert [e.families for e in got] == [[["own"]]]


def test_work_finished_after_the_engine_closed_writes_into_no_reused_descriptor(
        tmp_path, registry):
    """A batcher or /embed_all thread that finishes work after the engine's loop closed
    (its loop ended with work in the device) wakes the loop: that wake-up must go nowhere,
    not into the file or socket that took the closed pipe's number since."""
    engine = Service(Settings(), encoder=FakeEncoder(dimension=6),
                     metrics=Metrics(registry))
    engine.start(background=False)
    server = EngineServer(engine.runner, engine_address(private_dir(tmp_path / "run")),
                          card={}, state=lambda: "ready", metrics=engine.metrics)
    taken: list[socket.socket] = []
    try:
        wake_w = server._wake._w
        server.close()
        for _ in range(16):  # sockets opened meanwhile take the numbers (both ends write)
            taken += socket.socketpair()
        assert wake_w in [s.fileno() for s in taken], "the test lost its race for the number"
        server._wake.wake()
        assert not select.select(taken, [], [], 0)[0], f"a byte went into fd {wake_w}"
    finally:
        engine.drain(1)
        for sock in taken:
            sock.close()


class _NoBufferSpaceOnce:
    """A socket whose next send fails as a full kernel buffer pool does (ENOBUFS), the peer
    still there; the sends after it go."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.failed = False

    def send(self, data):
        if not self.failed:
            self.failed = True
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return self._sock.send(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _answered(front, text: str) -> bool:
    try:
        front.ready(0.5).run(Work(EMBED, [text], deadline=time.monotonic() + 2))
        return True
    except (Unavailable, EngineGone):  # loading, or the request the failed send took
        return False


def test_a_front_whose_send_fails_with_the_engine_there_connects_again_and_serves(served):
    """A front's send that failed with the engine alive (no buffer space) left its
    connection open with nothing going out: the engine heard nothing more, the front took
    it for gone and answered 503 ``loading`` to every request until it was restarted. Now
    the connection ends, the request in it gets 503 ``engine_gone``, and the front
    connects again and serves."""
    _, front, _, _ = served
    assert _answered(front, "before")
    link = front.ready().port.link
    stream = link._stream
    flaky = stream.sock = _NoBufferSpaceOnce(stream.sock)
    with pytest.raises(EngineGone):  # its frames went nowhere: it is failed, not left waiting
        front.ready(1).run(Work(EMBED, ["lost"], deadline=time.monotonic() + 10))
    assert flaky.failed
    assert soon(lambda: _answered(front, "after"), timeout=8), link.state
    assert link._stream is not stream


def test_an_engine_whose_send_to_a_front_fails_closes_it_and_the_front_serves_again(served):
    """The engine's send to a live front that failed (no buffer space) left the connection
    open and every later answer, pong and card to that front dropped: the request waited
    out the link's silence, then the front answered 503 ``loading`` for good. Now the
    engine closes that connection at once: the request gets 503 ``engine_gone`` well before
    the link would have given up, and the front connects again and serves."""
    _, front, _, server = served
    assert _answered(front, "before")
    (stream,) = server._streams.values()
    flaky = stream.sock = _NoBufferSpaceOnce(stream.sock)
    started = time.monotonic()
    with pytest.raises(EngineGone):
        front.ready(1).run(Work(EMBED, ["lost"], deadline=time.monotonic() + 10))
    assert flaky.failed
    assert time.monotonic() - started < client_module.LOST_AFTER_S
    assert soon(lambda: _answered(front, "after"), timeout=8)
    assert stream.closed and stream not in server._streams.values()


def test_a_closed_wake_pipe_reads_no_descriptor_that_took_its_number():
    """A link closed while its thread still turned (the close's join timed out) drained its
    pipe's number after the close: whatever had taken that number since (a connection, a
    body's file) lost its bytes to it."""
    pipe = wake_module.WakePipe()
    number = pipe.fileno()
    pipe.close()
    r, w = os.pipe()
    os.set_blocking(r, False)
    if r != number:
        os.dup2(r, number)  # another descriptor with the closed pipe's number
    try:
        os.write(w, b"someone else's")
        pipe.woken()  # as its loop's last poll saw the number readable
        assert os.read(number, 64) == b"someone else's"
    finally:
        for fd in {r, w, number}:
            os.close(fd)


def test_a_keeper_that_raises_leaves_the_link_alive_to_try_again(tmp_path, monkeypatch):
    """gunicorn's keeper (``SharedEngine.ensure``) writes files: one that raised (a full
    disk) ended the link's thread, and the front answered 503 ``loading`` for good."""
    monkeypatch.setattr(client_module, "LOST_AFTER_S", 0.05)  # the keeper's interval
    calls: list[float] = []

    def keeper() -> str | None:
        calls.append(time.monotonic())
        raise OSError(28, "No space left on device")

    link = client_module.Link(engine_address(private_dir(tmp_path / "run")), keeper=keeper)
    link.start()
    try:
        assert soon(lambda: len(calls) >= 3), calls
        assert link._thread.is_alive()
    finally:
        link.close()


def test_a_request_through_the_engine_leaves_no_cycle_for_the_collector(pair):
    """A request's records in the engine (its entry, work, admission ticket and job) and in
    its front are freed by their counts as it is answered: none is left in a reference cycle
    for Python's cyclic collector. Each answered request used to leave twelve objects in
    cycles, and the collections that freed them took a tenth of the engine's loop."""
    engine, front, encoder = pair
    service = front.ready()

    def requests(count: int) -> None:
        for i in range(count):  # one input, several, and per-token work (its own thread)
            service.run(Work(EMBED, [f"text {i}"], deadline=time.monotonic() + 5))
            service.run(Work(EMBED, [f"more {i} {k}" for k in range(9)],
                             deadline=time.monotonic() + 5))
            service.run(Work(TOKENS, [f"tokens {i}"], deadline=time.monotonic() + 5))

    requests(5)  # the first requests' one-off objects
    gc.collect()
    was = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds in cycles, kept to be seen
    try:
        requests(40)
        gc.collect()
        # embedsvc's own objects: a cycle another thread of this worker leaves (an exception
        # and its frames) is not the request's
        left = collections.Counter(type(o).__qualname__ for o in gc.garbage
                                   if type(o).__module__.startswith("embedsvc"))
    finally:
        gc.set_debug(was)
        gc.garbage.clear()
    assert not left, left
