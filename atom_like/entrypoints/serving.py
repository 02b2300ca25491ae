"""/v1/completions and /v1/chat/completions: queue a request's engine requests, and turn engine
outputs into OpenAI responses (whole, or streamed as server-sent events).

Tokenization, chat templates and detokenization of logprobs run on the tokenizer pool's worker
threads (see tokenization.py), never on the event loop; so does building a whole response,
which for `echo` with logprobs can mean a token text per prompt position.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from atom_like.entrypoints.engine_loop import Admitted, EngineLoop, EngineRequest, Failed, Rejected
from atom_like.entrypoints.engine_requests import (Plan, RequestBuilder, chat_max_tokens, chat_prompt,
                                                   completion_max_tokens, completion_prompts)
from atom_like.entrypoints.errors import OpenAIError, engine_failure, internal_error
from atom_like.entrypoints.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                            ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, CompletionChoice,
                                            CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                                            ErrorResponse, TokenLogprob, TopLogprob, UsageInfo)
from atom_like.entrypoints.tokenization import TokenizerPool
from atom_like.sampling_params import RequestOutput, TokenLogprobs

logger = logging.getLogger(__name__)

# JSON has no -inf; OpenAI and vLLM report impossible tokens with a large negative number instead.
MIN_LOGPROB = -9999.0


class _ClientGone(Exception):
    pass


class _Generation:
    """The engine requests behind one HTTP request, and their outputs as they arrive.

    Watches the connection while it lives: when the client goes away, its requests are aborted
    in the engine (so their KV blocks return to the pool), which is logged with the request id,
    and the consumer is woken up."""

    def __init__(self, engine_loop: EngineLoop, raw_request: Request, requests: list[EngineRequest]):
        self.engine_loop, self.raw_request, self.requests = engine_loop, raw_request, requests
        self.sink: asyncio.Queue = asyncio.Queue()
        self.finished: set[int] = set()
        self._aborted = False
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
        self._abort_unfinished("the response ended before its sequences did")

    def _abort_unfinished(self, why: str) -> None:
        unfinished = [r.request_id for i, r in enumerate(self.requests) if i not in self.finished]
        if unfinished and not self._aborted:
            self._aborted = True
            logger.info("request %s: %s; aborting %d unfinished sequence(s) (%s)", self.raw_request.state.request_id,
                        why, len(unfinished), ", ".join(unfinished[:4]) + (", ..." if len(unfinished) > 4 else ""))
            self.engine_loop.abort(unfinished)

    async def _watch_disconnect(self) -> None:
        # The body is already read, so the next ASGI message can only be the disconnect.
        while (await self.raw_request.receive())["type"] != "http.disconnect":
            pass
        self._abort_unfinished("the client disconnected")
        self.sink.put_nowait(_ClientGone())


def _client_gone() -> Response:
    # nginx's "client closed request". Nobody receives it; it only ends the handler cleanly.
    return Response(status_code=499)


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


async def _guarded(generation: _Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Every stream's ending: an error becomes an error event (our own bugs logged with the
    request id), a client that left stops the stream, and the generation is closed (its requests
    aborted if unfinished) however the stream ends."""
    try:
        async for event in events:
            yield event
    except _ClientGone:
        return
    except Exception as exc:
        if not isinstance(exc, OpenAIError):
            request_id = generation.raw_request.state.request_id
            logger.exception("request %s: internal error while streaming", request_id)
            exc = internal_error(request_id)
        yield _sse(ErrorResponse(error=exc.info))
        yield "data: [DONE]\n\n"
    finally:
        generation.close()


