"""A bounded fuzzer and soak for a running openai_server (loopback only; not part of CI: it runs
for minutes). It reports a status histogram and fails (exit 1) on any 5xx, any hang, any
malformed error body, or KV blocks / requests left behind.

    python ci/fuzz_server.py --base-url http://127.0.0.1:8000 --requests 4000 --soak 400

Fuzz: valid completion and chat bodies with one to three fields mutated (wrong types, huge,
negative, non-finite and boundary numbers, lone surrogates, unknown fields, nulls), raw
garbage and truncated JSON, odd headers, methods and paths. Soak: concurrent clients sending
valid requests (streamed or not, n > 1, echo, penalties, logit_bias, stop strings), a share of
which disconnect mid-way. Afterwards every KV block must be free and no request queued.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time

import httpx

VALUES = [None, True, False, 0, 1, -1, 2, 7, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, -0.5, 1e-45, 1e-38,
          1e-6, 1e308, float("inf"), float("-inf"), float("nan"), "", "w1", "\ud800x", "\udc00", "x" * 5000,
          [], [1], [1, 2, 3], [[1, 2], [3]], ["w1", "w2"], [None], {}, {"a": 1}, {"5": -100}, {"5": 1e9},
          {"999999999": 1}, "<|im_end|>", ["\ud800"], [-1], [10**12]]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k",
          "stop", "stop_token_ids", "seed", "n", "best_of", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "stream", "stream_options", "ignore_eos", "logprobs", "top_logprobs",
          "echo", "suffix", "user", "model", "tools", "response_format", "unknown_field"]


def base_body(rng: random.Random, chat: bool) -> dict:
    body = {"max_tokens": rng.choice([1, 3, 8]), "temperature": rng.choice([0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "w1 w2", "<|im_end|> x"])}]
    else:
        body["prompt"] = rng.choice(["w1 w2 w3", [1, 2, 3], ["w1", "w2"], [[4, 5], [6]]])
    return body


def fuzz_request(rng: random.Random) -> tuple[str, str, dict, bytes | None]:
    """(method, path, headers, body bytes)."""
    headers = {"content-type": "application/json"}
    roll = rng.random()
    if roll < 0.05:
        return rng.choice(["GET", "PUT", "DELETE"]), rng.choice(["/v1/completions", "/v1/x", "/", "/docs"]), headers, None
    if roll < 0.12:  # garbage or truncated JSON
        text = json.dumps(base_body(rng, rng.random() < 0.5))
        body = rng.choice([text[:rng.randrange(len(text))].encode(), bytes(rng.randrange(256) for _ in range(64)),
                           b"[1, 2]", b"null", b'"x"', b"{" * 2000])
        return "POST", rng.choice(["/v1/completions", "/v1/chat/completions"]), headers, body
    chat = rng.random() < 0.4
    body = base_body(rng, chat)
    for _ in range(rng.randint(1, 3)):
        body[rng.choice(FIELDS)] = rng.choice(VALUES)
    if rng.random() < 0.1:
        headers = rng.choice([{"content-type": "text/plain"}, {}, {**headers, "authorization": "Bearer x"}])
    return "POST", "/v1/chat/completions" if chat else "/v1/completions", headers, json.dumps(body).encode()


def soak_body(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.3
    body = base_body(rng, chat)
    body.update({"max_tokens": rng.choice([4, 16, 48]), "ignore_eos": rng.random() < 0.5,
                 "stream": rng.random() < 0.5, "n": rng.choice([1, 1, 2])})
    extra = rng.choice([{}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.3}, {"logit_bias": {"5": -100}},
                        {"stop": [" w9"]}, {"seed": rng.randrange(100)}, {"min_tokens": 2}])
    body.update(extra)
    if not chat and not body["stream"] and rng.random() < 0.2:
        body.update({"echo": True, "logprobs": 1, "max_tokens": rng.choice([0, 1])})
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def run(args) -> int:
    rng = random.Random(args.seed)
    histogram: collections.Counter = collections.Counter()
    problems: list[str] = []
    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits) as http:
        semaphore = asyncio.Semaphore(args.concurrency)

        async def fuzz_one(i: int) -> None:
            method, path, headers, body = fuzz_request(random.Random(args.seed * 1_000_003 + i))
            async with semaphore:
                try:
                    response = await http.request(method, path, headers=headers, content=body)
                except httpx.TimeoutException:
                    histogram["hang"] += 1
                    problems.append(f"hang: {method} {path} {body[:200] if body else b''!r}")
                    return
            histogram[response.status_code] += 1
            if response.status_code >= 500:
                problems.append(f"{response.status_code}: {method} {path} {body[:300] if body else b''!r} -> "
                                f"{response.text[:300]}")
            elif response.status_code >= 400 and path.startswith("/v1"):
                try:
                    error = response.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"} and error["message"]
                except Exception:
                    problems.append(f"bad error body {response.status_code}: {response.text[:200]}")

        async def soak_one(i: int) -> None:
            local = random.Random(args.seed * 7_000_003 + i)
            path, body = soak_body(local)

            async def send() -> None:
                async with http.stream("POST", path, json=body) as response:
                    histogram[f"soak {response.status_code}"] += 1
                    if response.status_code >= 500:
                        problems.append(f"soak {response.status_code}: {body}")
                    async for _ in response.aiter_bytes():
                        pass

            async with semaphore:
                task = asyncio.create_task(send())
                if local.random() < args.leave:  # disconnect after a while, mid-stream or mid-wait
                    await asyncio.wait({task}, timeout=local.uniform(0.0, 1.0))
                    if not task.done():
                        task.cancel()
                        histogram["soak left"] += 1
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except httpx.TimeoutException:
                    histogram["soak hang"] += 1
                    problems.append(f"soak hang: {body}")

        start = time.monotonic()
        await asyncio.gather(*(fuzz_one(i) for i in range(args.requests)))
        fuzz_time = time.monotonic() - start
        start = time.monotonic()
        await asyncio.gather(*(soak_one(i) for i in range(args.soak)))
        soak_time = time.monotonic() - start

        deadline = time.monotonic() + 60
        while True:
            text = (await http.get("/metrics")).text
            values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("atom_like:") and " " in line}
            leaked = values["atom_like:kv_cache_total_blocks"] - values["atom_like:kv_cache_free_blocks"]
            queued = values["atom_like:num_requests_running"] + values["atom_like:num_requests_waiting"]
            if (leaked == 0 and queued == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        health = (await http.get("/health")).status_code
    if leaked or queued or health != 200:
        problems.append(f"after the run: {leaked:.0f} KV blocks in use, {queued:.0f} requests queued, /health {health}")
    print(json.dumps({"fuzz_requests": args.requests, "fuzz_seconds": round(fuzz_time, 1), "soak_requests": args.soak,
                      "soak_seconds": round(soak_time, 1), "leave_fraction": args.leave,
                      "status": {str(k): v for k, v in sorted(histogram.items(), key=str)},
                      "5xx": sum(v for k, v in histogram.items() if str(k).split()[-1].startswith("5")),
                      "hangs": histogram["hang"] + histogram["soak hang"], "leaked_blocks": leaked,
                      "queued_after": queued, "problems": problems[:20]}, indent=1))
    return 1 if problems else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=4000, help="fuzzed requests")
    parser.add_argument("--soak", type=int, default=400, help="valid requests of the soak")
    parser.add_argument("--leave", type=float, default=0.4, help="share of soak clients that disconnect mid-way")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as a hang")
    parser.add_argument("--seed", type=int, default=0)
    sys.exit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
