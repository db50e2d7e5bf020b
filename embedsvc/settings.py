"""Every setting in one table: keyword arguments, ``EMBEDSVC_*`` variables and CLI flags.

>>> s = Settings.from_env({"EMBEDSVC_MAX_BATCH_SIZE": "64"}, port=9000)
>>> (s.max_batch_size, s.port)
(64, 9000)
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
ENV_PREFIX = "EMBEDSVC_"
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting has a value it cannot take; the message names the setting and the fix."""


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value

    return parse


def _device(text: str) -> str:
    value = text.strip().lower()
    if not _DEVICE_RE.match(value):
        raise ValueError("expected auto, cpu, cuda, cuda:N or mps")
    return value


def _number(kind: type, text: str) -> Any:
    """``int`` or ``float`` of ``text``, with a message for people rather than Python's."""
    try:
        value = kind(text)
    except ValueError:
        raise ValueError("expected a whole number" if kind is int else "expected a number"
                         ) from None
    if not math.isfinite(value):  # nan would pass every comparison below
        raise ValueError("expected a finite number")
    return value


def _positive(kind: type, most: float) -> Callable[[str], Any]:
    """A number above 0 and at most ``most``: every size and duration has a bound, so that no
    value passes the start and fails later (a wait past ``threading.TIMEOUT_MAX`` raises in
    the thread that waits; a drain of 1e10 s never ends)."""
    def parse(text: str) -> Any:
        value = _number(kind, text)
        if value <= 0:
            raise ValueError("must be greater than 0")
        return _at_most(value, most)

    return parse


def _non_negative(kind: type, most: float) -> Callable[[str], Any]:
    """As ``_positive``, 0 allowed."""
    def parse(text: str) -> Any:
        value = _number(kind, text)
        if value < 0:
            raise ValueError("must be 0 or more")
        return _at_most(value, most)

    return parse


