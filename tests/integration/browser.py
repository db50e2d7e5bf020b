"""Headless Chromium driven over the DevTools protocol: a page loaded, scripts evaluated in
it, every request it made recorded, a screenshot taken."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

from .. import loopback

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-default-apps", "--window-size=1280,2000", "--remote-debugging-port=0"]


class Page:
    """One tab: ``call`` a protocol method, ``evaluate`` a script, ``requested`` URLs."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.ids = itertools.count(1)
        self.requested: list[str] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        sent = next(self.ids)
        self.socket.send(json.dumps({"id": sent, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("method") == "Network.requestWillBeSent":
                self.requested.append(message["params"]["request"]["url"])
            if message.get("id") == sent:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, script: str) -> Any:
        out = self.call("Runtime.evaluate", expression=script, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{script[:60]}...: {out['exceptionDetails']}")
        return out["result"].get("value")

    def wait_for(self, script: str, timeout: float = 60) -> Any:
        """The first truthy value of ``script``, polled until ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(script)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"never true within {timeout}s: {script}")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@contextmanager
def browser_page(url: str) -> Iterator[Page]:
    """``url`` loaded in a fresh headless Chromium profile; the browser ends afterwards."""
    exe = chromium()
    assert exe, "headless Chromium is missing: apt-get install chromium"
    profile = Path(tempfile.mkdtemp(prefix="embedsvc-chromium-"))
    proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = _devtools_port(profile, proc)
        target = next(t for t in loopback.get(f"http://127.0.0.1:{port}/json/list").json()
                         if t["type"] == "page")
        with connect(target["webSocketDebuggerUrl"], max_size=None) as socket:
            page = Page(socket)
            page.call("Network.enable")
            page.call("Page.enable")
            page.call("Page.navigate", url=url)
            yield page
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(profile: Path, proc: subprocess.Popen, timeout: float = 60) -> int:
    """The port Chromium chose, from the file it writes in its profile."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        assert proc.poll() is None, f"chromium exited with {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError("chromium reported no DevTools port")
