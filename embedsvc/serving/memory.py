"""What several models will hold, and where: weighed before any of them loads.

A model's need is its weights as its device holds them: the files its loader reads (a
model directory, the hub cache's snapshot of a hub id, the bundled model's directory), each
floating-point tensor counted at the dtype the device computes in (DTYPE=auto: float16 on
CUDA, float32 elsewhere; a safetensors file's header says what it stores, a ``.bin`` or
``.pt`` is taken as float32); a model served from its export record counts the size its
record states. Activations are not counted: they grow with MAX_BATCH_TOKENS, and a batch
that runs out of device memory is split by the batcher, not refused here.

The models on this machine's memory (cpu, mps) are weighed against MemAvailable; those on
a CUDA device, summed per device, against that GPU's free memory as ``nvidia-smi`` reports
it. NVML is asked through that program, never through CUDA: the process that checks may
fork workers, and a CUDA context does not survive a fork. Without ``nvidia-smi`` the CUDA
models are not weighed (one warning line).

Under gunicorn a worker runs the check as a program of its own (``python -m
embedsvc.serving.memory``): its answer is one line, and the worker, a front in front of the
engine processes, imports nothing of the model side for it.

>>> _gpu_rows("0, 24000\\n1, 512\\n")
{0: 25165824000, 1: 536870912}
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..settings import Settings

log = logging.getLogger(__name__)

HOST = "this machine"  # where a model on the CPU (or MPS, which shares it) is weighed
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# a safetensors header's floating-point dtypes, by their bytes an element
_FLOATS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_SKIP_DIRS = frozenset({"onnx", "openvino"})  # other runtimes' copies beside the weights
_QUERY = ["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"]

# nvidia-smi's answer: each GPU's free bytes by its index, or why there is none
Gpus = dict[int, int] | str


class MemoryRefused(Exception):
    """The models do not fit where they are set to run; the message is one line."""


@dataclass(frozen=True)
class Need:
    """One model's weights as its device will hold them."""

    name: str
    device: str  # HOST or "cuda:N"
    dtype: str
    size: int

    def __str__(self) -> str:
        return f"{self.name} {_mib(self.size)} {self.dtype}"


def check_memory(models: Sequence[tuple[str, Settings]], available: int | None = None,
                 gpus: Callable[[], Gpus] | None = None,
                 env: Mapping[str, str] | None = None) -> list[Need]:
    """Each model's need, after MemoryRefused, in one line, for any device they overfill.

    ``available``: this machine's free bytes (MemAvailable by default); ``gpus``: each
    GPU's free bytes (nvidia-smi by default, asked only where a model may use CUDA)."""
    env = os.environ if env is None else env
    free = _visible((gpus or nvidia_free)(), env) if any(
        _may_use_cuda(s) for _, s in models) else "no model uses CUDA"
    needs = [need(name, own, free) for name, own in models]
    refusals = []
    host = [n for n in needs if n.device == HOST]
    room = _available_bytes() if available is None else available
    if host and room is not None and sum(n.size for n in host) > room:
        refusals.append(_refusal(host, f"more than the {_mib(room)} this machine has "
                                       "available: serve fewer models here, or give it more "
                                       "memory", "the models' weights take"))
    refusals += _gpu_refusals([n for n in needs if n.device != HOST], free)
    if refusals:
        raise MemoryRefused("; ".join(refusals))
    return needs


def _gpu_refusals(needs: list[Need], free: Gpus) -> list[str]:
    if not needs:
        return []
    if isinstance(free, str):
        log.warning("the memory of the models on CUDA (%s) is not checked: %s",
                    ", ".join(str(n) for n in needs), free)
        return []
    refusals = []
    for device in sorted({n.device for n in needs}):
        on = [n for n in needs if n.device == device]
        index = int(device.partition(":")[2])
        if index not in free:
            listed = ", ".join(f"cuda:{i}" for i in sorted(free)) or "none"
            refusals.append(f"{', '.join(n.name for n in on)} set for {device}, which is not "
                            f"a GPU here (nvidia-smi lists {listed}): check DEVICE and "
                            "CUDA_VISIBLE_DEVICES")
        elif sum(n.size for n in on) > free[index]:
            refusals.append(_refusal(on, f"more than the {_mib(free[index])} free on {device} "
                                         "(nvidia-smi): serve fewer models on it, or set one's "
                                         "DEVICE to another GPU", f"the models on {device} take"))
    return refusals


def _refusal(needs: list[Need], why: str, what: str) -> str:
    each = ", ".join(str(n) for n in needs)
    return f"{what} {_mib(sum(n.size for n in needs))} ({each}), {why}"


def need(name: str, settings: Settings, free: Gpus) -> Need:
    """What model ``name`` will hold on its device; ``free``: the GPUs it may use."""
    device = _device(settings, free)
    dtype = _dtype(settings.dtype, device)
    if device == HOST:
        recorded = _record_bytes(settings)
        if recorded is not None:
            return Need(name, device, "float32", recorded)
    from ..model.record import model_source

    source = model_source(settings.model)
    return Need(name, device, dtype, 0 if source is None else weights_bytes(source, dtype))


