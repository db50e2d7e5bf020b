"""The README is the fixture: its Quick start and Clients sections, and docs/clients.md's
client sections, run as typed.

Every ``sh`` and ``python`` block of those sections runs, in order, in one bash session
started in the checkout with no virtualenv active and a clean environment, as a newcomer's
terminal on a fresh machine would have it: nothing the test suite sets (HF_HUB_OFFLINE,
TIKTOKEN_CACHE_DIR, EMBEDSVC_CACHE_DIR ...) reaches it, and HOME and TMPDIR are new, empty
directories, so no file an earlier run left (tiktoken's cache, the ONNX graph) helps. The
conventions (background server, the test command, the port) are stated in a comment at the
top of the README's Quick start and parsed here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from embedsvc.settings import Settings

from .. import loopback

REPO = Path(__file__).parents[2]
# The pages and sections that run, in this order, in one session: the README's Quick start
# starts the server and activates .venv for the rest.
PAGES = (("README.md", ("Quick start", "Clients")),
         ("docs/clients.md", ("OpenAI clients", "TEI clients")))
# Quick start holds the install, the torch check, the curl lines, the activation and the
# openai snippet; pages that lost their blocks would make this test vacuous.
MIN_RUN = {("README.md", "Quick start"): 4, ("README.md", "Clients"): 1,
           ("docs/clients.md", "OpenAI clients"): 5, ("docs/clients.md", "TEI clients"): 3}
# What a newcomer's terminal holds of this one (the rest is what the test suite, make or the
# machine's tooling set); HOME and TMPDIR are replaced by fresh directories.
TERMINAL = ("PATH", "SHELL", "TERM", "LANG", "LC_ALL", "LC_CTYPE", "USER", "LOGNAME", "TZ",
            "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
README_URL = "127.0.0.1:8080"
RUNNABLE = ("sh", "python")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_MARK = re.compile(r"<!--\s*readme-test:\s*(\w+)\s*-->\s*$")
_OUTPUT = re.compile(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    section: str
    lang: str
    code: str
    mark: str | None  # "background", "ci" or None

    def expected_output(self) -> list[str]:
        """The ``# text`` after each ``print(...)`` line: what that line must print."""
        if self.lang != "python":
            return []
        return [m.group(1) for m in map(_OUTPUT.match, self.code.splitlines()) if m]


def section_text(markdown: str, title: str) -> str | None:
    found = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    return found.group(1) if found else None


def blocks() -> list[Block]:
    """Every fenced block of the sections that run, page after page, in order."""
    out = []
    for page, titles in PAGES:
        markdown = (REPO / page).read_text()
        for title in titles:
            text = section_text(markdown, title)
            assert text is not None, f"{page} has no section {title!r}"
            for fence in _FENCE.finditer(text):
                lang = {"bash": "sh", "shell": "sh", "py": "python"}.get(fence[1], fence[1])
                before = text[: fence.start()].rstrip().splitlines()
                mark = _MARK.match(before[-1].strip()) if before else None
                out.append(Block(page, title, lang, fence[2], mark[1] if mark else None))
    return out


def newcomer_env(port: int, fresh: Path) -> dict[str, str]:
    """A fresh terminal on a fresh machine: no virtualenv on PATH, nothing set for tests.

    Built from an allow-list, not by removing what is known: whatever conftest, make or
    pytest put into this process's environment stays out.
    """
    env = {k: os.environ[k] for k in TERMINAL if k in os.environ}
    venv_bins = {str(Path(sys.executable).parent), str(REPO / ".venv" / "bin")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if p.rstrip("/") not in venv_bins)
    for name in ("HOME", "TMPDIR"):  # caches start empty, as on a machine never used
        env[name] = str(fresh / name.lower())
        os.makedirs(env[name])
    env["EMBEDSVC_PORT"] = str(port)  # what `make serve` listens on, in place of 8080
    return env


def script(runnable: list[Block], port: int) -> str:
    """One bash session that runs the blocks in order, each after a marker line."""
    lines = ["set -e"]
    for i, block in enumerate(runnable):
        code = block.code.replace(README_URL, f"127.0.0.1:{port}")
        lines.append(f"echo '@@block {i}@@'")
        if block.lang == "python":
            lines += ["python - <<'README_PYTHON'", code.rstrip("\n"), "README_PYTHON"]
        else:
            lines.append(code.rstrip("\n"))
    lines.append("echo '@@end@@'")
    return "\n".join(lines) + "\n"


def ci_commands() -> list[str]:
    """What .ci/run runs, after its own set-up lines."""
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith(("#", "set ", "cd "))]


def installed_checkout() -> Path:
    """The checkout whose code .venv's embedsvc runs (its editable install's source)."""
    found = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c",
                            "import embedsvc; print(embedsvc.__file__)"],
                           cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                           text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    return Path(found.stdout.strip()).resolve().parents[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the background block exited:\n{log.read_text()}"
        try:
            if loopback.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"not healthy after {timeout}s:\n{log.read_text()}")


def test_the_readme_blocks_follow_the_conventions():
    found = blocks()
    # sh and python blocks run; others (text, json, js ...) are shown only. A block without a
    # language would be skipped unnoticed, so each one names its language.
    assert all(b.lang for b in found), [b.code for b in found if not b.lang]
    marks = [b.mark for b in found if b.mark]
    assert sorted(marks) == ["background", "ci"], marks
    ci = next(b for b in found if b.mark == "ci")
    assert ci.code.strip().splitlines() == ci_commands(), "README test command is not .ci/run's"
    assert README_URL.endswith(f":{Settings().port}"), "the README's port is not serve's default"
    background = next(b for b in found if b.mark == "background")
    assert background.code.strip() == "make serve"
    assert {b.page for b in found if b.mark} == {"README.md"}, "marks belong to the README"


