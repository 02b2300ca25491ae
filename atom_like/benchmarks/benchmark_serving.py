"""Serving benchmark against a running OpenAI-compatible server (ours, vLLM, SGLang, ATOM).

    python -m atom_like.benchmarks.benchmark_serving --base-url http://127.0.0.1:8000 --model NAME \\
        --tokenizer DIR --dataset sharegpt --num-prompts 200 --request-rate 8 --plot latency.png

Sends streamed /v1/completions requests (Poisson arrivals at --request-rate, and/or at most
--max-concurrency in flight) and reports request and token throughput, TTFT, TPOT, ITL and
end-to-end latency (mean / median / p99), plus the server's speculation numbers and prefix-cache
hit rate for this run (the difference of its /metrics counters before and after; absent on
servers without them).

ITL is measured between streamed chunks; with speculation one chunk may carry several tokens,
so ITL is the time between chunks and TPOT the time per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from atom_like.cli import entry_point
from atom_like.config import add_flag, load_tokenizer
from atom_like.entrypoints.metrics import PrefixCacheSnapshot, SpecSnapshot, scrape_metrics
from atom_like.zoo import MODELS, data, model_path



@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ----------------------------------------------------------------------------- datasets

def random_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    """Prompts of random token ids (sent as ids, so their length is exact), lengths drawn
    uniformly from [len * (1 - range_ratio), len]."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([t for t in range(len(tokenizer)) if t not in special])
    requests = []
    for _ in range(num):
        n_in = int(rng.integers(max(1, int(input_len * (1 - range_ratio))), input_len + 1))
        n_out = int(rng.integers(max(1, int(output_len * (1 - range_ratio))), output_len + 1))
        requests.append(BenchRequest(rng.choice(vocab, n_in).tolist(), n_in, n_out))
    return requests


