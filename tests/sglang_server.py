"""Start and stop a real SGLang server on 127.0.0.1 for tests (by PID / process group, with timeouts)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STARTUP_TIMEOUT_S = float(os.environ.get("JETFLOW_SGLANG_STARTUP_TIMEOUT", 420))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def server_cmd(target: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", target,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32",
        "--max-total-tokens", "8192",
        *extra,
    ]  # fmt: skip


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    startup_s: float = 0.0

    def stop(self) -> None:
        stop(self.proc)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def stop(proc: subprocess.Popen) -> None:
    """Stop the server and its scheduler/detokenizer children (its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def start(target: str, log: Path, *extra: str, env: dict | None = None) -> Server:
    """Start a server and wait until /health answers; raises RuntimeError with the log tail if it does not."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    full_env = dict(os.environ)
    full_env.pop("SGLANG_USE_CPU_ENGINE", None)
    full_env.update(env or {})
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            server_cmd(target, port, *extra), stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    server = Server(proc, url, log)
    t0 = time.monotonic()
    while not healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"sglang server exited with {proc.returncode}:\n{server.log_tail()}")
        if time.monotonic() - t0 > STARTUP_TIMEOUT_S:
            server.stop()
            raise RuntimeError(f"sglang server not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{server.log_tail()}")
        time.sleep(1)
    server.startup_s = time.monotonic() - t0
    return server


def run_to_exit(target: str, log: Path, *extra: str, timeout: float = 240) -> tuple[int, str]:
    """Run a launcher expected to refuse to start: (exit code, output). Kills it on timeout."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            server_cmd(target, free_port(), *extra), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return -1, log.read_text(errors="replace")
    stop(proc)
    return proc.returncode, log.read_text(errors="replace")
