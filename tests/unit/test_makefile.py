"""The Makefile's install: remembered inputs, a rebuild when they change, none otherwise.

Runs the real Makefile in a scratch directory with a stand-in interpreter whose venv's
python records the pip commands instead of installing anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
# The main environment's test install (`make setup` also builds the small .venv-hub1 for the
# huggingface_hub 1.x clients, which has no remembered inputs), and its serve-only install.
MAIN_VENV = ".venv/.installed"
SERVE_ONLY = "setup-serve"
FAKE_PYTHON = """#!/bin/sh
# stand-in for python3: `-m venv [--clear] DIR` makes DIR/bin/python, which logs its calls
[ "$1" = -m ] && [ "$2" = venv ] || exit 64
shift 2
clear=""
if [ "$1" = --clear ]; then clear=1; shift; fi
[ -n "$clear" ] && rm -rf "$1" && echo "clear" >> "$LOG"
mkdir -p "$1/bin"
printf '#!/bin/sh\\necho "pip $*" >> "$LOG"\\n' > "$1/bin/python"
chmod +x "$1/bin/python"
"""


@pytest.fixture
def checkout(tmp_path):
    if shutil.which("make") is None:
        pytest.fail("make is missing")
    for name in ("Makefile", "pyproject.toml", "tests/clients/requirements-hub1.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    python = tmp_path / "fake-python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def clean_env() -> dict[str, str]:
    """This environment without the Makefile's inputs (and an outer make's flags)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHON", "TORCH_PIP_ARGS", "TORCH_SPEC", "VENV", "MAKEFLAGS", "MFLAGS",
                         "MAKELEVEL")}


def make(checkout: Path, *args: str, **env: str) -> list[str]:
    """Run make; the install steps it took (``clear``, ``pip ...``)."""
    log = checkout / "steps.log"
    log.write_text("")
    result = subprocess.run(["make", "-s", *args], cwd=checkout, capture_output=True, text=True,
                            env={**clean_env(), "LOG": str(log), **env}, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return log.read_text().splitlines()


def test_the_install_remembers_its_inputs_and_rebuilds_when_one_changes(checkout):
    python = f"PYTHON={checkout / 'fake-python3'}"
    first = make(checkout, MAIN_VENV, python)
    assert first == ["clear", "pip -m pip install -q torch==2.13.0",
                     "pip -m pip install -q -e .[test]"]
    assert make(checkout, MAIN_VENV) == []  # PYTHON remembered, nothing changed
    cpu = "--index-url https://download.pytorch.org/whl/cpu"
    rebuilt = make(checkout, MAIN_VENV, f"TORCH_PIP_ARGS={cpu}")
    assert rebuilt == ["clear", f"pip -m pip install -q torch==2.13.0 {cpu}",
                       "pip -m pip install -q -e .[test]"]
    assert make(checkout, MAIN_VENV) == []  # the CPU build is kept without being asked again
    assert make(checkout, MAIN_VENV, TORCH_PIP_ARGS=cpu) == []  # the same, from the environment
    assert make(checkout, MAIN_VENV, "TORCH_PIP_ARGS=")[0] == "clear"  # back to plain PyPI


def test_a_changed_pyproject_reinstalls_into_the_same_venv(checkout):
    make(checkout, MAIN_VENV, f"PYTHON={checkout / 'fake-python3'}")
    stamp = checkout / ".venv" / ".installed"
    os.utime(checkout / "pyproject.toml", (stamp.stat().st_mtime + 5,) * 2)
    assert make(checkout, MAIN_VENV) == ["pip -m pip install -q torch==2.13.0",
                                       "pip -m pip install -q -e .[test]"]


def dry_run(checkout: Path, *args: str) -> str:
    """What ``make -n`` would run: the commands, none of them run."""
    result = subprocess.run(["make", "-n", *args], cwd=checkout, capture_output=True,
                            text=True, env=clean_env(), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_serving_installs_the_package_without_the_test_extra(checkout):
    python = f"PYTHON={checkout / 'fake-python3'}"
    planned = dry_run(checkout, "serve", python)
    assert 'pip install -q -e ".[torch]"' in planned and "[test]" not in planned
    assert "venv-hub1" not in planned
    assert make(checkout, SERVE_ONLY, python) == [
        "clear", "pip -m pip install -q torch==2.13.0", "pip -m pip install -q -e .[torch]"]
    assert make(checkout, SERVE_ONLY) == []  # remembered, nothing changed
    assert dry_run(checkout, "serve").split() == [".venv/bin/embedsvc", "serve"]


def test_testing_adds_the_test_extra_and_the_second_venv(checkout):
    python = f"PYTHON={checkout / 'fake-python3'}"
    make(checkout, SERVE_ONLY, python)
    planned = dry_run(checkout, "test")
    assert 'pip install -q -e ".[test]"' in planned
    assert "-r tests/clients/requirements-hub1.txt" in planned
    assert "-m pytest" in planned
    # onto the serve-only venv: the same torch kept, the extra added, nothing cleared
    assert make(checkout, MAIN_VENV) == ["pip -m pip install -q torch==2.13.0",
                                         "pip -m pip install -q -e .[test]"]


def test_a_test_install_serves_as_it_is(checkout):
    make(checkout, MAIN_VENV, f"PYTHON={checkout / 'fake-python3'}")
    assert make(checkout, SERVE_ONLY) == []
    assert dry_run(checkout, "serve").split() == [".venv/bin/embedsvc", "serve"]
    # a rebuild of that venv keeps what it holds: the test extra
    stamp = checkout / ".venv" / ".installed"
    os.utime(checkout / "pyproject.toml", (stamp.stat().st_mtime + 5,) * 2)
    assert make(checkout, SERVE_ONLY)[-1] == "pip -m pip install -q -e .[test]"
