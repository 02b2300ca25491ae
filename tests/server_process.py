"""A live `openai_server` subprocess on 127.0.0.1 for the server tests (one per test module)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180  # CI machines are shared; importing torch alone can take a while


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *args: str, log_path: Path, api_key: str | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        command = [sys.executable, "-m", "atom_like.entrypoints.openai_server", "--model", model,
                   "--port", str(self.port), "--disable-uvicorn-access-log", *args]
        if api_key:
            command += ["--api-key", api_key]
        # One torch thread: the tests' own clients share the CI machine's two cores with it.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not healthy after {timeout} s:\n{self.log_tail()}")

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("atom_like:kv_cache_free_blocks")."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"{name}{labels} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name}{labels} is not on /metrics")

    def wait_for_metric(self, name: str, predicate, timeout: float = 30.0, labels: str = "") -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, labels)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.1)

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-chars:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
