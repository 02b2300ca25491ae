"""OpenAI-compatible HTTP server: `python -m atom_like.entrypoints.openai_server --model DIR`.

Every EngineArgs flag is accepted (speculation included: `--method eagle3 --draft-model DIR
--num-speculative-tokens 3`; `-tp N` for N GPUs, also under torchrun: docs/parallel.md), plus
the server's own flags below. The model is loaded before the
port opens (a bad flag or checkpoint exits at once with the reason); /health turns 200 once the
engine thread has run a warm-up forward. Endpoints:

  POST /v1/completions, /v1/chat/completions   (stream or not)
  GET  /v1/models, /health, /metrics            (/health and /metrics need no API key)

Errors are OpenAI-shaped JSON: `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import os
import secrets
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_like.config import EngineArgs, add_flag
from atom_like.engine.llm_engine import LLMEngine
from atom_like.entrypoints.engine_loop import EngineLoop
from atom_like.entrypoints.metrics import ServerMetrics
from atom_like.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from atom_like.entrypoints.serving import OpenAIError, OpenAIServing

logger = logging.getLogger("atom_like.entrypoints.openai_server")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    # add_flag maps type names as dataclass annotations spell them ("int"), hence the strings.
    add_flag(parser, "host", str, "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
    add_flag(parser, "port", int, 8000, "HTTP port.")
    add_flag(parser, "api_key", str, None, "When set, /v1/* requests need 'Authorization: Bearer KEY'.")
    add_flag(parser, "served_model_name", str, None, "Model name clients send and see (default: the model folder's name).")
    add_flag(parser, "stats_interval", float, 10.0, "Seconds between stats log lines while busy (0: never).")
    add_flag(parser, "disable_uvicorn_access_log", bool, False, "Do not log one line per HTTP request.")
    return parser


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which interferes with streaming and disconnects).
    Runs before the body is parsed, so a request without the key gets 401 whatever its body."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                    code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's parse errors as OpenAI 400s naming the top-level field."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = [str(part) for part in first["loc"] if part != "body"]
    if not loc:
        return OpenAIError(400, f"the body must be a JSON object: {first['msg']}")
    param = loc[0]
    alternatives = [e for e in errors if len(e["loc"]) > 2 and e["loc"][1] == param]
    if len({e["loc"][2] for e in alternatives}) > 1:
        # A union field (prompt, stop, content): pydantic reports one error per alternative type.
        expected = ", ".join(dict.fromkeys(str(e["loc"][2]) for e in alternatives))
        return OpenAIError(400, f"{param}: {_short(alternatives[0]['input'])} is not one of: {expected}", param)
    return OpenAIError(400, f"{'.'.join(loc)}: {first['msg']}", param)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None,
              stats_interval: float = 10.0) -> FastAPI:
    metrics = ServerMetrics(engine.scheduler.spec_stats.num_speculative_tokens)
    engine_loop = EngineLoop(engine, metrics, stats_interval)
    tokenizer = copy.deepcopy(engine.tokenizer)  # the event loop's own copy (see serving.py)
    serving = OpenAIServing(engine_loop, tokenizer, served_model_name, engine.max_model_len, engine.runner.vocab_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        engine_loop.shutdown()

    app = FastAPI(title="atom_like", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), type="invalid_request_error").response()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request):
        return await serving.completions(body, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await serving.chat(body, raw_request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.max_model_len)])

    @app.get("/health")
    async def health():
        if engine.runner.failure is not None:  # a tensor-parallel rank died: the engine cannot run again
            return JSONResponse({"status": "error", "error": engine.runner.failure}, 503)
        if engine_loop.ready:
            return {"status": "ok"}
        if engine_loop.warmup_error is not None:
            return JSONResponse({"status": "error", "error": f"warm-up forward failed: {engine_loop.warmup_error}"}, 503)
        return JSONResponse({"status": "loading"}, 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_args = EngineArgs.from_cli_args(args)
        engine = LLMEngine.from_engine_args(engine_args)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    served_model_name = args.served_model_name or os.path.basename(os.path.normpath(engine_args.model))
    app = build_app(engine, served_model_name, args.api_key, args.stats_interval)
    logger.info("serving %r on http://%s:%d", served_model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, access_log=not args.disable_uvicorn_access_log,
                    log_level="info")
    finally:  # Ctrl-C or SIGTERM: uvicorn returns after its shutdown; -tp N workers go with us
        engine.shutdown()


if __name__ == "__main__":
    main()
