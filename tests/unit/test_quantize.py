"""model/quantize.py: the codes against sentence-transformers', and the calibration cache."""

import dataclasses
import errno
import logging

import numpy as np
import pytest

from embedsvc.model import quantize
from embedsvc.model.encoder import ModelInfo
from embedsvc.model.quantize import Calibration, Scale
from embedsvc.model.retrieval import recall

ROWS = np.random.default_rng(1).standard_normal((50, 37)).astype(np.float32)


def test_bits_are_packed_as_sentence_transformers_packs_them():
    from sentence_transformers.util.quantization import quantize_embeddings

    for dtype in ("binary", "ubinary"):
        want = quantize_embeddings(ROWS, precision=dtype)
        got = quantize.quantize(ROWS, dtype)
        assert got.dtype == want.dtype and got.shape == (50, 5)
        assert np.array_equal(got, want)


def test_int8_codes_are_the_values_in_steps_of_one_scale_zero_for_zero():
    scale = Scale(float(np.abs(ROWS).max()))
    got = quantize.quantize(ROWS, "int8", scale)
    assert got.dtype == np.int8 and np.abs(got).max() == 127
    step = scale.reach / 127
    np.testing.assert_array_equal(got, np.rint(ROWS / step))  # every dimension, one step
    assert (quantize.quantize(np.zeros((1, 37), np.float32), "int8", scale) == 0).all()
    np.testing.assert_array_equal(quantize.quantize(-ROWS, "int8", scale), -got)
    uint8 = quantize.quantize(ROWS, "uint8", scale)
    assert uint8.dtype == np.uint8
    assert np.array_equal(uint8.astype(int) - 128, got.astype(int))
    for dtype, codes in (("int8", got), ("uint8", uint8)):
        back = quantize.dequantize(codes, dtype, scale)
        assert np.abs(back - ROWS).max() <= step / 2 + 1e-6


def test_values_past_the_reach_get_the_end_codes():
    codes = quantize.quantize(np.array([[-5.0, 7.0, 0.5]], np.float32), "int8", Scale(1.0))
    assert codes.tolist() == [[-127, 127, 64]]


