"""-tp 2 on two GPUs (NCCL, graphs) against -tp 1, in fp32 on trained zoo models, so that the
logits are peaked and a different reduction order cannot flip a greedy token: the MXFP4
(Quark, W4A4) tiny-kimi with an fp8 KV cache, through the Triton MXFP4 kernels on sliced
experts, and tiny-kimi with its EAGLE3 draft. Skipped with fewer than two GPUs."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from atom_like import LLMEngine, SamplingParams
from atom_like.zoo import resolve

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def prompts(n: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[1] + [int(x) for x in rng.integers(20, 8000, int(rng.integers(8, 60)))] for _ in range(n)]


def run(model: str, tp: int, dtype: str = "float32", **kwargs) -> list[list[int]]:
    engine = LLMEngine(model, tensor_parallel_size=tp, dtype=dtype, max_model_len=256,
                       gpu_memory_utilization=0.3, max_num_seqs=16, **kwargs)
    try:
        return [o.token_ids for o in engine.generate(prompts(), GREEDY, use_tqdm=False)]
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # an in-process (-tp 1) engine's GPU memory must be gone before a later -tp 2 rank 0 sizes its pool
        torch.cuda.empty_cache()


@pytest.mark.parametrize("pair", ["mxfp4_fp8kv", "eagle3"])
def test_tp2_matches_tp1_in_fp32(pair):
    if pair == "mxfp4_fp8kv":
        model, kwargs = str(resolve("tiny-kimi-mxfp4")), dict(kv_cache_dtype="fp8")
    else:
        model = str(resolve("tiny-kimi"))
        kwargs = dict(method="eagle3", draft_model=str(resolve("tiny-kimi-eagle3")), num_speculative_tokens=3,
                      speculative_adaptive=False)
    # -tp 2 first: its workers free their GPUs when they exit, where an in-process -tp 1 engine
    # would still hold GPU 0's memory while rank 0 sizes its KV pool
    two = run(model, 2, **kwargs)
    one = run(model, 1, **kwargs)
    same = sum(a == b for a, b in zip(one, two))
    agree = np.mean([next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) / len(a) for a, b in zip(one, two)])
    print(f"{pair}: {same}/{len(one)} completions identical at -tp 1 and -tp 2, {agree:.1%} of tokens before a first difference")
    assert same >= len(one) - 1, f"{pair}: only {same}/{len(one)} identical"


def test_one_shot_all_reduce_gives_nccls_tokens_in_bf16():
    """Two ranks add a + b in the same order either way, so in bf16 too the one-shot all-reduce
    (the default) must give exactly the tokens NCCL alone gives (--disable-custom-all-reduce)."""
    model = str(resolve("tiny-kimi"))
    kwargs = dict(dtype="bfloat16", method="eagle3", draft_model=str(resolve("tiny-kimi-eagle3")),
                  num_speculative_tokens=3)
    one_shot = run(model, 2, **kwargs)
    nccl = run(model, 2, disable_custom_all_reduce=True, **kwargs)
    assert one_shot == nccl


def _fused_norm_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from kernels_rocm.rms_norm import fused_add_rms_norm
    from model_ops import tp

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        device = torch.device("cuda", rank)
        ar = tp.OneShotAllReduce(dist.group.WORLD, device)
        g = torch.Generator(device=device).manual_seed(100 + rank)  # each rank its own partial sums
        weight = torch.randn(4096, device=device, generator=torch.Generator(device=device).manual_seed(7)).bfloat16()
        mismatches = []
        for call, rows in enumerate([1, 5, 64, 1, 3, 128, 2]):  # slots alternate, counters of rows past T idle
            x = torch.randn(rows, 4096, device=device, generator=g).bfloat16()
            res = torch.randn(rows, 4096, device=device, generator=torch.Generator(device=device).manual_seed(call)).bfloat16()
            ref_res = res.clone()
            ref, _ = fused_add_rms_norm(ar(x.clone()), ref_res, weight, 1e-6)
            out, res = ar.add_rms_norm(x, res, weight, 1e-6)
            mismatches.append(int(not (torch.equal(out, ref) and torch.equal(res, ref_res))))
        # captured in a graph and replayed: the counters advance on the device, inputs change between replays
        x = torch.empty(4, 4096, device=device, dtype=torch.bfloat16)
        res = torch.empty_like(x)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            ar.add_rms_norm(x, res, weight, 1e-6)  # warm-up (compile) outside the capture
            with torch.cuda.graph(graph, stream=stream):
                out, _ = ar.add_rms_norm(x, res, weight, 1e-6)
        for replay in range(5):
            x.copy_(torch.randn(4, 4096, device=device, generator=g))
            res.copy_(torch.randn(4, 4096, device=device, generator=torch.Generator(device=device).manual_seed(50 + replay)))
            ref_res = res.clone()
            ref, _ = fused_add_rms_norm(ar(x.clone()), ref_res, weight, 1e-6)
            graph.replay()
            torch.cuda.synchronize(device)
            mismatches.append(int(not (torch.equal(out, ref) and torch.equal(res, ref_res))))
        results[rank] = (mismatches, int(ar.errors.item()))
    finally:
        dist.destroy_process_group()


def test_fused_all_reduce_add_rms_norm_is_one_shot_then_norm():
    """kernels_rocm.allreduce_rms_norm on two GPUs: bit-identical to the one-shot all-reduce followed
    by the fused add + RMSNorm kernel (two ranks add a + b once either way), eager over calls of
    1-128 rows (its two staging slots alternate) and replayed from a CUDA graph; no wait gave up."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_fused_norm_worker, args=(port, results), nprocs=2, join=True)
    for rank in range(2):
        mismatches, errors = results[rank]
        assert errors == 0, f"rank {rank}: {errors} waits gave up"
        assert sum(mismatches) == 0, f"rank {rank}: calls differing from one-shot + norm: {mismatches}"
