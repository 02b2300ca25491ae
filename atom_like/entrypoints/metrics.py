"""Prometheus metrics of the server, the periodic stats log line, and a reader for clients.

Only the engine thread writes these (prometheus_client objects are thread-safe, so the /metrics
handler may read them at any time). Engine numbers come from `LLMEngine.stats()`; its
cumulative counts become Prometheus counters by adding what changed since the last update.
Names follow vLLM's (`vllm:` -> `atom_like:`) so existing dashboards need only the prefix changed.

Clients (the serving benchmark, the GSM8K job) read counters back with `scrape_metrics` and the
`parse` of `SpecSnapshot`, `PrefixCacheSnapshot` and `HistogramSnapshot`; subtracting the
snapshot taken before a run from the one after gives numbers for that run alone.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from spec_decode.stats import SpecCounts

if TYPE_CHECKING:  # clients import this module to read /metrics back: they need no engine (nor torch)
    from atom_like.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

PREFIX = "atom_like:"
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class EngineState:
    """What the engine thread reads off the engine after each step (it alone may touch it)."""
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_histogram: list[int]  # drafts with exactly n accepted, n = 0..k
    prefix_cache_queries: int = 0  # tokens of admitted requests (0 while prefix caching is off)
    prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache
    drafted_per_position: list[int] | None = None  # drafts with a token at position i (None: every draft had k)
    num_drafts_in_use: int = 0  # k of the latest step (adaptive speculation)

    @classmethod
    def read(cls, engine: LLMEngine, num_pending: int = 0) -> "EngineState":
        """`num_pending`: admitted requests the server has not handed to the engine yet (they wait too)."""
        s = engine.stats()
        return cls(s.num_running, s.num_waiting + num_pending, s.num_free_blocks, s.num_blocks, s.num_preemptions,
                   s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_histogram),
                   s.prefix_cache_queries, s.prefix_cache_hits, list(s.drafted_per_position), s.num_drafts_in_use)

    @property
    def prefix_cache(self) -> "PrefixCacheSnapshot":
        return PrefixCacheSnapshot(self.prefix_cache_queries, self.prefix_cache_hits)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def spec(self) -> "SpecSnapshot":
        hist = self.accepted_histogram
        # Drafts whose position i was accepted are those with more than i accepted tokens.
        per_position = [sum(hist[i + 1:]) for i in range(len(hist) - 1)]
        drafted = self.drafted_per_position if self.drafted_per_position is not None else [self.num_drafts] * len(per_position)
        return SpecSnapshot(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, per_position,
                            len(per_position), list(drafted), self.num_drafts_in_use)


class ServerMetrics:
    def __init__(self, num_speculative_tokens: int, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, PREFIX
        self.requests = Counter(f"{p}request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)  # export zeros, so a missing series is never mistaken for a bug
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of (engine) requests that reached their first token; n choices count n times.", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Tokens generated, for every request including those later aborted.", registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Arrival to first generated token.", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{p}time_per_output_token_seconds", "Mean time per generated token after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Arrival to last token.", buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(f"{p}num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(f"{p}num_requests_waiting", "Requests waiting: queued in the scheduler (preempted ones included) or admitted and awaiting their round-robin turn.", registry=r)
        self.kv_usage = Gauge(f"{p}kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", registry=r)
        self.kv_free_blocks = Gauge(f"{p}kv_cache_free_blocks", "Free KV-cache blocks.", registry=r)
        self.kv_total_blocks = Gauge(f"{p}kv_cache_total_blocks", "KV-cache blocks in the pool.", registry=r)
        self.preemptions = Counter(f"{p}num_preemptions", "Sequences preempted for lack of KV blocks.", registry=r)
        self.prefix_queries = Counter(f"{p}prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(f"{p}prefix_cache_hits", "Tokens found in the prefix cache (not recomputed).", registry=r)
        self.prefix_hit_rate = Gauge(f"{p}prefix_cache_hit_rate", "Prefix-cache hits / queries in tokens since start.",
                                     registry=r)
        self.spec_k = Gauge(f"{p}spec_decode_num_speculative_tokens", "Most draft tokens a step proposes (0: speculation off).", registry=r)
        self.spec_k_in_use = Gauge(f"{p}spec_decode_draft_tokens_in_use",
                                   "Draft tokens the latest step proposed (adaptive speculation chooses 0..num_speculative_tokens per step).",
                                   registry=r)
        self.spec_drafted_per_pos = Counter(f"{p}spec_decode_num_drafts_per_pos",
                                            "Drafts that had a token at this position (0-based): the per-position denominator.",
                                            ["position"], registry=r)
        self.spec_drafts = Counter(f"{p}spec_decode_num_drafts", "Verified drafts (one per sequence per step).", registry=r)
        self.spec_draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens", "Verified draft tokens.", registry=r)
        self.spec_accepted_tokens = Counter(f"{p}spec_decode_num_accepted_tokens", "Accepted draft tokens.", registry=r)
        self.spec_accepted_per_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos",
                                             "Drafts whose token at this position (0-based) was accepted.", ["position"], registry=r)
        self.spec_acceptance_rate = Gauge(f"{p}spec_decode_acceptance_rate", "Accepted / drafted tokens since start.", registry=r)
        self.spec_mean_acceptance_length = Gauge(f"{p}spec_decode_mean_acceptance_length",
                                                 "1 + accepted tokens per draft since start (0 when nothing was drafted).", registry=r)
        self.spec_per_position = Gauge(f"{p}spec_decode_per_position_acceptance",
                                       "P(the draft token at this position, 0-based, was accepted) since start.", ["position"], registry=r)
        self.spec_k.set(num_speculative_tokens)
        for i in range(num_speculative_tokens):
            self.spec_accepted_per_pos.labels(str(i))
            self.spec_drafted_per_pos.labels(str(i))
            self.spec_per_position.labels(str(i))
        # Plain totals for the stats log (prometheus_client offers no public read-back).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self._last: EngineState | None = None

    # ------------------------------------------------------------------ per request

    def first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.total_prompt_tokens += num_prompt_tokens

    def generated(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)
        self.total_generation_tokens += num_tokens

    def finished(self, reason: str, e2e: float, decode_time: float | None, num_generated: int) -> None:
        self.requests.labels(reason).inc()
        self.e2e.observe(e2e)
        if decode_time is not None and num_generated > 1:
            self.tpot.observe(decode_time / (num_generated - 1))

    # ------------------------------------------------------------------ engine state

    def update(self, state: EngineState) -> None:
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        self.kv_usage.set(state.kv_usage)
        self.kv_free_blocks.set(state.num_free_blocks)
        self.kv_total_blocks.set(state.num_blocks)
        last, self._last = self._last, state
        self.preemptions.inc(state.num_preemptions - (last.num_preemptions if last else 0))
        cache = state.prefix_cache
        new_cache = cache.minus(last.prefix_cache) if last else cache
        self.prefix_queries.inc(new_cache.queries)
        self.prefix_hits.inc(new_cache.hits)
        self.prefix_hit_rate.set(cache.hit_rate)
        spec = state.spec
        self.spec_k_in_use.set(state.num_drafts_in_use)
        new = spec.minus(last.spec) if last else spec
        if not new.num_drafts:
            return  # nothing verified since the last update
        self.spec_drafts.inc(new.num_drafts)
        self.spec_draft_tokens.inc(new.num_draft_tokens)
        self.spec_accepted_tokens.inc(new.num_accepted_tokens)
        for i, n in enumerate(new.accepted_per_position):
            self.spec_accepted_per_pos.labels(str(i)).inc(n)
        for i, n in enumerate(new.drafted_per_position):
            self.spec_drafted_per_pos.labels(str(i)).inc(n)
        self.spec_acceptance_rate.set(spec.acceptance_rate)
        self.spec_mean_acceptance_length.set(spec.mean_acceptance_length)
        for i, rate in enumerate(spec.per_position_acceptance):
            self.spec_per_position.labels(str(i)).set(rate)


class StatsLogger:
    """Logs one line every `interval` seconds while the server has (or just had) work."""

    def __init__(self, metrics: ServerMetrics, interval: float):
        self.metrics, self.interval = metrics, interval
        self._last_time = time.monotonic()
        self._last_prompt = self._last_generation = 0

    def seconds_until_due(self, now: float) -> float | None:
        return None if self.interval <= 0 else max(0.0, self._last_time + self.interval - now)

    def maybe_log(self, now: float, state: EngineState) -> None:
        if self.interval <= 0 or now - self._last_time < self.interval:
            return
        m, elapsed = self.metrics, now - self._last_time
        prompt, generation = m.total_prompt_tokens - self._last_prompt, m.total_generation_tokens - self._last_generation
        self._last_time, self._last_prompt, self._last_generation = now, m.total_prompt_tokens, m.total_generation_tokens
        if not (prompt or generation or state.num_running or state.num_waiting):
            return  # idle: say nothing rather than repeat zeros
        line = (f"prompt throughput {prompt / elapsed:.1f} tokens/s, generation throughput {generation / elapsed:.1f} tokens/s, "
                f"running {state.num_running} reqs, waiting {state.num_waiting} reqs, KV cache usage {state.kv_usage:.1%} "
                f"({state.num_blocks - state.num_free_blocks}/{state.num_blocks} blocks)")
        if state.prefix_cache_queries:
            line += f"; since start, {state.prefix_cache.describe()}"
        if state.spec.num_speculative_tokens:
            line += f"; since start, {state.spec.describe()}"
        logger.info(line)


@dataclass
class SpecSnapshot(SpecCounts):
    """Speculation counts as /metrics reports them (and as the engine's stats give them)."""

    def describe(self) -> str:
        per_pos = ", ".join(f"{p:.3f}" for p in self.per_position_acceptance)
        mean_k = self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0
        return (f"speculation: k now {self.num_drafts_in_use} (mean {mean_k:.2f}, at most {self.num_speculative_tokens}), "
                f"acceptance rate {self.acceptance_rate:.1%} ({self.num_accepted_tokens:.0f}/"
                f"{self.num_draft_tokens:.0f} drafted tokens), mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"per-position [{per_pos}]")

    def as_dict(self) -> dict:
        return {"num_speculative_tokens": self.num_speculative_tokens, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance": self.per_position_acceptance, "num_drafts_in_use": self.num_drafts_in_use}

    @classmethod
    def parse(cls, metrics_text: str) -> "SpecSnapshot":
        """Read the speculation counters out of a /metrics page."""
        values: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        drafted: dict[int, float] = {}
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name == f"{PREFIX}spec_decode_num_accepted_tokens_per_pos_total":
                    per_pos[int(sample.labels["position"])] = sample.value
                elif sample.name == f"{PREFIX}spec_decode_num_drafts_per_pos_total":
                    drafted[int(sample.labels["position"])] = sample.value
                else:
                    values[sample.name] = sample.value
        return cls(values.get(f"{PREFIX}spec_decode_num_drafts_total", 0.0),
                   values.get(f"{PREFIX}spec_decode_num_draft_tokens_total", 0.0),
                   values.get(f"{PREFIX}spec_decode_num_accepted_tokens_total", 0.0),
                   [per_pos[i] for i in sorted(per_pos)],
                   int(values.get(f"{PREFIX}spec_decode_num_speculative_tokens", 0)),
                   [drafted[i] for i in sorted(per_pos)] if drafted else [],
                   int(values.get(f"{PREFIX}spec_decode_draft_tokens_in_use", 0)))

    @classmethod
    def scrape(cls, base_url: str, timeout: float = 10.0) -> "SpecSnapshot":
        return cls.parse(scrape_metrics(base_url, timeout))


def scrape_metrics(base_url: str, timeout: float = 10.0) -> str:
    """A server's /metrics page."""
    import httpx  # clients only; the server never imports it

    response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout)
    response.raise_for_status()
    return response.text


def _samples(metrics_text: str) -> dict[str, float]:
    """Unlabelled samples by name (labelled ones are left out)."""
    return {sample.name: sample.value for family in text_string_to_metric_families(metrics_text)
            for sample in family.samples if not sample.labels}


@dataclass
class PrefixCacheSnapshot:
    """Prefix-cache counters in tokens: looked up (every token of an admitted request) and hit."""
    queries: float = 0.0
    hits: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def minus(self, before: "PrefixCacheSnapshot") -> "PrefixCacheSnapshot":
        return PrefixCacheSnapshot(self.queries - before.queries, self.hits - before.hits)

    def describe(self) -> str:
        return f"prefix cache hit rate {self.hit_rate:.1%} ({self.hits:.0f}/{self.queries:.0f} prompt tokens)"

    def as_dict(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "hit_rate": self.hit_rate}

    @classmethod
    def parse(cls, metrics_text: str) -> "PrefixCacheSnapshot":
        values = _samples(metrics_text)
        return cls(values.get(f"{PREFIX}prefix_cache_queries_total", 0.0), values.get(f"{PREFIX}prefix_cache_hits_total", 0.0))


@dataclass
class HistogramSnapshot:
    """One Prometheus histogram read off a /metrics page: cumulative counts per upper bound."""
    bounds: list[float]
    cumulative: list[float]
    sum: float = 0.0
    count: float = 0.0

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """Prometheus' histogram_quantile: linear within the bucket the rank falls in (so only
        as fine as the buckets; the +Inf bucket answers with the largest finite bound)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative):
            if cumulative >= rank:
                if bound == float("inf"):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below) if cumulative > below else bound
            lower, below = bound, cumulative
        return lower

    def minus(self, before: "HistogramSnapshot") -> "HistogramSnapshot":
        if before.bounds != self.bounds:
            raise ValueError("histogram buckets changed between snapshots")
        return HistogramSnapshot(self.bounds, [a - b for a, b in zip(self.cumulative, before.cumulative)],
                                 self.sum - before.sum, self.count - before.count)

    @classmethod
    def parse(cls, metrics_text: str, name: str) -> "HistogramSnapshot":
        """`name` without the prefix, e.g. "time_to_first_token_seconds"; empty when absent."""
        buckets: dict[float, float] = {}
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(metrics_text):
            if family.name != f"{PREFIX}{name}":
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
                else:
                    values[sample.name.removeprefix(f"{PREFIX}{name}")] = sample.value
        bounds = sorted(buckets)
        return cls(bounds, [buckets[b] for b in bounds], values.get("_sum", 0.0), values.get("_count", 0.0))
