"""The model side of the boundary: one loaded encoder, its batcher and the device's admission.

A ``Runner`` takes ``Work`` whose ``ids`` the front side (engine_client.py) filled in and
returns its rows, activated for scorers and reduced to active pairs for sparse models:
everything that needs the model happens here, and nothing else does. It serves this process's
request threads (``LocalPort``) or, in the engine process, the HTTP processes' frames
(remote/server.py).

>>> import time
>>> from embedsvc.batching.batcher import Batcher, BatchLimits
>>> from embedsvc.model.fake import FakeEncoder
>>> from embedsvc.settings import Settings
>>> from embedsvc.work import EMBED, Work
>>> encoder = FakeEncoder(dimension=4)
>>> runner = Runner(Settings(), encoder, Batcher(encoder.encode,
...                                                BatchLimits.from_settings(Settings())))
>>> runner.batcher.start()
>>> port = LocalPort(runner)
>>> work = Work(EMBED, ["hi"], deadline=time.monotonic() + 5, ids=[[1, 7, 2]])
>>> port.submit(work, port.admit(work, 3)).result().vectors.shape
(1, 4)
>>> runner.shutdown(timeout=1.0).failed
0
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from .admission import Admission, Ticket, still_wanted
from .batching.batcher import Batcher, Job
from .metrics import Metrics
from .model.encoder import Encoder, ModelInfo
from .settings import Settings
from .work import Disconnected, Embedded, Pending, ShutdownReport, Work
from .work_kinds import WORK_KINDS, kind_of, wants_units

_LOCK_WATCH_S = 0.1  # how often /embed_all, waiting for the device, looks at its client


class Runner:
    """One encoder, its batcher and admission: where ``Work`` meets the model.

    ``submit`` queues embedding, scoring and sparse work for the batcher; ``finish`` turns a
    job's raw rows into the answer (activated scores, active pairs); ``embed_all`` computes
    per-token vectors in the calling thread, taking the device between two batches.
    """

    def __init__(self, settings: Settings, encoder: Encoder, batcher: Batcher,
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.encoder = encoder
        self.batcher = batcher
        self.metrics = metrics or batcher.metrics

    @property
    def info(self) -> ModelInfo:
        return self.encoder.info

    @property
    def alive(self) -> bool:
        return self.batcher.alive

    @property
    def device_free(self) -> bool:
        """Whether the encoder says its device costs nothing (``free = True``: the
        simulated one of bench/sim_server.py), so that the engine's loop runs it itself."""
        return bool(getattr(self.encoder, "free", False))

    @property
    def admission(self) -> Admission:
        """The device's admission (the batcher's)."""
        return self.batcher.admission

    def check(self, work: Work) -> None:
        """400 for work this model cannot do (a kind it does not serve)."""
        refusal = kind_of(work).refusal(self.encoder)
        if refusal is not None:
            raise refusal

    def submit(self, work: Work, ticket: Ticket | None,
               on_done: Callable[[Job], None] | None = None) -> Job:
        """Queue ``work.ids`` for the batcher under the admission ``ticket``; ``on_done``
        as ``Batcher.submit`` takes it."""
        assert work.deadline is not None
        return self.batcher.submit(work.ids, work.deadline, work.disconnected, ticket=ticket,
                                   flow=work.flow, on_done=on_done, origin=work.front,
                                   tenant=work.tenant, unit=wants_units(work))

    def submit_many(self, works: Sequence[tuple[Work, Ticket, Callable[[Job], None]]]
                    ) -> list[Job]:
        """``submit`` for a burst (each work, its open ticket, its ``on_done``), queued with
        one hold of the batcher's lock and one wake-up of its thread."""
        jobs = []
        for work, ticket, on_done in works:
            assert work.deadline is not None
            jobs.append((Job(work.ids, work.deadline, work.disconnected, flow=work.flow,
                             on_done=on_done, origin=work.front, tenant=work.tenant,
                             unit=wants_units(work)), ticket))
        self.batcher.submit_many(jobs)
        return [job for job, _ in jobs]

    def finish(self, work: Work, rows: np.ndarray) -> Embedded:
        """The answer to ``work`` from its raw rows."""
        return WORK_KINDS[work.kind].finish(self.encoder, work, rows)  # checked in ``check``

    def embed_all(self, work: Work, ticket: Ticket | None = None) -> Embedded:
        """Per-token vectors of ``work.ids``, in the calling thread, in slices of at most one
        input at the model's limit, each holding the device between two batches at its
        turn (so another client waits for one input's compute, not for a batch of them);
        dropped when the client leaves or the deadline passes. ``ticket``, its admission,
        held meanwhile, is charged the exact tokens now (``Admission.tokenized``)."""
        encode_tokens = self.encoder.encode_tokens  # type: ignore[attr-defined]
        assert work.deadline is not None
        ids = work.ids
        tokens = sum(map(len, ids))
        if ticket is not None:
            self.admission.tokenized(ticket, tokens)
        tag = self.batcher.start_tag(work.flow, tokens)
        rows: list[np.ndarray] = []
        limits = self.batcher.limits
        turn = min(limits.max_batch_tokens, self.encoder.info.max_input_tokens)
        started = time.monotonic()
        inference = 0.0
        largest = 0
        for part in slices(ids, limits.max_batch_size, turn):
            self._device_turn(len(ids) - len(rows), work.deadline, work.disconnected, tag)
            tag += sum(map(len, part))
            largest = max(largest, len(part))
            computing = time.monotonic()
            try:
                rows.extend(encode_tokens(part))
            finally:
                self.batcher.device_lock.release()
            inference += time.monotonic() - computing
        waited = time.monotonic() - started - inference
        return Embedded(np.empty((len(ids), 0), np.float32), 0, queue_s=waited,
                        inference_s=inference, batch_size=largest, token_vectors=rows)

    def shutdown(self, timeout: float) -> ShutdownReport:
        """Refuse new work (503), finish what was admitted within ``timeout``."""
        return self.batcher.shutdown(timeout)

    def _device_turn(self, left: int, deadline: float, disconnected: Disconnected, tag: float
                     ) -> None:
        """The device lock, taken between two batches at the turn of ``tag`` while the
        request is still wanted."""
        lock = self.batcher.device_lock
        while True:
            still_wanted(self.metrics, left, deadline, disconnected)
            wait = max(0.0, min(_LOCK_WATCH_S, deadline - time.monotonic()))
            if lock.acquire(timeout=wait, tag=tag):
                return



