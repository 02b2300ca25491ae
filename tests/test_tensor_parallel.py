"""Tensor parallelism on CPU (gloo, fp32): -tp 2 and -tp 4 give exactly the tokens of -tp 1, for
every model family and both EAGLE3 drafts (with the same acceptance, so the sharded drafts propose
what the whole ones do); each rank holds ~1/N of the weights; a dead worker ends the engine with
an error naming it and leaves no process; bad -tp values are refused before any process starts.

Each engine here spawns its workers (a few seconds each on two cores), so every engine serves
all the assertions it can. The server (tests/test_tensor_parallel_server.py) and torchrun
launches have their own module.
"""
from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_like import EngineArgs, LLMEngine, SamplingParams
from atom_like.config import load_model_config, text_config
from atom_like.engine.step_inputs import SeqStep, StepBatch
from atom_like.engine.tp_executor import WorkerError, check_tensor_parallel
from atom_like.loader.weights import check_tp_slices, iter_checkpoint, load_weights, tp_part
from atom_like.models.registry import build_model, target_model_class
from model_ops.linear import RowParallelLinear
from model_ops.quant.mxfp4_layers import MXFP4Experts, MXFP4Linear
from model_ops.tp import tp_state

rng = np.random.default_rng(5)
PROMPTS = [[int(x) for x in rng.integers(0, 128, n)] for n in (3, 29, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=s) for s in (1, 2, 3)]
COMMON = dict(max_model_len=96, max_num_seqs=4)


def generate(engine: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def trace(engine: LLMEngine, prompts=PROMPTS, params=GREEDY) -> tuple[list[list[int]], list, tuple]:
    """(tokens per prompt, every step's draft proposals, speculation counters), stepping by hand."""
    ids = [engine.add_request(p, params) for p in prompts]
    done, proposals = {}, []
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        proposals.append(sorted((rid, r.seq.spec_token_ids) for rid, r in engine.requests.items()))
    s = engine.spec_stats
    return [done[i] for i in ids], proposals, (s.num_drafts, s.num_accepted_tokens, s.accepted_per_position)


def assert_all_exited(engine: LLMEngine) -> None:
    procs = engine.runner.procs
    assert all(p.exitcode is not None for p in procs), [(p.pid, p.exitcode) for p in procs]
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


def check_spec_pair(target: str, draft: str, tp_size: int, prompts=PROMPTS, k: int = 3) -> LLMEngine:
    """-tp N with speculation: the tokens of -tp 1 without it, and at every step the proposals
    (so the acceptance) of -tp 1 with it."""
    plain = generate(LLMEngine(target, **COMMON), prompts)
    spec = dict(method="eagle3", draft_model=draft, num_speculative_tokens=k, **COMMON)
    one = trace(LLMEngine(target, **spec), prompts)
    assert one[0] == plain
    engine = LLMEngine(target, tensor_parallel_size=tp_size, **spec)
    assert trace(engine, prompts) == one
    return engine


# what a step carries to the ranks beyond tokens: logits processors, logprobs of sampled and of
# prompt tokens, a prompt-only request, seeded sampling (every rank must draw the same noise)
FEATURES = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                   presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, max_tokens=8, seed=7, logit_bias={5: 3.0, 9: -100.0}, min_tokens=5,
                   stop_token_ids=[1, 2, 3, 4]),
    SamplingParams(max_tokens=0, prompt_logprobs=1),
]
# after PROMPTS ran, prompts that share PROMPTS[1]'s first block hit the prefix cache
PREFIXED = [PROMPTS[1][:20] + [7, 7], PROMPTS[1][:17]]


def assert_same_outputs(got, expected) -> None:
    """Same tokens and finish reasons; logprobs equal up to fp32 rounding (the ranks' partial sums
    are added in another order than one GEMM's)."""
    def close(a, b) -> bool:
        return a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4 and a.top.keys() == b.top.keys()

    for g, e in zip(got, expected, strict=True):
        assert (g.token_ids, g.finish_reason) == (e.token_ids, e.finish_reason)
        for ours, theirs in ((g.logprobs, e.logprobs), (g.prompt_logprobs, e.prompt_logprobs)):
            assert (ours is None) == (theirs is None)
            assert ours is None or all(a is b is None or close(a, b) for a, b in zip(ours, theirs, strict=True))


