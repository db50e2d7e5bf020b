import random
import threading
import time

import numpy as np
import pytest

from embedsvc.batching.batcher import (
    Batcher,
    BatchLimits,
    ShutdownReport,
    _fits_one_batch,
    plan_batch,
)
from embedsvc.errors import (
    BatchFailed,
    ClientDisconnected,
    DeadlineExceeded,
    DeviceOutOfMemory,
    PayloadTooLarge,
    Unavailable,
)
from embedsvc.metrics import Metrics
from embedsvc.model.fake import FakeEncoder

from ..fakes import GatedEncoder


def ids(*words: int) -> list[int]:
    return [1, *words, 2]


def later(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def metrics(registry):
    return Metrics(registry)


def start(encoder, metrics, **limits) -> Batcher:
    values = {"max_batch_size": 256, "max_batch_tokens": 16384, "max_wait_s": 0.0,
              "max_queue": 2048, "max_queue_tokens": 1 << 20, "timeout_s": 30.0,
              "max_request": 1, **limits}
    b = Batcher(encoder.encode, BatchLimits(**values), metrics=metrics)
    b.start()
    return b


def occupy(b: Batcher, enc: GatedEncoder):
    """Put one batch on the device and keep it there until enc.gate is set."""
    enc.hold()
    job = b.submit([ids(999)], later())
    assert enc.entered.wait(5)
    return job


def test_requests_queued_while_the_device_is_busy_share_one_batch(metrics):
    enc = GatedEncoder()
    b = start(enc, metrics)
    first = occupy(b, enc)
    jobs = [b.submit([ids(10 + i, 20 + i)], later()) for i in range(10)]
    enc.gate.set()
    for job in [first, *jobs]:
        job.result(5)
    assert [len(batch) for batch in enc.batches] == [1, 10]
    b.shutdown(1)


def test_each_request_gets_exactly_its_rows_in_order(metrics):
    enc = FakeEncoder(dimension=6, delay_s=0.002)
    b = start(enc, metrics, max_batch_size=16)
    results: dict[int, np.ndarray] = {}
    inputs = {t: [ids(t, k, *([7] * (k % 5))) for k in range(1 + t % 7)] for t in range(40)}

    def client(t: int) -> None:
        results[t] = b.submit(inputs[t], later()).result(10)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(40)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t, rows in results.items():
        assert rows.shape == (len(inputs[t]), 6)
        for row, x in zip(rows, inputs[t], strict=True):
            np.testing.assert_array_equal(row, enc.vector(x))
    assert max(len(batch) for batch in enc.batches) > 1, "nothing was coalesced"
    b.shutdown(1)


def test_a_one_input_job_gets_its_row_at_unit_length_normalised_with_its_batch(metrics):
    """``Batcher.unit``: each one-input job's row, normalised once for the whole batch,
    exactly as normalising that row alone gives it; a job of several inputs gets none (its
    reader normalises its rows together), nor does any job where no ``unit`` is set."""
    from embedsvc.work_kinds import l2_normalize

    enc = GatedEncoder()
    b = start(enc, metrics)
    b.unit = l2_normalize
    first = occupy(b, enc)  # the next three wait together and share one batch
    singles = [b.submit([ids(t, t + 1, 7)], later()) for t in range(3, 5)]
    several = b.submit([ids(5), ids(6, 6)], later())
    enc.gate.set()
    for job in [first, *singles]:
        rows = job.result(5)
        assert job.units is not None and job.units.shape == rows.shape
        np.testing.assert_array_equal(job.units, l2_normalize(rows))
    assert several.result(5).shape == (2, 8) and several.units is None
    assert max(len(batch) for batch in enc.batches) == 4  # the singles' batch held several
    b.unit = None
    plain = b.submit([ids(9)], later())
    plain.result(5)
    assert plain.units is None
    b.shutdown(1)


def test_a_job_knows_the_largest_batch_that_held_its_inputs(metrics):
    """What a request's trace reports as its batch size (api/tracing.py)."""
    enc = GatedEncoder()
    b = start(enc, metrics, max_batch_tokens=40)  # 4 inputs of 10 tokens a batch
    first = occupy(b, enc)
    jobs = [b.submit([ids(*range(10 + i, 18 + i))], later()) for i in range(3)]
    enc.gate.set()
    for job in [first, *jobs]:
        job.result(5)
    split = b.submit([ids(*range(100, 108)) for _ in range(6)], later())  # 4 + 2
    split.result(5)
    assert [len(batch) for batch in enc.batches] == [1, 3, 4, 2]
    assert [job.batch_size for job in [first, *jobs, split]] == [1, 3, 3, 3, 4]
    b.shutdown(1)


def test_item_cap_and_token_budget_hold(metrics):
    enc = GatedEncoder()
    b = start(enc, metrics, max_batch_size=4, max_batch_tokens=24)
    occupy(b, enc)
    jobs = [b.submit([ids(*range(3, 3 + n))], later()) for n in [1, 2, 3, 4, 1, 2, 6, 1, 1, 3]]
    enc.gate.set()
    for job in jobs:
        job.result(5)
    for batch in enc.batches[1:]:
        assert len(batch) <= 4
        assert max(map(len, batch)) * len(batch) <= 24
    assert sum(len(batch) for batch in enc.batches[1:]) == 10
    b.shutdown(1)


def test_plan_batch_takes_the_oldest_and_groups_similar_lengths():
    lengths = [100, 5, 6, 98, 7, 101, 5]
    chosen = plan_batch(lengths, max_items=8, max_tokens=10_000)
    assert 0 in chosen
    assert sorted(chosen) == [0, 3, 5]  # the long ones travel together, the short ones wait
    assert sorted(plan_batch([5, 6, 7], 8, 10_000)) == [0, 1, 2]
    assert plan_batch([50], 1, 10) == [0]  # one over-budget input still runs, alone
    chosen = plan_batch([10] * 20, max_items=8, max_tokens=1000)
    assert len(chosen) == 8 and 0 in chosen


def test_plan_batch_takes_the_run_of_the_input_whose_turn_it_is():
    lengths = [100, 5, 6, 98, 7, 101, 5]
    assert sorted(plan_batch(lengths, 8, 10_000, first=4)) == [1, 2, 4, 6]
    assert sorted(plan_batch(lengths, 8, 10_000, first=3)) == [0, 3, 5]


def test_a_queue_taken_whole_without_planning_is_what_the_plan_takes():
    """``_take``'s shortcut: where ``_fits_one_batch`` says so, ``plan_batch`` takes every
    input whichever must be held; and it says so for most queues a batch can empty."""
    rng = np.random.default_rng(7)
    shortcuts = 0
    for _ in range(3000):
        count = int(rng.integers(1, 40))
        lengths = [int(n) for n in rng.integers(3, int(rng.choice([12, 40, 300])), size=count)]
        items, tokens = int(rng.choice([8, 32, 256])), int(rng.choice([400, 2000, 16384]))
        if not _fits_one_batch(lengths, items, tokens):
            continue
        shortcuts += 1
        tags = [float(t) for t in rng.permutation(count)]
        for first in {0, count - 1, int(rng.integers(count))}:
            assert sorted(plan_batch(lengths, items, tokens, first, tags)) == list(range(count))
    assert shortcuts > 500
    assert not _fits_one_batch([10] * 9, 8, 10_000)  # over the item cap
    assert not _fits_one_batch([5, 300], 8, 10_000)  # 295 tokens of padding
    assert not _fits_one_batch([50], 1, 10)  # over the token budget: plan_batch runs it alone


def test_a_request_split_over_batches_takes_turns_with_later_ones(metrics):
    """A large request does not hold the device until its last batch: one that arrives
    while its first batch computes runs next, before the rest of it."""
    enc = GatedEncoder(delay_s=0.05)  # a device of measurable speed: 50 ms a batch
    b = start(enc, metrics, max_batch_tokens=40)  # 4 inputs of 10 tokens a batch
    b.submit([ids(1)], later()).result(5)  # one batch measures the device's rate
    enc.hold()
    big = b.submit([ids(*range(100, 108)) for _ in range(12)], later())  # three batches
    assert enc.entered.wait(5)  # the first batch of the large request is on the device
    small = b.submit([ids(*range(7, 17))], later())  # 12 tokens: a batch of its own
    enc.gate.set()
    small.result(5)
    big.result(5)
    sizes = [(len(batch), max(map(len, batch))) for batch in enc.batches[1:]]
    assert sizes == [(4, 10), (1, 12), (4, 10), (4, 10)]
    b.shutdown(1)


def test_padding_stays_low_for_mixed_lengths():
    rng = np.random.default_rng(1)
    lengths = list(rng.integers(5, 260, size=256))
    real = padded = 0
    while lengths:
        chosen = plan_batch(lengths, 256, 16384)
        batch = [lengths[i] for i in chosen]
        real += sum(batch)
        padded += max(batch) * len(batch)
        lengths = [n for i, n in enumerate(lengths) if i not in set(chosen)]
    assert real / padded >= 0.8


def test_a_failing_batch_fails_only_its_requests_and_serving_goes_on(metrics, registry):
    enc = GatedEncoder(fail=lambda batch: RuntimeError("boom") if [1, 666, 2] in batch else None)
    b = start(enc, metrics, max_batch_size=1)
    occupy(b, enc)
    bad = b.submit([ids(666)], later())
    good = b.submit([ids(5)], later())
    enc.gate.set()
    with pytest.raises(BatchFailed) as info:
        bad.result(5)
    assert info.value.status == 500
    np.testing.assert_array_equal(good.result(5)[0], enc.vector(ids(5)))
    np.testing.assert_array_equal(b.submit([ids(8)], later()).result(5)[0], enc.vector(ids(8)))
    assert registry.get_sample_value("embedsvc_batch_failures_total") == 1
    assert b.admitted == 0
    b.shutdown(1)


def test_rows_out_must_equal_rows_in(metrics):
    class Short(FakeEncoder):
        def encode(self, batch):
            return super().encode(batch)[:-1]

    b = start(Short(), metrics)
    with pytest.raises(BatchFailed):
        b.submit([ids(1), ids(2)], later()).result(5)
    b.shutdown(1)


def test_a_full_admission_makes_the_next_request_wait_for_room_not_fail(metrics):
    enc = GatedEncoder()
    b = start(enc, metrics, max_queue=4, max_batch_size=4)
    occupy(b, enc)  # 1 input in flight
    queued = b.submit([ids(3), ids(4), ids(5)], later())  # 4 admitted
    assert (b.admitted, b.admission.used_tokens) == (4, 3 + 3 * 3)
    done = []
    waiter = threading.Thread(target=lambda: done.append(b.submit([ids(6)], later()).result(5)))
    waiter.start()
    time.sleep(0.05)
    assert b.admission.waiting == 1 and not done
    enc.gate.set()
    queued.result(5)
    waiter.join(5)
    np.testing.assert_array_equal(done[0][0], enc.vector(ids(6)))
    assert (b.admitted, b.admission.used_tokens) == (0, 0)
    b.shutdown(1)


def test_a_departed_client_loses_its_queued_inputs_even_after_some_were_computed(metrics,
                                                                                  registry):
    enc = GatedEncoder()
    b = start(enc, metrics, max_batch_size=2)
    enc.hold()
    gone = threading.Event()
    job = b.submit([ids(10 + i) for i in range(8)], later(), disconnected=gone.is_set)
    assert enc.entered.wait(5)  # its first two inputs are on the device: the job has started
    gone.set()
    assert b.cancel_due() == 1
    with pytest.raises(ClientDisconnected):
        job.result(1)
    enc.gate.set()
    b.submit([ids(5)], later()).result(5)
    assert registry.get_sample_value("embedsvc_dropped_inputs_total",
                                     {"reason": "disconnected"}) == 6
    assert sum(len(batch) for batch in enc.batches) == 2 + 1  # the six queued never ran
    assert (b.admitted, b.admission.used_tokens) == (0, 0)
    b.shutdown(1)


@pytest.mark.parametrize("stalled_batch_ends", ["after the report", "during the join"])
def test_the_drain_report_counts_inputs_computed_and_failed_of_a_long_request(
        metrics, stalled_batch_ends):
    class Stalling(FakeEncoder):
        """Holds its 2nd batch until ``resume``, its 4th until ``finish``."""

        def __init__(self):
            super().__init__()
            self.resume, self.finish = threading.Event(), threading.Event()
            self.calls = 0

        def encode(self, batch):
            self.calls += 1
            if self.calls in (2, 4):
                assert (self.resume if self.calls == 2 else self.finish).wait(10)
            return super().encode(batch)

    enc = Stalling()
    b = start(enc, metrics, max_batch_size=2)
    job = b.submit([ids(10 + i) for i in range(10)], later())  # five batches of two
    while enc.calls < 2:
        time.sleep(0.005)
    reports = []
    drain = threading.Thread(target=lambda: reports.append(b.shutdown(0.5)))
    drain.start()
    enc.resume.set()  # batches 2 and 3 finish while draining; 4 stalls; 5 stays queued
    joining = stalled_batch_ends == "during the join"
    if joining:  # after the 0.5 s timeout, within the thread join's 1 s of slack
        threading.Timer(0.8, enc.finish.set).start()
    drain.join(5)
    enc.finish.set()
    # the request (10 inputs) failed with 503; batches 4 and 5 were never computed for it
    assert reports[0] == ShutdownReport(completed=4, failed=10, clean=joining, uncomputed=2 + 2)
    with pytest.raises(Unavailable) as refused:
        job.result(1)
    assert refused.value.code == "draining" and refused.value.headers["Retry-After"] == "1"
    b._thread.join(5)


def test_a_drain_that_ends_with_a_batch_stuck_on_the_device_counts_its_request(metrics):
    enc = GatedEncoder()
    b = start(enc, metrics)
    job = occupy(b, enc)  # one input, on the device until the gate opens
    report = b.shutdown(0.1)
    enc.gate.set()
    assert report == ShutdownReport(completed=0, failed=1, clean=False, uncomputed=1)
    job.result(5)  # it does finish afterwards, but the process would have exited by now
    b._thread.join(5)


def test_a_request_larger_than_the_admission_limit_is_413_not_an_eternal_429(metrics):
    b = start(FakeEncoder(), metrics, max_queue=4, max_batch_size=4)
    with pytest.raises(PayloadTooLarge, match="MAX_QUEUE"):
        b.submit([ids(i) for i in range(5)], later())
    b.shutdown(1)


def test_a_request_queued_past_its_deadline_is_504_and_never_computed(metrics):
    enc = GatedEncoder()
    b = start(enc, metrics)
    occupy(b, enc)
    late = b.submit([ids(777)], time.monotonic() + 0.05)
    time.sleep(0.1)
    enc.gate.set()
    with pytest.raises(DeadlineExceeded) as info:
        late.result(5)
    assert info.value.status == 504
    b.submit([ids(5)], later()).result(5)
    assert all([1, 777, 2] not in batch for batch in enc.batches)
    assert b.admitted == 0
    b.shutdown(1)


def test_a_late_queued_job_is_cancelled_but_not_one_on_the_device(metrics):
    enc = GatedEncoder()
    b = start(enc, metrics)
    running = occupy(b, enc)
    queued = b.submit([ids(4)], later())
    assert b.cancel_due() == 0
    queued.deadline = running.deadline = 0  # both late now; only the queued one can be failed
    b._earliest_deadline = 0
    assert b.cancel_due() == 1
    enc.gate.set()
    running.result(5)
    with pytest.raises(DeadlineExceeded):
        queued.result(1)
    b.shutdown(1)


def test_out_of_memory_splits_the_batch_and_retries_the_halves(metrics, registry):
    def oom(batch):
        return DeviceOutOfMemory("out of memory") if len(batch) > 2 else None

    enc = GatedEncoder(fail=oom)
    b = start(enc, metrics)
    occupy(b, enc)
    job = b.submit([ids(i) for i in range(3, 9)], later())
    enc.gate.set()
    rows = job.result(5)
    for row, i in zip(rows, range(3, 9), strict=True):
        np.testing.assert_array_equal(row, enc.vector(ids(i)))
    assert registry.get_sample_value("embedsvc_oom_splits_total") >= 1
    b.shutdown(1)


def test_max_wait_lets_a_partial_batch_wait_for_more(metrics):
    enc = FakeEncoder()
    b = start(enc, metrics, max_wait_s=0.3, max_batch_size=8)
    first = b.submit([ids(3)], later())
    time.sleep(0.05)
    second = b.submit([ids(4)], later())
    first.result(5), second.result(5)
    assert [len(batch) for batch in enc.batches] == [2]
    b.shutdown(1)


def test_shutdown_finishes_admitted_work_then_refuses(metrics):
    enc = FakeEncoder(delay_s=0.01)
    b = start(enc, metrics, max_batch_size=2)
    jobs = [b.submit([ids(i)], later()) for i in range(3, 9)]
    report = b.shutdown(5)
    assert report.clean and report.failed == 0
    assert all(job.result(0).shape == (1, 8) for job in jobs)
    with pytest.raises(Unavailable):
        b.submit([ids(3)], later())
    assert not b.alive


def test_metrics_count_batches_inputs_and_tokens(metrics, registry):
    enc = GatedEncoder()
    b = start(enc, metrics)
    occupy(b, enc)
    job = b.submit([ids(3, 4), ids(5)], later())
    ticket = b.admit(4, 40, later())  # a request reserved while it tokenizes
    get = registry.get_sample_value
    # one on the device, two queued, four reserved
    assert (get("embedsvc_in_flight"), get("embedsvc_queue_depth")) == (1, 2)
    assert get("embedsvc_admitted_inputs") == 1 + 2 + 4
    b.admission.cancel(ticket)
    assert get("embedsvc_admitted_inputs") == 3
    enc.gate.set()
    job.result(5)
    b.shutdown(1)
    get = registry.get_sample_value
    assert get("embedsvc_batch_size_count") == 2
    assert get("embedsvc_batch_size_sum") == 3
    assert get("embedsvc_inputs_total") == 3
    assert get("embedsvc_input_tokens_total") == 3 + 4 + 3
    assert get("embedsvc_batch_tokens_sum") == 3 + 4 * 2
    assert get("embedsvc_queue_depth") == 0
    assert get("embedsvc_admitted_inputs") == 0


def test_cancel_due_fails_queued_jobs_past_their_deadline_or_orphaned_but_not_running_ones(metrics):
    enc = GatedEncoder()
    b = start(enc, metrics)
    running = occupy(b, enc)
    gone = threading.Event()
    late = b.submit([ids(5)], time.monotonic() + 0.01)
    orphan = b.submit([ids(6)], later(), disconnected=gone.is_set)
    patient = b.submit([ids(7)], later(), disconnected=gone.is_set)
    time.sleep(0.02)
    assert b.cancel_due() == 1  # only the late one; nobody has left yet
    gone.set()
    patient.disconnected = None  # this client is still there
    assert b.cancel_due() == 1
    with pytest.raises(DeadlineExceeded):
        late.result(1)
    with pytest.raises(ClientDisconnected):
        orphan.result(1)
    enc.gate.set()
    running.result(5)
    np.testing.assert_array_equal(patient.result(5)[0], enc.vector(ids(7)))
    assert all(ids(5) not in batch and ids(6) not in batch for batch in enc.batches)
    assert b.admitted == 0
    b.shutdown(1)


def test_a_job_can_be_waited_on_more_than_once_and_a_timeout_says_not_done(metrics):
    enc = GatedEncoder()
    b = start(enc, metrics)
    job = occupy(b, enc)
    assert job.wait(0.01) is False and not job.done
    enc.gate.set()
    assert job.wait(5) and job.wait(0) and job.done
    np.testing.assert_array_equal(job.result(0)[0], enc.vector(ids(999)))
    b.shutdown(1)


def test_the_device_goes_to_its_waiters_by_tag_then_in_the_order_they_asked():
    from embedsvc.batching.batcher import DeviceLock

    lock, order = DeviceLock(), []
    lock.acquire(tag=1.0)

    def worker(name: str, tag: float) -> None:
        assert lock.acquire(timeout=10, tag=tag)
        order.append(name)
        lock.release()

    waiting = []
    for name, tag in (("late", 50.0), ("batcher", 5.0), ("embed_all", 5.0), ("early", 2.0)):
        t = threading.Thread(target=worker, args=(name, tag))
        t.start()
        waiting.append(t)
        deadline = time.monotonic() + 5
        while len(lock._waiting) < len(waiting) and time.monotonic() < deadline:
            time.sleep(0.001)
    lock.release()
    assert lock.acquire(tag=100.0)  # the releaser asks again: behind all of them
    assert order == ["early", "batcher", "embed_all", "late"]
    assert lock.virtual == 100.0  # the tag of the work that last took the device
    assert not lock.acquire(timeout=0.05, tag=0.0)  # held: a timed wait gives up
    lock.release()
    for t in waiting:
        t.join(5)
    assert not lock.locked() and not lock._waiting
    with pytest.raises(RuntimeError):
        lock.release()


def test_a_client_sending_large_requests_back_to_back_waits_for_a_light_one(metrics):
    """Start-time fair queueing by connection: a flow's work starts where its previous
    work ends, so a light client's request goes before a heavy client's next one, even one
    queued earlier."""
    enc = GatedEncoder()
    b = start(enc, metrics, max_batch_tokens=40)
    heavy = [ids(*range(100, 108)) for _ in range(4)]  # 40 tokens: one batch each
    enc.hold()
    first = b.submit(heavy, later(), flow="heavy")
    assert enc.entered.wait(5)  # on the device
    second = b.submit(heavy, later(), flow="heavy")  # starts where the first ends
    light = b.submit([ids(*range(7, 17))], later(), flow="light")  # submitted after it
    enc.gate.set()
    for job in (first, second, light):
        job.result(5)
    assert [len(batch) for batch in enc.batches] == [4, 1, 4]
    assert light.finished_at < second.finished_at
    # the virtual time is the heavy client's second request's start (40 tokens); the light
    # client's next work starts there, not at the end of its own earlier work (12)
    assert b.device_lock.virtual == 40 and b.start_tag("light", 0) == 40
    assert b.start_tag("heavy", 0) == 80
    b.shutdown(1)


def test_the_flows_remembered_stay_bounded(metrics):
    from embedsvc.batching import batcher as module

    b = start(GatedEncoder(), metrics)
    for flow in range(module._MAX_FLOWS):
        assert b.start_tag(flow, 10) == 0  # each new flow starts at the virtual time now
    assert len(b._flows) == module._MAX_FLOWS and b.start_tag(0, 10) == 10  # flow 0 is ahead
    b.start_tag("one more", 10)  # over the bound, every flow still ahead: all start afresh
    assert b._flows == {} and b.start_tag(0, 10) == 0
    b.shutdown(1)


class Die(BaseException):
    """What kills the batcher thread (an encoder raising past Exception)."""


def test_a_dying_batcher_is_dead_before_its_requests_hear_of_it(metrics, registry):
    def encode(batch):
        raise Die()

    b = Batcher(encode, BatchLimits(max_batch_size=8, max_batch_tokens=1024, max_wait_s=0.0,
                                    max_queue=64, max_queue_tokens=4096, timeout_s=30.0,
                                    max_request=1), metrics=metrics)
    leaving = threading.Event()
    cancel = b._cancel

    def held_cancel(job, error):  # the thread's last step, held once the request has heard
        cancel(job, error)
        leaving.wait(5)

    b._cancel = held_cancel  # type: ignore[method-assign]
    b.start()
    job = b.submit([ids(3)], later())
    with pytest.raises(BatchFailed, match="batcher stopped"):
        job.result(5)
    try:
        assert not b.alive  # the thread still runs its last lines
        assert registry.get_sample_value("embedsvc_batcher_alive") == 0
    finally:
        leaving.set()
    b._thread.join(5)
    assert b.restart() and b.alive
    b.shutdown(1)


def slow_release(b: Batcher, seconds: float = 0.2) -> None:
    """The batcher thread's release of an admission takes ``seconds``."""
    release = b.admission.release

    def slow(inputs: int, tokens: int, tenant: str | None = None) -> None:
        time.sleep(seconds)
        release(inputs, tokens, tenant)

    b.admission.release = slow  # type: ignore[method-assign]


def test_a_request_has_given_its_admission_back_when_it_hears_its_answer(metrics):
    b = start(FakeEncoder(), metrics)
    slow_release(b)
    b.submit([ids(5), ids(6)], later()).result(5)
    assert b.admitted == 0
    b.shutdown(1)


def test_a_failed_batch_has_given_its_admission_back_when_its_requests_hear(metrics):
    def encode(batch):
        raise ValueError("broken")

    b = Batcher(encode, BatchLimits(max_batch_size=8, max_batch_tokens=1024, max_wait_s=0.0,
                                    max_queue=64, max_queue_tokens=4096, timeout_s=30.0,
                                    max_request=1), metrics=metrics)
    b.start()
    slow_release(b)
    with pytest.raises(BatchFailed):
        b.submit([ids(5)], later()).result(5)
    assert b.admitted == 0
    b.shutdown(1)


def test_a_started_request_gets_every_other_batch_under_a_stream_of_light_ones(metrics):
    """The floor of a large request's share: once its first input ran, it has the turn at
    least every other batch, however many light clients queue (issue 41: a 2,048-input
    request beside 16 single-input clients had a seventeenth of the turns)."""
    enc = GatedEncoder()
    b = start(enc, metrics, max_batch_tokens=20)  # two inputs of 10 tokens a batch
    enc.hold()
    big = b.submit([ids(*range(100, 108)) for _ in range(8)], later(), flow="big")
    assert enc.entered.wait(5)  # its first batch is on the device: it has started
    light = [b.submit([ids(*range(10 + i, 18 + i))], later(), flow=f"light{i}")
             for i in range(6)]
    enc.gate.set()
    for job in (big, *light):
        job.result(5)
    owners = ["big" if batch[0][1] == 100 else "light" for batch in enc.batches[1:]]
    # the light flows start at the virtual time and go first, two to a batch, but never
    # two batches in a row while the started request waits
    assert owners[:6] == ["light", "big", "light", "big", "light", "big"]
    b.shutdown(1)


class StepEncoder(FakeEncoder):
    """A fake that holds each batch on the device until the test lets one go (``step``)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        self.seen: list[list[list[int]]] = []  # every batch, as it reaches the device

    def encode(self, batch):
        self.seen.append([list(seq) for seq in batch])
        self.entered.release()
        assert self.go.acquire(timeout=10), "the test never let the batch go"
        return super().encode(batch)

    def step(self) -> None:
        """Let the batch on the device finish; wait for the next one to start."""
        self.go.release()
        assert self.entered.acquire(timeout=5)


def test_a_batch_given_to_the_started_request_does_not_move_new_clients_behind_the_queue(
        metrics):
    """The floor gives the oldest started request a batch of its own tags, far ahead of the
    others'. That batch had set the virtual time to its tags, so a client arriving next
    started there, behind every other client's queued work up to it: under a burst, the
    requests admitted from the FIFO got 504 with their first input never run (issue 45).
    The virtual time is the earliest tag queued: the new client's input runs in the next
    batch that is not the floor's."""
    enc = StepEncoder()
    b = start(enc, metrics, max_batch_tokens=20)  # two inputs of 10 tokens a batch
    try:
        b.submit([ids(*range(100, 108)) for _ in range(8)], later(), flow="big")  # tags 0..70
        assert enc.entered.acquire(timeout=5)  # its first batch (tags 0, 10) is on the device
        for name in ("h1", "h2", "h3"):  # tags 0..50 each
            b.submit([ids(*range(10, 18)) for _ in range(6)], later(), flow=name)
        enc.step()  # the turn's batch: h1's and h2's first inputs (tag 0)
        enc.step()  # the floor's: big's third input (tag 20), and h1's second
        late = b.submit([ids(*range(500, 508))], later(), flow="late")
        enc.step()  # the turn's batch: h3's first input (tag 0), and the late client's
        assert ids(*range(500, 508)) in enc.seen[-1], enc.seen[-1]
    finally:
        for _ in range(20):
            enc.go.release()
        b.shutdown(5)
    late.result(5)


def test_the_queue_model_puts_about_a_batch_ahead_of_a_new_client(metrics):
    """What 429 and Retry-After are computed from: a heavy client's queue is not ahead of a
    new client; its own queued work is ahead of its own next request; equal tags count the
    first input of each flow that came earlier."""
    enc = GatedEncoder()
    b = start(enc, metrics, max_batch_tokens=40)
    occupy(b, enc)  # 3 tokens on the device
    b.submit([ids(*range(100, 108)) for _ in range(20)], later(), flow="heavy")  # 200 tokens
    assert b.tokens_ahead("new") == 3 + 10  # the batch on the device, the heavy flow's first
    assert b.tokens_ahead("heavy") == 3 + 200  # its own queue first
    for i in range(5):
        b.submit([ids(1, 2)], later(), flow=f"light{i}")  # 4 tokens each, all at the same tag
    assert b.tokens_ahead("new") == 3 + 10 + 5 * 4
    enc.gate.set()
    b.shutdown(5)


def test_the_queue_models_bound_is_never_below_the_model_for_any_flow(metrics):
    """Admission decides on ``tokens_ahead_most`` (no walk over the flows) and asks the model
    only where the bound would refuse: a bound below the model for some flow would admit a
    request the model refuses. Random queues of many flows, a started request among them."""
    rng = random.Random(7)
    for _ in range(20):
        enc = GatedEncoder()
        b = start(enc, metrics, max_batch_tokens=rng.choice([8, 40, 200]))
        occupy(b, enc)
        flows = [f"f{i}" for i in range(rng.randint(1, 12))] + [None]
        for _ in range(rng.randint(1, 30)):
            n = rng.randint(1, 6)
            b.submit([ids(*range(rng.randint(1, 9))) for _ in range(n)], later(),
                     flow=rng.choice(flows))
        most = b.tokens_ahead_most()
        for flow in [*flows, "new"]:
            assert b.tokens_ahead(flow) <= most, flow
        enc.gate.set()
        b.shutdown(5)


def test_plan_batch_fills_a_batch_of_equal_lengths_in_the_order_of_their_tags():
    """Inputs of one length from four requests: the batch holding the turn's input takes
    the others with the earliest tags (fair queueing's order), not the earliest submitted;
    in submission order, a burst of same-size requests was served first come, first served
    whatever the tags, past the start admission had promised (504)."""
    tags = [10.0, 11.0, 12.0, 0.0, 20.0, 1.0]  # inputs 3 and 5: new flows, at the virtual now
    chosen = plan_batch([5] * 6, max_items=3, max_tokens=1000, first=3, tags=tags)
    assert sorted(chosen) == [0, 3, 5]


def test_a_wake_up_that_comes_as_the_threads_wait_times_out_is_kept_and_taken_once(metrics):
    """The thread sleeps on a held lock that a submit releases. A submit that rings after
    the sleep timed out, before the thread has its lock back, leaves the bell open: the
    thread counts it as rung (the work it announced is taken now) and closes the bell again,
    so that the next sleep waits for a ring of its own instead of returning at once, turn
    after turn."""
    b = Batcher(FakeEncoder().encode, BatchLimits(256, 16384, 0.0, 64, 1 << 20, 30.0, 1),
                metrics=metrics)  # never started: this thread plays its part
    bell = b._bell

    class LateRing:  # the bell's wait times out, and the ring comes before the relock
        def acquire(self, blocking=True, timeout=-1):
            if timeout == -1:
                return bell.acquire(blocking)
            assert not bell.acquire(timeout=0.01)
            submitter = threading.Thread(target=lambda: b.submit([ids(5)], later()))
            submitter.start()
            submitter.join(5)
            return False

        def release(self):
            bell.release()

    b._bell = LateRing()  # type: ignore[assignment]
    with b._lock:
        assert b._sleep(1.0) is True
        assert not b._asleep and bell.locked()  # closed again, the ring taken
        assert b.depth == 1  # what it announced is queued, for this turn to take
    b._bell = bell
    with b._lock:
        started = time.monotonic()
        assert b._sleep(0.05) is False  # a sleep of its own: no ring left over
        assert time.monotonic() - started >= 0.04
    b.start()  # the thread takes what is queued, then sleeps until the shutdown rings
    assert b.shutdown(5).clean


def test_work_queued_as_the_caller_stops_computing_goes_to_the_thread_at_once(metrics):
    """``here``: the caller that queues computes (the engine's loop over a device that costs
    nothing) and the thread only waits to trim. When the caller stops computing (the loop
    ends) with work still queued, the thread takes it at once, not at its next trim."""
    enc = FakeEncoder(dimension=4)
    b = start(enc, metrics)
    b.here = True
    time.sleep(0.05)  # the thread now waits as ``here`` has it wait
    job = b.submit([ids(5, 6)], later())
    assert not job.wait(0.05)  # nobody computes it: the caller has not come to it
    started = time.monotonic()
    b.here = False
    job.result(2)
    assert time.monotonic() - started < 1.0  # the trim comes after 5 s
    np.testing.assert_allclose(job.result(0)[0], enc.encode([ids(5, 6)])[0], rtol=1e-6)
    b.shutdown(1)


def test_a_batch_of_inputs_with_no_tokens_is_computed_and_the_thread_lives_on(metrics, registry):
    """Its padding efficiency (real over padded tokens) divided by zero in the batcher's
    thread, after the compute and outside its handler: the thread died, and with it every
    request of the batch and the server's health (the engine's front-facing check refuses
    such a frame now; this is the batcher's own guard)."""
    enc = FakeEncoder(dimension=6, record=False)
    b = start(enc, metrics)
    assert b.submit([[]], later()).result(5).shape == (1, 6)
    assert b.alive
    assert b.submit([ids(5)], later()).result(5).shape == (1, 6)
    assert registry.get_sample_value("embedsvc_batch_size_count") == 2
    b.shutdown(1)