class LocalPort:
    """The model side in this process: what the front side (engine_client.py) calls on a Runner."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.admission = runner.batcher.admission

    @property
    def alive(self) -> bool:
        return self.runner.alive

    @property
    def state(self) -> str:
        return "ready" if self.runner.alive else "unhealthy"

    @property
    def queue_limit(self) -> int:
        return self.admission.limit

    def admit(self, work: Work, tokens: int) -> Ticket:
        """Reserve room for ``work`` before it is tokenized (``Admission.admit``)."""
        self.runner.check(work)
        assert work.deadline is not None
        return self.admission.admit(work.count, tokens, work.deadline, work.disconnected,
                                    work.flow, work.tenant)

    def cancel(self, ticket: Ticket) -> None:
        self.admission.cancel(ticket)  # a no-op once the batcher took it over

    def shutdown(self, timeout: float) -> ShutdownReport:
        return self.runner.shutdown(timeout)

    def submit(self, work: Work, ticket: Ticket) -> Pending:
        if not WORK_KINDS[work.kind].batched:  # checked in ``admit``
            done = self.runner.embed_all(work, ticket)  # in this thread, the ticket held
            return Pending(lambda: done)
        job = self.runner.submit(work, ticket)
        return Pending(lambda: self._answer(work, job))

    def _answer(self, work: Work, job: Job) -> Embedded:
        rows = job.result()  # no timeout: the watchdog fails it at its deadline while queued
        out = self.runner.finish(work, rows)
        out.queue_s, out.inference_s, out.batch_size = job.queue_s, job.inference_s, \
            job.batch_size
        if out.vectors is rows:  # the rows as computed: their unit rows, if the batch had them
            out.units = job.units
        return out


def slices(ids: Sequence[Sequence[int]], max_items: int, max_tokens: int
           ) -> list[list[Sequence[int]]]:
    """``ids`` cut, in order, into runs of at most ``max_items`` and ``max_tokens`` padded
    tokens (a longer input runs alone)."""
    out: list[list[Sequence[int]]] = []
    run: list[Sequence[int]] = []
    longest = 0
    for seq in ids:
        wider = max(longest, len(seq))
        if run and (len(run) >= max_items or wider * (len(run) + 1) > max_tokens):
            out.append(run)
            run, wider = [], len(seq)
        run.append(seq)
        longest = wider
    if run:
        out.append(run)
    return out