def _at_most(value: Any, most: float) -> Any:
    if value > most:
        raise ValueError(f"must be at most {int(most) if most == int(most) else most}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError("must be greater than 0 and at most 1")
    return value


def _port(text: str) -> int:
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port, 0 to 65535 (0 picks a free one)")
    return value


def _text(text: str) -> str:
    return text


def _optional_text(text: str) -> str | None:
    return text or None


def _api_key(text: str) -> str | None:
    """A key clients can send in an ``Authorization`` header: printable ASCII, no spaces."""
    if text and not all("!" <= c <= "~" for c in text):
        raise ValueError("must be printable ASCII without spaces or line ends, as clients send "
                         "it in the Authorization header (a key read from a file may end in a "
                         "newline)")
    return text or None


def _otlp_endpoint(text: str) -> str:
    """An OTLP/HTTP collector (``http://host:4318``: spans go to its ``/v1/traces``) or the
    full URL that takes its traces; empty: no traces."""
    value = text.strip()
    if not value:
        return ""
    scheme, sep, rest = value.partition("://")
    if scheme.lower() not in ("http", "https") or not sep or not rest.split("/", 1)[0]:
        raise ValueError("expected an http:// or https:// URL of an OTLP/HTTP collector, "
                         "such as http://localhost:4318")
    host, slash, path = rest.partition("/")
    return value if slash and path.strip("/") else f"{scheme}://{host}/v1/traces"


def standard_otlp_endpoint(env: Mapping[str, str]) -> str:
    """OpenTelemetry's own variables, as its exporters read them: the traces URL, else the
    collector's, with ``/v1/traces`` added to it."""
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return base.rstrip("/") + "/v1/traces" if base else ""


def _optional_port(text: str) -> int | None:
    value = text.strip().lower()
    if value in ("", "off", "none"):
        return None
    return _port(value)


_HOUR = 3600.0  # the longest timeout any setting takes
COMMANDS = ("serve", "embed", "export")
_ENGINE = ("serve", "embed")  # the default: the engine, in a server or in a bulk job
_EXPORT = ("serve", "embed", "export")  # also shapes the ONNX graphs that export builds


def _setting(default: Any, parse: Callable[[str], Any], help: str, serve_only: bool = False,
             commands: tuple[str, ...] | None = None, help_for: Mapping[str, str] | None = None,
             secret: bool = False) -> Any:
    """One row of the table. ``commands``: the subcommands that offer it as a flag (by
    default the engine's, ``serve`` and ``embed``; ``serve_only``: the HTTP server's alone).
    ``help_for``: a subcommand's own wording where ``help`` (the server's) does not fit.
    ``secret``: a refused value is not repeated in the message (it goes to logs)."""
    if commands is None:
        commands = ("serve",) if serve_only else _ENGINE
    return field(default=default, metadata={"parse": parse, "help": help,
                                            "serve_only": commands == ("serve",),
                                            "commands": commands,
                                            "help_for": dict(help_for or {}),
                                            "secret": secret})



@dataclass(frozen=True)
class Settings:
    """Validated settings; build with ``Settings(...)``, ``from_env`` or ``from_args``."""

    model: str = _setting("", _text, "local path or model id; empty or all-MiniLM-L6-v2: the "
                          "bundled all-MiniLM-L6-v2", commands=_EXPORT)
    device: str = _setting(
        "auto", _device, "auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N, mps"
    )
    dtype: str = _setting(
        "auto",
        _choice("auto", "float32", "float16", "bfloat16"),
        "auto (float16 on CUDA, float32 elsewhere), float32, float16, bfloat16",
    )
    max_batch_tokens: int = _setting(16384, _positive(int, 1 << 22),
                                     "padded tokens in one device batch")
    max_batch_size: int = _setting(256, _positive(int, 1 << 16), "inputs in one device batch")
    max_wait_ms: float = _setting(
        0.0, _non_negative(float, 60_000),
        "how long a partial batch may wait for more while idle (below REQUEST_TIMEOUT_S)"
    )
    max_queue: int | None = _setting(
        None, _positive(int, 1 << 24),
        "inputs admitted (tokenizing, queued, in flight) at once; more wait in FIFO order; "
        "unset: what the device starts within REQUEST_TIMEOUT_S at its measured rate, at "
        "least MAX_INPUTS_PER_REQUEST and at most 16 times it",
        help_for={"embed": "inputs admitted to the in-process engine at once; chunks beyond "
                  "it wait their turn (unset: sized from the device's measured rate)"},
    )
    request_timeout_s: float = _setting(
        30.0, _positive(float, _HOUR), "deadline from arrival to reaching the model, else 504",
        serve_only=True,
    )
    max_inputs_per_request: int = _setting(
        None, _positive(int, 1 << 24),
        "inputs in one request; unset: 2048, or MAX_QUEUE if set lower",
        help_for={"embed": "inputs in one call to the in-process engine, so the largest "
                  "--chunk-size; unset: 2048, or MAX_QUEUE if set lower"},
    )
    max_body_bytes: int = _setting(16 * 1024 * 1024, _positive(int, 1 << 30),
                                   "largest request body", serve_only=True)
    max_input_chars: int = _setting(
        200_000, _positive(int, 1 << 30),
        "characters in one input string, checked before tokenizing"
    )
    max_images_per_request: int = _setting(
        16, _positive(int, 1024), "images in one request (image-text models)",
        help_for={"embed": "images in one call to the in-process engine: an image job's "
                  "chunks go to it in runs of this many"},
    )
    max_image_bytes: int = _setting(
        10 * 1024 * 1024, _positive(int, 1 << 30),
        "bytes of one image as sent (decoded from base64, or fetched)",
        help_for={"embed": "bytes of one image file; a larger one fails the job, naming it"},
    )
    max_image_pixels: int = _setting(
        40_000_000, _positive(int, 1 << 32),
        "pixels of one decoded image; a header declaring more is refused before decoding",
        help_for={"embed": "pixels of one decoded image; a file whose header declares more "
                  "fails the job before it is decoded"},
    )
    image_url_hosts: str = _setting(
        "", _text,
        "comma-separated hosts whose http(s) image URLs are fetched (never a loopback or "
        "private address); empty: images only as base64 data URIs", serve_only=True,
    )
    auto_truncate: bool = _setting(
        True, _bool, "truncate over-long inputs instead of a 400",
        help_for={"embed": "truncate over-long inputs instead of failing the job at the first"},
    )
    api_key: str | None = _setting(
        None, _api_key,
        "when set, 'Authorization: Bearer <key>' is required; printable ASCII, no spaces",
        help_for={"embed": "with --url: the server's key, sent as 'Authorization: Bearer <key>'"},
        secret=True,
    )
    keys_file: str | None = _setting(
        None, _optional_text,
        "a TOML file of API keys, each with its tenant's name and optional quotas "
        "(requests_per_second, tokens_per_minute, inputs_in_flight); read at start, on SIGHUP "
        "and when it changes (docs/operations.md, tenants)",
        serve_only=True,
    )
    models: str = _setting(
        "", _text,
        "several models behind one port: comma-separated NAME=SOURCE (SOURCE as MODEL); a "
        "request's 'model' field chooses one by NAME, TEI's routes take the first of their "
        "kind; empty: MODEL alone (docs/deployment.md, several models)",
        serve_only=True,
    )
    models_file: str | None = _setting(
        None, _optional_text,
        "a TOML file of models ([[models]] with name, source, aliases and this model's own "
        "settings), instead of MODELS",
        serve_only=True,
    )
    host: str = _setting("127.0.0.1", _text, "address for 'embedsvc serve'", serve_only=True)
    port: int = _setting(8080, _port, "TCP port for 'embedsvc serve' (0: any free port)",
                         serve_only=True)
    threads: int = _setting(16, _positive(int, 4096), "request threads for 'embedsvc serve'",
                            serve_only=True)
    drain_timeout_s: float = _setting(
        30.0, _non_negative(float, _HOUR),
        "on SIGTERM, how long admitted requests may take to finish",
        serve_only=True,
    )
    log_level: str = _setting("info", _choice("debug", "info", "warning", "error"), "log level",
                              commands=COMMANDS)
    log_format: str = _setting("plain", _choice("plain", "json"), "log lines as text or JSON",
                               commands=COMMANDS)
    otlp_endpoint: str = _setting(
        "", _otlp_endpoint,
        "where each request's trace goes (OpenTelemetry, OTLP/HTTP; needs the 'otel' extra): "
        "a collector, http://host:4318, or its traces URL; empty: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT; none of them: "
        "no traces",
        serve_only=True,
    )
    header_timeout_s: float = _setting(
        10.0, _positive(float, _HOUR),
        "a connection's request head must arrive in full within this long (from accept, or "
        "from its first byte on a kept-alive connection), else the connection is closed",
        serve_only=True,
    )
    body_timeout_s: float = _setting(
        60.0, _positive(float, _HOUR),
        "a request body must arrive in full within this long after its head, else 408",
        serve_only=True,
    )
    idle_timeout_s: float = _setting(
        30.0, _positive(float, _HOUR),
        "a kept-alive connection with no request is closed after this",
        serve_only=True,
    )
    send_timeout_s: float = _setting(
        60.0, _positive(float, _HOUR),
        "a connection whose client takes none of its answer for this long is closed and its "
        "buffers freed (as nginx's send_timeout)",
        serve_only=True,
    )
    max_connections: int = _setting(
        1000, _positive(int, 1 << 20),
        "open client connections, at most what the open-files limit holds (the startup line "
        "says how many); past them a new connection gets 503 and is closed",
        serve_only=True,
    )
    health_port: int | None = _setting(
        None, _optional_port,
        "serve /health, /metrics and /info also on this port, with their own threads "
        "(off: not at all; 0: any free port)",
        serve_only=True,
    )
    backend: str = _setting(
        "auto", _choice("auto", "torch", "onnx", "onnx-torch"),
        "auto (PyTorch on CUDA and MPS, ONNX Runtime on the CPU), torch, onnx, onnx-torch "
        "(ONNX Runtime computes the transformer only, PyTorch loaded beside it: the path "
        "before the PyTorch-free one)",
        commands=_EXPORT, help_for={"export": "onnx-torch: build the transformer's graph of "
                                    "that path instead of the PyTorch-free record"},
    )
    quantize: str = _setting(
        "none", _choice("none", "int8"), "none, int8 (ONNX Runtime on the CPU, quality-gated)",
        commands=_EXPORT,
    )
    quantize_min_recall: float = _setting(
        0.97, _fraction, "QUANTIZE=int8 refuses to serve an int8 graph whose vectors keep less "
        "than this share of float32's 10 nearest neighbours (recall@10 on the calibration "
        "set)", commands=_EXPORT,
        help_for={"export": "QUANTIZE=int8 refuses the graph below this recall@10 against "
                  "float32", "embed": "QUANTIZE=int8 refuses to run below this recall@10 "
                  "against float32"},
    )
    cache_dir: str = _setting(
        "", _text, "where exported ONNX graphs are kept; empty: $XDG_CACHE_HOME/embedsvc "
        "(~/.cache/embedsvc)", commands=_EXPORT,
    )
    onnx_threads: int = _setting(
        0, _non_negative(int, 4096),
        "ONNX Runtime intra-op threads; 0: the CPUs this process may use",
        commands=_EXPORT,
    )
    max_queue_tokens: int = _setting(
        1 << 20, _positive(int, 1 << 34),
        "tokens admitted at once (the memory budget of work in progress); a larger request "
        "runs alone",
        help_for={"embed": "tokens admitted to the in-process engine at once (the memory "
                  "budget of chunks in progress); a larger chunk runs alone"},
    )
    kind: str = _setting(
        "auto",
        _choice("auto", "embedding", "reranker", "classifier", "sparse", "image-text"),
        "the model's kind; auto: read from its config files (see docs/api.md, model kinds)",
    )
    workers: int = _setting(
        1, _positive(int, 256),
        "HTTP processes for 'embedsvc serve', sharing its port; with more than one, the model "
        "is in one engine process of its own that every one of them feeds (one model copy, "
        "one batcher)",
        serve_only=True,
    )
    engine: str = _setting(
        "auto", _choice("auto", "inline", "process"),
        "where the model is: auto (in a process of its own when several HTTP processes serve: "
        "'embedsvc serve --workers N' or 'gunicorn -w N'; else in the process that serves), "
        "process (in a process of its own, always), inline (in each serving process: one copy "
        "per gunicorn worker)",
        serve_only=True,
    )
    token_ids: str = _setting(
        "openai",
        _choice("openai", "model"),
        "token-id input on /v1/embeddings: openai (ids of the OpenAI tokenizer of the requested "
        "model, decoded to text) or model (ids of the served model's own vocabulary)",
        serve_only=True,
    )

    def __post_init__(self) -> None:
        # Keyword values pass through the same parsers as the environment's strings, so a
        # bad value fails the same way whichever of the three places it came from.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                text = str(value).lower() if isinstance(value, bool) else str(value)
                object.__setattr__(self, f.name, _parse(f, text))
        if self.workers > 1 and self.engine == "inline":
            raise SettingsError(
                f"WORKERS={self.workers} puts one engine process behind the HTTP processes, "
                "and ENGINE=inline asks for a model in each: set EMBEDSVC_ENGINE=auto (or "
                "--engine auto), or run one process per model copy with gunicorn -w N")
        if self.max_inputs_per_request is None:
            object.__setattr__(self, "max_inputs_per_request", min(2048, self.max_queue or 2048))
        elif self.max_queue is not None and self.max_inputs_per_request > self.max_queue:
            raise SettingsError(
                f"MAX_INPUTS_PER_REQUEST ({self.max_inputs_per_request}) is larger than "
                f"MAX_QUEUE ({self.max_queue}), so the largest requests could never be "
                "admitted: lower EMBEDSVC_MAX_INPUTS_PER_REQUEST / --max-inputs-per-request "
                "or raise EMBEDSVC_MAX_QUEUE / --max-queue"
            )
        if self.max_wait_ms >= self.request_timeout_s * 1000:
            raise SettingsError(
                f"MAX_WAIT_MS ({self.max_wait_ms:g}) is not below REQUEST_TIMEOUT_S "
                f"({self.request_timeout_s:g} s), so a request that waits for a batch to fill "
                "would pass its deadline: lower EMBEDSVC_MAX_WAIT_MS / --max-wait-ms (a few "
                "milliseconds is typical)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: Any) -> Settings:
        """Read ``EMBEDSVC_<NAME>`` from ``env``; keyword ``overrides`` win. A variable of
        that prefix that names no setting gets a warning, once per process."""
        for line in unknown_variables(env):
            if line not in _WARNED:
                _WARNED.add(line)
                log.warning("%s", line)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f, raw)
        if "otlp_endpoint" not in values and standard_otlp_endpoint(env):
            values["otlp_endpoint"] = standard_otlp_endpoint(env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """These settings as ``EMBEDSVC_*`` variables: what a child process (the engine,
        a front) reads back with ``from_env`` to run with exactly them."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                text = str(value).lower() if isinstance(value, bool) else str(value)
                out[ENV_PREFIX + f.name.upper()] = text
        return out

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
        """Settings from parsed CLI flags (see ``add_arguments``) over the environment."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls.from_env(env, **{k: v for k, v in vars(args).items() if k in names})

    @classmethod
    def for_command(cls, command: str) -> list[dataclasses.Field]:
        """The settings ``embedsvc <command>`` offers (the table's ``commands``), in order."""
        return [f for f in dataclasses.fields(cls) if command in f.metadata["commands"]]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, command: str = "serve") -> None:
        """Add a ``--<name>`` flag for each setting of ``command``, described in that
        command's words; unset flags leave the environment's value."""
        for f in cls.for_command(command):
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                default=None,
                type=_flag_parser(f),
                metavar=f.name.upper(),
                help=f"{setting_help(f, command)} "
                f"[env {ENV_PREFIX}{f.name.upper()}; default {f.default!r}]",
            )


