"""/v1/completions and /v1/chat/completions: turn a request body into engine requests, and
engine outputs into OpenAI responses (whole, or streamed as server-sent events).

Runs on the event loop. Tokenization happens here with the server's own copy of the tokenizer,
so the engine thread (which detokenizes) never shares the Rust tokenizer object with us.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel

from atom_like.entrypoints.engine_loop import Admitted, EngineLoop, EngineRequest, Failed, Rejected
from atom_like.entrypoints.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                            ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, CompletionChoice,
                                            CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                                            ErrorInfo, ErrorResponse, SamplingFields, TokenLogprob, TopLogprob,
                                            UsageInfo)
from atom_like.sampling_params import RequestOutput, SamplingParams, TokenLogprobs

# JSON has no -inf; OpenAI and vLLM report impossible tokens with a large negative number instead.
MIN_LOGPROB = -9999.0


class OpenAIError(Exception):
    """An error the client gets as an OpenAI-style JSON body."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status_code)


def engine_failure(message: str) -> OpenAIError:
    # 503, not 500: the server is healthy and keeps serving; this request hit an engine fault.
    return OpenAIError(503, message, type="server_error", code="engine_error")


class _ClientGone(Exception):
    pass


class _Generation:
    """The engine requests behind one HTTP request, and their outputs as they arrive.

    Watches the connection while it lives: when the client goes away, its requests are aborted
    in the engine (so their KV blocks return to the pool) and the consumer is woken up."""

    def __init__(self, engine_loop: EngineLoop, raw_request: Request, requests: list[EngineRequest]):
        self.engine_loop, self.raw_request, self.requests = engine_loop, raw_request, requests
        self.sink: asyncio.Queue = asyncio.Queue()
        self.finished: set[int] = set()
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        """Queue the requests; raises OpenAIError when the engine refuses them."""
        self.engine_loop.submit(self.requests, self.sink)
        self._watcher = asyncio.create_task(self._watch_disconnect())
        try:
            answer = await self.sink.get()
            if isinstance(answer, Rejected):
                raise OpenAIError(400, answer.message)
            if isinstance(answer, Failed):
                raise engine_failure(answer.message)
            if isinstance(answer, _ClientGone):
                raise answer
            assert isinstance(answer, Admitted), answer
        except BaseException:
            self.close()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while len(self.finished) < len(self.requests):
            item = await self.sink.get()
            if isinstance(item, Failed):
                raise engine_failure(item.message)
            if isinstance(item, _ClientGone):
                raise item
            index, out = item
            if out.finished:
                self.finished.add(index)
            yield index, out

    async def final_outputs(self) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        async for index, out in self.outputs():
            if out.finished:
                final[index] = out
        return [final[i] for i in range(len(self.requests))]

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self._abort_unfinished()

    def _abort_unfinished(self) -> None:
        unfinished = [r.request_id for i, r in enumerate(self.requests) if i not in self.finished]
        if unfinished:
            self.engine_loop.abort(unfinished)

    async def _watch_disconnect(self) -> None:
        # The body is already read, so the next ASGI message can only be the disconnect.
        while (await self.raw_request.receive())["type"] != "http.disconnect":
            pass
        self._abort_unfinished()
        self.sink.put_nowait(_ClientGone())


def _client_gone() -> Response:
    # nginx's "client closed request". Nobody receives it; it only ends the handler cleanly.
    return Response(status_code=499)


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


