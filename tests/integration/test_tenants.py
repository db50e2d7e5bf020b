"""Tenants on live servers (issue 42): API keys from a file, each with its quotas, on
`embedsvc serve` and with an engine process behind two fronts, around the fake encoder
(tests/integration/fake_serve.py), whose device time is a sleep per padded token."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from embedsvc.api.routes import ROUTES

from .. import loopback
from .servers import BIN, FAKE_EMBEDSVC, Server, running

KEYS = {"search": "sk-search-7f3a", "flood": "sk-flood-19bc", "limited": "sk-limited-c04e"}
FILE = f"""
[[keys]]
tenant = "search"
key = "{KEYS['search']}"

[[keys]]
tenant = "flood"
key = "{KEYS['flood']}"

[[keys]]
tenant = "limited"
key = "{KEYS['limited']}"
requests_per_second = 2
"""
ADDED = "sk-added-5d21"  # a key a reload adds
LAUNCHES = {"serve": [], "workers": ["--workers", "2"]}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def write(path: Path, text: str) -> None:
    path.write_text(text)
    stamp = time.time_ns() + 10**9
    os.utime(path, ns=(stamp, stamp))


@contextmanager
def tenants_server(tmp_path: Path, launch: str, per_token_s: float = 0.0) -> Iterator[Server]:
    keys = tmp_path / "keys.toml"
    write(keys, FILE)
    cmd = [*FAKE_EMBEDSVC, "serve", "--port", "0", "--threads", "32", "--keys-file", str(keys),
           "--request-timeout-s", "5", "--max-batch-tokens", "2048", *LAUNCHES[launch]]
    env = {"FAKE_SERVE_PER_TOKEN_S": str(per_token_s)}
    with running(cmd, tmp_path / "server.log", env=env) as server:
        server.keys = keys  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60  # with fronts: until each front is ready
        while time.monotonic() < deadline and not all(
                loopback.post(server.url + "/embed", json={"inputs": "warm"}, timeout=30,
                              headers=auth("search")).status_code == 200 for _ in range(6)):
            time.sleep(0.2)
        yield server


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_a_flooding_tenant_cannot_push_another_past_its_deadline(tmp_path, launch):
    """Three tenants: one floods the device from 12 connections with no quota, one sends ten
    a second against a quota of two (429s with the quota's Retry-After), and one sends a
    light stream: every light request is answered within its deadline, in about two
    batches."""
    results: dict[str, list] = {"flood": [], "limited": [], "search": []}
    stop = threading.Event()

    def client(tenant: str, texts: list[str], pause: float) -> None:
        with loopback.Client(base_url=server.url, timeout=60, headers=auth(tenant)) as c:
            while not stop.is_set():
                resp = c.post("/embed", json={"inputs": texts})
                results[tenant].append(resp)
                time.sleep(pause)

    with tenants_server(tmp_path, launch, per_token_s=2e-5) as server:
        flood = ["a flood of words " * 12] * 64  # about 50 ms of device a request
        threads = [threading.Thread(target=client, args=("flood", flood, 0.0))
                   for _ in range(12)]
        threads += [threading.Thread(target=client, args=("limited", ["hello"], 0.1)),
                    threading.Thread(target=client, args=("search", ["a query"], 0.05))]
        for t in threads:
            t.start()
        time.sleep(4.0)
        stop.set()
        for t in threads:
            t.join(60)
        metrics = loopback.get(server.url + "/metrics", timeout=30).text
    search = results["search"]
    assert len(search) >= 10 and {r.status_code for r in search} == {200}
    assert max(float(r.headers["x-queue-time"]) for r in search) < 5000  # its deadline
    limited = [r.status_code for r in results["limited"]]
    assert 200 in limited and 429 in limited, limited
    refused = next(r for r in results["limited"] if r.status_code == 429)
    error = refused.json()["error"]
    assert refused.headers["Retry-After"] == "1" and error["code"] == "quota_exceeded"
    assert "'limited'" in error["message"] and KEYS["limited"] not in refused.text
    assert 'embedsvc_tenant_requests_total{status="429",tenant="limited"}' in metrics or \
        'embedsvc_tenant_requests_total{tenant="limited",status="429"}' in metrics
    assert all(key not in metrics and key not in server.output() for key in KEYS.values())


def tokenized(server: Server) -> float:
    """Requests tokenized for the model, in every HTTP process (fronts report each second)."""
    text = loopback.get(server.url + "/metrics", timeout=30).text
    found = re.search(r"^embedsvc_tokenization_seconds_count (\S+)$", text, re.M)
    assert found, "no embedsvc_tokenization_seconds_count"
    return float(found.group(1))


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_a_tenant_over_its_rate_quota_is_refused_before_tokenizing(tmp_path, launch):
    """One process charges the quota before tokenizing. With fronts, the engine charges it on
    arrival; its refusal says how long the quota stays spent, and the front refuses the
    tenant's next requests until then without tokenizing them: per refill of the quota, at
    most one refused request is tokenized, not every one a flooding client sends."""
    with tenants_server(tmp_path, launch) as server:
        time.sleep(1.5)  # the warm-up's counts reach the engine
        before = tokenized(server)
        codes: list[int] = []
        retry_after: set[str] = set()
        with loopback.Client(base_url=server.url, timeout=30, headers=auth("limited")) as c:
            until = time.monotonic() + 3.0
            while time.monotonic() < until:
                resp = c.post("/embed", json={"inputs": ["a limited tenant's words " * 20]})
                codes.append(resp.status_code)
                if resp.status_code == 429:
                    assert resp.json()["error"]["code"] == "quota_exceeded"
                    retry_after.add(resp.headers["Retry-After"])
        time.sleep(1.5)
        spent = tokenized(server) - before
    ok, refused = codes.count(200), codes.count(429)
    assert ok + refused == len(codes) and refused >= 20, codes
    assert 4 <= ok <= 2 + 2 * 3 + 2  # its burst, then two a second
    assert retry_after == {"1"}
    if launch == "serve":
        assert spent == ok
    else:  # one learning refusal a refill, at most
        assert ok <= spent <= 2 * ok + 2, (spent, ok, refused)


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_a_reload_that_lifts_a_spent_quota_is_honoured_at_once(tmp_path, launch):
    """A tenant that spent an hour of its tokens-a-minute quota in one request is refused
    with that hour in Retry-After; the operator lifts the quota and reloads: the tenant is
    served again within about a second, also where a front holds the engine's refusal."""
    limited = '\n[[keys]]\ntenant = "tpm"\nkey = "sk-tpm-83e1"\n'
    with tenants_server(tmp_path, launch) as server:
        write(server.keys, FILE + limited + "tokens_per_minute = 60\n")
        os.kill(server.pid, signal.SIGHUP)
        time.sleep(1.0)
        headers = {"Authorization": "Bearer sk-tpm-83e1"}
        with loopback.Client(base_url=server.url, timeout=30, headers=headers) as c:
            big = c.post("/embed", json={"inputs": ["word " * 400] * 16, "truncate": True})
            assert big.status_code == 200, big.text
            for _ in range(3):  # refused, by the engine and then by the front's copy
                refused = c.post("/embed", json={"inputs": ["hi"]})
                assert refused.status_code == 429, refused.text
                assert int(refused.headers["Retry-After"]) > 600
            write(server.keys, FILE + limited)
            os.kill(server.pid, signal.SIGHUP)
            reloaded = time.monotonic()
            while (resp := c.post("/embed", json={"inputs": ["hi"]})).status_code == 429 \
                    and time.monotonic() - reloaded < 10:
                time.sleep(0.1)
            assert resp.status_code == 200, resp.text
            assert time.monotonic() - reloaded < 5


def test_sighup_reloads_the_keys_without_dropping_a_request_and_a_bad_file_keeps_them(
        tmp_path):
    with tenants_server(tmp_path, "serve", per_token_s=1e-4) as server:
        answers: list = []
        stop = threading.Event()

        def client() -> None:
            with loopback.Client(base_url=server.url, timeout=60, headers=auth("search")) as c:
                while not stop.is_set():
                    answers.append(c.post("/embed", json={"inputs": ["across the reload"] * 8}))

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        write(server.keys, FILE.replace('tenant = "flood"', 'tenant = "added"')
              .replace(KEYS["flood"], ADDED))
        os.kill(server.pid, signal.SIGHUP)
        time.sleep(0.5)
        added = {"Authorization": f"Bearer {ADDED}"}
        assert loopback.post(server.url + "/embed", json={"inputs": "new"},
                             headers=added).status_code == 200
        assert loopback.post(server.url + "/embed", json={"inputs": "old"},
                             headers=auth("flood")).status_code == 401
        write(server.keys, "[[keys]]\ntenant = 'broken'\n")  # no key: refused, old keys stay
        os.kill(server.pid, signal.SIGHUP)
        time.sleep(0.5)
        assert loopback.post(server.url + "/embed", json={"inputs": "still"},
                             headers=added).status_code == 200
        stop.set()
        for t in threads:
            t.join(60)
        assert server.alive()
        log = server.output()
    assert len(answers) >= 4 and {r.status_code for r in answers} == {200}
    assert "reloaded (SIGHUP)" in log and log.count("not reloaded") >= 1
    assert all(key not in log for key in [*KEYS.values(), ADDED])


def test_a_wrong_key_gets_401_on_every_route_that_needs_one(tmp_path):
    with tenants_server(tmp_path, "serve") as server:
        for route in ROUTES:
            if route.open or route.listed is False:
                continue
            path = route.path.replace("{model}", "fake")
            for headers in ({"Authorization": "Bearer sk-wrong"}, {}):
                resp = loopback.request(route.method, server.url + path, headers=headers,
                                        json={} if route.method == "POST" else None,
                                        timeout=30)
                assert resp.status_code == 401, (route.method, path, resp.text[:200])
                body = resp.json()
                message = body["error"] if isinstance(body["error"], str) \
                    else body["error"]["message"]
                assert "API key" in message


# Two models (the fake encoder under `embedsvc serve`, the bundled model under gunicorn), in
# one process or one engine process each: one tenant's quotas hold across both
TWO_MODELS = "a=,b="
ACROSS = {
    "one process": [*FAKE_EMBEDSVC, "serve", "--port", "0", "--threads", "16", "--models",
                    TWO_MODELS],
    "workers 2": [*FAKE_EMBEDSVC, "serve", "--port", "0", "--threads", "16", "--workers", "2",
                  "--models", TWO_MODELS],
    "gunicorn -w 2": [str(BIN / "gunicorn"), "-w", "2", "--threads", "8", "-b",
                      "127.0.0.1:0", "embedsvc:app"],
}
RARE = """
[[keys]]
tenant = "rare"
key = "sk-rare-52d0"
requests_per_second = 0.1

[[keys]]
tenant = "tpm"
key = "sk-tpm-0b77"
tokens_per_minute = 100
"""


def embed(server: Server, model: str, key: str, text: str) -> httpx.Response:
    """An OpenAI request to model a, an Ollama request to model b: each family's shape."""
    route = "/v1/embeddings" if model == "a" else "/api/embed"
    return loopback.post(server.url + route, json={"model": model, "input": text},
                         headers={"Authorization": f"Bearer {key}"}, timeout=60)


def refusal(resp: httpx.Response) -> str:
    """The 429's message, after checking its family's shape."""
    assert resp.status_code == 429, resp.text[:300]
    assert int(resp.headers["Retry-After"]) >= 1
    error = resp.json()["error"]
    if isinstance(error, str):  # Ollama's
        return error
    assert error["code"] == "quota_exceeded" and error["type"] == "rate_limit_error"
    return error["message"]


@pytest.mark.parametrize("launch", list(ACROSS))
def test_a_tenants_quotas_count_its_requests_to_every_model_once(tmp_path, launch):
    """A tenant of one request every 10 s gets one answer across both models' routes, and
    one of 100 tokens a minute that spent them on one model is refused on the other: each
    model's engine counts in one table, not a quota of its own each."""
    keys = tmp_path / "keys.toml"
    write(keys, FILE + RARE)
    env = {"EMBEDSVC_MODELS": TWO_MODELS, "EMBEDSVC_KEYS_FILE": str(keys)}
    with running(ACROSS[launch], tmp_path / "server.log", env=env) as server:
        deadline = time.monotonic() + 120  # until each front has met both engines
        while time.monotonic() < deadline and not all(
                embed(server, model, KEYS["search"], "warm").status_code == 200
                for model in "abababab"):
            time.sleep(0.2)
        answered = embed(server, "a", "sk-rare-52d0", "a text")
        assert answered.status_code == 200, answered.text
        for model in "bab":
            assert "0.1 requests a second" in refusal(embed(server, model, "sk-rare-52d0",
                                                            "a text"))
        assert embed(server, "a", "sk-tpm-0b77", "word " * 200).status_code == 200
        for model in "ba":
            assert "100 tokens a minute" in refusal(embed(server, model, "sk-tpm-0b77", "hi"))