class OpenAIServing:
    def __init__(self, engine_loop: EngineLoop, tokenizers: TokenizerPool, builder: RequestBuilder):
        self.engine_loop, self.tokenizers, self.builder = engine_loop, tokenizers, builder

    @property
    def served_model_name(self) -> str:
        return self.builder.served_model_name

    # ------------------------------------------------------------------ endpoints

    async def completions(self, body: CompletionRequest, raw_request: Request) -> Response | BaseModel:
        single = isinstance(body.prompt, str) or not body.prompt or isinstance(body.prompt[0], int)
        per_prompt = self.builder.check(body, 1 if single else len(body.prompt))
        max_tokens = completion_max_tokens(body)
        prompts = await self.tokenizers.run(completion_prompts, body.prompt, self.builder.vocab_size)
        echo_logprobs = body.logprobs if body.echo else None
        plan = self.builder.plan("cmpl", raw_request.state.request_id, body, prompts, per_prompt, "prompt",
                                 max_tokens, body.logprobs, echo_logprobs)

        def respond(tokenizer, outputs: list[RequestOutput]) -> CompletionResponse:
            choices = []
            for index, out in _best(plan, outputs):
                text, logprobs = out.text, None
                if body.echo:
                    text = _prompt_text(tokenizer, out) + text
                if body.logprobs is not None:
                    logprobs = _completion_logprobs(tokenizer, _scored(out, body.echo, 0), 0)
                choices.append(CompletionChoice(index=index, text=text, finish_reason=out.finish_reason,
                                                logprobs=logprobs))
            return CompletionResponse(id=_base_id(plan), model=self.served_model_name, choices=choices,
                                      usage=_usage(plan, [out for _, out in _best(plan, outputs)]))

        return await self._generate(plan, raw_request, respond,
                                    (lambda g: self._stream_completion(g, body, plan)) if body.stream else None)

    async def chat(self, body: ChatCompletionRequest, raw_request: Request) -> Response | BaseModel:
        per_prompt = self.builder.check(body, 1)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens, max_param = chat_max_tokens(body)
        prompts = await self.tokenizers.run(chat_prompt, body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        plan = self.builder.plan("chatcmpl", raw_request.state.request_id, body, prompts, per_prompt, "messages",
                                 max_tokens, logprobs, max_param=max_param)

        def respond(tokenizer, outputs: list[RequestOutput]) -> ChatCompletionResponse:
            choices = [ChatChoice(index=index, message=AssistantMessage(content=out.text), finish_reason=out.finish_reason,
                                  logprobs=ChatLogprobs(content=_chat_logprobs(tokenizer, out.logprobs)) if body.logprobs else None)
                       for index, out in _best(plan, outputs)]
            return ChatCompletionResponse(id=_base_id(plan), model=self.served_model_name, choices=choices,
                                          usage=_usage(plan, outputs))

        return await self._generate(plan, raw_request, respond,
                                    (lambda g: self._stream_chat(g, body, plan)) if body.stream else None)

    async def _generate(self, plan: Plan, raw_request: Request,
                        respond: Callable[..., BaseModel],
                        stream: Callable[[_Generation], AsyncIterator[str]] | None) -> Response | BaseModel:
        """Queue the requests; then stream their events, or wait for them and `respond`."""
        generation = _Generation(self.engine_loop, raw_request, plan.requests)
        try:
            await generation.start()
            if stream is not None:
                return StreamingResponse(_guarded(generation, stream(generation)), media_type="text/event-stream")
            try:
                outputs = await generation.final_outputs()
            finally:
                generation.close()
            return await self.tokenizers.run(respond, outputs)
        except _ClientGone:
            return _client_gone()

    # ------------------------------------------------------------------ streaming

    async def _stream_completion(self, generation: _Generation, body: CompletionRequest, plan: Plan) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        request_id = _base_id(plan)
        text = _TextDeltas(body.stop, len(plan.requests))
        sent_tokens = [0] * len(plan.requests)
        token_text_offset = [0] * len(plan.requests)  # for logprobs.text_offset
        started: set[int] = set()
        final: list[RequestOutput] = []

        def chunk(tokenizer, index: int, out: RequestOutput) -> str | None:
            delta, logprobs = text.delta(index, out), None
            echo = body.echo and index not in started  # the first chunk of a choice carries the prompt
            started.add(index)
            if echo:
                delta = _prompt_text(tokenizer, out) + delta
            scored = _scored(out, echo, sent_tokens[index]) if out.logprobs is not None else []
            if body.logprobs is not None:
                logprobs = _completion_logprobs(tokenizer, scored, token_text_offset[index])
                token_text_offset[index] += sum(len(t) for t in logprobs.tokens)
            sent_tokens[index] = out.num_tokens
            if not (delta or out.finished or (logprobs and logprobs.tokens)):
                return None
            choice = CompletionChoice(index=index, text=delta, logprobs=logprobs, finish_reason=out.finish_reason)
            return _sse(CompletionResponse(id=request_id, model=self.served_model_name, choices=[choice]))

        async for index, out in generation.outputs():
            event = await self.tokenizers.run(chunk, index, out)
            if event is not None:
                yield event
            if out.finished:
                final.append(out)
        if include_usage:
            yield _sse(CompletionResponse(id=request_id, model=self.served_model_name, choices=[],
                                          usage=_usage(plan, final)))
        yield "data: [DONE]\n\n"

    async def _stream_chat(self, generation: _Generation, body: ChatCompletionRequest, plan: Plan) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        request_id = _base_id(plan)
        text = _TextDeltas(body.stop, len(plan.requests))
        sent_tokens = [0] * len(plan.requests)
        final: list[RequestOutput] = []

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return _sse(ChatCompletionChunk(id=request_id, model=self.served_model_name, choices=choices, usage=usage))

        def delta_chunk(tokenizer, index: int, out: RequestOutput) -> str | None:
            delta, logprobs = text.delta(index, out), None
            if body.logprobs and out.logprobs is not None:
                logprobs = ChatLogprobs(content=_chat_logprobs(tokenizer, out.logprobs[sent_tokens[index]:]))
            sent_tokens[index] = out.num_tokens
            if not (delta or out.finished or (logprobs and logprobs.content)):
                return None
            return chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=delta), logprobs=logprobs,
                                           finish_reason=out.finish_reason)])

        for index in range(len(plan.requests)):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for index, out in generation.outputs():
            event = await self.tokenizers.run(delta_chunk, index, out)
            if event is not None:
                yield event
            if out.finished:
                final.append(out)
        if include_usage:
            yield chunk([], _usage(plan, final))
        yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------- choices, text, logprobs

