"""Overlapped scheduling (step N + 1 scheduled and launched before step N's results are read)
must give exactly the tokens of synchronous stepping, through late arrivals, chunked prefill,
preemption, aborts, stop strings, penalties and min_tokens (which fall back to waiting), prompt
logprobs, with and without an EAGLE3 draft; a stop string found a step late never reaches a
client; and launching a step reads nothing back from the device."""
from __future__ import annotations

import contextlib

import pytest
import torch

from atom_like import LLMEngine, SamplingParams

PROMPT_LENS = (45, 10, 50, 8, 20, 12, 30)
ARRIVALS = {0: (0, 1, 2), 1: (3,), 2: (4, 5), 4: (6,)}  # step -> requests added before it
ABORTED, ABORT_STEP = "r5", 6


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


def params(stop: str | None) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=[stop] if stop else [], ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=5, max_tokens=12),
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=16, stop_token_ids=[5, 9]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, ignore_eos=True),
    ]


def drive(engine: LLMEngine, stop: str | None) -> tuple[dict, dict]:
    """Final outputs and every streamed output, per request."""
    ps, sp = prompts(), params(stop)
    final, streamed = {}, {}
    for step in range(400):
        for r in ARRIVALS.get(step, ()):
            engine.add_request(None, sp[r], request_id=f"r{r}", prompt_ids=ps[r])
        if step == ABORT_STEP:
            engine.abort_request(ABORTED)
        if step > max(ARRIVALS) and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(out)
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return final, streamed


def build(path: str, overlap: bool, draft: str | None, **kwargs) -> LLMEngine:
    spec = dict(method="eagle3", draft_model=draft, num_speculative_tokens=3) if draft else {}
    return LLMEngine(path, max_model_len=96, max_num_batched_tokens=32, num_kv_blocks=10,
                     overlap_scheduling=overlap, **spec, **kwargs)


@pytest.mark.parametrize("with_draft", [False, True])
def test_overlapped_and_synchronous_stepping_give_the_same_tokens(make_llama, make_eagle3_llama, with_draft):
    path = make_llama(tokenizer=True)
    draft = make_eagle3_llama(path, aux_layer_ids=[0, 1, 2]) if with_draft else None
    # a stop string from the synchronous run's own text, so that it is met mid-generation
    probe = build(path, False, draft)
    words = drive(probe, None)[0]["r2"].text.split()
    stop = words[len(words) // 2]

    runs = {}
    for overlap in (False, True):
        engine = build(path, overlap, draft)
        runs[overlap] = drive(engine, stop)
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    (sync, _), (over, streamed) = runs[False], runs[True]
    # the aborted request ends without a final output (an abort is the caller's own act)
    assert sync.keys() == over.keys() == {f"r{i}" for i in range(len(PROMPT_LENS))} - {ABORTED}
    for request_id in sync:
        a, b = sync[request_id], over[request_id]
        assert (b.token_ids, b.finish_reason, b.text) == (a.token_ids, a.finish_reason, a.text), request_id
        # logprob values agree to fp32 rounding across batch shapes (the batches differ)
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert x.token_id == y.token_id and x.top.keys() == y.top.keys(), request_id
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4), request_id
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (x is None and y is None) or y.logprob == pytest.approx(x.logprob, abs=1e-4), request_id
    assert sync["r2"].finish_reason == "stop" and stop not in sync["r2"].text
    assert len(sync["r0"].token_ids) == 20 and len(sync["r3"].token_ids) >= 5  # max_tokens exact, min_tokens held
    for outs in streamed.values():  # what a client sees: text only grows, and never passes a stop string
        seen = ""
        for out in outs:
            assert out.text.startswith(seen) and stop not in out.text
            seen = out.text


def test_seeded_sampling_survives_forced_preemption(make_llama):
    """Without a draft, a seeded request's tokens are the same alone and batched with others in a
    pool so small that it is preempted and recomputed (its generator draws only for tokens it keeps)."""
    path = make_llama()
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=40, ignore_eos=True)
    alone = LLMEngine(path, max_model_len=128).generate([list(range(1, 30))], seeded, use_tqdm=False)[0]
    engine = LLMEngine(path, max_model_len=128, num_kv_blocks=8)
    others = [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)] * 3
    outs = engine.generate([list(range(1, 30))] + [list(range(40 + i, 60 + i)) for i in range(3)],
                           [seeded] + others, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert outs[0].token_ids == alone.token_ids


@contextlib.contextmanager
def no_device_reads(allowed: list[torch.nn.Module]):
    """Any read of a tensor's value by the host raises (on a GPU each one is a synchronisation),
    except inside the forwards of `allowed`: on CPU they run the torch reference attention, which
    reads its metadata (the GPU kernels do not; tests/gpu times the GPU path)."""
    depth = [0]

    def refuse(original):
        def method(*args, **kwargs):
            if depth[0] == 0:
                raise AssertionError("the host read a device value while launching a step")
            return original(*args, **kwargs)
        return method

    def permitted(forward):
        def method(*args, **kwargs):
            depth[0] += 1
            try:
                return forward(*args, **kwargs)
            finally:
                depth[0] -= 1
        return method

    with pytest.MonkeyPatch.context() as patch:
        for module in allowed:
            patch.setattr(module, "forward", permitted(module.forward))
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__array__", "numpy", "cpu"):
            patch.setattr(torch.Tensor, name, refuse(getattr(torch.Tensor, name)))
        yield


@pytest.mark.parametrize("with_draft,eager", [(False, False), (True, False), (True, True)])
def test_launching_a_step_reads_nothing_back(make_llama, make_eagle3_llama, with_draft, eager):
    """Everything a launch does around the networks: inputs, the previous step's tokens,
    sampling, verification, logprobs, the draft loop's bookkeeping."""
    path = make_llama()
    engine = build(path, True, make_eagle3_llama(path, aux_layer_ids=[0, 1, 2]) if with_draft else None,
                   enforce_eager=eager)
    runner, launch = engine.runner, engine.runner.launch
    networks = [runner.model] + ([runner.proposer.draft] if with_draft else [])

    def checked(batch):
        with no_device_reads(networks):
            launch(batch)

    runner.launch = checked
    sampled = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, logprobs=1, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logit_bias={3: 2.0})
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = engine.generate(prompts()[:3], [sampled, seeded, greedy], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