def _device(settings: Settings, free: Gpus) -> str:
    """HOST or cuda:N, as the engine will resolve DEVICE (auto: cuda:0 where PyTorch is
    installed and a GPU is visible, as torch would find it)."""
    device = settings.device
    if device.startswith("cuda"):
        return f"cuda:{device.partition(':')[2] or 0}"
    if device == "auto" and not isinstance(free, str) and free:
        from ..model.device import pytorch_installed

        if pytorch_installed():
            return "cuda:0"
    return HOST


def _may_use_cuda(settings: Settings) -> bool:
    if settings.device == "auto":
        from ..model.device import pytorch_installed

        return pytorch_installed()
    return settings.device.startswith("cuda")


def _dtype(setting: str, device: str) -> str:
    if setting != "auto":
        return setting
    return "float32" if device == HOST else "float16"


def _record_bytes(settings: Settings) -> int | None:
    """The size the export record states, for a model this machine serves from one."""
    from ..model.lean import record_path, why_not
    from ..model.record import RECORD

    found = record_path(settings) if why_not(settings) is None else None
    if found is None:
        return None
    try:
        record = json.loads((found[0] / RECORD).read_text(encoding="utf-8"))
        return int(record["info"]["size_bytes"]) if record.get("lean") else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no record there (yet): its weights are weighed instead


def weights_bytes(source: Path, dtype: str) -> int:
    """The bytes of the weights in model directory ``source`` at ``dtype``: its safetensors
    files, else its PyTorch files (taken as float32), else its ONNX graphs."""
    itemsize = _ITEMSIZE[dtype]
    tensors = _files(source, "*.safetensors")
    if tensors:
        return sum(_safetensors_bytes(path, itemsize) for path in tensors)
    pickled = _files(source, "*.bin") + _files(source, "*.pt")
    if pickled:
        return sum(path.stat().st_size * itemsize // 4 for path in pickled)
    return sum(path.stat().st_size for path in source.rglob("*.onnx") if path.is_file())


def _files(source: Path, pattern: str) -> list[Path]:
    return [path for path in source.rglob(pattern) if path.is_file() and not any(
        part in _SKIP_DIRS or part.startswith(".")
        for part in path.relative_to(source).parts[:-1])]


def _safetensors_bytes(path: Path, itemsize: int) -> int:
    """Each tensor's bytes, a floating-point one's at ``itemsize`` an element; the file's
    size where its header does not read."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length)) if length <= 100 << 20 else None
        if not isinstance(header, dict) or not header:
            return path.stat().st_size
        total = 0
        for key, tensor in header.items():
            if key == "__metadata__":
                continue
            start, end = tensor["data_offsets"]
            if not 0 <= start <= end:  # a size below 0 would hide another model's
                raise ValueError(f"data_offsets {start}, {end}")
            stored = _FLOATS.get(tensor["dtype"])
            total += (end - start) * itemsize // stored if stored else end - start
        return int(total)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return path.stat().st_size


def nvidia_free(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Gpus:
    """Each GPU's free bytes by nvidia-smi's index, or why nvidia-smi gave none."""
    try:
        done = run(_QUERY, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi did not run ({exc.strerror if isinstance(exc, OSError) else exc})"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"nvidia-smi failed ({said[0] if said else f'exit {done.returncode}'})"
    try:
        return _gpu_rows(done.stdout)
    except ValueError:
        return f"nvidia-smi's answer does not read ({done.stdout.strip()[:80]!r})"


def _gpu_rows(text: str) -> dict[int, int]:
    rows = [line.split(",") for line in text.splitlines() if line.strip()]
    return {int(index): int(float(free)) << 20 for index, free in rows}


def _visible(free: Gpus, env: Mapping[str, str]) -> Gpus:
    """The GPUs as CUDA numbers them in the engine: CUDA_VISIBLE_DEVICES's list, in its
    order (nvidia-smi numbers every GPU of the machine in PCI order)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if isinstance(free, str) or listed is None:
        return free
    picked = [part.strip() for part in listed.split(",") if part.strip()]
    if not all(part.isdigit() for part in picked):
        return f"CUDA_VISIBLE_DEVICES={listed!r} names GPUs other than by index"
    return {i: free[int(part)] for i, part in enumerate(picked) if int(part) in free}


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


def stated(needs: list[Need]) -> str:
    """The startup line: each model's weights where they go, and the total."""
    each = ", ".join(f"{n} on {n.device}" for n in needs)
    return f"the models' weights: {each}; {_mib(sum(n.size for n in needs))} in all"


REFUSED = 3  # this module's exit code when the models do not fit


def check_apart(settings: Settings, timeout: float = 120) -> str | None:
    """The check as a program of its own (see the module docstring): the refusal's line,
    or None when the models fit (their sizes logged) or the check itself failed (logged)."""
    try:
        done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True,
                              env={**os.environ, **settings.to_env()}, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("the models' memory is not checked: the check did not run (%s)", exc)
        return None
    said = done.stdout.strip().splitlines()
    if done.returncode == REFUSED and said:
        return said[-1]
    if done.returncode != 0 or not said:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        log.warning("the models' memory is not checked: the check failed (%s)", why)
        return None
    for line in done.stderr.strip().splitlines():  # its warnings: nvidia-smi missing
        log.warning("%s", line)
    log.info("%s", said[-1])
    return None


def main() -> int:
    from ..catalog import catalog

    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    settings = Settings.from_env(os.environ)
    try:
        needs = check_memory([(e.name, e.settings) for e in catalog(settings)])
    except MemoryRefused as exc:
        print(exc)
        return REFUSED
    print(stated(needs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