def sharegpt_requests(tokenizer, num: int, seed: int, max_model_len: int | None,
                      fixed_output_len: int | None) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's token count as the output length (vLLM's
    recipe: skip prompts or replies under 4 tokens, prompts over 1024, pairs over 2048)."""
    text = data.sharegpt_path().read_text(encoding="utf-8")  # names the pip command when missing
    pairs = [(c[0]["value"], c[1]["value"]) for r in data.iter_sharegpt_records(text)
             if len(c := r.get("conversations", [])) >= 2 and c[0].get("from") == "human"]
    random.Random(seed).shuffle(pairs)
    limit = min(2048, max_model_len or 2048)
    requests = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer(prompt).input_ids)
        output_len = fixed_output_len or len(tokenizer(reply).input_ids)
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > limit:
            continue
        requests.append(BenchRequest(prompt, prompt_len, output_len))
        if len(requests) == num:
            return requests
    raise SystemExit(f"only {len(requests)} ShareGPT prompts fit the limits; ask for fewer")


# ----------------------------------------------------------------------------- client

async def send(client: httpx.AsyncClient, model: str, request: BenchRequest, ignore_eos: bool) -> RequestResult:
    payload = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk["choices"]:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = True
    return result


async def run(base_url: str, model: str, requests: list[BenchRequest], request_rate: float,
              max_concurrency: int | None, ignore_eos: bool, seed: int) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    rng = random.Random(seed)
    bar = tqdm(total=len(requests), desc="requests")

    async def one(client: httpx.AsyncClient, request: BenchRequest) -> RequestResult:
        async with limit:
            result = await send(client, model, request, ignore_eos)
        bar.update(1)
        return result

    connections = httpx.Limits(max_connections=max_concurrency or len(requests), max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=connections) as client:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(client, request)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


# ----------------------------------------------------------------------------- report

def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0  # milliseconds
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float, spec: SpecSnapshot | None,
              prefix_cache: PrefixCacheSnapshot | None = None) -> dict:
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "request_throughput": len(done) / duration, "input_token_throughput": prompt_tokens / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "ttft_ms": _stats([r.ttft for r in done]), "tpot_ms": _stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats([x for r in done for x in r.itl]), "e2e_latency_ms": _stats([r.latency for r in done]),
        "speculation": spec.as_dict() if spec is not None and spec.num_speculative_tokens else None,
        "prefix_cache": prefix_cache.as_dict() if prefix_cache is not None and prefix_cache.queries else None,
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def print_report(summary: dict) -> None:
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Benchmark duration (s)", summary["duration_s"]), ("Total input tokens", summary["total_input_tokens"]),
            ("Total output tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"]),
            ("Input token throughput (tok/s)", summary["input_token_throughput"]),
            ("Output token throughput (tok/s)", summary["output_token_throughput"]),
            ("Total token throughput (tok/s)", summary["total_token_throughput"])]
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E latency")):
        rows += [(f"{stat.capitalize()} {title} (ms)", summary[key][stat]) for stat in ("mean", "median", "p99")]
    spec = summary["speculation"]
    if spec:
        rows += [("Acceptance rate", spec["acceptance_rate"]), ("Mean acceptance length", spec["mean_acceptance_length"]),
                 ("Per-position acceptance", " ".join(f"{p:.3f}" for p in spec["per_position_acceptance"]))]
    else:
        rows.append(("Speculative decoding", "off (or not reported)"))
    cache = summary.get("prefix_cache")
    rows.append(("Prefix cache hit rate (tokens)", f"{cache['hit_rate']:.1%}" if cache else "off (or not reported)"))
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    for name, value in rows:
        print(f"{name:<40}{value:>26.2f}" if isinstance(value, float) else f"{name:<40}{value!s:>26}")
    for error in summary["errors"]:
        print(f"error: {error}")
    print("=" * 66)


def plot(results: list[RequestResult], path: str) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    series = {"TTFT (ms)": [r.ttft * 1e3 for r in done], "TPOT (ms)": [r.tpot * 1e3 for r in done if r.tpot],
              "ITL (ms)": [x * 1e3 for r in done for x in r.itl], "E2E latency (s)": [r.latency for r in done]}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, values) in zip(axes.flat, series.items()):
        ax.hist(values, bins=40)
        ax.set_title(title)
        ax.set_ylabel("count")
    fig.suptitle(f"{len(done)} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _scrape(base_url: str) -> str | None:
    try:
        return scrape_metrics(base_url)
    except httpx.HTTPError:
        return None  # a server without /metrics: report no speculation or cache numbers


@entry_point
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(parser, "base_url", str, "http://127.0.0.1:8000", "Server address (without /v1).")
    add_flag(parser, "model", str, None, "Model name to send (default: the server's first model).")
    add_flag(parser, "tokenizer", str, None, "Tokenizer folder or zoo name, to size prompts and outputs (default: --model, when it is a folder).")
    parser.add_argument("--dataset", choices=["sharegpt", "random"], default="random")
    add_flag(parser, "num_prompts", int, 100, "Requests to send.")
    add_flag(parser, "request_rate", float, float("inf"), "Poisson arrival rate in requests/s (inf: all at once).")
    add_flag(parser, "max_concurrency", int, None, "Most requests in flight at once.")
    add_flag(parser, "random_input_len", int, 1024, "random: prompt tokens (upper bound).")
    add_flag(parser, "random_output_len", int, 128, "random: output tokens (upper bound).")
    add_flag(parser, "random_range_ratio", float, 0.0, "random: lengths drawn from [len * (1 - ratio), len].")
    add_flag(parser, "sharegpt_output_len", int, None, "sharegpt: fixed output length instead of the reply's.")
    add_flag(parser, "ignore_eos", bool, False, "Generate exactly the requested output lengths.")
    add_flag(parser, "seed", int, 0, "Seed for prompts and arrivals.")
    add_flag(parser, "plot", str, None, "Write latency histograms to this PNG.")
    add_flag(parser, "save_result", str, None, "Write the summary and per-request numbers to this JSON.")
    args = parser.parse_args(argv)

    tokenizer_path = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    if tokenizer_path is None:
        parser.error("--tokenizer DIR is needed to size prompts")
    if tokenizer_path in MODELS:  # a zoo name, as the server's --model takes
        tokenizer_path = model_path(tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path)
    base_url = args.base_url.rstrip("/")
    try:
        card = httpx.get(f"{base_url}/v1/models", timeout=30).raise_for_status().json()["data"][0]
    except httpx.TransportError as exc:
        raise ValueError(f"no server answers at --base-url {base_url} ({exc}); start one with "
                         "python -m atom_like.entrypoints.openai_server --model DIR") from exc
    model = args.model or card["id"]
    if args.dataset == "random":
        requests = random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                   args.random_range_ratio, args.seed)
    else:
        requests = sharegpt_requests(tokenizer, args.num_prompts, args.seed, card.get("max_model_len"),
                                     args.sharegpt_output_len)

    before = _scrape(base_url)
    results, duration = asyncio.run(run(base_url, model, requests, args.request_rate, args.max_concurrency,
                                        args.ignore_eos, args.seed))
    after = _scrape(base_url)
    spec = cache = None
    if before is not None and after is not None:
        spec = SpecSnapshot.parse(after).minus(SpecSnapshot.parse(before))
        cache = PrefixCacheSnapshot.parse(after).minus(PrefixCacheSnapshot.parse(before))
    summary = summarize(results, duration, spec, cache)
    print_report(summary)
    if args.plot:
        plot(results, args.plot)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(
            {"args": vars(args), "summary": summary, "requests": [asdict(r) for r in results]}, indent=1))
    return summary


if __name__ == "__main__":
    main()
