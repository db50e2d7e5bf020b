"""Images served end to end (issue 48): images/s, latency, and where the time goes, for a
CLIP of ViT-B/32's compute shape, one process against ``--workers 2``.

    PYTHONPATH=$PWD flock /tmp/embedsvc-bench.lock .venv/bin/python bench/image_serving.py --record

The model: openai/clip-vit-base-patch32's shape (vision: hidden 768, 12 layers, 12 heads,
intermediate 3072, 224 x 224 in patches of 32; text: hidden 512, 12 layers, 8 heads,
intermediate 2048, 77 positions; projection 512) with random weights, the bundled model's
tokenizer and ``CLIPImageProcessor(size={"shortest_edge": 224}, crop_size=224)``. It is
built once under bench/out/ with PyTorch and exported there with ``embedsvc export``; the
servers serve that record (no PyTorch in them).

Each round starts every launch anew (the order reversed every other round) and, for each
input size (bench/images.py's ``photo()``: 224 x 224 and 1024 x 768 JPEG data URIs), runs
``--clients`` threads, each a keep-alive connection sending one-image POST /v1/embeddings
after the other, ``--warmup`` seconds unmeasured and then ``--duration`` seconds measured.
Figures: images/s (answers completed in the window), p50 and p99 latency, and, from
/metrics deltas over the window, the front's decode + preprocess seconds per image
(``embedsvc_image_preprocess_seconds``, wall time in the HTTP processes, waiting for a core
included) and the engine's vision-tower seconds per image
(``embedsvc_modality_seconds_total{modality="image"}`` over its inputs: a batch's seconds
shared by its images), each also as a share of the window's wall time (process-seconds per
second: the fronts' threads overlap, so a share may pass 100%); and the CPU seconds per image
of every process of the server (/proc; under ``--workers 2`` the engine's and the fronts'
apart) and of this load generator, with the machine's load average as each window closed.
The load generator runs on the same 2 cores as the server: every figure is of this machine
and this run; compare the launches within a round.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.images import photo  # noqa: E402 - the path above makes the repository importable

OUT = REPO / "bench" / "out"
MODEL = OUT / "clip-vit-b32-random"
CACHE = OUT / "clip-vit-b32-random-cache"
EXPORTED = CACHE / "exported-by-bench"  # written once `embedsvc export` has succeeded
RESULTS = REPO / "bench" / "RESULTS.md"
EMBEDSVC = Path(sys.executable).parent / "embedsvc"
SIZES = [(224, 224), (1024, 768)]
LAUNCHES = {"one process": [], "--workers 2": ["--workers", "2"]}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the model ----------------------------------------------------------------------------------


def build(path: Path) -> None:
    """ViT-B/32 CLIP's shape, random weights, saved as transformers saves it."""
    import torch
    import transformers

    from embedsvc.model.encoder import bundled_model_path

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path())
    text = dict(vocab_size=tokenizer.vocab_size, hidden_size=512, num_hidden_layers=12,
                num_attention_heads=8, intermediate_size=2048, max_position_embeddings=77,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                eos_token_id=tokenizer.sep_token_id)
    vision = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, image_size=224, patch_size=32)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=512)
    building = path.with_name(path.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    transformers.CLIPModel(config).eval().save_pretrained(building)
    tokenizer.save_pretrained(building)
    transformers.CLIPImageProcessor(size={"shortest_edge": 224},
                                    crop_size=224).save_pretrained(building)
    building.rename(path)


def ensure_model() -> None:
    """The model directory and its export record, built on first use."""
    if not MODEL.exists():
        print(f"building {MODEL.relative_to(REPO)} ...", flush=True)
        build(MODEL)
    if not EXPORTED.exists():
        print(f"embedsvc export into {CACHE.relative_to(REPO)} ...", flush=True)
        subprocess.run([str(EMBEDSVC), "export", "--model", str(MODEL), "--cache-dir",
                        str(CACHE)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        EXPORTED.write_text("ok\n")


# -- the server ---------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return [pid] + [p for child in children for p in _tree(child)]


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


class Server:
    """``embedsvc serve`` of the record with ``launch``'s flags, on ``port``, ready."""

    def __init__(self, name: str, port: int, launch: list[str]) -> None:
        self.name, self.port = name, port
        self.log = OUT / f"image-serving-{port}.log"
        cmd = [str(EMBEDSVC), "serve", "--model", str(MODEL), "--cache-dir", str(CACHE),
               "--host", "127.0.0.1", "--port", str(port), *launch]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} not ready after 300 s")

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """The samples this bench reads, summed over any labels but modality's."""
        status, text = self.get("/metrics")
        assert status == 200, text[:500]
        want = {"embedsvc_image_preprocess_seconds_sum": "front_s",
                "embedsvc_image_preprocess_seconds_count": "front_n",
                'embedsvc_modality_seconds_total{modality="image"}': "engine_s",
                'embedsvc_modality_inputs_total{modality="image"}': "engine_n",
                "embedsvc_batch_size_count": "batches"}
        out = dict.fromkeys(want.values(), 0.0)
        for line in text.splitlines():
            found = re.match(r"^(\w+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
            if not found:
                continue
            name, labels, value = found.groups()
            labels = labels or ""
            modality = re.search(r'modality="(\w+)"', labels)
            key = name + (f'{{modality="{modality.group(1)}"}}' if modality else "")
            if key in want:
                out[want[key]] += float(value)
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds of every process of the server, by role: the engine and the fronts
        under ``--workers``, else the one process ("server")."""
        out = {"server": 0.0, "engine": 0.0, "fronts": 0.0}
        for pid in _tree(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:4]
            except OSError:
                continue
            role = "engine" if b"engine" in argv else "fronts" if b"front" in argv else "server"
            out[role] += _cpu_ticks(pid) / CLK_TCK
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the load -----------------------------------------------------------------------------------


@dataclass
class Measured:
    launch: str
    size: tuple[int, int]
    round: int
    seconds: float
    latencies: list[float]  # of the answers completed in the window, seconds
    errors: int
    metrics: dict[str, float]  # Server.metrics' deltas over the window
    cpu: dict[str, float]  # Server.cpu_seconds' deltas over the window
    client_cpu_s: float  # this process's
    loadavg: float  # the machine's 1-minute load average as the window closed

    @property
    def images(self) -> int:
        return len(self.latencies)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


def load(server: Server, body: bytes, clients: int, warmup: float, seconds: float
         ) -> tuple[float, list[float], int, dict[str, float], dict[str, float], float, float]:
    """``clients`` threads posting ``body`` back to back; the window opens ``warmup`` seconds
    in and lasts ``seconds``. Returns its length, the latencies of the answers completed in
    it, the errors, the deltas of the metrics, of the server's CPU and of this process's CPU
    over it, and the machine's load average as it closed."""
    stop = threading.Event()
    answers: list[tuple[float, float, bool]] = []  # (completed, latency, ok), list.append is atomic
    headers = {"Content-Type": "application/json"}

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        while not stop.is_set():
            started = time.perf_counter()
            try:
                conn.request("POST", "/v1/embeddings", body, headers)
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            done = time.perf_counter()
            answers.append((done, done - started, ok))
        conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    metrics_before, cpu_before = server.metrics(), server.cpu_seconds()
    own_before, opened = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    closed, own = time.perf_counter(), time.process_time() - own_before
    loadavg = os.getloadavg()[0]
    metrics_after, cpu_after = server.metrics(), server.cpu_seconds()
    stop.set()
    for t in threads:
        t.join()
    inside = [(latency, ok) for done, latency, ok in answers if opened <= done < closed]
    return (closed - opened, [latency for latency, ok in inside if ok],
            sum(not ok for _, ok in inside),
            {k: metrics_after[k] - metrics_before[k] for k in metrics_before},
            {k: cpu_after[k] - cpu_before[k] for k in cpu_before}, own, loadavg)


def measure(server: Server, size: tuple[int, int], args: argparse.Namespace, round_no: int
            ) -> Measured:
    body = json.dumps({"input": [{"image": photo(size)}]}).encode()
    return Measured(server.name, size, round_no,
                    *load(server, body, args.clients, args.warmup, args.duration))


def per(total: float, count: float) -> float:
    return total / count if count else 0.0


@dataclass
class Split:
    """Runs pooled: seconds and CPU per image, and the metrics' seconds over the wall's."""

    wall: float
    images: int
    front_ms: float  # decode + preprocess, per image the fronts counted
    front_share: float
    engine_ms: float  # vision tower, per image it computed
    engine_share: float
    batch: float  # images a device batch
    server_cpu_ms: float
    server_cores: float  # the server's CPU seconds over the wall's
    engine_cpu_ms: float | None  # under --workers: the engine process's, and the fronts'
    fronts_cpu_ms: float | None
    client_cpu_ms: float

    @classmethod
    def of(cls, runs: list[Measured]) -> Split:
        wall = sum(m.seconds for m in runs)
        images = sum(m.images for m in runs)

        def total(key: str) -> float:
            return sum(m.metrics[key] for m in runs)

        def cpu(role: str) -> float:
            return sum(m.cpu[role] for m in runs)

        workers = cpu("engine") > 0
        return cls(
            wall, images, per(total("front_s"), total("front_n")) * 1000,
            total("front_s") / wall, per(total("engine_s"), total("engine_n")) * 1000,
            total("engine_s") / wall, per(total("engine_n"), total("batches")),
            per(cpu("server") + cpu("engine") + cpu("fronts"), images) * 1000,
            (cpu("server") + cpu("engine") + cpu("fronts")) / wall,
            per(cpu("engine"), images) * 1000 if workers else None,
            per(cpu("fronts"), images) * 1000 if workers else None,
            per(sum(m.client_cpu_s for m in runs), images) * 1000)


def line(m: Measured) -> str:
    s = Split.of([m])
    workers = (f" (engine {s.engine_cpu_ms:.0f}, fronts {s.fronts_cpu_ms:.0f})"
               if s.engine_cpu_ms is not None else "")
    return (f"round {m.round + 1} {m.launch:12} {m.size[0]}x{m.size[1]}: "
            f"{m.images_per_s:5.2f} images/s, p50 {m.pct(0.5):5.0f} ms, p99 {m.pct(0.99):5.0f} "
            f"ms, errors {m.errors}; front decode + preprocess {s.front_ms:5.1f} ms/image "
            f"({s.front_share:4.0%} of wall), vision tower {s.engine_ms:5.1f} ms/image "
            f"({s.engine_share:4.0%} of wall, {s.batch:.1f} images a batch); server CPU "
            f"{s.server_cpu_ms:.0f} ms/image{workers}, {s.server_cores:.2f} cores; load "
            f"generator CPU {s.client_cpu_ms:.1f} ms/image; load average {m.loadavg:.1f}")


def table(results: list[Measured]) -> str:
    rows = ["| input | launch | images/s (median) | each round | p50 ms | p99 ms | errors "
            "| front: decode + preprocess ms/image | share of wall | engine: vision tower "
            "ms/image | share of wall | images a batch | server CPU ms/image (engine, fronts) "
            "| server CPU-s per s | load generator CPU ms/image |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in SIZES:
        for launch in LAUNCHES:
            runs = [m for m in results if m.launch == launch and m.size == size]
            if not runs:
                continue
            s = Split.of(runs)
            cpu = f"{s.server_cpu_ms:.0f}" + (
                f" ({s.engine_cpu_ms:.0f}, {s.fronts_cpu_ms:.0f})"
                if s.engine_cpu_ms is not None else "")
            rows.append(
                f"| {size[0]} x {size[1]} JPEG | {launch} | "
                f"{median(m.images_per_s for m in runs):.2f} | "
                f"{', '.join(f'{m.images_per_s:.2f}' for m in runs)} | "
                f"{median(m.pct(0.5) for m in runs):,.0f} | "
                f"{median(m.pct(0.99) for m in runs):,.0f} | {sum(m.errors for m in runs)} | "
                f"{s.front_ms:.1f} | {s.front_share:.0%} | {s.engine_ms:.1f} | "
                f"{s.engine_share:.0%} | {s.batch:.1f} | {cpu} | {s.server_cores:.2f} | "
                f"{s.client_cpu_ms:.1f} |")
    return "\n".join(rows)


def ratios(results: list[Measured]) -> str:
    """``--workers 2`` over one process, images/s, by round and size."""
    out = []
    for size in SIZES:
        each = []
        for r in sorted({m.round for m in results}):
            got = {m.launch: m.images_per_s for m in results if m.size == size and m.round == r}
            if len(got) == 2 and got["one process"]:
                each.append(got["--workers 2"] / got["one process"])
        if each:
            out.append(f"{size[0]} x {size[1]} " + ", ".join(f"{x:.2f}" for x in each))
    return "`--workers 2` / one process, images/s, each round: " + "; ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds first")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=18531)
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    ensure_model()
    print(f"{args.clients} client threads (this process) share the machine's "
          f"{os.cpu_count()} cores with the server", flush=True)
    started = time.gmtime()
    results: list[Measured] = []
    for r in range(args.rounds):
        names = list(LAUNCHES) if r % 2 == 0 else list(LAUNCHES)[::-1]
        for name in names:
            server = Server(name, args.port, LAUNCHES[name])
            try:
                for size in SIZES:
                    results.append(measure(server, size, args, r))
                    print(line(results[-1]), flush=True)
            finally:
                server.stop()
    text = table(results)
    loads = [m.loadavg for m in results]
    context = (f"The load generator shares the {os.cpu_count()} cores with the server; the "
               f"machine's 1-minute load average as the windows closed: {min(loads):.1f} to "
               f"{max(loads):.1f}.")
    print(text)
    print(ratios(results))
    print(context)
    if args.record:
        record(args, started, text + "\n\n" + ratios(results) + ".", context)


def record(args: argparse.Namespace, started: time.struct_time, figures: str, context: str
           ) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M", started) + time.strftime("-%H:%M UTC", time.gmtime())
    python = Path(sys.executable)
    python_shown = python.relative_to(REPO) if python.is_relative_to(REPO) else python
    command = (f"PYTHONPATH=$PWD flock /tmp/embedsvc-bench.lock {python_shown} "
               f"bench/image_serving.py {' '.join(sys.argv[1:])}")
    about = (
        "Images served end to end (issue 48): a CLIP of openai/clip-vit-base-patch32's "
        "compute shape with random weights, exported by "
        "`embedsvc export` and served from its record; `embedsvc serve` in one process and "
        "with `--workers 2`, started anew each round, alternated over "
        f"{args.rounds} rounds (reversed every other round). {args.clients} client threads of "
        "this script (keep-alive `http.client`, one image a request, POST /v1/embeddings) for "
        f"{args.duration:g} s after {args.warmup:g} s of warm-up, on JPEG data URIs "
        f"(bench/images.py's `photo()`). **{context}**")
    columns = (
        "Front: `embedsvc_image_preprocess_seconds` (decode + preprocess, wall time in the "
        "HTTP processes, a wait for a core or the interpreter lock included) over the images "
        "it counted; engine: `embedsvc_modality_seconds_total{modality=\"image\"}` over its "
        "inputs (a batch's seconds shared by its images); share of wall: those seconds over "
        "the window's (process-seconds per second: a front's threads overlap). Server CPU: "
        "every process of the server (/proc/PID/stat), over the images answered, split "
        "between the engine process and the fronts under `--workers 2`; server CPU-s per s: "
        "the cores it kept busy; load generator CPU: this script's process time. Latency "
        "medians and the splits are over the rounds.")
    with RESULTS.open("a") as out:
        out.write(f"\n## {stamp}: `{command}`\n\n{textwrap.fill(about, 95)}\n\n"
                  f"{textwrap.fill(columns, 95)}\n\n{figures}\n")


if __name__ == "__main__":
    main()
