"""``embedsvc embed``: embed a whole file or dataset, resumably, in this process, through a
running server, or on a Ray cluster.

Modules: ``records`` (inputs, streamed), ``embedders`` (engine or server), ``kinds`` (which
model kinds it writes, to which outputs), ``parts`` (output written in committed pieces),
``checkpoint`` (the manifest and resume), ``job`` (one file's run), ``dataset`` (files on any
filesystem), ``shards`` (a Ray job's output), ``cluster`` (Ray Data), ``command`` (the
command line's checks and wiring).
"""

from __future__ import annotations

from .embedders import Embedder, LocalEmbedder, RemoteEmbedder
from .errors import BulkError, JobChanged, UsageError
from .job import Summary, embed_file
from .records import Record, count_records, read_records

__all__ = ["BulkError", "Embedder", "JobChanged", "LocalEmbedder", "Record", "RemoteEmbedder",
           "Summary", "UsageError", "count_records", "embed_file", "read_records"]
