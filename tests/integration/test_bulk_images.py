"""`embedsvc embed` over images (issue 48): a folder of PNG and JPEG files of several sizes,
and a JSONL column of their paths, embedded by a tiny random CLIP exported with `embedsvc
export`, as users run the command; the vectors are transformers' own `get_image_features`
after its own processor. Ctrl-C and the rerun it prints end equal to an uninterrupted run,
and a corrupt image fails the job in one line that names its row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from ..models import build_image_text
from .conftest import pin_mtimes
from .test_bulk_interrupt import EXIT_S, Job, saved_and_command
from .test_bulk_resume import assert_same_output, done_rows, read_output

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

ROOT = Path(__file__).resolve().parents[2]
EMBEDSVC = str(Path(sys.executable).with_name("embedsvc"))
PARITY = 0.9999
# (name, width, height): PNG and JPEG, square, wide, tall, larger than the model's input
IMAGES = [("a.png", 30, 30), ("b.jpg", 64, 40), ("sub/c.png", 17, 90), ("sub/d.jpeg", 200, 120)]


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> list[str]:
    """The model flags of a tiny CLIP, exported by `embedsvc export` into its own cache."""
    base = tmp_path_factory.mktemp("bulk-clip")
    path, cache = base / "clip", base / "cache"
    build_image_text(path, "clip")
    pin_mtimes(path)
    flags = ["--model", str(path), "--cache-dir", str(cache)]
    done = subprocess.run([EMBEDSVC, "export", *flags], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return flags


def write_images(folder: Path, sizes: list[tuple[str, int, int]], seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    for name, width, height in sizes:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / name)


def reference(model: str, files: list[Path]) -> np.ndarray:
    """transformers' unit vectors of the image files, after its own processor."""
    net = transformers.AutoModel.from_pretrained(model).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(model)
    with torch.no_grad():
        pixels = processor(images=[Image.open(f) for f in files],
                           return_tensors="pt")["pixel_values"]
        out = net.get_image_features(pixel_values=pixels)
    rows = (out if hasattr(out, "shape") else out.pooler_output).numpy()
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def embed(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([EMBEDSVC, "embed", *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_a_folder_and_a_column_of_paths_give_transformers_vectors(clip, tmp_path):
    folder = tmp_path / "photos"
    write_images(folder, IMAGES)
    (folder / "notes.txt").write_text("not an image: skipped")
    (folder / "._a.png").write_bytes(b"macOS metadata beside a copied image: skipped")
    names = sorted(name for name, _, _ in IMAGES)
    want = reference(clip[1], [folder / name for name in names])

    done = embed(str(folder), "-o", str(tmp_path / "folder.jsonl"), *clip)
    assert done.returncode == 0, done.stderr
    ids, rows = read_output(tmp_path / "folder.jsonl")
    assert ids == names  # the paths relative to the folder, sorted
    cosines = (rows / np.linalg.norm(rows, axis=1, keepdims=True) * want).sum(axis=1)
    assert cosines.min() > PARITY, cosines

    # A JSONL column of paths: relative ones from the file's folder, an absolute one as is.
    listing = tmp_path / "lists" / "images.jsonl"
    listing.parent.mkdir()
    paths = [f"../photos/{name}" for name in names[::-1]]
    paths[0] = str(folder / names[-1])
    listing.write_bytes(b"".join(orjson.dumps({"key": f"k{i}", "path": p}) + b"\n"
                                 for i, p in enumerate(paths)))
    done = embed("images.jsonl", "-o", str(tmp_path / "column.parquet"), "--image-field",
                 "path", "--id-field", "key", *clip, cwd=listing.parent)
    assert done.returncode == 0, done.stderr
    ids, rows = read_output(tmp_path / "column.parquet")
    assert ids == [f"k{i}" for i in range(len(names))]
    cosines = (rows / np.linalg.norm(rows, axis=1, keepdims=True) * want[::-1]).sum(axis=1)
    assert cosines.min() > PARITY, cosines


def test_an_interrupted_image_job_resumes_to_the_uninterrupted_output(clip, tmp_path):
    n = 160
    folder = tmp_path / "photos"
    rng = np.random.default_rng(3)
    write_images(folder, [(f"{i % 4}/{i:03d}.{'png' if i % 2 else 'jpg'}",
                           *map(int, rng.integers(8, 48, 2))) for i in range(n)])
    target, whole = tmp_path / "out.parquet", tmp_path / "whole.parquet"
    # Parts of 4 rows, one chunk of 2 in flight: once a part is in, the job is well under way.
    argv = [str(folder), "-o", str(target), "--chunk-size", "2", "--concurrency", "1",
            "--part-size", "4", *clip]
    job = Job(argv, tmp_path, "first", command=[EMBEDSVC])
    job.wait_until(lambda: done_rows(target) >= 4)
    seconds = job.signal_and_wait(signal.SIGINT)
    assert seconds < EXIT_S and job.proc.returncode == 130, (seconds, job.output)
    saved, again = saved_and_command(job.last_line(), "SIGINT")
    assert 4 <= saved < n and done_rows(target) == saved
    assert again == argv
    rerun = embed(*again)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{n - saved} inputs" in rerun.stderr and f"{saved} done by an earlier" in rerun.stderr
    done = embed(str(folder), "-o", str(whole), *clip)
    assert done.returncode == 0, done.stderr
    assert_same_output(target, whole)


def test_a_corrupt_image_fails_the_job_in_one_line_naming_its_row(clip, tmp_path):
    folder = tmp_path / "photos"
    write_images(folder, IMAGES)
    whole = (folder / "b.jpg").read_bytes()
    (folder / "sub" / "cut.jpg").write_bytes(whole[: len(whole) // 2])  # truncated
    (folder / "sub" / "text.png").write_text("a text file named like an image")
    listing = tmp_path / "images.jsonl"
    listing.write_text('{"path": "photos/a.png"}\n{"path": "photos/sub/text.png"}\n')

    done = embed(str(listing), "-o", str(tmp_path / "column.npy"), "--image-field", "path",
                 *clip)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (  # after the progress bar
        f"embedsvc: {listing}: record 2: the input is image file "
        f"'{tmp_path}/photos/sub/text.png', which does not decode: the data is not an image "
        "in an accepted format (PNG, JPEG, WEBP, GIF, BMP)"), done.stderr

    done = embed(str(folder), "-o", str(tmp_path / "folder.npy"), *clip)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"embedsvc: {folder}: record sub/cut.jpg: the input is image file "
                           f"'{folder}/sub/cut.jpg', which does not decode: the image could not "
                           "be decoded ("), last
    assert "is it truncated?" in last and "Traceback" not in done.stderr
    assert not os.path.exists(tmp_path / "folder.npy")
