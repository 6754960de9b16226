"Helpers the tests share for servers and processes: a free local port, and polling with a deadline."

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    "Poll `condition()` until it returns something truthy; fail (naming `what`) after `timeout` seconds."
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
