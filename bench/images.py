"""CPU cost of an image's decode + preprocess (issue 48): embedsvc.image against transformers'
own image processor, in the same run, on 224 x 224 and 1024 x 768 JPEGs sent as data URIs.

    PYTHONPATH=$PWD flock /tmp/embedsvc-bench.lock .venv/bin/python bench/images.py --record

Both sides decode the same data URI (ours through ``decode_image``'s checks; transformers'
side through a bare ``Image.open`` + ``load``, its processor taking images, not bytes) and
preprocess to CLIP's 224 x 224 (shortest edge, bicubic, centre crop) or SigLIP's fixed size.
The figure is CPU time (``time.process_time``) per image, median of ``--repeat`` runs of
``--images`` images each, one thread.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from embedsvc.image.decode import decode_image
from embedsvc.image.preprocess import Preprocessor

RESULTS = Path(__file__).with_name("RESULTS.md")
SIZES = [(224, 224), (1024, 768)]


def photo(size: tuple[int, int]) -> str:
    """A JPEG data URI of a smooth image with noise, about what a camera gives."""
    w, h = size
    rng = np.random.default_rng(0)
    x, y = np.meshgrid(np.linspace(0, 6, w), np.linspace(0, 4, h))
    base = np.stack([np.sin(x) * 100, np.cos(y) * 100, np.sin(x + y) * 100], -1) + 128
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def cpu_ms(step: Callable[[], object], images: int, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(images):
            step()
        runs.append((time.process_time() - start) / images * 1000)
    return statistics.median(runs)


def bare_decode(uri: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    image.load()
    return image


def measure(kind: str, images: int, repeat: int) -> list[str]:
    import transformers

    theirs = {"clip": transformers.CLIPImageProcessorPil,
              "siglip": transformers.SiglipImageProcessorPil}[kind]()
    ours = Preprocessor.from_config(theirs.to_dict())
    rows = []
    for size in SIZES:
        uri = photo(size)
        mine = cpu_ms(lambda: ours([decode_image(uri)]), images, repeat)  # noqa: B023
        ref = cpu_ms(lambda: theirs(images=[bare_decode(uri)], return_tensors="np"),  # noqa: B023
                     images, repeat)
        decode_only = cpu_ms(lambda: decode_image(uri), images, repeat)  # noqa: B023
        rows.append(f"| {kind} | {size[0]} x {size[1]} | {decode_only:.2f} | {mine:.2f} "
                    f"| {ref:.2f} | {ref / mine:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()
    rows = ["| model | input | decode ms | embedsvc decode + preprocess ms "
            "| transformers decode + preprocess ms | ratio |", "|---|---|---:|---:|---:|---:|"]
    for kind in ("clip", "siglip"):
        rows += measure(kind, args.images, args.repeat)
    print("\n".join(rows))
    if args.record:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with RESULTS.open("a") as out:
            out.write(f"\n## {stamp}: `PYTHONPATH=$PWD flock /tmp/embedsvc-bench.lock "
                      f".venv/bin/python bench/images.py --images {args.images} "
                      f"--repeat {args.repeat} --record`\n\nCPU ms per image (process time, "
                      f"median of {args.repeat} runs of {args.images}), one thread; JPEG data "
                      "URIs. The 2 cores were shared with other work. Ratio: transformers' CPU "
                      "time over embedsvc's.\n\n"
                      + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