_WARNED: set[str] = set()  # the lines of unknown variables this process has said


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """A line for each ``EMBEDSVC_*`` variable of ``env`` that names no setting, with the
    closest name that does: a misspelt setting is otherwise ignored without a word."""
    names = [ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)]
    lines = []
    for name in sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in names):
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX),
                                          [n.removeprefix(ENV_PREFIX) for n in names], n=1)
        hint = (f"did you mean {ENV_PREFIX}{close[0]}?" if close
                else f"the settings are in {SETTINGS_PAGE}")
        lines.append(f"{name} is not a setting, so it is ignored; {hint}")
    return lines


def setting_help(f: dataclasses.Field, command: str = "serve") -> str:
    """What setting ``f`` does under ``embedsvc <command>``."""
    return f.metadata["help_for"].get(command, f.metadata["help"])


def _describe(f: dataclasses.Field, value: Any, exc: Exception) -> str:
    name = f.name.upper()
    given = "the value given" if f.metadata["secret"] else repr(value)
    return (
        f"setting {name} (env {ENV_PREFIX}{name}, flag --{f.name.replace('_', '-')}) "
        f"cannot be {given}: {exc}"
    )


def _parse(f: dataclasses.Field, raw: str) -> Any:
    try:
        return f.metadata["parse"](raw)
    except (TypeError, ValueError) as exc:
        raise SettingsError(_describe(f, raw, exc)) from None