def test_dot_products_of_codes_rank_as_the_floats_and_the_old_ranges_did_not():
    """Dimensions of unequal spread, as a model's are: one scale keeps the dot product's
    order; a scale per dimension (what was served before) reweights the dimensions."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((400, 64)) * np.linspace(0.2, 2.0, 64)
    rows = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)
    codes = quantize.quantize(rows, "int8", Calibration(rows[:200]).scale()).astype(np.float32)
    truth = rows[200:] @ rows[200:].T
    assert recall(truth, codes[200:] @ codes[200:].T) >= 0.97
    per_dimension = np.rint(rows / (np.abs(rows[:200]).max(axis=0) * 1.5 / 127))
    assert recall(truth, per_dimension[200:] @ per_dimension[200:].T) < 0.9


def test_the_scale_is_the_reach_whose_codes_keep_the_most_neighbours():
    calibration = Calibration(ROWS)
    scale = calibration.scale()
    normed = ROWS / np.linalg.norm(ROWS, axis=1, keepdims=True)
    largest = np.abs(normed).max()
    kept = {}
    for factor in quantize.REACHES:
        codes = quantize.quantize(normed, "int8", Scale(largest * factor)).astype(np.float32)
        kept[factor] = recall(normed @ normed.T, codes @ codes.T)
    best = max(kept.values())
    assert scale.reach / largest == pytest.approx(max(f for f in kept if kept[f] == best))
    assert calibration.scale() is scale  # chosen once per shape


def test_the_scale_follows_the_requests_shape():
    calibration = Calibration(ROWS)
    cut = ROWS[:, :8] / np.linalg.norm(ROWS[:, :8], axis=1, keepdims=True)
    assert calibration.scale(dimensions=8) == quantize.best_scale(cut)
    assert calibration.scale(normalize=False) == quantize.best_scale(ROWS)
    assert calibration.scale(normalize=False).reach > 2  # raw rows: their own magnitude


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_calibration_that_is_not_finite_or_has_a_zero_row_is_refused(bad):
    rows = ROWS.copy()
    rows[7, 3] = bad
    with pytest.raises(quantize.CalibrationError, match="not finite"):
        Calibration(rows)
    rows = ROWS.copy()
    rows[7] = 0
    with pytest.raises(quantize.CalibrationError, match="zeros"):
        Calibration(rows)


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


TEXTS = [f"text {i}" for i in range(20)]
TABLE = np.random.default_rng(4).standard_normal((20, 6)).astype(np.float32)
INFO = ModelInfo(name="m", dimension=6, max_input_tokens=8, vocab_size=10, device="cpu",
                 dtype="float32")


def counting_embed(calls: list[int]):
    def embed(batch):
        calls.append(len(batch))
        return np.stack([TABLE[int(t.split()[1])] for t in batch])
    return embed


def test_a_calibration_holding_nan_is_computed_again_never_served(tmp_path):
    calls: list[int] = []
    embed = counting_embed(calls)
    quantize.calibrate(tmp_path, INFO, embed, batch=8, texts=TEXTS)
    [path] = tmp_path.glob("*.calibration.npy")
    damaged = TABLE.copy()
    damaged[15, 2] = np.nan  # past the probed rows: the probe alone does not see it
    with open(path, "wb") as out:
        np.save(out, damaged)
    calls.clear()
    again = quantize.calibrate(tmp_path, INFO, embed, batch=8, texts=TEXTS)
    np.testing.assert_array_equal(again.rows, TABLE)
    assert calls == [8, 8, 4, 8]  # computed afresh (and probed before publishing)
    assert np.isfinite(np.load(path)).all()  # the file replaced
    codes = quantize.quantize(TABLE, "int8", again.scale())
    assert (codes != -127).any()


def test_a_calibration_that_cannot_be_written_is_computed_once_and_kept(tmp_path, caplog):
    """``.locks`` a file (its directory cannot be made): computed once, one warning, and every
    later call in the process gets it from memory."""
    (tmp_path / ".locks").write_text("not a directory")
    calls: list[int] = []
    embed = counting_embed(calls)
    caplog.set_level(logging.INFO, logger="embedsvc.model.quantize")
    first = quantize.calibrate(tmp_path, INFO, embed, batch=8, texts=TEXTS)
    second = quantize.calibrate(tmp_path, INFO, embed, batch=8, texts=TEXTS)
    assert second is first and calls == [8, 8, 4]
    np.testing.assert_array_equal(first.rows, TABLE)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "memory" in warnings[0] and "CACHE_DIR" in warnings[0]


def test_a_full_disk_costs_one_calibration_not_one_per_request(tmp_path, monkeypatch, caplog):
    def full(file, rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(quantize.np, "save", full)
    calls: list[int] = []
    embed = counting_embed(calls)
    for _ in range(3):
        got = quantize.calibrate(tmp_path, INFO, embed, batch=8, texts=TEXTS)
        np.testing.assert_array_equal(got.rows, TABLE)
    assert calls == [8, 8, 4]  # the rows computed for the file are the ones kept
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    assert not list(tmp_path.glob("*.npy")) and not list(tmp_path.glob(".*.tmp*"))


def test_the_int8_graphs_batch_dependent_probe_is_accepted_a_changed_model_is_not(tmp_path):
    """The int8 graph gives a text a slightly different vector in another batch (dynamic
    quantization): its cached calibration is still used; float32's must match closely."""
    int8 = dataclasses.replace(INFO, dtype="int8")
    quantize.calibrate(tmp_path, int8, counting_embed([]), batch=8, texts=TEXTS)
    quantize.calibrate(tmp_path, INFO, counting_embed([]), batch=8, texts=TEXTS)
    noise = np.random.default_rng(5).standard_normal(TABLE.shape).astype(np.float32) * 0.05

    def batched_otherwise(batch):
        return np.stack([TABLE[int(t.split()[1])] + noise[int(t.split()[1])] for t in batch])

    calls: list[int] = []
    again = quantize.calibrate(tmp_path, int8, lambda b: calls.append(len(b)) or
                               batched_otherwise(b), batch=8, texts=TEXTS)
    assert calls == [8] and np.array_equal(again.rows, TABLE)  # read back after the probe
    redone = quantize.calibrate(tmp_path, INFO, batched_otherwise, batch=8, texts=TEXTS)
    assert not np.array_equal(redone.rows, TABLE)  # float32: a changed model, calibrated again


def test_an_int8_graph_whose_rows_depend_on_the_batch_passes_its_own_probe(tmp_path):
    """The int8 graph's dynamic quantization scales each batch's activations, so a text's row
    depends on its batch-mates: a probe batched otherwise than the calibration (texts 0-7
    alone, against the batch of 16 they were calibrated in) refused the unchanged model. The
    probe embeds the calibration's first batch again, whose rows are the same."""
    def embed(batch):
        ids = np.array([int(t.split()[1]) for t in batch])
        wobble = np.sin(np.outer(ids + 1, np.arange(6)) * len(batch)) * 0.6
        return TABLE[ids] + wobble.astype(np.float32)

    int8 = dataclasses.replace(INFO, dtype="int8")
    first = quantize.calibrate(tmp_path, int8, embed, batch=16, texts=TEXTS)
    again = quantize.calibrate(tmp_path, int8, embed, batch=16, texts=TEXTS)  # read back
    np.testing.assert_array_equal(again.rows, first.rows)
    alone = embed(TEXTS[:8])  # what the probe saw before: too far for the int8 floor
    batched = first.rows[:8]
    cos = (alone * batched).sum(1) / np.linalg.norm(alone, axis=1) / np.linalg.norm(batched, axis=1)
    assert cos.min() < 0.98
