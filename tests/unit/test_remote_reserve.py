"""Reservations under --workers (remote/: ``Reserve`` before a front tokenizes): every path
a request can end by gives its room in the engine's admission back, and is answered once."""

from __future__ import annotations

import threading
import time

from embedsvc.errors import EngineGone
from embedsvc.remote import client as client_module
from embedsvc.work import EMBED, Work
from tests.unit.test_remote import _in_threads, _soon, serving


def test_a_reservation_of_a_request_failed_when_the_engine_went_silent_is_given_back(
        tmp_path, registry, monkeypatch):
    """An engine silent past ``LOST_AFTER_S`` (its loop held up) is taken for gone: the
    front answers its requests 503 and forgets them. The engine, once it runs again, reads
    their reservations: they must not hold its room until their deadlines for ids that will
    never come."""
    monkeypatch.setattr(client_module, "LOST_AFTER_S", 1.0)
    with serving(tmp_path, registry) as (engine, front, _, server, _stop):
        admission = engine.runner.admission
        held, resume = threading.Event(), threading.Event()
        take = server._take

        def held_up(burst):  # the engine's loop stops answering as the reservation comes
            if burst and not held.is_set():
                held.set()
                resume.wait(10)
            take(burst)

        monkeypatch.setattr(server, "_take", held_up)
        errors: list[Exception] = []

        def request(_: int) -> None:  # 9 inputs: it waits for its grant before tokenizing
            try:
                front.ready().run(Work(EMBED, [f"text {i}" for i in range(9)],
                                       deadline=time.monotonic() + 30))
            except Exception as exc:  # noqa: BLE001 - the test reads what it got
                errors.append(exc)

        (thread,) = _in_threads(request, [0])
        assert held.wait(5)
        thread.join(5)
        assert [type(e) for e in errors] == [EngineGone], errors
        resume.set()
        assert _soon(lambda: front.state == "ready", 5)
        assert _soon(lambda: admission.used_inputs == 0, 3), \
            (admission.used_inputs, server._reserved)
        assert admission.used_tokens == 0
