"""Tensor parallelism on GPUs: -tp 2 against -tp 1 in one run, bf16, CUDA graphs on.

Three parts, each writing its results as soon as it has them:
* allreduce: the collectives of one decode step, alone: per layer two all-reduces of [batch, H]
  bf16 (attention o_proj, MLP / MoE), one for the embedding, one all-gather of the logits
  [batch, V/2]; timed eagerly and replayed as one CUDA graph (what the engine's graphs do), on
  two ranks over NCCL, and replayed with the all-reduces up to 1 MiB on the one-shot kernel
  (model_ops.tp.OneShotAllReduce, the engine's default on one host); then one all-reduce of
  8 KiB .. 4 MiB alone, NCCL against one-shot, after checking the two sums are the same bits.
  Run first, while the GPUs are otherwise idle.
* speed: decode tokens/s at each batch size (default 1 and 32) for an 8B Llama-shaped model
  (Llama-3.1-8B's shape) and the ~2B DeepSeek-V3-shaped MoE of ci/bench_models.py, random-init
  bf16 checkpoints written here, -tp 1, -tp 2 with NCCL only (--disable-custom-all-reduce), with
  the one-shot all-reduce alone (--no-fuse-all-reduce-norm) and with it fused with the residual
  add and RMSNorm that follow (the default); the per-rank weight bytes; the step time the
  measured collectives take up. Methodology as bench_models.py (prompt 64 random tokens,
  64 generated, ignore_eos, greedy, one untimed warm-up; prefill excluded). Each step ends in a
  host read of the sampled tokens, so timing engine.step() needs no extra synchronisation.
* zoo: each shipped tiny-kimi pair (target + EAGLE3 / EAGLE3-MLA / EAGLE3.1-MLA draft, k = 3)
  and the SmolLM2 pair when the zoo cache has it, at -tp 1 and -tp 2 on the same prompts (the
  held-out set at $ATOM_LIKE_EVAL_PROMPTS when staged, else 32 built-in prompts), greedy, 128
  tokens, all prompts in one batch: mean acceptance length of each, and how many completions
  are token-identical (bf16 reductions run in another order across two ranks, so near-ties may
  flip; on CPU in fp32 the tests demand identity). A pair -tp 2 cannot split is reported so.
* mxfp4: the DeepSeek-shaped MoE converted to the released Quark MXFP4 layout (routed and shared
  experts and the dense MLP packed, MLA bf16; atom_like.zoo.quark_mxfp4) served with an fp8 KV
  cache, Kimi-K2.5-MXFP4's setup: decode tokens/s at -tp 1 and -tp 2 and how many greedy
  completions of the largest batch are token-identical.

Everything runs in one call on a two-GPU machine (nvidia-h200-x2) within --budget-s seconds
(default 420, so that ci/gpu_check.sh's call ends well inside the device's 10 minutes): a part
that would start after the budget is spent is recorded as skipped, in the report, not run.

    OUT=dir python ci/bench_tp.py [--parts allreduce,speed,zoo,mxfp4] [--models llama8b,deepseek]
results: $OUT/bench_tp.json and $OUT/bench_tp.md (default folder ./bench_out)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from queue import Empty

import torch
from bench_tp_report import markdown

# NVLink multicast (NVLS) stays off on shared machines: one misbehaving program can take the
# host's GPUs out of service. Set before NCCL starts; spawned ranks inherit it.
for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")

TP = 2
START = time.monotonic()
ZOO_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a KV cache is in one sentence.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "List three prime numbers greater than 50.", "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?", "Give me a recipe for pancakes.", "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet in two sentences.", "How do vaccines work?",
    "Write a Python function that reverses a string.", "What is 17 times 23?", "Name the planets of the solar system.",
    "What causes the seasons on Earth?", "Describe a cat to someone who has never seen one.",
] * 2


def llama8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_configs():
    from bench_models import deepseek_config

    return {"llama8b": llama8b_config, "deepseek": deepseek_config}


class Results:
    def __init__(self, out_dir: str, meta: dict):
        self.path = os.path.join(out_dir, "bench_tp.json")
        self.data = dict(meta=meta, allreduce=[], allreduce_sweep=[], speed=[], zoo=[], mxfp4=[], params={}, errors=[])
        self.out_dir = out_dir
        self.budget_s = meta["args"]["budget_s"]

    def over_budget(self, **what) -> bool:
        """True (and the skip recorded) once --budget-s seconds have passed since the start."""
        spent = time.monotonic() - START
        if spent < self.budget_s:
            return False
        self.add("errors", dict(**what, error=f"skipped: {spent:.0f} s of the {self.budget_s:.0f} s budget spent"))
        return True

    def add(self, part: str, row: dict) -> None:
        self.data[part].append(row)
        print(json.dumps({part: row}, default=str), flush=True)
        self.save()

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        with open(os.path.join(self.out_dir, "bench_tp.md"), "w") as f:
            f.write(markdown(self.data, TP))


# ----------------------------------------------------------------------------- collectives alone

def collective_plan(config, batch: int) -> list[tuple[str, tuple[int, ...]]]:
    """The collectives of one -tp 2 decode step without speculation (batch tokens)."""
    h = config.hidden_size
    return ([("all_reduce", (batch, h))] * (1 + 2 * config.num_hidden_layers)
            + [("all_gather", (batch, config.vocab_size // TP))])


SWEEP_BYTES = [2**k for k in range(13, 23)]  # 8 KiB .. 4 MiB: one all-reduce of each size
SWEEP_HIDDEN = 4096  # rows of the 8B model's hidden size for the fused all-reduce + RMSNorm


def _allreduce_rank(rank: int, store: str, plans: dict, queue) -> None:
    import torch.distributed as dist

    from model_ops import tp

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=TP)
    one_shot = tp.OneShotAllReduce(dist.group.WORLD, torch.device("cuda", rank), max_bytes=max(SWEEP_BYTES))

    def timed(fn, n: int = 50) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    def graph_ms(fn) -> float:
        fn()  # warm-up outside the capture (NCCL's and symmetric memory's lazy set-up)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return timed(graph.replay)

    def nccl_sum(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    # the one-shot sum must be NCCL's, bit for bit, at two ranks (a + b either way)
    torch.manual_seed(rank)
    for nbytes in (SWEEP_BYTES[0], 3 * SWEEP_BYTES[0], max(SWEEP_BYTES)):
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        if not torch.equal(one_shot(x), nccl_sum(x.clone())):
            raise AssertionError(f"one-shot all-reduce of {nbytes} B differs from NCCL's")
    weight = torch.randn(SWEEP_HIDDEN, dtype=torch.bfloat16, device="cuda")
    for nbytes in SWEEP_BYTES:  # one collective alone, graph-replayed: µs a call
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        row = {name: 1e3 * graph_ms(lambda: [fn(x) for _ in range(20)]) / 20
               for name, fn in (("nccl_us", nccl_sum), ("one_shot_us", one_shot))}
        rows = x.view(-1, SWEEP_HIDDEN)  # and fused with the residual add + RMSNorm, as rows of the 8B's hidden size
        if one_shot.accepts_rows(rows):
            residual = torch.randn_like(rows)
            row["fused_norm_us"] = 1e3 * graph_ms(
                lambda: [one_shot.add_rms_norm(rows, residual, weight, 1e-6) for _ in range(20)]) / 20
        if rank == 0:
            queue.put((f"sweep/{nbytes}", row))
    for key, plan in plans.items():
        bufs = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _, shape in plan]
        outs = [torch.empty((TP * b.shape[0], *b.shape[1:]), dtype=b.dtype, device="cuda") for b in bufs]

        def step(reduce) -> None:
            for (op, _), buf, out in zip(plan, bufs, outs):
                if op == "all_reduce":
                    reduce(buf)
                else:
                    dist.all_gather_into_tensor(out, buf)

        def small(x: torch.Tensor) -> torch.Tensor:
            return one_shot(x) if one_shot.accepts(x) and x.numel() * x.element_size() <= tp.ONE_SHOT_MAX_BYTES else nccl_sum(x)

        row = dict(eager_ms=timed(lambda: step(nccl_sum)), graph_ms=graph_ms(lambda: step(nccl_sum)),
                   one_shot_graph_ms=graph_ms(lambda: step(small)), collectives=len(plan))
        if rank == 0:  # each result as soon as it exists: a later hang loses only what follows
            queue.put((key, row))
    if rank == 0:
        queue.put(None)
        queue.close()
        queue.join_thread()  # written to the pipe before anything below can block
    # no destroy_process_group: tearing down NCCL communicators that graphs captured is where a rank
    # can hang, and the parent waits for nothing after the results; the process just ends
    os._exit(0)


def bench_allreduce(results: Results, names: list[str], batches: list[int]) -> None:
    configs = model_configs()
    plans = {f"{name}/{b}": collective_plan(configs[name](), b) for name in names for b in batches}
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=_allreduce_rank, args=(r, os.path.join(folder, "store"), plans, queue))
                 for r in range(TP)]
        for p in procs:
            p.start()
        deadline, error = time.monotonic() + 180, None
        while True:
            try:
                item = queue.get(timeout=5)
            except Empty:
                failed = any(p.exitcode not in (None, 0) for p in procs)
                if failed or time.monotonic() > deadline:  # a hung collective must not eat the device call
                    why = "failed" if failed else "gave no further result within 180 s (hung?)"
                    error = RuntimeError(f"an all-reduce rank {why}: exit codes {[p.exitcode for p in procs]}")
                    break
                continue
            if item is None:
                break
            key, row = item
            name, size = key.split("/")
            if name == "sweep":
                results.add("allreduce_sweep", dict(bytes=int(size), **row))
            else:
                results.add("allreduce", dict(model=name, batch=int(size), **row))
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join()
    if error is not None:
        raise error


# ----------------------------------------------------------------------------- decode speed

def save_random_model(config, folder: str) -> tuple[str, int]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return folder, params


def decode_tokens_per_s(engine, batch_prompts: list[list[int]], max_tokens: int) -> float:
    from atom_like import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in batch_prompts}
    started: set[str] = set()
    while started != ids:  # prefill (untimed) until every request holds its first token
        started |= {out.request_id for out in engine.step() if out.token_ids}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(batch_prompts) * (max_tokens - 1) / (time.perf_counter() - start)


def profiled_decode(engine, batch_prompts: list[list[int]], steps: int, tp: int) -> list[dict]:
    """Each rank's kernel table over `steps` decode steps (device activity only, so that idle
    time is the device waiting, not the tracer slowing the host)."""
    from profile_tables import trace_kernel_table

    from atom_like import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for p in batch_prompts:
        engine.add_request(p, params)
    for _ in range(4):  # the prefill and a few decode steps, untraced
        engine.step()
    with tempfile.TemporaryDirectory() as folder:
        engine.start_profile(folder, record_host=False)
        for _ in range(steps):
            engine.step()
        engine.stop_profile()
        tables = [trace_kernel_table(os.path.join(folder, f"rank{r}.trace.json"), steps, top=30) for r in range(tp)]
    while engine.has_unfinished_requests():
        engine.step()
    return tables


SPEED_CONFIGS = ((1, "-"), (TP, "nccl"), (TP, "one-shot"), (TP, "one-shot + norm"))  # tp, all-reduce
CONFIG_NAMES = {"tp1": "-", "nccl": "nccl", "one-shot": "one-shot", "fused": "one-shot + norm"}  # --configs


def bench_speed(results: Results, names: list[str], batches: list[int], prompt_len: int, max_tokens: int,
                profile_steps: int = 0, all_reduces: tuple[str, ...] = tuple(CONFIG_NAMES.values())) -> None:
    from bench_models import prompts

    from atom_like import LLMEngine

    configs = model_configs()
    for name in names:
        if results.over_budget(part="speed", model=name):
            continue
        with tempfile.TemporaryDirectory() as folder:
            path, params = save_random_model(configs[name](), os.path.join(folder, name))
            for tp, reduce in SPEED_CONFIGS:
                if reduce not in all_reduces or results.over_budget(part="speed", model=name, tp=tp, all_reduce=reduce):
                    continue
                engine = None
                try:  # a failure is recorded and the other configurations still run
                    engine = LLMEngine(path, dtype="bfloat16", max_model_len=prompt_len + max_tokens + 16,
                                       max_num_seqs=max(batches), gpu_memory_utilization=0.5, tensor_parallel_size=tp,
                                       disable_custom_all_reduce=reduce == "nccl",
                                       fuse_all_reduce_norm=reduce == "one-shot + norm")
                    weights = ([engine.runner.param_bytes] if tp == 1 else
                               [info.param_bytes for info in engine.runner.infos])
                    results.data["params"][f"{name}/tp{tp}"] = dict(params=params, bytes_per_rank=weights)
                    for batch in batches:
                        batch_prompts = prompts(batch, prompt_len, engine.runner.vocab_size)
                        decode_tokens_per_s(engine, batch_prompts, max_tokens)  # warm-up
                        tps = decode_tokens_per_s(engine, batch_prompts, max_tokens)
                        row = dict(model=name, tp=tp, all_reduce=reduce, batch=batch, tokens_per_s=tps,
                                   step_ms=1e3 * batch / tps, weight_gib_per_rank=max(weights) / 2**30)
                        if profile_steps:
                            row["profile"] = profiled_decode(engine, batch_prompts, profile_steps, tp)
                        results.add("speed", row)
                except Exception as exc:  # noqa: BLE001
                    results.add("errors", dict(part="speed", model=name, tp=tp, all_reduce=reduce,
                                               error=f"{type(exc).__name__}: {exc}"))
                if engine is not None:
                    engine.shutdown()
                del engine
                gc.collect()
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- zoo pairs

def zoo_prompts(tokenizer) -> tuple[str, list[list[int]]]:
    staged = os.environ.get("ATOM_LIKE_EVAL_PROMPTS", ".stage/eval_prompts.jsonl")
    if os.path.isfile(staged):
        from atom_like.zoo.acceptance import load_eval_prompts

        chats = [c for cs in load_eval_prompts(staged, 32).values() for c in cs]
        source = f"{staged} (32 per set)"
    else:
        chats = [[{"role": "user", "content": p}] for p in ZOO_PROMPTS]
        source = "built-in prompts"
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for c in chats]
    return source, ids


def bench_zoo(results: Results, k: int = 3, max_tokens: int = 128) -> None:
    from atom_like import LLMEngine, SamplingParams
    from atom_like.zoo import resolve
    from atom_like.zoo.registry import locate

    pairs = [("tiny-kimi", "tiny-kimi-eagle3"), ("tiny-kimi", "tiny-kimi-eagle3-mla"),
             ("tiny-kimi", "tiny-kimi-eagle3.1-mla"), ("smollm2-135m", "smollm2-135m-eagle3")]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for target, draft in pairs:
        if locate(target) is None or locate(draft) is None:
            results.add("zoo", dict(target=target, draft=draft, skipped="not in the zoo cache"))
            continue
        runs = {}
        for tp in (1, TP):
            if results.over_budget(part="zoo", model=f"{target} + {draft}", tp=tp):
                continue
            try:
                engine = LLMEngine(str(resolve(target)), dtype="bfloat16", method="eagle3", draft_model=str(resolve(draft)),
                                   num_speculative_tokens=k, speculative_adaptive=False, max_model_len=4096, max_num_seqs=64,
                                   gpu_memory_utilization=0.3, tensor_parallel_size=tp)
            except Exception as exc:  # noqa: BLE001 - e.g. a pair -tp 2 cannot split (SmolLM2's 9 heads)
                runs[tp] = dict(error=f"{type(exc).__name__}: {exc}")
                continue
            try:
                source, prompt_ids = zoo_prompts(engine.tokenizer)
                outs = engine.generate(prompt_ids, params, use_tqdm=False)
                s = engine.spec_stats
                runs[tp] = dict(tokens=[o.token_ids for o in outs], mean_acceptance_length=s.mean_acceptance_length,
                                acceptance_rate=s.acceptance_rate, prompts=source)
            except Exception as exc:  # noqa: BLE001
                runs[tp] = dict(error=f"{type(exc).__name__}: {exc}")
            engine.shutdown()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        row = dict(target=target, draft=draft, k=k)
        for tp, run in runs.items():
            row[f"tp{tp}"] = {key: v for key, v in run.items() if key != "tokens"}
        if len(runs) == 2 and all("tokens" in run for run in runs.values()):
            a, b = runs[1]["tokens"], runs[TP]["tokens"]
            row["identical_completions"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
            row["same_tokens_before_first_difference"] = sum(_common_prefix(x, y) for x, y in zip(a, b)) / max(1, sum(map(len, a)))
        results.add("zoo", row)


# ----------------------------------------------------------------------------- MXFP4 + fp8 KV

def bench_mxfp4(results: Results, batches: list[int], prompt_len: int, max_tokens: int) -> None:
    from pathlib import Path

    from bench_models import deepseek_config, prompts

    from atom_like import LLMEngine, SamplingParams
    from atom_like.zoo.checkpoint import load_tensors
    from atom_like.zoo.quark_mxfp4 import write

    if results.over_budget(part="mxfp4"):
        return
    with tempfile.TemporaryDirectory() as folder:
        src, _ = save_random_model(deepseek_config(), os.path.join(folder, "bf16"))
        tensors = {k: v.cuda() for k, v in load_tensors(Path(src)).items()}  # quantized on the GPU: seconds
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        path = os.path.join(folder, "mxfp4")
        write(tensors, config, path, style="released")
        del tensors
        gc.collect()
        torch.cuda.empty_cache()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        tokens = {}
        for tp in (1, TP):
            if results.over_budget(part="mxfp4", tp=tp):
                continue
            engine = None
            try:
                engine = LLMEngine(path, dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=prompt_len + max_tokens + 16,
                                   max_num_seqs=max(batches), gpu_memory_utilization=0.5, tensor_parallel_size=tp)
                for batch in batches:
                    batch_prompts = prompts(batch, prompt_len, engine.runner.vocab_size)
                    decode_tokens_per_s(engine, batch_prompts, max_tokens)  # warm-up
                    tps = decode_tokens_per_s(engine, batch_prompts, max_tokens)
                    results.add("mxfp4", dict(tp=tp, batch=batch, tokens_per_s=tps, step_ms=1e3 * batch / tps))
                big = prompts(max(batches), prompt_len, engine.runner.vocab_size)
                tokens[tp] = [o.token_ids for o in engine.generate(big, params, use_tqdm=False)]
            except Exception as exc:  # noqa: BLE001
                results.add("errors", dict(part="mxfp4", tp=tp, error=f"{type(exc).__name__}: {exc}"))
            if engine is not None:
                engine.shutdown()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        if len(tokens) == 2:
            a, b = tokens[1], tokens[TP]
            results.add("mxfp4", dict(identical_completions=f"{sum(x == y for x, y in zip(a, b))}/{len(a)}",
                                      same_tokens_before_first_difference=sum(map(_common_prefix, a, b)) / sum(map(len, a))))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ----------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="allreduce,speed,zoo,mxfp4")
    parser.add_argument("--models", default="llama8b,deepseek")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", default=",".join(CONFIG_NAMES),
                        help="speed part: which of -tp 1 (tp1) and -tp 2 with NCCL only (nccl), the one-shot "
                             "all-reduce (one-shot) or it fused with the add + RMSNorm (fused) to run")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="speed part: also record N decode steps per configuration with LLMEngine.start_profile "
                             "and report each rank's device busy time and top kernels")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="no part starts after this many seconds (skips are reported)")
    args = parser.parse_args()
    if torch.cuda.device_count() < TP:
        sys.exit(f"bench_tp needs {TP} GPUs; torch sees {torch.cuda.device_count()}")
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    import transformers

    meta = dict(device=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), torch=torch.__version__,
                transformers=transformers.__version__, date=time.strftime("%Y-%m-%d"), args=vars(args),
                nccl=str(torch.cuda.nccl.version()))
    results = Results(out_dir, meta)
    parts, names = args.parts.split(","), args.models.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if "allreduce" in parts:
        try:
            bench_allreduce(results, names, batches)
        except Exception as exc:  # noqa: BLE001
            results.add("errors", dict(part="allreduce", error=f"{type(exc).__name__}: {exc}"))
    if "speed" in parts:
        bench_speed(results, names, batches, args.prompt_len, args.max_tokens, args.profile_steps,
                    tuple(CONFIG_NAMES[c] for c in args.configs.split(",")))
    if "zoo" in parts:
        bench_zoo(results)
    if "mxfp4" in parts:
        try:
            bench_mxfp4(results, batches, args.prompt_len, args.max_tokens)
        except Exception as exc:  # noqa: BLE001
            results.add("errors", dict(part="mxfp4", error=f"{type(exc).__name__}: {exc}"))
    results.save()
    print(markdown(results.data, TP))


if __name__ == "__main__":
    main()
