"""What one ``embedsvc embed`` job is asked to do: one frozen object that the command line
builds from its flags, and that library callers build themselves.

>>> BulkOptions("corpus.txt", "vectors.npy", chunk_size=64).part_size
10000
>>> BulkOptions("corpus.txt", "vectors.npy", chunk_size=0)
Traceback (most recent call last):
...
embedsvc.bulk.errors.UsageError: --chunk-size must be greater than 0, not 0
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .errors import UsageError

_POSITIVE = ("chunk_size", "concurrency", "part_size", "part_seconds", "actors", "actor_cpus")
# model/quantize.py's DTYPES, named here so that the command line parses without numpy
# (tests/unit/test_bulk.py holds the two equal).
OUTPUT_DTYPES = ("float", "int8", "uint8", "binary", "ubinary")


@dataclass(frozen=True)
class BulkOptions:
    """One job's input, output and how its work is cut (the settings shape the model)."""

    input: str  # a file, or a folder of images; with ray, a file, directory or glob on any
    # filesystem pyarrow reads
    output: str  # .npy, .jsonl or .parquet; with ray, a directory of Parquet shards
    text_field: str = "text"
    id_field: str | None = None  # None: "id" where present, else the line or row number
    image_field: str | None = None  # a column of image paths: an image job (image-text models)
    url: str | None = None  # send to this running server instead of loading the model
    chunk_size: int = 256  # inputs per call to the model or server
    concurrency: int = 4  # chunks in flight
    part_size: int = 10_000  # a part is committed after this many rows...
    part_seconds: float = 30.0  # ...or this long after it opened (the first ones sooner)
    restart: bool = False  # discard an unfinished run of this output
    ray: str | None = None  # None: not on Ray; "": a local Ray or RAY_ADDRESS; else its address
    actors: int | None = None  # with ray: model replicas (None: one per GPU, else 1)
    actor_cpus: float | None = None  # with ray: CPUs of each replica without a GPU
    output_dtype: str = "float"  # or int8/uint8 codes, binary/ubinary bits (model/quantize.py)
    # Settings given as flags rather than EMBEDSVC_* variables: with url, the in-process
    # model's are refused (a variable may be set for a server on the same machine).
    setting_flags: frozenset[str] = frozenset()
    # The command as typed after "embedsvc", to tell an interrupted job how to continue.
    argv: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UsageError(f"--{name.replace('_', '-')} must be greater than 0, "
                                 f"not {value!r}")
        self._check_output_dtype()

    def _check_output_dtype(self) -> None:
        if self.output_dtype not in OUTPUT_DTYPES:
            raise UsageError(f"--output-dtype must be one of {', '.join(OUTPUT_DTYPES)}, "
                             f"not {self.output_dtype!r}")
        if self.output_dtype != "float" and (self.url or self.on_ray):
            raise UsageError("--output-dtype quantizes in this process, with the model's own "
                             "calibration: drop --url or --ray, or ask the server's /v2/embed "
                             "for embedding_types")

    @property
    def on_ray(self) -> bool:
        return self.ray is not None

    @property
    def images(self) -> bool:
        """An image job: ``image_field`` names a column of image paths, or the input is a
        folder of images (with ray, a folder is a dataset of Parquet or JSONL files)."""
        return self.image_field is not None or (not self.on_ray and os.path.isdir(self.input))


def option_default(name: str) -> object:
    """The default of option ``name``: the command line's flags show this one."""
    return next(f.default for f in fields(BulkOptions) if f.name == name)
