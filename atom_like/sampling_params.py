"""SamplingParams (what a request asks for) and RequestOutput (what it gets back)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this a temperature means greedy (vLLM's threshold): dividing logits by a temperature
# near float32's smallest normals overflows them, and the probabilities become NaN.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI and vLLM


@dataclass
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16  # 0: only run the prompt (for prompt_logprobs)
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens exist
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # end the request on these as on EOS (also with ignore_eos)
    seed: int | None = None
    logprobs: int | None = None  # per generated token: its logprob and the top `logprobs`
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    logit_bias: dict[int, float] | None = None  # added to the logits of these token ids
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.logit_bias = {int(t): float(v) for t, v in (self.logit_bias or {}).items()}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number; got {getattr(self, name)!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0; got {self.max_tokens!r}")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}]; got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1; got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1]; got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= getattr(self, name) <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in [-2, 2]; got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0; got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:  # NaN fails too
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100]; got {token}: {bias}")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass
class TokenLogprobs:
    """Log-probabilities of one token under the model's raw distribution (before temperature
    and the logits processors), as OpenAI and vLLM report them."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # the `logprobs` most likely tokens


class Span:
    """source[start:stop] of a list that only ever grows (a sequence's tokens or logprobs), copied
    into a list of its own when first read: what stood there when the Span was made."""
    __slots__ = ("source", "start", "stop")

    def __init__(self, source: list, start: int, stop: int):
        self.source, self.start, self.stop = source, start, stop

    def read(self) -> list:
        return self.source[self.start:self.stop]


class TextPieces(list):
    """A detokenizer's text, a piece a token (appended, never changed), with the text of the pieces
    read so far kept joined: outputs are read in order (a stream), so each read joins only the new
    pieces onto it, one copy of the text a read as `text += piece` made one a token."""

    def __init__(self):
        super().__init__()
        self.ends = [0]  # ends[i]: characters in the first i pieces (appended with each piece)
        self._joined = ("", 0)  # (the text of the first n pieces, n): one attribute, replaced whole

    def add(self, piece: str) -> None:
        self.append(piece)
        self.ends.append(self.ends[-1] + len(piece))

    def text(self, n: int) -> str:
        """The text of the first n pieces."""
        joined, have = self._joined
        if n > have:
            joined = joined + "".join(self[have:n])
            self._joined = (joined, n)
            return joined
        return joined if n == have else joined[:self.ends[n]]


class TextSpan(Span):
    """The text of the first `stop` pieces of a TextPieces (start is 0)."""
    __slots__ = ()

    def read(self) -> str:
        return self.source.text(self.stop)


class _Snapshot:
    """A RequestOutput attribute given as its value or a Span: a Span is read at first access."""

    def __set_name__(self, owner, name: str):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = getattr(obj, self.slot)
        if isinstance(value, Span):
            value = value.read()
            setattr(obj, self.slot, value)
        return value

    def __set__(self, obj, value) -> None:
        setattr(obj, self.slot, value)


class RequestOutput:
    """What a request has so far (the engine makes one for every request a step touched).

    text, token_ids, prompt_token_ids and logprobs are the caller's own, which later steps do not
    change. The engine passes them as Spans of the sequence's lists and the detokenizer's pieces,
    read when first accessed: copying every touched request's whole lists at every step cost 1.2 ms
    of host time a step at batch 128 x 2,000 generated tokens (the CPU machine of CI, 2026-11-27),
    growing with the context, and most outputs (a benchmark's, generate()'s unfinished ones) are
    never read; the server reads them on its tokenizer threads, off the engine's step."""

    text = _Snapshot()
    prompt_token_ids = _Snapshot()
    token_ids = _Snapshot()  # generated tokens
    logprobs = _Snapshot()
    __slots__ = ("request_id", "prompt", "finish_reason", "prompt_logprobs", "_text", "_prompt_token_ids", "_token_ids",
                 "_logprobs")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | Span, text: str | Span = "",
                 token_ids: list[int] | Span | None = None, finish_reason: str | None = None,
                 logprobs: list[TokenLogprobs] | Span | None = None,
                 prompt_logprobs: list[TokenLogprobs | None] | None = None):
        # the slots directly, not through the descriptors: the engine makes one output a request a step
        self.request_id, self.prompt, self._prompt_token_ids, self._text = request_id, prompt, prompt_token_ids, text
        self._token_ids = [] if token_ids is None else token_ids
        self.finish_reason = finish_reason  # "stop" | "length" | "abort"; None while running
        self._logprobs = logprobs
        # With prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it).
        self.prompt_logprobs = prompt_logprobs

    FIELDS = ("request_id", "prompt", "prompt_token_ids", "text", "token_ids", "finish_reason", "logprobs",
              "prompt_logprobs")

    def __eq__(self, other) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.FIELDS)

    def __repr__(self) -> str:
        return f"RequestOutput({', '.join(f'{f}={getattr(self, f)!r}' for f in self.FIELDS)})"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """len(token_ids), without reading them (the server counts every output's on the engine's thread)."""
        ids = self._token_ids
        return ids.stop - ids.start if isinstance(ids, Span) else len(ids)
