"""Where the engine's socket lives: a private directory (mode 0700, this user's), never TCP.

``embedsvc serve --workers N`` makes a fresh one for each run; gunicorn's workers find the
one named for their master's pid (``owner_dir``). A directory that exists with another owner, other
permissions or as a symlink is never used: another local user must not be able to put a socket
where the fronts will connect, nor read the metrics kept beside it. ``--workers`` then makes
a fresh private one beside it; gunicorn's workers, which must all find the same one, refuse
to start with one line naming the fix.

>>> import tempfile
>>> base = private_dir(Path(tempfile.mkdtemp()) / "run")
>>> oct(base.stat().st_mode & 0o777), engine_address(base).startswith("ipc://")
('0o700', True)
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_SOCKET = "engine.sock"
USAGE_FILE = "quotas"
# the bytes of a Unix socket's path: sun_path holds 108 on Linux, 104 on macOS and the BSDs,
# the terminating NUL included; a longer path fails to bind ("File name too long")
SOCKET_PATH_MAX = 103
# the longest name a run's directory gets: fresh_dir's mkdtemp, or owner_dir's largest pid (the
# fresh directory made beside an untrusted embedsvc-<uid> is shorter than both together)
_LONGEST_RUN_DIR = "engine-4194304"


def private_dir(path: Path) -> Path:
    """``path``, created with mode 0700 if it is not there; RuntimeError if it is there
    but not a directory of this user's that only this user can enter."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=False)
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() \
            or found.st_mode & 0o077:
        raise RuntimeError(f"{path} is not a private directory of this user (owner "
                           f"{found.st_uid}, mode {oct(found.st_mode & 0o777)}); remove it, "
                           "or run as the user who made it")
    return path


def runtime_base() -> Path:
    """This user's directory for the engine's sockets: $XDG_RUNTIME_DIR (a tmpfs only the
    user can enter) when set, else the temporary directory, else /tmp: the first of them
    short enough for a Unix socket's path (``SOCKET_PATH_MAX``) whose ``embedsvc-<uid>``
    is this user's private directory (or can be made one). RuntimeError, in one line,
    when none is: another local user can make ``/tmp/embedsvc-<uid>`` first."""
    refused = []
    for base in _bases():
        try:
            return private_dir(base / f"embedsvc-{os.getuid()}")
        except RuntimeError as exc:
            refused.append(str(exc))
    if not refused:
        raise RuntimeError(
            f"no directory for the engine's socket has a path short enough for a Unix socket "
            f"({SOCKET_PATH_MAX} bytes at most): set XDG_RUNTIME_DIR or TMPDIR to a shorter "
            "directory")
    raise RuntimeError(f"{refused[0]}; or set XDG_RUNTIME_DIR or TMPDIR to a directory of "
                       "this user's")


def fresh_dir() -> Path:
    """A new private directory for one run of ``embedsvc serve --workers N``: in
    ``runtime_base``, or, where another user holds ``embedsvc-<uid>``, a fresh one of its
    own beside it (``mkdtemp`` makes it private, under a name nobody can take first)."""
    try:
        base = runtime_base()
    except RuntimeError:
        bases = _bases()
        if not bases:
            raise
        log.warning("%s/embedsvc-%d is not this user's private directory: the engine's "
                    "socket goes in a fresh one", bases[0], os.getuid())
        return Path(tempfile.mkdtemp(prefix=f"embedsvc-{os.getuid()}-run-", dir=bases[0]))
    return Path(tempfile.mkdtemp(prefix="run-", dir=base))


def owner_dir(pid: int) -> Path:
    """The directory of the engine that serves while ``pid`` lives (the one the workers of
    gunicorn master ``pid`` share: a name each can find, so ``runtime_base`` must be
    trustworthy)."""
    return private_dir(runtime_base() / f"engine-{pid}")


def _bases() -> list[Path]:
    """The candidate directories, in order, whose paths leave room for a socket."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    candidates = [Path(runtime)] if runtime and os.path.isdir(runtime) else []
    candidates += [Path(tempfile.gettempdir()), Path("/tmp")]
    return [base for base in dict.fromkeys(candidates)
            if _fits(base / f"embedsvc-{os.getuid()}" / _LONGEST_RUN_DIR / ENGINE_SOCKET)]


def model_dir(directory: Path, index: int) -> Path:
    """The directory of the ``index``-th model's engine among several (catalog.py): the run's
    own for the first, a subdirectory, private as the run's is, for each other."""
    if index == 0:
        return directory
    own = directory / f"model-{index}"
    with contextlib.suppress(FileExistsError):
        own.mkdir(mode=0o700)
    return own


def usage_file(directory: Path, index: int) -> Path:
    """The file of the tenants' usage that every model's engine maps (tenant_usage.py), from
    the ``index``-th model's directory: in the run's own, beside the first model's socket."""
    return (directory if index == 0 else directory.parent) / USAGE_FILE


def engine_address(directory: Path) -> str:
    path = directory / ENGINE_SOCKET
    if not _fits(path):
        raise RuntimeError(f"{path} is longer than a Unix socket's path may be "
                           f"({SOCKET_PATH_MAX} bytes): use a shorter directory")
    return f"ipc://{path}"


def _fits(path: Path) -> bool:
    return len(os.fsencode(path)) <= SOCKET_PATH_MAX