def _flag_parser(f: dataclasses.Field) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return f.metadata["parse"](raw)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


# The settings page, docs/settings.md, is this table rendered; tests/unit/test_docs.py fails
# when the two differ. Regenerate: python -m embedsvc.settings > docs/settings.md
SETTINGS_PAGE = "docs/settings.md"
REGENERATE = f"python -m embedsvc.settings > {SETTINGS_PAGE}"
# What the metadata columns mean, for the page's key; a column without a line here is shown
# with its name only.
def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(map(str, value))
    return str(value).replace("|", "\\|")


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def settings_page() -> str:
    """The markdown of docs/settings.md: one row per field of ``Settings``, with the
    subcommands that offer it as a flag, and a subcommand's own wording where it has one."""
    lines = [
        "# Settings",
        "",
        f"<!-- generated from embedsvc/settings.py by `{REGENERATE}`; edit the table there -->",
        "",
        "Each setting has one name, used three ways: a keyword of "
        "`embedsvc.settings.Settings`, an environment variable `EMBEDSVC_<NAME>`, and a flag "
        "`--<name>` (the flag wins over the variable). A bad value stops the command at "
        "startup with one line naming the setting, its variable and its flag; every number "
        "has an upper bound (a timeout at most an hour), and a variable `EMBEDSVC_*` that "
        "names no setting gets a warning naming the closest one. *Commands* "
        "are the subcommands that offer the flag; the others ignore the setting (its "
        "variable is still checked). What the one-line meanings leave out: "
        "[operations.md](operations.md#settings-in-practice).",
        "",
        "| name | variable | flag | default | meaning | commands |",
        "|---|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(Settings):
        name = f.name.upper()
        meaning = f.metadata["help"] + "".join(
            f"; *{command}*: {text}" for command, text in f.metadata["help_for"].items())
        cells = [f"`{name}`", f"`{ENV_PREFIX}{name}`", f"`--{f.name.replace('_', '-')}`",
                 _default(f.default), _cell(meaning), _cell(f.metadata["commands"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(settings_page(), end="")
