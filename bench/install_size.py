"""What `pip install embedsvc` puts on disk: a fresh venv per install, its size and packages.

    .venv/bin/python bench/install_size.py                 # the install without extras
    .venv/bin/python bench/install_size.py --extra torch   # with the torch extra (CPU torch)
    .venv/bin/python bench/install_size.py --extra image   # with the image extra (Pillow)

Each install goes into a new venv as `python -m venv` makes it (pip inside), from this
checkout, not editable; then the same without pip (`venv --without-pip`, the base's pip
installing into it, as deploy/docker/Dockerfile's CPU stage does). Where the torch extra is
among --extra's (comma-separated) the CPU build of torch (--torch-spec, where pip finds it or
from --torch-index) is installed first, as the Makefile does; no other extra installs it.
Prints the venv's size (du, MiB and MB), the installed distributions (`pip list`, header not
counted), whether torch imports, and, with --record, the size of an export record directory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).parents[1]


def du_bytes(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def install(venv: Path, target: str, pip_in_venv: bool, torch: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "venv", *([] if pip_in_venv else ["--without-pip"]),
                    str(venv)], check=True)
    pip = ([str(venv / "bin" / "python"), "-m", "pip"] if pip_in_venv
           else [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")])
    if torch:
        subprocess.run([*pip, "install", "-q", *torch], check=True)
    subprocess.run([*pip, "install", "-q", target], check=True)


def report(name: str, venv: Path) -> None:
    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                             "list", "--format", "freeze"], capture_output=True, text=True,
                            check=True).stdout.split()
    torch = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"],
                           capture_output=True).returncode == 0
    size = du_bytes(venv)
    print(f"{name:34} {size / 2**20:8.0f} MiB {size / 1e6:8.0f} MB {len(listed):4d} packages  "
          f"torch imports: {'yes' if torch else 'no'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", default="",
                        help="extras to install, comma-separated, e.g. torch or image")
    parser.add_argument("--torch-spec", default="torch==2.13.0")
    parser.add_argument("--torch-index", default="",
                        help="an index with the CPU build of torch, e.g. "
                        "https://download.pytorch.org/whl/cpu (default: where pip finds it)")
    parser.add_argument("--record", type=Path, help="an export record directory to size too")
    args = parser.parse_args()
    target = f"{REPO}[{args.extra}]" if args.extra else str(REPO)
    index = ["--extra-index-url", args.torch_index] if args.torch_index else []
    # the CPU build of torch first only where the torch extra is among the extras asked for
    wants_torch = "torch" in (e.strip() for e in args.extra.split(","))
    torch = [args.torch_spec, *index] if wants_torch else []
    label = f"pip install embedsvc{f'[{args.extra}]' if args.extra else ''}"
    with tempfile.TemporaryDirectory(prefix="embedsvc-size-") as work:
        for pip_in_venv in (True, False):
            venv = Path(work) / ("with-pip" if pip_in_venv else "without-pip")
            install(venv, target, pip_in_venv, torch)
            report(f"{label}{'' if pip_in_venv else ', no pip'}", venv)
    if args.record:
        size = du_bytes(args.record)
        print(f"{'export record ' + args.record.name[:20]:34} {size / 2**20:8.0f} MiB "
              f"{size / 1e6:8.0f} MB")


if __name__ == "__main__":
    main()
