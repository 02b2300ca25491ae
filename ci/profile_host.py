"""Host time of a speculative decode step per draft count k, with a cProfile of the engine's own
Python (CPU).

A small model at a large batch is host-bound on a GPU: there the SmolLM2 pair's step period grew
by ~0.8 ms per draft at batch 128 while the device work stayed near 1-1.5 ms (docs/benchmarks.md
section 11). This script runs the zoo's tiny-kimi target with its EAGLE3 MLA draft (float32, real
weights and tokenizer, so detokenization runs too) at `--batch` requests of short prompts that
decode with ignore_eos, the decode graphs' code path on (on a CPU a "replay" re-runs the captured
function), and for each k of `--ks` (forced with FixedDraftLength) and each temperature:

- step_ms: the median wall time of LLMEngine.step;
- model_ms: the mean time inside the decode graphs' replays (target, draft first pass and
  chain): what a GPU runs as graphs, so not host work there;
- sampler_ms: the mean time inside Sampler.sample (on a CPU its torch ops compute; on a GPU
  they are ~60-230 launches whose number does not depend on k, and device work over
  batch x (k + 1) logits rows outside the decode graphs);
- host_ms: the median over steps of the rest (a step's wall time less its own model and sampler
  time; host_min_ms the fastest): scheduling, step inputs, uploads, collect,
  result processing, detokenization: what the host pays per step on a GPU as well;
- a cProfile of further steps: the `--top` functions of the engine's host code (atom_like/engine
  but the sampler and the graphs' captured functions, spec_decode's policy and stats) and the
  builtins (numpy, torch, list methods) they call directly, by own time per step;
- ops: the torch ops a step dispatches outside the graphs' replays (views left out), by where:
  on a GPU each is about one kernel launch or copy, host time a host-bound step pays. (The CPU
  path of `follow` is ~20 torch ops that a GPU runs as one kernel, kernels_rocm.step_advance.)

    python ci/profile_host.py                          # batch 128, k = 0 1 3 5, T = 0 and 1 (~1 min)
    python ci/profile_host.py --batch 64 --ks 0,5 --temperatures 1 --top 15
    python ci/profile_host.py --out docs/data/x.json   # also the rows as JSON
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from atom_like import LLMEngine, SamplingParams  # noqa: E402
from atom_like.engine import cuda_graph  # noqa: E402
from atom_like.engine.model_runner import ModelRunner  # noqa: E402
from atom_like.engine.sampler import Sampler  # noqa: E402
from spec_decode.adaptive import FixedDraftLength  # noqa: E402

MODELS = ROOT / "atom_like" / "zoo" / "models"
# host code whose functions the profile lists; left out: what a GPU runs as graphs (the model, the
# draft's first pass and chain) and the sampler, whose torch ops compute here (timed apart)
HOST_PATHS = ("atom_like/engine/", "spec_decode/adaptive", "spec_decode/stats", "atom_like/sampling_params")
GRAPHED = {"__call__", "_target_step", "_first_pass", "_chain"}  # cuda_graph.py's replays and what they run
PROMPT_LEN = 16  # short contexts: attention stays cheap, the step is the host's


class Split:
    """Seconds spent inside the graphs' replays and inside Sampler.sample (wrapped while timing)."""

    def __init__(self):
        self.model = self.sampler = 0.0

    def __enter__(self) -> "Split":
        replay, sample = cuda_graph._Replayable.__call__, Sampler.sample

        def timed_replay(graph):
            start = time.perf_counter()
            try:
                return replay(graph)
            finally:
                self.model += time.perf_counter() - start

        def timed_sample(sampler, *args):
            start = time.perf_counter()
            try:
                return sample(sampler, *args)
            finally:
                self.sampler += time.perf_counter() - start

        self._saved = replay, sample
        cuda_graph._Replayable.__call__, Sampler.sample = timed_replay, timed_sample
        return self

    def __exit__(self, *exc) -> None:
        cuda_graph._Replayable.__call__, Sampler.sample = self._saved


