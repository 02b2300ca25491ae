"""Host cost of a decode step at temperature 0 vs 1 (issue 14: sampling and verification on the
device, the host side flat in the batch).

A tiny random Llama target (config.json alone, --load-format dummy), optionally with an EAGLE3
draft verifying k drafts a step, runs `--batch` requests that decode with ignore_eos; after the
prompts are in and `--warm` decode steps, `--steps` decode steps are measured three ways:

- ms: the host's wall time per LLMEngine.step (on a CPU this includes the tiny model's compute;
  on a GPU with overlapped scheduling it is what the host spends while the device runs);
- calls: Python function calls per step (cProfile), which do not depend on the machine's load;
- engine: those of them made outside the model's forward (torch.nn.Module calls): what a GPU's
  decode graphs leave to the host (on a CPU the eager reference attention loops over sequences);
- torch: torch functions called per launched step (a TorchFunctionMode over ModelRunner.launch);
- blocking: those of them that, on a GPU, make the host wait for the device in the middle of a
  launch (a Python list or a boolean mask used as an index, a blocking copy to the device, a
  read of a device value): each costs a step its overlap, i.e. the host waits for the queued
  forward before it can go on. The sampler (Sampler.sample, counted apart) should have none;
  on a CPU the eager torch_ref attention adds its own (tolist, Python-list indices), which a
  GPU's decode graphs do not run.

    python ci/bench_host_sampling.py                 # CPU or GPU: batches 64 and 128, k = 0, 1, 3 (~2 min CPU)
    python ci/bench_host_sampling.py --smoke         # CPU, batch 8, a few seconds (tests/test_bench_host_sampling.py)
    python ci/bench_host_sampling.py --tokenizer atom_like/zoo/models/tiny-kimi   # outputs detokenized too

Prints one line per (batch, k, temperature) and writes them as JSON to $OUT/host_sampling.json
when $OUT is set.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from atom_like import LLMEngine, SamplingParams  # noqa: E402
from atom_like.engine.model_runner import ModelRunner  # noqa: E402
from atom_like.engine.sampler import Sampler  # noqa: E402
import bench_adaptive  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1024)
_READS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "masked_select", "unique"}


def write_configs(folder: Path, tokenizer: str | None = None) -> tuple[str, str]:
    """bench_adaptive's target + EAGLE3 draft configs at SHAPE (dummy weights), with the
    tokenizer files of the folder `tokenizer` next to the target's."""
    target, draft = bench_adaptive.write_configs(folder, SHAPE, "float32")
    for f in ("tokenizer.json", "tokenizer_config.json") if tokenizer else ():
        shutil.copy(Path(tokenizer, f), target)
    return target, draft


def _is_index_hazard(index) -> bool:
    """An index that a GPU cannot use without the host waiting: a Python list (copied to the
    device with a blocking copy) or a boolean mask (its nonzero count is read back)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts)


class Counter(TorchFunctionMode):
    """Counts torch functions, and those that block the host on a GPU (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops, self.blocking = 0, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = getattr(func, "__name__", str(func))
        hazard = (name in _READS
                  or (name in ("__getitem__", "__setitem__") and _is_index_hazard(args[1]))
                  or (name == "tensor" and kwargs.get("device") is not None)
                  or (name == "to" and not kwargs.get("non_blocking", False)
                      and any(isinstance(a, (torch.device, str)) for a in args[1:])))
        if hazard:
            self.blocking[name] = self.blocking.get(name, 0) + 1
        return func(*args, **kwargs)


def measure(target: str, draft: str, batch: int, k: int, temperature: float, warm: int, steps: int) -> dict:
    spec = dict(method="eagle3", draft_model=draft, num_speculative_tokens=k, speculative_adaptive=False) if k else {}
    engine = LLMEngine(target, load_format="dummy", max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 8),
                       max_model_len=512, num_kv_blocks=batch * (512 // 16 + 2), **spec)
    params = SamplingParams(temperature=temperature, max_tokens=400, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % SHAPE["vocab_size"] for j in range(8)], params)
    for _ in range(warm + 2):  # the prompts, then decode steps
        engine.step()
    profile = cProfile.Profile()  # alone: the counters below would add Python calls of their own
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    calls = pstats.Stats(profile).total_calls
    engine_calls = count_engine_calls(engine, steps)
    counter, sampling = Counter(), Counter()
    launch, sample = ModelRunner.launch, Sampler.sample

    def counted(self, step_batch):
        with counter:
            return launch(self, step_batch)

    def counted_sample(self, *args):
        with sampling:
            return sample(self, *args)

    ModelRunner.launch, Sampler.sample = counted, counted_sample
    try:
        for _ in range(steps):
            engine.step()
    finally:
        ModelRunner.launch, Sampler.sample = launch, sample
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain = time.perf_counter() - start
    engine.shutdown()
    return dict(batch=batch, k=k, temperature=temperature, ms=round(plain / steps * 1e3, 2), calls=round(calls / steps),
                engine_calls=round(engine_calls / steps),
                torch=round(counter.ops / steps), blocking=round(sum(counter.blocking.values()) / steps, 2),
                blocking_kinds={name: round(n / steps, 2) for name, n in sorted(counter.blocking.items())},
                sampler_torch=round(sampling.ops / steps), sampler_blocking=round(sum(sampling.blocking.values()) / steps, 2))


def count_engine_calls(engine: LLMEngine, steps: int) -> int:
    """Python calls (as cProfile counts them: functions and builtins) of `steps` engine steps made
    outside any torch.nn.Module call."""
    forward = torch.nn.Module._call_impl.__code__
    depth, calls = 0, 0

    def count(frame, event, arg):
        nonlocal depth, calls
        if event == "call" and frame.f_code is forward:
            depth += 1
        elif event == "return" and frame.f_code is forward:
            depth -= 1
        elif depth == 0 and event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,128")
    parser.add_argument("--ks", default="0,1,3", help="drafts verified a step (0: no draft)")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokenizer", help="a folder whose tokenizer the target gets (its outputs are detokenized)")
    parser.add_argument("--smoke", action="store_true", help="batch 8, k = 0 and 1, 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.ks, args.warm, args.steps = "8", "0,1", 1, 2
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        target, draft = write_configs(Path(folder), args.tokenizer)
        for batch in map(int, args.batches.split(",")):
            for k in map(int, args.ks.split(",")):
                for temperature in map(float, args.temperatures.split(",")):
                    row = measure(target, draft, batch, k, temperature, args.warm, args.steps)
                    rows.append(row)
                    print(f"batch {batch:4d} k={k} T={temperature:g}: {row['ms']:7.2f} ms/step, "
                          f"{row['calls']:6d} Python calls/step ({row['engine_calls']} outside the model), "
                          f"{row['torch']:5d} torch calls/launch ({row['sampler_torch']} sampling), "
                          f"{row['blocking']:g} blocking/launch ({row['sampler_blocking']:g} sampling) "
                          f"{row['blocking_kinds'] or ''}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "host_sampling.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