def test_quick_start_and_clients_run_as_typed(tmp_path):
    found = blocks()
    if subprocess.run(["make", "-q", "setup"], cwd=REPO).returncode != 0:
        pytest.fail("the install in .venv is not up to date: run `make setup` (make test does)")
    if installed_checkout() != REPO.resolve():
        pytest.fail(f".venv runs the embedsvc of {installed_checkout()}, not of this checkout "
                    f"({REPO}), so the blocks would test that code: run `make setup` here, "
                    "into a .venv of this checkout's own")
    port = loopback.fixed_port()
    env = newcomer_env(port, tmp_path)
    server_log = tmp_path / "background.log"
    background = [b for b in found if b.mark == "background"]
    runnable = [b for b in found if b.mark is None and b.lang in RUNNABLE]
    for (page, title), least in MIN_RUN.items():
        ran = [b for b in runnable if (b.page, b.section) == (page, title)]
        assert len(ran) >= least, f"{page} section {title!r} runs {len(ran)} blocks"
    with open(server_log, "wb") as out:
        procs = [subprocess.Popen(["bash", "-c", b.code], cwd=REPO, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
                 for b in background]
    try:
        for proc in procs:
            wait_healthy(proc, f"http://127.0.0.1:{port}", server_log)
        result = subprocess.run(["bash"], input=script(runnable, port), cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=600)
    finally:
        for proc in procs:  # Ctrl-C, as the README says
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    check_session(result, runnable)


def check_session(result: subprocess.CompletedProcess, runnable: list[Block]) -> None:
    parts = re.split(r"^@@block (\d+)@@\n", result.stdout, flags=re.M)
    outputs = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    last = max(outputs, default=-1)
    if result.returncode != 0 or "@@end@@" not in result.stdout:
        block = runnable[last] if last >= 0 else None
        raise AssertionError(
            f"block {last} of {block.page if block else '?'}, section "
            f"{block.section if block else '?'!r}, failed "
            f"(exit {result.returncode}):\n{block.code if block else ''}\n"
            f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
    assert len(outputs) == len(runnable)
    for i, block in enumerate(runnable):
        out = outputs[i].replace("@@end@@\n", "")
        assert '{"error"' not in out, f"{block.page} block {i} got an error answer:\n{out}"
        expected = block.expected_output()
        if expected:
            assert out.strip().splitlines() == expected, (block.code, out)


# -- the launcher lines the docs print --------------------------------------------------------

LAUNCHERS = ("embedsvc serve", "gunicorn ", "waitress-serve ", "EMBEDSVC_PORT=")
_PORTS = ((re.compile(r"127\.0\.0\.1:80\d\d"), "127.0.0.1:0"),
          (re.compile(r"--port 80\d\d"), "--port 0"),
          (re.compile(r"EMBEDSVC_PORT=80\d\d"), "EMBEDSVC_PORT=0"))


def launch_lines() -> list[str]:
    """Each launcher command of the README's launch modes and of docs/deployment.md's
    gunicorn section, once, without its comment."""
    readme = section_text((REPO / "README.md").read_text(), "Launch modes") or ""
    lines = re.findall(r"^\| `([^`]+)` \|", readme, re.M)
    deploy = section_text((REPO / "docs" / "deployment.md").read_text(),
                          "Running under gunicorn, waitress and friends") or ""
    fence = _FENCE.search(deploy)
    lines += fence[2].splitlines() if fence else []
    found = [ln.split("  #")[0].strip() for ln in lines]
    return list(dict.fromkeys(ln for ln in found if ln.startswith(LAUNCHERS)))


def test_the_launcher_lines_use_the_recommended_flags():
    lines = launch_lines()
    assert len(lines) >= 4, lines  # embedsvc serve, gunicorn -c, plain gunicorn, waitress
    for line in lines:
        # embedsvc serve and deploy/gunicorn.conf.py bind HOST, 127.0.0.1 unless told
        assert "0.0.0.0" not in line and ("127.0.0.1:" in line or "serve" in line
                                          or "-c deploy/gunicorn.conf.py" in line), line
        if "gunicorn " in line and "-c deploy/gunicorn.conf.py" not in line:
            assert "--no-control-socket" in line, line
            assert "-k embedsvc.gunicorn_worker.ThreadWorker" in line, line
        if line.startswith("waitress-serve"):
            for flag in ("--channel-timeout=", "--connection-limit=",
                         "--max-request-body-size=", "--asyncore-use-poll"):
                assert flag in line, (flag, line)


@pytest.mark.parametrize("line", launch_lines())
def test_a_launcher_line_serves_on_loopback_as_printed(line, tmp_path):
    from .servers import BIN, running

    command = line
    for pattern, port_zero in _PORTS:
        command = pattern.sub(port_zero, command)
    # a HOME and runtime dir of its own, where gunicorn would open its control socket
    home, runtime = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    runtime.mkdir()
    env = {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
           "XDG_RUNTIME_DIR": str(runtime),
           "EMBEDSVC_PORT": "0"}  # for a line that names no port: not 8080, maybe in use
    with running(["bash", "-c", command], tmp_path / "server.log", env=env,
                 cwd=str(REPO)) as server, server.client() as client:
        # the port came from its own line "... http://127.0.0.1:PORT": loopback only
        vectors = client.post("/embed", json={"inputs": ["a", "b"]})
        assert vectors.status_code == 200 and len(vectors.json()) == 2, vectors.text
        # gunicorn removes its control socket at exit: look while it runs
        assert not (runtime / "gunicorn.ctl").exists() and not (home / ".gunicorn").exists()
        assert "Control socket listening" not in server.output()
