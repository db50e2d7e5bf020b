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
    user can enter) when set, else ``embedsvc-<uid>`` in the temporary directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isdir(runtime) else Path(tempfile.gettempdir())
    return private_dir(base / f"embedsvc-{os.getuid()}")


def fresh_dir() -> Path:
    """A new private directory for one run of ``embedsvc serve --workers N``."""
    return Path(tempfile.mkdtemp(prefix="run-", dir=runtime_base()))


def owner_dir(pid: int) -> Path:
    """The directory of the engine that serves while ``pid`` lives (the one the workers of
    gunicorn master ``pid`` share)."""
    return private_dir(runtime_base() / f"engine-{pid}")


def engine_address(directory: Path) -> str:
    return f"ipc://{directory / ENGINE_SOCKET}"
