"""A live `openai_server` subprocess on 127.0.0.1 for the server tests (one per test module)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from atom_like.entrypoints.launch import LaunchedServer

STARTUP_TIMEOUT_S = 180  # CI machines are shared; importing torch alone can take a while


class ServerProcess(LaunchedServer):
    def __init__(self, model: str, *args: str, log_path: Path, api_key: str | None = None):
        self.api_key = api_key
        server_args = ["--model", model, "--disable-uvicorn-access-log", *args]
        if api_key:
            server_args += ["--api-key", api_key]
        # One torch thread: the tests' own clients share the CI machine's two cores with it.
        super().__init__(server_args, log_path, env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        super().wait_healthy(timeout)
        return self

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("atom_like:kv_cache_free_blocks")."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=10).text
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


@contextmanager
def running_server(model: str, *args: str, log_dir: Path, api_key: str | None = None) -> Iterator[ServerProcess]:
    """A healthy server for the duration of the block (a test module's fixture), stopped after."""
    with ServerProcess(model, *args, log_path=Path(log_dir) / "server.log", api_key=api_key) as proc:
        yield proc.wait_healthy()
