"""What ``embedsvc serve`` checks before it loads the model: that the settings fit this machine.

Each problem is one line that names the setting and the fix, with the exit code it deserves
(2: a setting that cannot work, 1: the machine refuses, e.g. a port already in use), so that
the user learns it in a second rather than after the model has loaded, and without a
traceback.

>>> check_model("/no/such/model")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
embedsvc.serving.preflight.PreflightError: setting MODEL (...) cannot be '/no/such/model': ...
"""

from __future__ import annotations

import errno
import os
import socket

from ..settings import ENV_PREFIX, Settings, SettingsError

USAGE, FAILURE = 2, 1


class PreflightError(Exception):
    """A setting this machine cannot serve with; ``exit_code`` is 2 (usage) or 1 (failure)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_serving(settings: Settings) -> None:
    """Raise PreflightError for the first setting that cannot work here (each model's, with
    several)."""
    from ..catalog import catalog

    try:
        entries = catalog(settings)
    except SettingsError as exc:
        raise PreflightError(str(exc), USAGE) from None
    for entry in entries:
        own = entry.settings
        check_model(own.model)
        check_hub(own)
        check_kind(own)
        check_device(own.device)
    if len(entries) > 1:
        check_memory([(entry.name, entry.settings) for entry in entries])
    check_tracing(settings.otlp_endpoint)
    check_listen(settings.host, settings.port)
    check_keys(settings.keys_file, settings.api_key)


def check_memory(entries: list[tuple[str, Settings]]) -> None:
    """Several models: their weights against the memory of the devices they are set for
    (memory.py), refused in one line when they do not fit."""
    from .memory import MemoryRefused
    from .memory import check_memory as weigh

    try:
        weigh(entries)
    except MemoryRefused as exc:
        raise PreflightError(str(exc), FAILURE) from None


def check_keys(path: str | None, api_key: str | None = None) -> None:
    """A KEYS_FILE that is there, parses and does not clash with API_KEY (a reload that fails
    later keeps the keys)."""
    if not path:  # before the import: a start without keys loads its model sooner
        return
    from ..tenants import KeysFileError, parse_keys, read_keys_file, with_api_key

    try:
        with_api_key(parse_keys(read_keys_file(path)), api_key)
    except OSError as exc:
        raise setting_error("KEYS_FILE", path, exc.strerror or str(exc)) from None
    except KeysFileError as exc:
        raise setting_error("KEYS_FILE", path, str(exc)) from None


def setting_error(name: str, value: object, why: str) -> PreflightError:
    flag = "--" + name.lower().replace("_", "-")
    return PreflightError(f"setting {name} (env {ENV_PREFIX}{name}, flag {flag}) cannot be "
                          f"{value!r}: {why}", USAGE)


def check_model(model: str) -> None:
    """A MODEL that is a local path must be a directory; a hub id is checked when it loads."""
    if not model:
        return
    if os.path.exists(model):
        if not os.path.isdir(model):
            raise setting_error("MODEL", model, "a file, not a model directory")
    elif os.path.isabs(model) or model.startswith((".", "~")):
        raise setting_error("MODEL", model, "no such directory")


def check_hub(settings: Settings) -> None:
    """A MODEL that names a hub repository, with no record of it here, must be in the hub
    cache or fetchable now: said in seconds, not after a minute of retries."""
    from ..model.hub import ModelUnavailable, check_fetchable, repository
    from ..model.lean import recorded

    if repository(settings.model) is None or recorded(settings):
        return
    try:
        check_fetchable(settings.model)
    except ModelUnavailable as exc:
        raise PreflightError(f"{exc}", FAILURE) from None


def check_kind(settings: Settings) -> None:
    """A KIND must name a head the model has (read from its config files, for a model on
    disk; a hub model's are read when it loads)."""
    from ..model.hub import repository
    from ..model.kinds import KindMismatch, resolve

    if settings.kind == "auto" or repository(settings.model) is not None:
        return
    try:
        resolve(settings.kind, settings.model)
    except KindMismatch as exc:
        raise setting_error("KIND", settings.kind, str(exc)) from None
    except (OSError, ValueError):
        return  # unreadable config files: the load says what is wrong


def check_device(device: str) -> None:
    """A DEVICE other than auto or cpu must exist here."""
    if device in ("auto", "cpu"):
        return
    from ..model.device import pytorch_installed

    if not pytorch_installed():
        raise setting_error("DEVICE", device, "only PyTorch serves on an accelerator, and this "
                            "install has none: pip install 'embedsvc[torch]', or set "
                            "EMBEDSVC_DEVICE=cpu")
    import torch

    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise PreflightError("DEVICE is 'mps' but torch sees no Apple GPU here: set "
                                 "EMBEDSVC_DEVICE=auto or cpu", FAILURE)
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        seen = f"{count} CUDA device(s)" if count else "no CUDA device"
        raise PreflightError(f"DEVICE is {device!r} but torch sees {seen}: check the driver and "
                             "CUDA_VISIBLE_DEVICES, or set EMBEDSVC_DEVICE=auto or cpu", FAILURE)


def check_tracing(endpoint: str) -> None:
    """Traces asked for need the OpenTelemetry packages (the ``otel`` extra)."""
    if not endpoint:
        return
    from ..api.tracing import check_installed

    try:
        check_installed(endpoint)
    except SettingsError as exc:
        raise PreflightError(str(exc), USAGE) from None


def check_listen(host: str, port: int) -> None:
    """HOST must name an address of this machine and PORT be free on it."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise setting_error("HOST", host, f"{exc.strerror} (an address of this machine, e.g. "
                            "127.0.0.1, or 0.0.0.0 for every interface)") from None
    family, kind, proto, _, address = found[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise PreflightError(listen_failure(host, port, exc), FAILURE) from None


def listen_failure(host: str, port: int, exc: OSError) -> str:
    """The one line for a socket that cannot listen on ``host:port``."""
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (f"{where}: the port is in use (another embedsvc, or `make serve`?); stop it "
                "or choose another port with --port or EMBEDSVC_PORT")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"{where}: {host} is not an address of this machine; set --host or "
                "EMBEDSVC_HOST to 127.0.0.1, 0.0.0.0 or one of its addresses")
    if exc.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need root); choose a higher port"
    return f"{where}: {exc.strerror or exc}"


LISTEN_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})
