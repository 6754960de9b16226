"Helpers the tests share for servers and processes: a free local port, polling with a deadline, a server started."

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bound_socket() -> socket.socket:
    "A socket bound to a free local port, to hand to a server in this process (no other process can take the port)."
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


# a server that answers GET /health with 200 (for the tests of the server starts)
HEALTH_SERVER = """
import http.server, socketserver, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
socketserver.TCPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def health_server(port: int) -> list[str]:
    "The command of a server on `port` whose GET /health answers 200 (plain TCPServer: no slow host-name lookup)."
    return [sys.executable, "-c", HEALTH_SERVER, str(port)]


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    "Poll `condition()` until it returns something truthy; fail (naming `what`) after `timeout` seconds."
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def kill_group(proc: subprocess.Popen) -> None:
    "SIGKILL the process's session (it was started with start_new_session=True) and reap it."
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def start_server(
    args: Callable[[int], list[str]], log: Path, timeout: float, tries: int = 3, health: str = "/health", **popen
) -> tuple[subprocess.Popen, str]:
    """Start the server `args(port)` on a free port in a session of its own, its output appended to `log`, and wait
    until GET `health` answers 200; return the process and its URL. Between `free_port` and the server's bind another
    process may take the port (a busy machine opens ports all the time): then the server exits saying the address is
    "already in use" and starts again on another port, up to `tries` ports. Any other exit, or no answer within
    `timeout` seconds, fails with the end of the log."""
    for attempt in range(tries):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        start = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                args(port),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **popen,
            )

        try:
            state = wait_for(functools.partial(server_state, proc, url + health), timeout, url + health, interval=0.25)
        except AssertionError as e:
            kill_group(proc)
            raise AssertionError(f"{e}; the end of its log:\n{since(log, start)}") from None
        if state == "up":
            return proc, url
        lines = since(log, start)
        if "already in use" not in lines.lower() or attempt + 1 == tries:
            raise AssertionError(f"the server exited with {proc.returncode}; the end of its log:\n{lines}")
    raise AssertionError("unreachable")


def server_state(proc: subprocess.Popen, url: str) -> str | None:
    "'exited', 'up' (GET `url` answers 200), or None (starting)."
    if proc.poll() is not None:
        return "exited"
    with contextlib.suppress(httpx.TransportError):
        if httpx.get(url, timeout=5).status_code == 200:
            return "up"
    return None


def since(log: Path, start: int, chars: int = 4000) -> str:
    "The end of what `log` gained after byte `start`."
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")[-chars:]
