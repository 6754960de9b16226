"The test helpers' server start (tests/_net.py): a port taken before the server binds it moves the server."

from __future__ import annotations

import socket
import sys

import _net
import httpx
import pytest


@pytest.mark.timeout(120)
def test_a_port_taken_before_the_server_binds_it_moves_the_server(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        ports = iter([taken.getsockname()[1], _net.free_port()])
        monkeypatch.setattr(_net, "free_port", lambda: next(ports))
        proc, url = _net.start_server(_net.health_server, log, 60)
        try:
            assert url.endswith(f":{proc.args[-1]}") and proc.args[-1] != str(taken.getsockname()[1])
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert "address already in use" in log.read_text().lower()  # the first start's exit, logged
        finally:
            _net.kill_group(proc)
        monkeypatch.setattr(_net, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(AssertionError, match="(?s)exited with 1.*already in use"):
            _net.start_server(_net.health_server, log, 60, tries=2)


@pytest.mark.timeout(60)
def test_a_server_that_exits_for_another_reason_fails_at_once_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(AssertionError, match="(?s)exited with 3.*no model here"):
        _net.start_server(lambda port: [sys.executable, "-c", "print('no model here'); exit(3)"], log, 60)