def _best(plan: Plan, outputs: list[RequestOutput]) -> list[tuple[int, RequestOutput]]:
    """(choice index, output): per prompt, all its sequences, or with best_of > n the n whose
    generated tokens have the highest cumulative logprob."""
    chosen = []
    for p in range(len(plan.prompts)):
        group = outputs[p * plan.per_prompt:(p + 1) * plan.per_prompt]
        if plan.per_prompt > plan.n:
            group = sorted(group, key=lambda o: -sum(lp.logprob for lp in o.logprobs))[:plan.n]
        chosen += [(p * plan.n + j, out) for j, out in enumerate(group)]
    return chosen


def _prompt_text(tokenizer, out: RequestOutput) -> str:
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _scored(out: RequestOutput, echo: bool, start: int) -> list[tuple[int, TokenLogprobs | None]]:
    """(token id, its logprobs) of the generated tokens from `start` on, after the prompt's with echo."""
    prompt = list(zip(out.prompt_token_ids, out.prompt_logprobs or [])) if echo else []
    return prompt + [(lp.token_id, lp) for lp in out.logprobs[start:]]


def _completion_logprobs(tokenizer, scored: list[tuple[int, TokenLogprobs | None]], text_offset: int) -> CompletionLogprobs:
    """A token without logprobs (the first prompt token under echo: nothing predicts it) gets
    null ones, as in OpenAI's API."""
    result = CompletionLogprobs()
    for token_id, lp in scored:
        token = _token_text(tokenizer, token_id)
        result.tokens.append(token)
        result.token_logprobs.append(None if lp is None else max(lp.logprob, MIN_LOGPROB))
        result.top_logprobs.append(None if lp is None else {_token_text(tokenizer, t): max(v, MIN_LOGPROB)
                                                           for t, v in lp.top.items()})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def _chat_logprobs(tokenizer, logprobs: list[TokenLogprobs]) -> list[TokenLogprob]:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = _token_text(tokenizer, token_id)
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


def _base_id(plan: Plan) -> str:
    rid = plan.requests[0].request_id
    return rid if len(plan.requests) == 1 else rid.rsplit("-", 1)[0]


def _usage(plan: Plan, outputs: list[RequestOutput]) -> UsageInfo:
    """Each prompt counts once however many choices it has; completion tokens of every choice."""
    prompt = sum(len(p.ids) for p in plan.prompts)
    completion = sum(len(o.token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
