"""From a parsed request body to engine requests: the per-request caps, the prompts (tokenized
on a worker thread), the sampling parameters, and `n` / `best_of` as one engine request per
sequence. Everything the client got wrong is an OpenAIError (400) naming the field."""
from __future__ import annotations

from dataclasses import dataclass

from atom_like.entrypoints.engine_loop import EngineRequest
from atom_like.entrypoints.errors import OpenAIError
from atom_like.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from atom_like.entrypoints.tokenization import ChatTemplateError, render_chat
from atom_like.sampling_params import SEED_RANGE, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the engine (each refused with a 400 naming the limit)."""
    max_sequences: int = 2048  # prompts x best_of (--max-sequences-per-request)
    max_stop_strings: int = 64
    max_stop_chars: int = 4096  # all stop strings together
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries


@dataclass
class Prompt:
    text: str | None  # as the client sent it, when it sent text
    ids: list[int]


@dataclass
class Plan:
    """The engine requests behind one HTTP request: prompt p's sequence j is request
    p * per_prompt + j; `n` of each prompt's `per_prompt` are returned (per_prompt = best_of)."""
    requests: list[EngineRequest]
    prompts: list[Prompt]
    n: int
    per_prompt: int


def check_limits(body: SamplingFields, num_prompts: int, per_prompt: int, limits: RequestLimits) -> None:
    sequences = num_prompts * per_prompt
    if sequences > limits.max_sequences:
        param = "prompt" if num_prompts > limits.max_sequences else ("best_of" if per_prompt > body.n else "n")
        raise OpenAIError(400, f"{num_prompts} prompt(s) x {per_prompt} sequence(s) each = {sequences} sequences, "
                               f"more than this server's limit of {limits.max_sequences} per request "
                               "(--max-sequences-per-request)", param)
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise OpenAIError(400, f"{len(stops)} stop strings; the limit is {limits.max_stop_strings}", "stop")
    if sum(len(s) for s in stops) > limits.max_stop_chars:
        raise OpenAIError(400, f"the stop strings have {sum(len(s) for s in stops)} characters in all; the limit is "
                               f"{limits.max_stop_chars}", "stop")
    if len(body.stop_token_ids or []) > limits.max_stop_token_ids:
        raise OpenAIError(400, f"{len(body.stop_token_ids)} stop_token_ids; the limit is {limits.max_stop_token_ids}",
                          "stop_token_ids")
    if len(body.logit_bias or {}) > limits.max_logit_bias:
        raise OpenAIError(400, f"logit_bias has {len(body.logit_bias)} entries; the limit is {limits.max_logit_bias}",
                          "logit_bias")


def completion_prompts(tokenizer, prompt, vocab_size: int) -> list[Prompt]:
    """Runs on a tokenizer worker thread."""
    single = isinstance(prompt, str) or not prompt or isinstance(prompt[0], int)  # else a batch
    result = []
    for p in [prompt] if single else prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise OpenAIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
            result.append(Prompt(p, tokenizer(p).input_ids))
        else:
            if any(not 0 <= t < vocab_size for t in p):
                raise OpenAIError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
            result.append(Prompt(None, list(p)))
    return result


def chat_prompt(tokenizer, body: ChatCompletionRequest) -> list[Prompt]:
    """Runs on a tokenizer worker thread."""
    if tokenizer is None or not tokenizer.chat_template:
        raise OpenAIError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        return [Prompt(None, render_chat(tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages]))]
    except ChatTemplateError as exc:
        raise OpenAIError(400, str(exc), "messages") from exc


class RequestBuilder:
    def __init__(self, served_model_name: str, max_model_len: int, vocab_size: int, limits: RequestLimits):
        self.served_model_name, self.max_model_len = served_model_name, max_model_len
        self.vocab_size, self.limits = vocab_size, limits

    def check(self, body: SamplingFields, num_prompts: int) -> int:
        """Checks that need no tokens; returns the sequences per prompt (best_of, else n)."""
        if body.model is not None and body.model != self.served_model_name:
            raise OpenAIError(400, f"model {body.model!r} is not served here; this server serves "
                                   f"{self.served_model_name!r}", "model", code="model_not_found")
        best_of = getattr(body, "best_of", None)
        if best_of is not None and best_of < body.n:
            raise OpenAIError(400, f"best_of={best_of} must be >= n={body.n}", "best_of")
        per_prompt = best_of or body.n
        if body.stream and per_prompt != body.n:
            raise OpenAIError(400, "best_of > n cannot stream: the best are known only at the end", "best_of")
        check_limits(body, num_prompts, per_prompt, self.limits)
        outside = [k for k in (body.logit_bias or {}) if int(k) >= self.vocab_size]
        if outside:
            raise OpenAIError(400, f"logit_bias token ids must be in [0, {self.vocab_size}); got {outside[:5]}",
                              "logit_bias")
        return per_prompt

    def plan(self, kind: str, request_id: str, body: SamplingFields, prompts: list[Prompt], per_prompt: int,
             prompt_param: str, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
             max_param: str = "max_tokens") -> Plan:
        base_id = f"{kind}-{request_id}"
        # Ranking best_of by cumulative logprob needs the logprobs even when the client wants none.
        engine_logprobs = logprobs if logprobs is not None or per_prompt == body.n else 0
        requests = []
        for i, prompt in enumerate(prompts):
            ids = prompt.ids
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
            limit = room if max_tokens is None else max_tokens
            if body.min_tokens > limit:
                raise OpenAIError(400, f"min_tokens={body.min_tokens} exceeds the {limit} tokens this prompt may "
                                       "generate", "min_tokens")
            for j in range(per_prompt):
                params = self._params(body, j, limit, engine_logprobs, prompt_logprobs)
                suffix = "" if len(prompts) * per_prompt == 1 else f"-{i * per_prompt + j}"
                requests.append(EngineRequest(base_id + suffix, prompt.text, ids, params))
        return Plan(requests, prompts, body.n, per_prompt)

    @staticmethod
    def _params(body: SamplingFields, j: int, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None) -> SamplingParams:
        seed = body.seed
        if seed is not None and j:  # sequence j of a prompt follows seed + j (vLLM's rule), wrapped to 64 bits
            seed = seed + j if seed + j <= SEED_RANGE[1] else seed + j - 2**64
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=-1 if body.top_k in (None, 0) else body.top_k,
                max_tokens=max_tokens, min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos, stop=body.stop, stop_token_ids=body.stop_token_ids, seed=seed,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty)
        except ValueError as exc:  # pydantic checked the ranges; this is a backstop
            raise OpenAIError(400, str(exc)) from exc


def completion_max_tokens(body: CompletionRequest) -> int | None:
    if body.max_tokens == 0 and not body.echo:
        raise OpenAIError(400, "max_tokens must be >= 1 (0 is allowed with echo: the prompt's logprobs alone)",
                          "max_tokens")
    return body.max_tokens


def chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    if body.max_tokens == 0:
        raise OpenAIError(400, "max_tokens must be >= 1", "max_tokens")
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"
