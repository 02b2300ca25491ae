"""Start `openai_server` as a subprocess on a free local port and wait until /health is green
(used by the GSM8K job and the tests; the server's output goes to a log file)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from atom_like.cli import EXIT_BAD_INPUT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerLaunchError(RuntimeError):
    pass


class LaunchedServer:
    def __init__(self, server_args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.command = [sys.executable, "-m", "atom_like.entrypoints.openai_server", *server_args,
                        "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def wait_healthy(self, timeout: float) -> "LaunchedServer":
        """Raises ServerLaunchError, with the end of the server's log, if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self.process.returncode == EXIT_BAD_INPUT:  # it refused its input, saying why on its last line
                    raise ServerLaunchError(f"the server refused to start: {self.last_line()}")
                raise ServerLaunchError(f"the server exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise ServerLaunchError(f"the server was not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def last_line(self) -> str:
        lines = self.log_tail().strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> "LaunchedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
