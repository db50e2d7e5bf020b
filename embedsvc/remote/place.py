"""Where the engine's socket lives: a private directory (mode 0700, this user's), never TCP.

``embedsvc serve --workers N`` makes a fresh one for each run; gunicorn's workers find the
one named for their master's pid (``owner_dir``). A directory that exists with another owner, other
permissions or as a symlink is refused: another local user must not be able to put a socket
where the fronts will connect, nor read the metrics kept beside it.

>>> import tempfile
>>> base = private_dir(Path(tempfile.mkdtemp()) / "run")
>>> oct(base.stat().st_mode & 0o777), engine_address(base).startswith("ipc://")
('0o700', True)
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

ENGINE_SOCKET = "engine.sock"
# the bytes of a Unix socket's path: sun_path holds 108 on Linux, 104 on macOS and the BSDs,
# the terminating NUL included; a longer path fails to bind ("File name too long")
SOCKET_PATH_MAX = 103
# the longest name a run's directory gets: fresh_dir's mkdtemp, or owner_dir's largest pid
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
    short enough for a Unix socket's path (``SOCKET_PATH_MAX``), with ``embedsvc-<uid>`` in
    it. RuntimeError when none is."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    candidates = [Path(runtime)] if runtime and os.path.isdir(runtime) else []
    candidates += [Path(tempfile.gettempdir()), Path("/tmp")]
    for base in candidates:
        mine = base / f"embedsvc-{os.getuid()}"
        if _fits(mine / _LONGEST_RUN_DIR / ENGINE_SOCKET):
            return private_dir(mine)
    raise RuntimeError(
        f"no directory for the engine's socket has a path short enough for a Unix socket "
        f"({SOCKET_PATH_MAX} bytes at most; tried {', '.join(map(str, candidates))}): set "
        "XDG_RUNTIME_DIR or TMPDIR to a shorter directory")


def fresh_dir() -> Path:
    """A new private directory for one run of ``embedsvc serve --workers N``."""
    return Path(tempfile.mkdtemp(prefix="run-", dir=runtime_base()))


def owner_dir(pid: int) -> Path:
    """The directory of the engine that serves while ``pid`` lives (the one the workers of
    gunicorn master ``pid`` share)."""
    return private_dir(runtime_base() / f"engine-{pid}")


def engine_address(directory: Path) -> str:
    path = directory / ENGINE_SOCKET
    if not _fits(path):
        raise RuntimeError(f"{path} is longer than a Unix socket's path may be "
                           f"({SOCKET_PATH_MAX} bytes): use a shorter directory")
    return f"ipc://{path}"


def _fits(path: Path) -> bool:
    return len(os.fsencode(path)) <= SOCKET_PATH_MAX
