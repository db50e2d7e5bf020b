"""Several `embedsvc serve` replicas behind a real nginx; one restarts under load.

What is tested is the spreading, the drain and the restart, so the replicas run the real
`embedsvc serve` around the fake encoder (tests/integration/fake_serve.py); the drain under
load on the real model is test_reliability.py's SIGTERM test.
"""

import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from embedsvc.model.fake import FakeEncoder

from .. import loopback
from .conftest import cosine
from .servers import FAKE_EMBEDSVC, Server, running, start, stop

REPO = Path(__file__).parents[2]
SNIPPET = REPO / "deploy" / "nginx" / "embedsvc.conf"
REPLICA = [*FAKE_EMBEDSVC, "serve", "--threads", "16"]


def served_requests(url: str) -> float:
    text = loopback.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "embedsvc_requests":
            return sum(s.value for s in family.samples if s.name.endswith("_total")
                       and s.labels["route"] == "/v1/embeddings" and s.labels["status"] == "200")
    return 0.0


def nginx_config(tmp: Path, listen: int, replicas: list[int]) -> Path:
    snippet = SNIPPET.read_text().replace("listen 127.0.0.1:8080", f"listen 127.0.0.1:{listen}")
    snippet = snippet.replace("127.0.0.1:8081", f"127.0.0.1:{replicas[0]}")
    snippet = snippet.replace("127.0.0.1:8082", f"127.0.0.1:{replicas[1]}")
    temp = "\n".join(f"    {kind}_temp_path {tmp}/{kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log off;
{temp}
{snippet}
}}
""")
    return conf


def start_replica(port: int, log: Path):
    return running([*REPLICA, "--port", str(port)], log, cwd=str(REPO))


def test_load_spreads_over_replicas_and_a_restart_fails_no_request(tmp_path):
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        pytest.fail("nginx is missing: `make test` installs it (Debian package nginx)")
    ports = [loopback.fixed_port(), loopback.fixed_port()]
    listen = loopback.fixed_port()
    texts = [f"client {i} asks about replicas and load balancing" for i in range(8)]
    fake = FakeEncoder(dimension=384, max_input_tokens=256)  # as fake_serve.py serves
    expected = np.array([fake.expected(t) for t in texts])
    outcomes: list[str] = []
    stop_load = threading.Event()

    with start_replica(ports[0], tmp_path / "a.log") as a, \
            start_replica(ports[1], tmp_path / "b.log") as b:
        proc = subprocess.Popen([nginx, "-c", str(nginx_config(tmp_path, listen, ports)),
                                 "-e", str(tmp_path / "error.log")])
        try:
            front = f"http://127.0.0.1:{listen}"
            Server(proc, listen, tmp_path / "error.log").wait_healthy(30)

            def client(i: int) -> None:
                with loopback.Client(base_url=front, timeout=60) as c:
                    while not stop_load.is_set():
                        try:
                            resp = c.post("/v1/embeddings", json={"input": texts[i]})
                        except httpx.HTTPError as exc:
                            outcomes.append(f"error {exc!r}")
                            continue
                        if resp.status_code != 200:
                            outcomes.append(f"status {resp.status_code} {resp.text[:200]}")
                            continue
                        got = resp.json()["data"][0]["embedding"]
                        ok = cosine(got, expected[i])[0] > 0.9999
                        outcomes.append("ok" if ok else "wrong vector")
                        # a steady stream (8 clients, about 100 requests/s) keeps requests in
                        # flight through the drain and the restart without taking every core
                        stop_load.wait(0.05)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            time.sleep(4)
            spread = (served_requests(a.url), served_requests(b.url))
            assert min(spread) > 0, f"one replica got nothing: {spread}"

            assert stop(a.proc) == 0, a.output()[-2000:]  # drain replica A, then bring it back
            restarted = start([*REPLICA, "--port", str(ports[0])], tmp_path / "a2.log",
                              cwd=str(REPO))
            try:
                Server(restarted, ports[0], tmp_path / "a2.log").wait_healthy(120)
                time.sleep(4)
                after_restart = served_requests(f"http://127.0.0.1:{ports[0]}")
            finally:
                stop_load.set()
                for t in threads:
                    t.join(60)
                stop(restarted)
        finally:
            stop(proc, timeout=10)
    failures = [o for o in outcomes if o != "ok"]
    assert not failures, failures[:5]
    assert len(outcomes) > 50 and after_restart > 0