async def _guarded(generation: _Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Every stream's ending: an engine-side error becomes an error event, a client that left
    stops the stream, and the generation is closed (its requests aborted if unfinished) however
    the stream ends."""
    try:
        async for event in events:
            yield event
    except OpenAIError as exc:
        yield _sse(ErrorResponse(error=exc.info))
        yield "data: [DONE]\n\n"
    except _ClientGone:
        return
    finally:
        generation.close()


class OpenAIServing:
    def __init__(self, engine_loop: EngineLoop, tokenizer, served_model_name: str, max_model_len: int,
                 vocab_size: int):
        self.engine_loop = engine_loop
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    # ------------------------------------------------------------------ endpoints

    async def completions(self, body: CompletionRequest, raw_request: Request) -> Response | BaseModel:
        self._check_common(body)
        if body.echo:
            raise OpenAIError(400, "echo is not supported", "echo")
        prompts = self._completion_prompts(body.prompt)
        requests = self._engine_requests("cmpl", body, prompts, "prompt", body.max_tokens, body.logprobs)

        def respond(outputs: list[RequestOutput]) -> CompletionResponse:
            choices = [CompletionChoice(index=i, text=out.text, finish_reason=out.finish_reason,
                                        logprobs=None if body.logprobs is None else self._completion_logprobs(out.logprobs, 0))
                       for i, out in enumerate(outputs)]
            return CompletionResponse(id=_base_id(requests), model=self.served_model_name, choices=choices,
                                      usage=_usage(outputs))

        return await self._generate(requests, raw_request, respond,
                                    (lambda g: self._stream_completion(g, body)) if body.stream else None)

    async def chat(self, body: ChatCompletionRequest, raw_request: Request) -> Response | BaseModel:
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        prompt_ids = self._chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        max_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requests = self._engine_requests("chatcmpl", body, [(None, prompt_ids)], "messages", max_tokens, logprobs,
                                         max_param)

        def respond(outputs: list[RequestOutput]) -> ChatCompletionResponse:
            (out,) = outputs
            choice = ChatChoice(index=0, message=AssistantMessage(content=out.text), finish_reason=out.finish_reason,
                                logprobs=ChatLogprobs(content=self._chat_logprobs(out.logprobs)) if body.logprobs else None)
            return ChatCompletionResponse(id=_base_id(requests), model=self.served_model_name, choices=[choice],
                                          usage=_usage(outputs))

        return await self._generate(requests, raw_request, respond,
                                    (lambda g: self._stream_chat(g, body)) if body.stream else None)

    async def _generate(self, requests: list[EngineRequest], raw_request: Request,
                        respond: Callable[[list[RequestOutput]], BaseModel],
                        stream: Callable[[_Generation], AsyncIterator[str]] | None) -> Response | BaseModel:
        """Queue the requests; then stream their events, or wait for them and `respond`."""
        generation = _Generation(self.engine_loop, raw_request, requests)
        try:
            await generation.start()
            if stream is not None:
                return StreamingResponse(_guarded(generation, stream(generation)), media_type="text/event-stream")
            try:
                return respond(await generation.final_outputs())
            finally:
                generation.close()
        except _ClientGone:
            return _client_gone()

    # ------------------------------------------------------------------ request -> engine requests

    def _check_common(self, body: SamplingFields) -> None:
        if body.model is not None and body.model != self.served_model_name:
            raise OpenAIError(400, f"model {body.model!r} is not served here; this server serves "
                                   f"{self.served_model_name!r}", "model", code="model_not_found")
        if body.n != 1:
            raise OpenAIError(400, f"n={body.n} is not supported: only one choice per prompt (n=1)", "n")

    def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt."""
        single = isinstance(prompt, str) or not prompt or isinstance(prompt[0], int)  # else a batch
        if single:
            prompt = [prompt]
        result = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise OpenAIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
                result.append((p, self.tokenizer(p).input_ids))
            else:
                if any(not 0 <= t < self.vocab_size for t in p):
                    raise OpenAIError(400, f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
                result.append((None, list(p)))
        return result

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise OpenAIError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise OpenAIError(400, f"the chat template rejected the messages: {exc}", "messages") from exc
        # The template already wrote any BOS it wants; tokenizing with special tokens would double it.
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _engine_requests(self, kind: str, body: SamplingFields, prompts: list[tuple[str | None, list[int]]],
                         prompt_param: str, max_tokens: int | None, logprobs: int | None,
                         max_param: str = "max_tokens") -> list[EngineRequest]:
        base_id = f"{kind}-{uuid.uuid4().hex}"
        requests = []
        for i, (text, ids) in enumerate(prompts):
            if not ids:
                raise OpenAIError(400, "the prompt is empty", prompt_param)
            if len(ids) >= self.max_model_len:
                raise OpenAIError(400, f"the prompt has {len(ids)} tokens but the context is {self.max_model_len} "
                                       "tokens, which must also hold at least one generated token", prompt_param)
            room = self.max_model_len - len(ids)
            if max_tokens is not None and max_tokens > room:
                raise OpenAIError(400, f"{max_param}={max_tokens} does not fit: the prompt has {len(ids)} tokens and "
                                       f"the context is {self.max_model_len}, so at most {room} can be generated",
                                  max_param)
            try:
                params = SamplingParams(
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=-1 if body.top_k in (None, 0) else body.top_k,
                    max_tokens=room if max_tokens is None else max_tokens,
                    ignore_eos=body.ignore_eos, stop=body.stop, stop_token_ids=body.stop_token_ids, seed=body.seed,
                    logprobs=logprobs)
            except ValueError as exc:  # pydantic checked the ranges; this is a backstop
                raise OpenAIError(400, str(exc)) from exc
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            requests.append(EngineRequest(request_id, text, ids, params))
        return requests

    # ------------------------------------------------------------------ streaming

    async def _stream_completion(self, generation: _Generation, body: CompletionRequest) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        request_id = _base_id(generation.requests)
        text = _TextDeltas(body.stop, len(generation.requests))
        sent_tokens = [0] * len(generation.requests)
        token_text_offset = [0] * len(generation.requests)  # for logprobs.text_offset
        final: list[RequestOutput] = []
        async for index, out in generation.outputs():
            delta = text.delta(index, out)
            logprobs = None
            if body.logprobs is not None and out.logprobs is not None:
                logprobs = self._completion_logprobs(out.logprobs[sent_tokens[index]:], token_text_offset[index])
                token_text_offset[index] += sum(len(t) for t in logprobs.tokens)
            sent_tokens[index] = len(out.token_ids)
            if delta or out.finished or (logprobs and logprobs.tokens):
                choice = CompletionChoice(index=index, text=delta, logprobs=logprobs, finish_reason=out.finish_reason)
                yield _sse(CompletionResponse(id=request_id, model=self.served_model_name, choices=[choice]))
            if out.finished:
                final.append(out)
        if include_usage:
            yield _sse(CompletionResponse(id=request_id, model=self.served_model_name, choices=[], usage=_usage(final)))
        yield "data: [DONE]\n\n"

    async def _stream_chat(self, generation: _Generation, body: ChatCompletionRequest) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        request_id = _base_id(generation.requests)
        text = _TextDeltas(body.stop, 1)
        sent_tokens = 0

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return _sse(ChatCompletionChunk(id=request_id, model=self.served_model_name, choices=choices, usage=usage))

        yield chunk([ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
        async for _, out in generation.outputs():
            delta = text.delta(0, out)
            logprobs = None
            if body.logprobs and out.logprobs is not None:
                logprobs = ChatLogprobs(content=self._chat_logprobs(out.logprobs[sent_tokens:]))
            sent_tokens = len(out.token_ids)
            if delta or out.finished or (logprobs and logprobs.content):
                yield chunk([ChatStreamChoice(index=0, delta=DeltaMessage(content=delta), logprobs=logprobs,
                                              finish_reason=out.finish_reason)])
            if out.finished and include_usage:
                yield chunk([], _usage([out]))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ logprobs

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _completion_logprobs(self, logprobs: list[TokenLogprobs], text_offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for lp in logprobs:
            token = self._token_text(lp.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
            result.top_logprobs.append({self._token_text(t): max(v, MIN_LOGPROB) for t, v in lp.top.items()})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    def _chat_logprobs(self, logprobs: list[TokenLogprobs]) -> list[TokenLogprob]:
        def top(token_id: int, logprob: float) -> TopLogprob:
            token = self._token_text(token_id)
            return TopLogprob(token=token, logprob=max(logprob, MIN_LOGPROB), bytes=list(token.encode()))

        return [TokenLogprob(**top(lp.token_id, lp.logprob).model_dump(),
                             top_logprobs=[top(t, v) for t, v in lp.top.items()]) for lp in logprobs]


class _TextDeltas:
    """New text per streamed chunk. While a stop string may still be completing, its possible
    beginning is held back: the engine cuts the text before a stop string once it completes,
    and text already sent cannot be taken back. So the chunks always add up to the final text."""

    def __init__(self, stop: str | list[str] | None, n: int):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = [0] * n

    def delta(self, index: int, out: RequestOutput) -> str:
        end = len(out.text) if out.finished else max(self.sent[index], len(out.text) - self.hold)
        delta = out.text[self.sent[index]:end]
        self.sent[index] = end
        return delta


def _base_id(requests: list[EngineRequest]) -> str:
    rid = requests[0].request_id
    return rid if len(requests) == 1 else rid.rsplit("-", 1)[0]


def _usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
