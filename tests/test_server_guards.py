"""The server's guards in-process (no subprocess but for the CLI checks): --public-metrics,
body limits that refuse before the app runs, JSON 500s logged with the request id, --help
defaults, and a busy port or unknown zoo name refused before any model loads."""
from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import pytest

from atom_like.entrypoints.http_guards import OPEN_PATHS, RequestGuard
from atom_like.entrypoints.openai_server import make_parser


async def _echo_app(scope, receive, send):
    body = (await receive())["body"]
    _echo_app.calls += 1
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _client(**guard) -> httpx.AsyncClient:
    _echo_app.calls = 0
    app = RequestGuard(_echo_app, **{"api_key": "k", "open_paths": OPEN_PATHS, "max_body_bytes": 100,
                                     "read_timeout": 5.0, **guard})
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_public_metrics_opens_metrics_only():
    async def main():
        key = {"Authorization": "Bearer k"}
        async with _client() as c:
            assert (await c.get("/metrics")).status_code == 401 and (await c.get("/health")).status_code == 200
        async with _client(open_paths=OPEN_PATHS + ("/metrics",)) as c:
            assert (await c.get("/metrics")).status_code == 200
            assert (await c.get("/v1/models")).status_code == 401 and (await c.get("/v1/models", headers=key)).status_code == 200
    asyncio.run(main())


def test_oversized_bodies_never_reach_the_app():
    async def main():
        key = {"Authorization": "Bearer k"}
        async with _client() as c:
            assert (await c.post("/v1/completions", content=b"x" * 100, headers=key)).content == b"x" * 100
            assert (await c.post("/v1/completions", content=b"x" * 101, headers=key)).status_code == 413
            async def chunks():
                for _ in range(4):
                    yield b"x" * 30

            chunked = await c.post("/v1/completions", content=chunks(), headers=key)
            assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
            assert _echo_app.calls == 1
    asyncio.run(main())


def test_an_internal_error_is_a_json_500_logged_with_the_request_id(llama_path, monkeypatch, caplog):
    from fastapi.testclient import TestClient

    from atom_like import LLMEngine
    from atom_like.entrypoints.openai_server import build_app
    from atom_like.entrypoints.serving import OpenAIServing

    async def bug(self, body, raw_request):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(OpenAIServing, "completions", bug)
    app = build_app(LLMEngine(llama_path, max_model_len=64), "m")
    with TestClient(app, raise_server_exceptions=False) as client, caplog.at_level(logging.ERROR):
        response = client.post("/v1/completions", json={"prompt": [1, 2]})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    request_id = error["message"].split("request id ")[1].split(";")[0]
    assert error["type"] == "server_error" and len(request_id) == 32 and "planted" not in error["message"]
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)


def test_help_shows_defaults():
    text = make_parser().format_help()
    for default in ("(default: 8000)", "(default: 4194304)", "(default: 2048)", "(default: 30.0)", "(default: 16)"):
        assert default in text, default


def test_busy_port_and_unknown_zoo_name_fail_before_loading(llama_path, monkeypatch, capsys):
    from atom_like.engine.llm_engine import LLMEngine
    from atom_like.entrypoints.openai_server import main

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LLMEngine, "from_engine_args", no_loading)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["--model", llama_path, "--port", str(port)])
    assert exit_.value.code == 2 and f"cannot listen on 127.0.0.1:{port} (--host/--port)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "no-such-model", "--port", "0"])
    assert exit_.value.code == 2 and "'no-such-model' is neither a checkpoint folder nor a zoo model" in capsys.readouterr().err