class OpCount(TorchDispatchMode):
    """Non-view torch ops dispatched outside the decode graphs' replays, by where they came from."""

    VIEWS = {"slice", "view", "select", "as_strided", "unsqueeze", "squeeze", "expand", "alias", "t", "transpose",
             "permute", "_unsafe_view", "detach", "unbind", "split", "narrow", "_reshape_alias", "lift_fresh"}
    PLACES = {"sampler": (Sampler, "sample"), "draft inputs": (ModelRunner, "_propose"),
              "step inputs": (cuda_graph.DecodeGraphs, "load"), "follow": (ModelRunner, "_follow_last_step")}

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self._where, self._paused = ["other"], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and func.overloadpacket.__name__ not in self.VIEWS:
            self.counts[self._where[-1]] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "OpCount":
        def tagged(place, fn):
            def wrapped(*a, **k):
                self._where.append(place)
                try:
                    return fn(*a, **k)
                finally:
                    self._where.pop()
            return wrapped

        def paused(fn):
            def wrapped(*a, **k):
                self._paused += 1
                try:
                    return fn(*a, **k)
                finally:
                    self._paused -= 1
            return wrapped

        self._saved = [(cls, name, getattr(cls, name)) for cls, name in self.PLACES.values()]
        self._saved.append((cuda_graph._Replayable, "__call__", cuda_graph._Replayable.__call__))
        for place, (cls, name) in self.PLACES.items():
            setattr(cls, name, tagged(place, getattr(cls, name)))
        cuda_graph._Replayable.__call__ = paused(cuda_graph._Replayable.__call__)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)


