"""Request and response bodies of the OpenAI-compatible API (the subset atom_like serves).

Requests are parsed strictly: a string where a number belongs is a 400, not a silent cast, so
clients learn about their bug instead of getting an answer to a question they did not ask.
Numbers must be finite (Python's JSON reader accepts NaN and Infinity), text must be valid
Unicode (JSON can spell lone surrogates, which no tokenizer takes). A field this server does
not implement (`suffix`, `tools`, ...) is a 400 naming it, never silently ignored; sending it
as null is the same as leaving it out. Value ranges that depend on the model (max_tokens vs
the context, token ids vs the vocabulary) and the per-request caps are checked in serving.py.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      model_validator)

from atom_like.sampling_params import LOGIT_BIAS_RANGE, PENALTY_RANGE, SEED_RANGE

# OpenAI allows 20 top logprobs on chat and 5 on completions; one limit for both keeps it simple.
MAX_TOP_LOGPROBS = 20


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: a lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start}") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unknown_nulls_are_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class StreamOptions(RequestBody):
    include_usage: StrictBool = False


class SamplingFields(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Text | None = None  # None: the one model this server serves
    max_tokens: StrictInt | None = Field(None, ge=0)  # None: up to the context length; 0 only with echo
    min_tokens: StrictInt = Field(0, ge=0)  # vLLM extension: EOS and stop_token_ids held back until then
    temperature: float | None = Field(None, ge=0)  # below 1e-5: greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)  # vLLM extension; -1 and 0 both mean off
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extension: end on these ids
    seed: StrictInt | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: StrictInt = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float = Field(1.0, gt=0)  # vLLM extension
    # OpenAI's JSON keys are token ids as strings: {"50256": -100}
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                     Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM extension, used by benchmarks to fix output lengths
    user: Text | None = None  # an end-user id for the caller's own records; it changes nothing


class CompletionRequest(SamplingFields):
    # A string, a list of token ids, or a batch of either (one choice per prompt, as OpenAI does).
    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(None, ge=1)  # sequences per prompt; the n best are returned


class TextPart(RequestBody):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestBody):
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # the newer name for max_tokens
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


# ----------------------------------------------------------------------------- responses

def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the whole response and, with `stream`, each chunk (OpenAI uses one shape for both)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "atom_like"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
