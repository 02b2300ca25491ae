"""The two step kernels a GPU runs between graph replays, compiled (not interpreted), against the torch
versions the CPU engine runs: the greedy verification (kernels_rocm.greedy_verify against
DraftLayout.verified) and the draft's first inputs (kernels_rocm.step_advance.draft_starts against
atom_like.engine.step_inputs.draft_starts). Graph-vs-eager tests cannot catch a wrong kernel here (both
modes run it), so the engine check is speculative against plain greedy decoding in fp32."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

CUDA = torch.device("cuda")


def _greedy_step(num_drafts: list[int], seed: int, vocab: int):
    """Logits on the GPU whose argmax follows each sequence's drafts for a random number of positions."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(num_drafts) + len(num_drafts), vocab, generator=g)
    drafts, r = [], 0
    for n in num_drafts:
        ids = torch.randint(0, vocab, (n,), generator=g)
        for j in range(int(torch.randint(0, n + 1, (1,), generator=g))):
            logits[r + j, ids[j]] = 10.0
        drafts.append(ids)
        r += n + 1
    return logits.to(CUDA), torch.cat(drafts).to(CUDA)


@pytest.mark.parametrize("num_drafts", [[1], [3, 0, 2], [5] * 4, [8, 1, 0, 7, 3], [2] * 17, [4] * 128, [0, 0, 6]])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_verify_compiled_matches_the_torch_verification(num_drafts, seed):
    from kernels_rocm.greedy_verify import greedy_verify
    from model_ops.sampling import DraftLayout

    logits, draft_ids = _greedy_step(num_drafts, seed, vocab=163_840)
    layout = DraftLayout.of(logits, num_drafts, draft_ids)
    emitted = logits.argmax(dim=-1)
    ref = layout.verified(emitted, layout.valid & (layout.drafts == emitted[layout.row_index[:, :-1]]))
    tokens, accepted = greedy_verify(emitted, draft_ids, layout.row_index, layout.draft_index, layout.valid)
    assert torch.equal(tokens, ref.token_ids) and torch.equal(accepted, ref.num_accepted)
    if len(num_drafts) >= 4:
        assert len(set(accepted.tolist())) > 1


@pytest.mark.parametrize("b, n", [(1, 1), (5, 8), (37, 64), (200, 256)])
@pytest.mark.parametrize("verified", [True, False])
def test_draft_starts_compiled_matches_the_torch_version(b, n, verified):
    from atom_like.engine.step_inputs import draft_starts as reference
    from kernels_rocm.step_advance import draft_starts

    g = torch.Generator().manual_seed(b + n)
    sampling = list(range(0, b, 2))
    src = torch.full((b,), -1, dtype=torch.int64)
    src[sampling] = torch.tensor(torch.randperm(len(sampling), generator=g).tolist(), dtype=torch.int64)
    host_next = torch.randint(0, 2**33, (b,), generator=g)
    host_next[sampling] = 0
    rows = torch.stack([torch.randint(0, 2**33, (b,), generator=g), src, host_next]).to(CUDA)
    num_accepted = torch.randint(0, 5, (len(sampling),), generator=g).to(CUDA) if verified else None
    token_ids = torch.randint(0, 2**33, (len(sampling), 5), generator=g).to(CUDA) if verified else None
    out = {name: [torch.full((n,), -7, dtype=torch.int64, device=CUDA) for _ in range(2)] for name in ("k", "t")}
    draft_starts(rows, num_accepted, token_ids, *out["k"], 3)
    reference(rows, num_accepted, token_ids, *out["t"], 3)
    assert all(torch.equal(x, y) for x, y in zip(out["k"], out["t"]))


@pytest.mark.parametrize("graphs", [False, True])
def test_fp32_speculation_gives_the_plain_tokens_through_the_kernels(make_llama, make_eagle3_llama, monkeypatch, graphs):
    """fp32 greedy, k switching every step (0 included): the tokens of plain decoding, with the greedy
    verification kernel deciding every verified step."""
    import model_ops.sampling as sampling
    from test_adaptive_spec import Cycle

    calls = []
    real = sampling._greedy_verify_kernel(CUDA)
    assert real is not None

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(sampling, "_greedy_verify_kernel", lambda device: counted)
    from atom_like import LLMEngine, SamplingParams

    path = make_llama(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    kwargs = dict(dtype="float32", max_model_len=256, gpu_memory_utilization=0.2, max_num_seqs=8,
                  enforce_eager=not graphs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, 2048, (int(n),), generator=g).tolist() for n in torch.randint(8, 60, (5,), generator=g)]
    plain = LLMEngine(path, **kwargs)
    expected = [o.token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    plain.shutdown()
    del plain
    spec = LLMEngine(path, method="eagle3", draft_model=make_eagle3_llama(path, aux_layer_ids=[1, 3, 5]),
                     num_speculative_tokens=4, speculative_adaptive=False, **kwargs)
    spec.draft_policy = Cycle([3, 0, 1, 4, 2], 4)
    assert [o.token_ids for o in spec.generate(batch, params, use_tqdm=False)] == expected
    assert len(calls) > 10
