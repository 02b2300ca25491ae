"""GPU checks of the engine (skipped without CUDA/ROCm): bf16 parity with transformers, and
graph replay giving the eager tokens for the target alone and with the captured draft loop.

Graph vs eager is compared at batch sizes equal to a capture bucket (no padding, so every GEMM
has the same shape) and a short max_model_len (the attention kernels then pick the same KV-split
plan from the host bound in both modes): under those conditions the two paths run the same
kernels on the same shapes and must agree token for token.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atom_like import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

GPU_LLAMA = dict(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, 2048, int(rng.integers(8, 60)))] for _ in range(n)]


def test_llama_bf16_parity_with_transformers(make_llama):
    """bf16 tolerance, stated against an fp32 oracle (transformers' fp32 forward): the engine's
    bf16 logits may differ from it by at most 1.5x (+1e-3) transformers' own bf16 error, and pick
    the oracle's argmax at no fewer positions than transformers' bf16 minus 2 points."""
    from transformers import AutoModelForCausalLM

    from test_llama_parity import prefill_logits  # the CPU test's batched paged prefill

    path = make_llama(**GPU_LLAMA)
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    engine = LLMEngine(path, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3)
    batch = prompts(6)
    err = {"engine": 0.0, "transformers": 0.0}
    agree = {"engine": 0, "transformers": 0}
    total = 0
    for prompt, ours in zip(batch, prefill_logits(engine, batch)):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref, theirs = hf32(ids).logits[0].float(), hf16(ids).logits[0].float()
        for name, logits in (("engine", ours.float()), ("transformers", theirs)):
            err[name] = max(err[name], float((logits - ref).abs().max() / ref.abs().max()))
            agree[name] += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += len(prompt)
    print(f"bf16 vs fp32 oracle: relative logit error engine {err['engine']:.2e}, transformers "
          f"{err['transformers']:.2e}; argmax agreement engine {agree['engine'] / total:.1%}, "
          f"transformers {agree['transformers'] / total:.1%}")
    assert err["engine"] <= 1.5 * err["transformers"] + 1e-3
    assert agree["engine"] / total >= agree["transformers"] / total - 0.02


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("spec", [False, True])
def test_graph_replay_matches_eager(make_llama, make_eagle3_llama, batch_size, spec):
    path = make_llama(**GPU_LLAMA)
    kwargs = dict(dtype="bfloat16", max_model_len=192, gpu_memory_utilization=0.3, max_num_seqs=16)
    if spec:
        kwargs.update(method="eagle3", draft_model=make_eagle3_llama(path, aux_layer_ids=[1, 4, 7]),
                      num_speculative_tokens=3, speculative_adaptive=False)  # one k in both engines
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    batch = prompts(batch_size, seed=batch_size)
    eager = LLMEngine(path, enforce_eager=True, **kwargs)
    expected = [o.token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    del eager
    graphed = LLMEngine(path, **kwargs)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.target[1, 4 if spec else 1].graph is not None
    assert [o.token_ids for o in graphed.generate(batch, params, use_tqdm=False)] == expected
    if spec:
        assert graphed.runner.graphs.first_pass[1, 4].graph is not None


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("spec", [False, True])
def test_pdl_launches_match_plain_launches(make_llama, make_eagle3_llama, batch_size, spec):
    """Programmatic dependent launch (kernels_rocm._pdl, sm_90+) overlaps a kernel's launch with
    the previous kernel's tail; a kernel reading or writing before its wait would race. The
    graphed engine with it gives the tokens of one without it (batch 1 and 3: the GEMV and its
    SwiGLU epilogue run, with the verify's 4 rows too)."""
    from kernels_rocm import _pdl

    hopper = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
    assert _pdl.launch_args(torch.device("cuda"))["PDL"] == hopper
    path = make_llama(**GPU_LLAMA)
    kwargs = dict(dtype="bfloat16", max_model_len=192, gpu_memory_utilization=0.3, max_num_seqs=16)
    if spec:
        kwargs.update(method="eagle3", draft_model=make_eagle3_llama(path, aux_layer_ids=[1, 4, 7]),
                      num_speculative_tokens=3, speculative_adaptive=False)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    batch = prompts(batch_size, seed=10 + batch_size)
    _pdl.set_enabled(False)
    try:
        plain = LLMEngine(path, **kwargs)
        expected = [o.token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    finally:
        _pdl.set_enabled(True)
    plain.shutdown()
    del plain
    with_pdl = LLMEngine(path, **kwargs)
    assert [o.token_ids for o in with_pdl.generate(batch, params, use_tqdm=False)] == expected


@pytest.mark.parametrize("batch_size", [1, 4])
def test_graph_replay_matches_eager_mla(make_deepseek, make_eagle3_mla, batch_size):
    """DeepSeek-V3 target (MLA + fused MoE) with an EAGLE3 MLA draft: the captured target step
    and draft loop give the eager tokens."""
    path = make_deepseek(arch="v3", dtype=torch.bfloat16)
    draft = make_eagle3_mla(path, aux_layer_ids=(0, 1, 2))
    kwargs = dict(dtype="bfloat16", max_model_len=192, gpu_memory_utilization=0.2, max_num_seqs=8,
                  method="eagle3", draft_model=draft, num_speculative_tokens=3, speculative_adaptive=False)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batch = [p[:40] for p in prompts(batch_size, seed=7)]
    batch = [[t % 128 for t in p] for p in batch]  # the tiny DeepSeek's vocabulary
    eager = LLMEngine(path, enforce_eager=True, **kwargs)
    expected = [o.token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    del eager
    graphed = LLMEngine(path, **kwargs)
    assert graphed.runner.graphs.first_pass[1, 4].graph is not None
    assert [o.token_ids for o in graphed.generate(batch, params, use_tqdm=False)] == expected


def test_changing_k_compiles_nothing_after_start_up(make_llama, make_eagle3_llama):
    """Adaptive k runs every verify width 0..k in any order: the step-advance kernel, which runs
    between the graph replays, is compiled for all of them at start-up, so no decode step waits for
    a Triton compile (each took ~90 ms on an H100 host) whatever the widths and the batch size."""
    from kernels_rocm.step_advance import _advance_kernel

    from test_adaptive_spec import Cycle  # the CPU tests' forced k pattern

    path = make_llama(**GPU_LLAMA)
    engine = LLMEngine(path, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, method="eagle3",
                       draft_model=make_eagle3_llama(path, aux_layer_ids=[1, 4, 7]), num_speculative_tokens=5,
                       speculative_adaptive=True)

    def compiled() -> int:
        return sum(len(caches[0]) for caches in _advance_kernel.device_caches.values())

    after_start_up = compiled()
    assert after_start_up >= 6  # query widths 1..6
    engine.draft_policy = Cycle((5, 0, 3, 1, 4, 2, 0, 5, 2, 4, 1, 3), 5)
    for batch in (1, 7, 16, 33):  # stride classes: == 1, neither, multiples of 16
        engine.generate(prompts(batch, seed=batch), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    assert compiled() == after_start_up


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_the_torch_reference_backend_runs_eagerly_with_one_warning(make_llama, make_deepseek, model, caplog):
    """`--attention-backend torch` on a GPU without --enforce-eager: its writes and attention read the
    step's metadata back to the host, which a CUDA graph cannot capture (capturing it failed with "operation
    not permitted when stream is capturing"); the engine decodes eagerly instead, says so once, and gives
    the tokens of the same backend under --enforce-eager."""
    import logging

    path = make_llama(**GPU_LLAMA) if model == "llama" else make_deepseek()
    kw = dict(dtype="float32", max_model_len=128, gpu_memory_utilization=0.3, attention_backend="torch")
    batch = [[t % (2048 if model == "llama" else 128) for t in p] for p in prompts(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="atom_like.engine.model_runner"):
        engine = LLMEngine(path, **kw)
    warnings = [r.getMessage() for r in caplog.records if "graph cannot capture" in r.getMessage()]
    assert len(warnings) == 1 and "attention backend torch" in warnings[0]
    assert engine.runner.graphs is None
    got = [o.token_ids for o in engine.generate(batch, params, use_tqdm=False)]
    del engine
    eager = LLMEngine(path, enforce_eager=True, **kw)
    assert got == [o.token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    assert all(len(t) == 12 for t in got)
