"""model/quantize.py: the codes against sentence-transformers', and the calibration cache."""

import dataclasses

import numpy as np

from embedsvc.model import quantize
from embedsvc.model.encoder import ModelInfo
from embedsvc.model.quantize import Calibration, Ranges

ROWS = np.random.default_rng(1).standard_normal((50, 37)).astype(np.float32)


def test_bits_are_packed_as_sentence_transformers_packs_them():
    from sentence_transformers.util.quantization import quantize_embeddings

    for dtype in ("binary", "ubinary"):
        want = quantize_embeddings(ROWS, precision=dtype)
        got = quantize.quantize(ROWS, dtype)
        assert got.dtype == want.dtype and got.shape == (50, 5)
        assert np.array_equal(got, want)


def test_int8_codes_span_the_range_and_come_back_within_half_a_step():
    ranges = Ranges(ROWS.min(axis=0), ROWS.max(axis=0))
    got = quantize.quantize(ROWS, "int8", ranges)
    assert got.min() == -127 and got.max() == 127
    middle = quantize.quantize(((ranges.low + ranges.high) / 2)[None], "int8", ranges)
    assert (middle == 0).all()
    uint8 = quantize.quantize(ROWS, "uint8", ranges)
    assert np.array_equal(uint8.astype(int) - 128, got.astype(int))
    for dtype, codes in (("int8", got), ("uint8", uint8)):
        back = quantize.dequantize(codes, dtype, ranges)
        assert np.abs(back - ROWS).max() <= (ranges.high - ranges.low).max() / 254 / 2 + 1e-6


def test_values_past_the_calibrated_range_get_the_end_codes():
    ranges = Ranges(np.zeros(2, np.float32), np.ones(2, np.float32))
    codes = quantize.quantize(np.array([[-5.0, 7.0]], np.float32), "int8", ranges)
    assert codes.tolist() == [[-127, 127]]


def test_ranges_follow_the_requests_shape():
    calibration = Calibration(ROWS)
    cut = ROWS[:, :8] / np.linalg.norm(ROWS[:, :8], axis=1, keepdims=True)
    r = calibration.ranges(dimensions=8)
    assert r.low.shape == (8,)
    reach = np.abs(cut).max(axis=0) * (1 + quantize.MARGIN)
    np.testing.assert_allclose(r.high, reach, rtol=1e-5)
    np.testing.assert_array_equal(r.low, -r.high)  # symmetric: 0.0 is code 0
    zero = quantize.quantize(np.zeros((1, 8), np.float32), "int8", r)
    assert (zero == 0).all()
    raw = calibration.ranges(normalize=False)
    np.testing.assert_allclose(raw.high, np.abs(ROWS).max(axis=0) * (1 + quantize.MARGIN),
                               rtol=1e-5)


def test_the_shipped_set_is_varied_and_unique():
    texts = quantize.calibration_texts()
    assert len(texts) >= 250 and len(set(texts)) == len(texts)


def test_calibration_is_computed_once_then_read_and_checked(tmp_path):
    texts = [f"text {i}" for i in range(20)]
    table = np.random.default_rng(2).standard_normal((20, 6)).astype(np.float32)
    calls = []

    def embed(batch):
        calls.append(len(batch))
        return np.stack([table[int(t.split()[1])] for t in batch])

    info = ModelInfo(name="m", dimension=6, max_input_tokens=8, vocab_size=10, device="cpu",
                     dtype="float32")
    first = quantize.calibrate(tmp_path, info, embed, batch=8, texts=texts)
    np.testing.assert_array_equal(first.rows, table)
    assert calls == [8, 8, 4, 8]  # all, in batches, then the probe before publishing
    calls.clear()
    again = quantize.calibrate(tmp_path, info, embed, batch=8, texts=texts)
    np.testing.assert_array_equal(again.rows, table)
    assert calls == [8]  # read from disk, after the probe agreed
    changed = table + 1.0  # the same name, other weights: calibrated afresh

    def embed_changed(batch):
        return np.stack([changed[int(t.split()[1])] for t in batch])

    np.testing.assert_array_equal(
        quantize.calibrate(tmp_path, info, embed_changed, batch=8, texts=texts).rows, changed)
    other = dataclasses.replace(info, backend="onnx")  # another backend: its own file
    np.testing.assert_array_equal(
        quantize.calibrate(tmp_path, other, embed, batch=8, texts=texts).rows, table)
