"""The models one service serves: their names, aliases, and each one's settings.

One model (MODEL) is the default, and what every route serves. Several are listed by
MODELS (``NAME=SOURCE,...``) or in MODELS_FILE, a TOML file::

    [[models]]
    name = "embedder"
    source = "/models/bge-small"        # as MODEL: a directory, a hub id, or empty (bundled)
    aliases = ["text-embedding-3-small"]
    [models.settings]                   # this model's own engine settings, as the variables
    max_batch_tokens = 8192
    kind = "embedding"

    [[models]]
    name = "reranker"
    source = "/models/bge-reranker-base"

Each model runs in its own engine (one batcher, one admission, its own process under
``--workers N``); the service's other settings (the port, keys, timeouts) are shared.
Requests choose a model by name or alias (``Service.choose``).

>>> [(e.name, e.settings.model) for e in catalog(Settings(models="a=/m/a, b=/m/b"))]
[('a', '/m/a'), ('b', '/m/b')]
>>> [e.name for e in catalog(Settings())]
['']
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import Settings, SettingsError

# The settings a model may set for itself: what its engine loads, places and batches with.
OWN = ("kind", "device", "dtype", "backend", "quantize", "quantize_min_recall",
       "onnx_threads", "max_batch_tokens", "max_batch_size", "max_wait_ms", "max_queue",
       "max_queue_tokens", "auto_truncate")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


@dataclass(frozen=True)
class Entry:
    """One served model: its ``name`` ("" for the one model of MODEL), the other names
    clients may send for it, and its settings (MODEL is its source)."""

    name: str
    settings: Settings
    aliases: tuple[str, ...] = ()


def catalog(settings: Settings) -> list[Entry]:
    """The models ``settings`` serve, in order; SettingsError, in one line, for a list that
    cannot be served."""
    if settings.models_file and settings.models:
        raise SettingsError("MODELS and MODELS_FILE are both set: set one")
    if settings.models_file:
        rows = _read_file(settings.models_file)
    elif settings.models:
        rows = [_parse_item(item) for item in settings.models.split(",") if item.strip()]
    else:
        return [Entry("", settings)]
    if not rows:
        raise SettingsError("MODELS lists no model")
    entries = [_entry(settings, row) for row in rows]
    # as requests name them: Ollama's clients add ":latest" to a name without a tag
    names = [n for e in entries
             for n in dict.fromkeys(m.removesuffix(":latest") for m in (e.name, *e.aliases))]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SettingsError(f"MODELS: model names must differ: {', '.join(twice)} names two "
                            "models")
    return entries


def index_settings(settings: Settings, index: int) -> Settings:
    """The settings of the ``index``-th model (its engine process's)."""
    return catalog(settings)[index].settings


def _parse_item(item: str) -> dict[str, Any]:
    name, sep, source = item.strip().partition("=")
    if not sep:
        raise SettingsError(f"MODELS: {item.strip()!r} is not NAME=SOURCE")
    return {"name": name.strip(), "source": source.strip()}


PINNED = "models.toml"  # a run's own copy of MODELS_FILE, in its private directory


def pinned(settings: Settings, directory: Path) -> Settings:
    """``settings`` reading MODELS_FILE as the run found it: the file copied into the run's
    private ``directory`` by the first process to come (made whole under a name of its own,
    then linked in place: a later one finds it, or loses the race and takes the winner's),
    so that an engine or a worker started later, after the file was edited, serves the list
    the run started with, and an engine's index names the same model in every process."""
    if not settings.models_file:
        return settings
    target = directory / PINNED
    if not target.exists():
        try:
            data = Path(settings.models_file).read_bytes()
        except OSError:  # catalog() says why, in one line
            return settings
        made = directory / f".{PINNED}.{os.getpid()}"
        fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(made, target)
        except FileExistsError:
            pass
        finally:
            made.unlink()
    return dataclasses.replace(settings, models_file=str(target))


def _read_file(path: str) -> list[dict[str, Any]]:
    import tomllib  # only where a file lists the models: not on every start

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"MODELS_FILE {path}: {exc}") from None
    rows = data.get("models")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SettingsError(f"MODELS_FILE {path}: expected [[models]] tables")
    return rows


def _entry(base: Settings, row: dict[str, Any]) -> Entry:
    name = row.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise SettingsError(f"MODELS: a model's name must be 1-128 letters, digits and ._:/- "
                            f"(got {name!r})")
    unknown = set(row) - {"name", "source", "aliases", "settings"}
    if unknown:
        raise SettingsError(f"model {name}: unknown field {sorted(unknown)[0]!r}")
    own = row.get("settings") or {}
    if not isinstance(own, dict):
        raise SettingsError(f"model {name}: settings must be a table ([models.settings])")
    if set(own) - set(OWN):
        wrong = sorted(set(own) - set(OWN))
        raise SettingsError(f"model {name}: {wrong[0]!r} is not a model's own setting (those "
                            f"are {', '.join(OWN)}; its source is 'source')")
    source = row.get("source", "")
    if not isinstance(source, str):
        raise SettingsError(f"model {name}: source must be a string")
    aliases = row.get("aliases") or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) and _NAME.fullmatch(a)
                                                for a in aliases):
        raise SettingsError(f"model {name}: aliases must be a list of names, each 1-128 "
                            "letters, digits and ._:/-")
    if "max_queue" in own and "max_inputs_per_request" not in own and \
            base.max_inputs_per_request == min(2048, base.max_queue or 2048):
        # the base's was derived from its own MAX_QUEUE: this model's derives from its own
        own = {**own, "max_inputs_per_request": None}
    try:
        settings = dataclasses.replace(base, model=source, models="", models_file=None, **own)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"model {name}: {exc}") from None
    return Entry(name, settings, tuple(aliases))
