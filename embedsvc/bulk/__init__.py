"""``embedsvc embed``: embed a whole file or dataset, resumably, in this process, through a
running server, or on a Ray cluster.

Modules: ``records`` (inputs, streamed), ``embedders`` (engine or server), ``kinds`` (which
model kinds it writes, to which outputs), ``parts`` (output written in committed pieces),
``checkpoint`` (the manifest and resume), ``job`` (one file's run), ``dataset`` (files on any
filesystem), ``shards`` (a Ray job's output), ``cluster`` (Ray Data), ``options`` (what a
job is asked), ``interrupt`` (Ctrl-C and SIGTERM), ``command`` (the command line's checks
and wiring).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use: the command line reads the options' defaults from here for every
# subcommand, and embedders.py brings in the engine.
_EXPORTS = {"BulkError": "errors", "JobChanged": "errors", "UsageError": "errors",
            "BulkOptions": "options", "Interrupted": "interrupt", "Embedder": "embedders",
            "LocalEmbedder": "embedders", "RemoteEmbedder": "embedders", "Summary": "job",
            "embed_file": "job", "Record": "records", "count_records": "records",
            "read_records": "records"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
