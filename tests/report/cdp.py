"""Headless Chromium driven over the DevTools protocol: load a page, collect its console errors
and uncaught exceptions, query the DOM, take a screenshot.

Chromium's stderr log is not a reliable record of JavaScript errors; the protocol's events are:
``Runtime.exceptionThrown`` (uncaught exceptions), ``Runtime.consoleAPICalled`` (``console.error``)
and ``Log.entryAdded`` (the browser's own errors: failed loads, blocked content).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL_HINT = ("run `make test` as root (it installs Debian's chromium), or `apt-get install -y chromium`; "
                "SEXTANT_CHROMIUM can name the executable")


def find_chromium() -> str | None:
    exe = os.environ.get("SEXTANT_CHROMIUM")
    if exe:
        return exe
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class Chromium:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, exe: str, width: int = 1400, height: int = 1000, timeout_s: float = 60):
        self.exe, self.width, self.height, self.timeout_s = exe, width, height, timeout_s
        self.events: list[dict[str, Any]] = []
        self._id = 0

    def __enter__(self) -> Chromium:
        self._dir = tempfile.mkdtemp(prefix="sextant-chromium-")
        self._log = open(Path(self._dir) / "stderr.log", "w+b")  # closed in __exit__
        args = [self.exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={self._dir}",
                f"--window-size={self.width},{self.height}", "about:blank"]
        # Its own process group: Chromium's helpers (zygote, renderer, crashpad) outlive a kill of
        # the main process and keep writing into the profile directory we are about to delete.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True)
        try:
            self.ws = websocket.create_connection(self._page_url(), timeout=self.timeout_s, suppress_origin=True)
            for domain in ("Runtime", "Log", "Page"):
                self.call(f"{domain}.enable")
            self.call("Emulation.setDeviceMetricsOverride",
                      {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()
        self._remove_profile()

    def _remove_profile(self) -> None:
        """Delete the profile directory; a helper that escaped the process group may still be
        writing there for a moment, so retry before giving up quietly (it is a temp directory)."""
        for _ in range(20):
            try:
                shutil.rmtree(self._dir)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _stderr(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def _page_url(self) -> str:
        port_file = Path(self._dir) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start its DevTools endpoint (exit {self.proc.poll()}):\n"
                                   f"{self._stderr()}")
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=self.timeout_s) as r:
            targets = json.load(r)
        return next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one protocol command and wait for its answer (events arriving meanwhile are kept)."""
        self._id += 1
        self.ws.settimeout(self.timeout_s)
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params or {}}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method} failed: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def _wait_event(self, method: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not any(e["method"] == method for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {self.timeout_s} s")
            self.ws.settimeout(max(deadline - time.monotonic(), 0.01))
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                self.events.append(msg)

    def load(self, url: str, settle_s: float = 0.3) -> None:
        """Navigate and wait for the load event, then a little longer for late errors."""
        self.events.clear()
        self.call("Page.navigate", {"url": url})
        self._wait_event("Page.loadEventFired")
        self.evaluate(f"new Promise(r => setTimeout(r, {int(settle_s * 1000)}))")

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"evaluating {expression!r} threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    def errors(self) -> list[str]:
        """Every console error, uncaught exception and browser error logged since the last load."""
        out = []
        for e in self.events:
            p = e["params"]
            if e["method"] == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
            elif e["method"] == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                out.append("console.error: " + " ".join(str(a.get("value", a.get("description", "")))
                                                       for a in p["args"]))
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"browser: {p['entry']['text']} {p['entry'].get('url', '')}".strip())
        return out

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
