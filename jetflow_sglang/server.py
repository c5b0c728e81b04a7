"""Start and stop a real SGLang server on 127.0.0.1: by process group, with a startup timeout.

Used by `jetflow serve`, `jetflow bench`, the benchmarks and the server tests.
"""

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
from typing import IO, Optional

from jetflow_sglang.errors import JetFlowError

STARTUP_TIMEOUT_S = float(os.environ.get("JETFLOW_SGLANG_STARTUP_TIMEOUT", 420))
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """True when `port` on HOST cannot be bound now (as uvicorn binds it: with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return True
        return False


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


def jetflow_args(head: str, budget: int) -> list[str]:
    """The SGLang flags that turn JETFLOW on."""
    return [
        "--speculative-algorithm", "JETFLOW",
        "--speculative-draft-model-path", str(head),
        "--speculative-num-draft-tokens", str(budget),
    ]  # fmt: skip


def server_cmd(target: str, port: int, *extra: str, dtype: str = "float32", max_total_tokens: int = 8192) -> list[str]:
    """`python -m sglang.launch_server` on 127.0.0.1; later flags in `extra` override these defaults."""
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(target),
        "--host", HOST, "--port", str(port),
        "--dtype", dtype,
        "--max-total-tokens", str(max_total_tokens),
        *extra,
    ]  # fmt: skip


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Optional[Path]
    startup_s: float = 0.0

    def stop(self) -> None:
        stop(self.proc)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log else ""


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


def launcher_env(env: Optional[dict] = None) -> dict:
    """The environment a launcher runs in: ours, plus `env`, less what would switch the platform."""
    full_env = dict(os.environ)
    full_env.pop("SGLANG_USE_CPU_ENGINE", None)  # the jetflow_cpu platform serves on CPU
    full_env.update(env or {})
    return full_env


PORT_IN_USE = "address already in use"  # uvicorn's bind error; the launcher then hangs instead of exiting
PORT_ATTEMPTS = 3  # a port picked by free_port() can be taken by another process before the server binds it


class PortInUse(RuntimeError):
    pass


def start(
    target: str,
    log: Optional[Path],
    *extra: str,
    env: Optional[dict] = None,
    port: Optional[int] = None,
    dtype: str = "float32",
    max_total_tokens: int = 8192,
    timeout_s: float = STARTUP_TIMEOUT_S,
    cwd: Optional[str] = None,
) -> Server:
    """Start a server and wait until /health answers. Its output goes to `log` (None: this
    process's stdout/stderr). Raises RuntimeError with the log tail if it does not come up. With a
    log, a failed bind is seen at once: a port picked here that another process took first is
    replaced by a new one (up to `PORT_ATTEMPTS` launches); a port the caller chose is refused,
    before the launch where it is already taken.
    cwd: the launcher's directory (``python -m`` puts it first on its import path)."""
    if port and port_in_use(port):  # refused before the model loads, not after
        raise RuntimeError(f"port {port} on {HOST} is in use")
    for _ in range(0 if port else PORT_ATTEMPTS - 1):
        try:
            return _start_once(target, log, extra, env, free_port(), dtype, max_total_tokens, timeout_s, cwd)
        except PortInUse:
            pass
    return _start_once(target, log, extra, env, port or free_port(), dtype, max_total_tokens, timeout_s, cwd)


def _start_once(target, log, extra, env, port: int, dtype: str, max_total_tokens: int, timeout_s: float,
                cwd: Optional[str] = None) -> Server:  # fmt: skip
    url = f"http://{HOST}:{port}"
    cmd = server_cmd(target, port, *extra, dtype=dtype, max_total_tokens=max_total_tokens)
    out: IO | None = open(log, "wb") if log else None
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=launcher_env(env),
                                start_new_session=True, cwd=cwd)  # fmt: skip
    finally:
        if out:
            out.close()
    server = Server(proc, url, log)
    t0 = time.monotonic()
    try:
        while not healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"sglang server exited with {proc.returncode}:\n{server.log_tail()}")
            if PORT_IN_USE in server.log_tail().lower():
                raise PortInUse(f"port {port} on {HOST} is in use")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"sglang server not healthy after {timeout_s:.0f}s:\n{server.log_tail()}")
            time.sleep(1)
    except BaseException:  # also Ctrl-C / SIGTERM while waiting: never leave a server behind
        server.stop()
        raise
    server.startup_s = time.monotonic() - t0
    return server


def run_to_exit(target: str, log: Path, *extra: str, timeout: float = 240, env: Optional[dict] = None) -> tuple[int, str]:
    """Run a launcher expected to refuse to start: (exit code, output). Kills it on timeout."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            server_cmd(target, free_port(), *extra), stdout=out, stderr=subprocess.STDOUT, env=launcher_env(env), start_new_session=True
        )
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return -1, log.read_text(errors="replace")
    stop(proc)
    return proc.returncode, log.read_text(errors="replace")


def serve_forever(target: str, extra: list[str], port: int, dtype: str, max_total_tokens: int) -> int:
    """`jetflow serve`: run the server in the foreground until it exits or we are interrupted."""

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)  # before the launch: a SIGTERM while starting stops it too
    try:
        server = start(target, None, *extra, port=port, dtype=dtype, max_total_tokens=max_total_tokens)
    except RuntimeError as exc:
        raise JetFlowError(str(exc).splitlines()[0]) from None
    except KeyboardInterrupt:
        return 0
    print(json.dumps({"url": server.url, "openai_base_url": server.url + "/v1", "pid": server.proc.pid}), flush=True)
    try:
        return server.proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