def test_llama_tp2_sampling_features_prefix_cache_weights_profiles_and_a_killed_worker(make_llama, tmp_path):
    path = make_llama()
    one = LLMEngine(path, **COMMON)
    engine = LLMEngine(path, tensor_parallel_size=2, **COMMON)
    engine.start_profile(str(tmp_path / "tp2"))
    assert generate(engine) == generate(one)
    engine.stop_profile()
    # every rank wrote its own trace of the steps, before stop_profile returned
    for rank in (0, 1):
        events = json.loads((tmp_path / "tp2" / f"rank{rank}.trace.json").read_text())["traceEvents"]
        assert any(e.get("name") == "aten::linear" for e in events), rank
    with pytest.raises(RuntimeError, match="no profile is recording"):  # refused; the ranks keep serving
        engine.stop_profile()
    with pytest.raises(RuntimeError, match="no profile is recording"):
        one.stop_profile()
    one.start_profile(str(tmp_path / "tp1"))
    with pytest.raises(RuntimeError, match="already recording"):
        one.start_profile(str(tmp_path / "tp1"))
    one.stop_profile()
    assert (tmp_path / "tp1" / "rank0.trace.json").stat().st_size > 0
    # a repeated prefix: the same cache hits at -tp 2 as at -tp 1, and the same tokens
    assert generate(engine, PREFIXED) == generate(one, PREFIXED)
    assert engine.block_manager.num_hit_tokens == one.block_manager.num_hit_tokens == 32
    # seeded sampling: every rank draws the same noise as -tp 1 does
    assert generate(engine, params=SEEDED) == generate(one, params=SEEDED)
    outs = engine.generate(PROMPTS, FEATURES, use_tqdm=False)
    assert_same_outputs(outs, one.generate(PROMPTS, FEATURES, use_tqdm=False))
    assert outs[0].prompt_logprobs and outs[2].prompt_logprobs and not outs[2].token_ids

    # weights: only the norms are replicated, so each rank holds half (and no rank the whole model)
    total = one.runner.param_bytes
    per_rank = [info.param_bytes for info in engine.runner.infos]
    assert all(total / 2 <= b <= total / 2 * 1.01 for b in per_rank), (total, per_rank)

    # kill rank 1 between steps: rank 0 then blocks in the next step's first collective
    engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    os.kill(engine.runner.procs[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died: killed by SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    assert_all_exited(engine)
    with pytest.raises(WorkerError, match="rank 1"):  # and it stays down, saying why
        engine.step()


def test_llama_tp2_more_ranks_than_kv_heads_with_the_eagle3_mha_draft(make_llama, make_eagle3_llama):
    target = make_llama(num_key_value_heads=1)  # at -tp 2 the one KV head lives on both ranks
    engine = check_spec_pair(target, make_eagle3_llama(target, aux_layer_ids=[0, 1, 2]), 2)
    engine.shutdown()
    assert_all_exited(engine)


def test_deepseek_v3_tp2_with_the_eagle3_mla_draft_and_a_failing_step(make_deepseek, make_eagle3_mla):
    target = make_deepseek("v3")  # grouped noaux_tc routing, a shared expert, a dense first layer
    engine = check_spec_pair(target, make_eagle3_mla(target), 2)
    # a worker that raises (a block id far outside the pool) is reported with its error
    bad = SeqStep("bad", [1, 2], [], 0, [10**9], True, None, GREEDY, 0, 2)
    with pytest.raises(WorkerError, match=r"rank \d failed: IndexError"):
        engine.runner.launch(StepBatch([bad]))
        engine.runner.collect()
    assert_all_exited(engine)


def test_kimi_k25_tp4_with_the_shipped_eagle3_mla_draft():
    """The zoo's trained tiny-kimi pair, so the drafts really are accepted (and equally often)."""
    from atom_like.zoo import model_path

    prompts = ["The capital of France is", "Once upon a time, there was a little"]
    engine = check_spec_pair(model_path("tiny-kimi"), model_path("tiny-kimi-eagle3-mla"), 4, prompts)
    assert engine.spec_stats.num_accepted_tokens > 0
    engine.shutdown()
    assert_all_exited(engine)


@pytest.fixture(scope="module")
def mxfp4_kimi(make_deepseek, tmp_path_factory):
    """Factory: a random tiny Kimi-K2.5 in the released Quark MXFP4 layout (routed and shared
    experts and the dense MLP packed, MLA bf16) with fp8 KV-cache scales, whose experts'
    intermediate size is `intermediate` (the dense MLP's twice that)."""
    from atom_like.zoo.quark_mxfp4 import convert

    def make(intermediate: int) -> str:
        src = make_deepseek("kimi", n_group=1, topk_group=1, moe_intermediate_size=intermediate,
                            intermediate_size=2 * intermediate)
        scales = {f"language_model.model.layers.{i}.self_attn": 0.01 + 0.002 * i for i in range(3)}
        return str(convert(src, tmp_path_factory.mktemp(f"mxfp4_{intermediate}"), style="released",
                           kv_scales=scales))

    return make


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mxfp4_kimi_tp2(mxfp4_kimi, kv_cache_dtype):
    """Packed weights split on block boundaries (64 intermediate rows: one 32-value block a rank),
    the shared expert fused into the routed experts and cut like one of them, fp8 KV with the
    checkpoint's per-tensor scales on every rank."""
    path = mxfp4_kimi(64)
    one = LLMEngine(path, kv_cache_dtype=kv_cache_dtype, **COMMON)
    experts = [m for m in one.runner.model.modules() if isinstance(m, MXFP4Experts)]
    assert len(experts) == 2 and all(m.num_experts == 8 + 1 for m in experts)  # 8 routed + the shared one
    engine = LLMEngine(path, tensor_parallel_size=2, kv_cache_dtype=kv_cache_dtype, **COMMON)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)  # the CPU reference MoE is slow
    assert generate(engine, PROMPTS[:2], short) == generate(one, PROMPTS[:2], short)
    assert all(info.param_bytes < 0.7 * one.runner.param_bytes for info in engine.runner.infos)
    engine.shutdown()
    assert_all_exited(engine)


def test_an_mxfp4_tp_that_cuts_a_block_is_refused_before_any_process_starts(mxfp4_kimi):
    import multiprocessing

    path = mxfp4_kimi(32)  # 16 intermediate rows a rank: half a block
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.w2\b.*: --tensor-parallel-size 2 would cut "
                                         r"dim \d \(32 elements\) at element 16, inside a 32-element block"):
        LLMEngine(path, tensor_parallel_size=2, **COMMON)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("tp_size, message", [
    (3, "vocab_size 128 is not divisible by --tensor-parallel-size 3"),
    (8, "num_attention_heads 4 is not divisible by --tensor-parallel-size 8"),
])
def test_a_tp_the_model_cannot_be_split_by_is_refused_before_any_process_starts(make_llama, tp_size, message):
    import multiprocessing

    with pytest.raises(ValueError, match=message):
        LLMEngine(make_llama(), tensor_parallel_size=tp_size, **COMMON)
    assert not multiprocessing.active_children()


