"""The benches' zero-cost simulated device (bench/sim_server.py's ``FreeDevice``): the fake's
rows, to the bit, whatever it remembers."""

from __future__ import annotations

import numpy as np

from bench import sim_server
from bench.sim_server import FreeDevice, fake_encoder
from embedsvc.model.fake import FakeEncoder


def _pair() -> tuple[FreeDevice, FakeEncoder]:
    free = fake_encoder()
    assert isinstance(free, FreeDevice)
    return free, FakeEncoder(dimension=384, max_input_tokens=256, record=False)


def test_its_rows_are_the_fakes_in_any_batch_remembered_or_not() -> None:
    free, fake = _pair()
    a, b, c = [1, 5, 9, 2], [1, 7, 2], [1, 5, 9, 11, 13, 17, 2]
    batches = [[a], [a, b], [c, a, b, a], [b], [c, c], [a, b, c]]
    for batch in batches:
        got = free.encode(batch)
        assert got.dtype == np.float32
        assert got.shape == (len(batch), 384)
        np.testing.assert_array_equal(got, fake.encode(batch))
        for row, ids in zip(got, batch, strict=True):  # each row as its input alone gets it
            np.testing.assert_array_equal(row, fake.vector(ids))


def test_a_batch_written_to_leaves_the_next_one_as_it_was() -> None:
    free, fake = _pair()
    first = free.encode([[1, 5, 2]])
    first[:] = 0.0  # whoever takes a batch may normalise it in place
    np.testing.assert_array_equal(free.encode([[1, 5, 2]]), fake.encode([[1, 5, 2]]))


def test_it_remembers_a_bounded_number_of_rows(monkeypatch) -> None:
    monkeypatch.setattr(sim_server, "_KNOWN_MOST", 4)
    free, fake = _pair()
    batches = [[[1, i, 2] for i in range(k, k + 3)] for k in range(3, 30, 3)]
    for batch in batches:
        np.testing.assert_array_equal(free.encode(batch), fake.encode(batch))
        assert len(free._known) <= 4