def build_engine(batch: int, max_k: int) -> LLMEngine:
    return LLMEngine(str(MODELS / "tiny-kimi"), method="eagle3", draft_model=str(MODELS / "tiny-kimi-eagle3-mla"),
                     num_speculative_tokens=max_k, speculative_adaptive=True, dtype="float32",
                     max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * PROMPT_LEN),
                     max_model_len=512, num_kv_blocks=batch * (512 // 16 + 2), enable_prefix_caching=False)


def is_host(func: tuple[str, int, str]) -> bool:
    path, _, name = func
    return (any(p in path for p in HOST_PATHS) and not path.endswith("engine/sampler.py")
            and not (path.endswith("engine/cuda_graph.py") and name in GRAPHED))


def host_profile(stats: pstats.Stats, steps: int, top: int) -> dict:
    """The host functions by own time, and the builtins they call directly (time on those edges)."""
    own, callees = [], {}
    for func, (_, calls, tt, ct, callers) in stats.stats.items():
        if is_host(func):
            name = f"{Path(func[0]).relative_to(ROOT) if func[0].startswith(str(ROOT)) else func[0]}:{func[1]}:{func[2]}"
            own.append(dict(function=name, calls=round(calls / steps, 1), tottime_ms=tt / steps * 1e3,
                            cumtime_ms=ct / steps * 1e3))
        elif func[0] == "~":  # a builtin: its time on edges from host functions
            for caller, (_, ncalls, ett, _) in callers.items():
                if is_host(caller):
                    entry = callees.setdefault(func[2], dict(function=func[2], calls=0.0, tottime_ms=0.0))
                    entry["calls"] += ncalls / steps
                    entry["tottime_ms"] += ett / steps * 1e3
    by_time = lambda rows: sorted(rows, key=lambda r: -r["tottime_ms"])[:top]  # noqa: E731
    rnd = lambda rows: [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows]  # noqa: E731
    return dict(host_own_ms=round(sum(r["tottime_ms"] for r in own), 3),
                builtins_from_host_ms=round(sum(r["tottime_ms"] for r in callees.values()), 3),
                functions=rnd(by_time(own)), builtins=rnd(by_time(list(callees.values()))))


def measure(engine: LLMEngine, batch: int, k: int, temperature: float, args, tag: str) -> dict:
    params = SamplingParams(temperature=temperature, max_tokens=400, ignore_eos=True, seed=None)
    gen = torch.Generator().manual_seed(batch * 10 + k)
    vocab = engine.vocab_size
    ids = [engine.add_request(None, params, request_id=f"{tag}-{i}",
                              prompt_ids=torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist())
           for i in range(batch)]
    engine.draft_policy = FixedDraftLength(k)
    running = engine.scheduler.running
    while len(running) < batch or any(s.num_generated == 0 for s in running):
        engine.step()
    for _ in range(args.warm):
        engine.step()
    times, hosts, tokens0 = [], [], sum(s.num_generated for s in running)
    gc.collect()  # a full collection inside a few timed steps would be most of their host time
    with Split() as split:
        for _ in range(args.steps):
            inside = split.model + split.sampler
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            # per step, so that the compute's own spread (the most of a step here) cancels out
            hosts.append(times[-1] - (split.model + split.sampler - inside))
    tokens = sum(s.num_generated for s in running) - tokens0
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.profile_steps):
        engine.step()
    profile.disable()
    stats = pstats.Stats(profile)
    with OpCount() as ops:
        for _ in range(args.op_steps):
            engine.step()
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()  # collects the step in flight
    model_ms, sampler_ms = split.model / args.steps * 1e3, split.sampler / args.steps * 1e3
    return dict(batch=batch, k=k, temperature=temperature, step_ms=round(statistics.median(times) * 1e3, 3),
                model_ms=round(model_ms, 3), sampler_ms=round(sampler_ms, 3),
                host_ms=round(statistics.median(hosts) * 1e3, 3), host_min_ms=round(min(hosts) * 1e3, 3),
                tokens_per_step=round(tokens / args.steps / batch, 3),
                python_calls=round(stats.total_calls / args.profile_steps),
                ops_per_step=round(sum(ops.counts.values()) / args.op_steps, 1),
                ops_by_place={p: round(n / args.op_steps, 1) for p, n in ops.counts.most_common()},
                **host_profile(stats, args.profile_steps, args.top))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--ks", default="0,1,3,5", help="draft counts forced per step (the engine's k is their max)")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--warm", type=int, default=3, help="untimed decode steps before the timed ones")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps")
    parser.add_argument("--profile-steps", type=int, default=4, help="decode steps under cProfile")
    parser.add_argument("--top", type=int, default=12, help="functions and builtins listed per point")
    parser.add_argument("--op-steps", type=int, default=5, help="decode steps whose torch ops are counted")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread times more steadily
    engine = build_engine(args.batch, max(max(ks), 1))
    gc.collect()
    gc.freeze()  # as the server does once its engine is built: collections skip the start-up heap
    rows = []
    for temperature in map(float, args.temperatures.split(",")):
        for k in ks:
            row = measure(engine, args.batch, k, temperature, args, f"t{temperature}k{k}")
            rows.append(row)
            print(f"batch {args.batch} T={temperature:g} k={k}: step {row['step_ms']:.2f} ms: model {row['model_ms']:.2f}, "
                  f"sampler {row['sampler_ms']:.2f}, host {row['host_ms']:.3f} (min {row['host_min_ms']:.3f}); "
                  f"host functions' own {row['host_own_ms']:.2f} + their builtins {row['builtins_from_host_ms']:.2f} ms "
                  f"(cProfile); {row['python_calls']} calls; {row['tokens_per_step']:.2f} tokens/seq/step", flush=True)
            print(f"    torch ops outside the graphs a step: {row['ops_per_step']:.1f} ("
                  + ", ".join(f"{p} {n:.1f}" for p, n in row["ops_by_place"].items()) + ")")
            for r in row["functions"]:
                print(f"    {r['tottime_ms']:7.3f} own {r['cumtime_ms']:7.3f} cum ms  {r['calls']:8.1f}x  {r['function']}")
            for r in row["builtins"]:
                print(f"    {r['tottime_ms']:7.3f} own              {r['calls']:8.1f}x  {r['function']}")
    engine.shutdown()
    gc.unfreeze()  # a caller's process (a test) gets its collector and threads back
    torch.set_num_threads(threads)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
