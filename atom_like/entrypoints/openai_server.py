"""OpenAI-compatible HTTP server: `python -m atom_like.entrypoints.openai_server --model DIR`.

Every EngineArgs flag is accepted (speculation included: `--method eagle3 --draft-model DIR
--num-speculative-tokens 3`; --model and --draft-model also take zoo names; `-tp N` for N GPUs,
also under torchrun: docs/parallel.md), plus the server's own flags below. The port is bound
first, then the model loaded (a bad flag, a busy port or a bad checkpoint exits at once with the
reason); /health turns 200 once the engine thread has run a warm-up forward. Endpoints:

  POST /v1/completions, /v1/chat/completions   (stream or not)
  GET  /v1/models, /health, /metrics            (with --api-key all but /health need the key)

Errors are OpenAI-shaped JSON: `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_like.cli import entry_point
from atom_like.config import EngineArgs, add_flag
from atom_like.engine.llm_engine import LLMEngine
from atom_like.engine.tp_executor import torchrun_launch
from atom_like.entrypoints.engine_loop import EngineLoop
from atom_like.entrypoints.engine_requests import RequestBuilder, RequestLimits
from atom_like.entrypoints.errors import OpenAIError, internal_error
from atom_like.entrypoints.http_guards import OPEN_PATHS, RequestGuard, TimedH11Protocol
from atom_like.entrypoints.metrics import ServerMetrics
from atom_like.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard,
                                            ModelList)
from atom_like.entrypoints.serving import OpenAIServing
from atom_like.entrypoints.tokenization import TokenizerPool
from atom_like.zoo import model_path

logger = logging.getLogger("atom_like.entrypoints.openai_server")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    add_flag(parser, "host", str, "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
    add_flag(parser, "port", int, 8000, "HTTP port.")
    add_flag(parser, "api_key", str, None, "When set, every path but /health needs 'Authorization: Bearer KEY'.")
    add_flag(parser, "public_metrics", bool, False, "With --api-key, serve /metrics without the key (for scrapers).")
    add_flag(parser, "served_model_name", str, None, "Model name clients send and see (default: the model folder's name).")
    add_flag(parser, "max_request_bytes", int, 4 << 20, "Largest request body accepted (413 beyond it, before parsing).")
    add_flag(parser, "max_sequences_per_request", int, RequestLimits.max_sequences,
             "Most sequences (prompts x best_of, or n) one request may queue.")
    add_flag(parser, "read_timeout", float, 30.0,
             "Seconds a client has to send its request headers, and then its body, before the connection is dropped.")
    add_flag(parser, "stats_interval", float, 10.0, "Seconds between stats log lines while busy (0: never).")
    add_flag(parser, "disable_uvicorn_access_log", bool, False, "Do not log one line per HTTP request.")
    add_flag(parser, "profile_dir", str, None,
             "Enables POST /start_profile and /stop_profile: a torch.profiler trace of every rank's steps in between, "
             "written to DIR/rank<r>.trace.json (open in Perfetto).")
    return parser


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
    if first["type"] == "extra_forbidden":
        return OpenAIError(400, f"{'.'.join(loc)} is not supported by this server (send null or leave it out)", param)
    alternatives = [e for e in errors if len(e["loc"]) > 2 and e["loc"][1] == param]
    ours = [e for e in alternatives if e["type"] == "value_error"]  # e.g. a lone surrogate in a string
    if ours:
        return OpenAIError(400, f"{param}: {ours[0]['msg'].removeprefix('Value error, ')}", param)
    if len({e["loc"][2] for e in alternatives}) > 1:
        # A union field (prompt, stop, content): pydantic reports one error per alternative type.
        expected = ", ".join(dict.fromkeys(str(e["loc"][2]) for e in alternatives))
        return OpenAIError(400, f"{param}: {_short(alternatives[0]['input'])} is not one of: {expected}", param)
    return OpenAIError(400, f"{'.'.join(loc)}: {first['msg']}", param)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# What the OpenAPI schema promises (schemathesis checks responses against it).
_RESPONSES = {
    200: {"content": {"text/event-stream": {}}, "description": "the response, or with stream: server-sent events"},
    **{code: {"model": ErrorResponse, "description": what} for code, what in (
        (400, "the request is invalid (the error's param names the field)"), (401, "missing or wrong API key"),
        (408, "the body did not arrive within --read-timeout"), (413, "the body exceeds --max-request-bytes"),
        (500, "a bug of this server (logged with the request id)"), (503, "the engine failed on this request"))},
}


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None, public_metrics: bool = False,
              max_request_bytes: int = 4 << 20, read_timeout: float = 30.0, limits: RequestLimits = RequestLimits(),
              stats_interval: float = 10.0, profile_dir: str | None = None) -> FastAPI:
    metrics = ServerMetrics(engine.stats().num_speculative_tokens)
    engine_loop = EngineLoop(engine, metrics, stats_interval)
    tokenizers = TokenizerPool(engine.tokenizer)
    builder = RequestBuilder(served_model_name, engine.max_model_len, engine.vocab_size, limits)
    serving = OpenAIServing(engine_loop, tokenizers, builder)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        engine_loop.shutdown()
        tokenizers.shutdown()

    app = FastAPI(title="atom_like", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    open_paths = OPEN_PATHS + (("/metrics",) if public_metrics else ())
    app.add_middleware(RequestGuard, api_key=api_key, open_paths=open_paths, max_body_bytes=max_request_bytes,
                       read_timeout=read_timeout)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), type="invalid_request_error").response()

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):
        request_id = request.state.request_id
        logger.error("request %s: internal error", request_id, exc_info=exc)
        return internal_error(request_id).response()

    @app.post("/v1/completions", responses=_RESPONSES)
    async def completions(body: CompletionRequest, raw_request: Request):
        return await serving.completions(body, raw_request)

    @app.post("/v1/chat/completions", responses=_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await serving.chat(body, raw_request)

    @app.get("/v1/models", responses={401: _RESPONSES[401]})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.max_model_len)])

    @app.get("/health", responses={503: {"description": "loading, or the warm-up forward failed"}})
    async def health():
        if engine.failure is not None:  # a tensor-parallel rank died: the engine cannot run again
            return JSONResponse({"status": "error", "error": engine.failure}, 503)
        if engine_loop.ready:
            return {"status": "ok"}
        if engine_loop.warmup_error is not None:
            return JSONResponse({"status": "error", "error": f"warm-up forward failed: {engine_loop.warmup_error}"}, 503)
        return JSONResponse({"status": "loading"}, 503)

    if profile_dir is not None:  # as vLLM and SGLang: only when the operator asked for it
        async def on_engine(fn) -> None:
            try:
                await asyncio.wrap_future(engine_loop.call(fn))
            except RuntimeError as exc:  # already recording / nothing recording
                raise OpenAIError(400, str(exc), type="invalid_request_error") from None

        @app.post("/start_profile", responses={400: {"description": "a profile is already recording"}})
        async def start_profile():
            await on_engine(lambda e: e.start_profile(profile_dir))
            return {"status": "recording", "profile_dir": profile_dir}

        @app.post("/stop_profile", responses={400: {"description": "no profile is recording"}})
        async def stop_profile():
            await on_engine(lambda e: e.stop_profile())
            return {"status": "written", "profile_dir": profile_dir}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                        401: _RESPONSES[401]})
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, before the model loads: a busy port is an error in a second, not
    after minutes of loading (and no other process can take the port in between)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} (--host/--port): {exc.strerror}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@entry_point
def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("max_request_bytes", "max_sequences_per_request", "read_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0; got {getattr(args, name)}")
    # under torchrun every rank runs this; only rank 0 serves HTTP (the others never return from LLMEngine)
    launch = torchrun_launch(args.tensor_parallel_size)
    sock = bind(args.host, args.port) if launch is None or launch[0] == 0 else None
    args.model = model_path(args.model) if args.model is not None else None
    if args.draft_model is not None:
        args.draft_model = model_path(args.draft_model)
    engine_args = EngineArgs.from_cli_args(args)
    engine = LLMEngine.from_engine_args(engine_args)
    served_model_name = args.served_model_name or os.path.basename(os.path.normpath(engine_args.model))
    app = build_app(engine, served_model_name, args.api_key, args.public_metrics, args.max_request_bytes,
                    args.read_timeout, RequestLimits(max_sequences=args.max_sequences_per_request), args.stats_interval,
                    args.profile_dir)
    TimedH11Protocol.header_timeout = args.read_timeout
    # The engine's start-up heap (model, tokenizer, graphs: ~355k objects with SmolLM2) lives as long
    # as the server; left in the collector's oldest generation, each full collection walks it, a
    # 155 ms pause of every client's stream measured on CPU (docs/benchmarks.md section 11).
    gc.collect()
    gc.freeze()
    logger.info("serving %r on http://%s:%d", served_model_name, args.host, args.port)
    config = uvicorn.Config(app, http=TimedH11Protocol, timeout_keep_alive=5,
                            access_log=not args.disable_uvicorn_access_log, log_level="info")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # Ctrl-C: uvicorn has shut the app down and re-raised it (uvicorn.run swallows it the same way)
    finally:  # Ctrl-C or SIGTERM: -tp N workers go with us
        engine.shutdown()


if __name__ == "__main__":
    main()