def test_more_ranks_than_gpus_is_refused(make_llama, monkeypatch):
    path = make_llama()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs 2 GPUs .* torch sees 1"):
        check_tensor_parallel(EngineArgs(model=path, tensor_parallel_size=2), load_model_config(path), torch.float32,
                              torch.device("cuda"))


# ----------------------------------------------------------------------------- loading (no processes)

def rank_params(path: str, rank: int, size: int) -> dict[str, torch.Tensor]:
    """The parameters rank `rank` of `size` loads (tensor-parallel state set, no group needed)."""
    config = load_model_config(path)
    with tp_state(rank, size):
        model = build_model(target_model_class(config), text_config(config), torch.float32, torch.device("cpu"))
        load_weights(model, iter_checkpoint(path), model.weight_map())
        parts = {name: tp_part(model, name, None) for name, _ in model.named_parameters()}
        index = {name: part.stored_index(name) for name, part in parts.items() if part is not None}
    return {name: (p.data, parts[name], index.get(name)) for name, p in model.named_parameters()}


def stack_experts(src: str, dst) -> str:
    """The checkpoint with transformers' stacked expert tensors instead of per-expert ones."""
    path = shutil.copytree(src, dst)
    tensors, experts = load_file(str(path / "model.safetensors")), {}
    for name in [n for n in tensors if ".experts." in n]:
        prefix, e, proj, _ = name.rsplit(".", 3)
        experts.setdefault(prefix, {})[(int(e), proj)] = tensors.pop(name)
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                                                         for e in range(n)])
        tensors[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize("arch, size", [("llama", 4), ("v3", 2), ("v3-stacked", 4)])
def test_each_rank_loads_exactly_its_slice_of_every_tensor(make_llama, make_deepseek, tmp_path, arch, size):
    """Per-projection and per-expert checkpoint tensors, each cut for one rank, give that rank
    the slice of the whole (fused) parameter its TPSlice names; KV heads follow their q heads."""
    path = make_llama() if arch == "llama" else make_deepseek("v3")
    full = rank_params(path, 0, 1)
    if arch == "v3-stacked":
        path = stack_experts(path, tmp_path / "stacked")
    for rank in range(size):
        local = rank_params(path, rank, size)
        assert local.keys() == full.keys()
        split = 0
        for name, (tensor, part, index) in local.items():
            whole = full[name][0]
            expected = whole if part is None else torch.cat([whole[i] for i in index], dim=part.dim)
            assert torch.equal(tensor, expected), name
            split += part is not None
        assert split > len(local) // 3
        if arch == "llama":  # 4 q heads, 2 KV heads of 16 dims: rank r holds q head r and KV head r // 2
            qkv, qkv_full = local["model.layers.0.self_attn.qkv_proj.weight"][0], full["model.layers.0.self_attn.qkv_proj.weight"][0]
            assert torch.equal(qkv[:16], qkv_full[16 * rank:16 * (rank + 1)])
            kv_head = rank // 2
            assert torch.equal(qkv[16:32], qkv_full[64 + 16 * kv_head:64 + 16 * (kv_head + 1)])


def test_a_split_inside_an_mxfp4_block_is_refused_naming_the_layer():
    """The packed layers take their float layer's split and refuse one that cuts a 32-value block."""
    model = torch.nn.Module()
    with tp_state(0, 2):
        model.down_proj = MXFP4Linear(64, 16, sharding=RowParallelLinear(128, 16).sharding)  # 64 inputs a rank
        check_tp_slices(model)
        assert model.down_proj.tp_slice("weight", None).stored_index("w") == [(slice(None), slice(0, 32))]
        assert model.down_proj.tp_slice("weight_scale", None).stored_index("s") == [(slice(None), slice(0, 2))]
        model.down_proj = MXFP4Linear(48, 16, sharding=RowParallelLinear(96, 16).sharding)  # rank 1 starts mid-block
        with pytest.raises(ValueError, match=r"down_proj\.weight: --tensor-parallel-size 2 would cut dim 1 "
                                             r"\(96 elements\) at element 48, inside a 32-element block"):
            check_tp_slices(model)
        model.down_proj = MXFP4Experts(2, 32, 96)  # the experts' down_proj alike
        with pytest.raises(ValueError, match=r"down_proj\.w2\b.*: --tensor-parallel-size 2 .* at element 48"):
            check_tp_slices(model)
