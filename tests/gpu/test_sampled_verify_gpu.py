"""The sampled verification kernels (kernels_rocm.sampled_verify), compiled, through verify() against
its torch path on the same GPU: the same generator seed must give the same tokens and accepted counts
(the torch path draws the same noise; only a near-tie of two candidates' p / E, of order 1e-6 a row,
could differ). At Kimi's and SmolLM2's vocabularies, batch 1 (rows split into chunks) to 64."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from chi_square import P_FLOOR, chi_square_pvalue

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

CUDA = torch.device("cuda")


def _step(num_drafts: list[int], vocab: int, seed: int, dtype: torch.dtype):
    """Random logits and drafts, most of them the row's most likely token (long accepted runs occur)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(num_drafts) + len(num_drafts), vocab, generator=g) * 4
    drafts, r = [], 0
    for n in num_drafts:
        likely = logits[r:r + n].argmax(dim=-1)
        drafts.append(torch.where(torch.rand(n, generator=g) < 0.8, likely, torch.randint(0, vocab, (n,), generator=g)))
        r += n + 1
    return logits.to(dtype).to(CUDA), torch.cat(drafts).to(CUDA)


def _verify(monkeypatch, kernel: bool, logits, num_drafts, draft_ids, seed: int, greedy_every: int = 0, **kwargs):
    """verify() on the kernel or the torch path; with greedy_every n, every n-th sequence's rows greedy."""
    import model_ops.sampling as sampling
    from model_ops.sampling import SamplingTensors, verify

    rows, vocab = logits.shape
    temps = [0.6 + 0.2 * (i % 4) for i in range(rows)]
    if greedy_every:
        sequence_of_row = [s for s, n in enumerate(num_drafts) for _ in range(n + 1)]
        temps = [0.0 if sequence_of_row[r] % greedy_every == 0 else t for r, t in enumerate(temps)]
    st = SamplingTensors.build(temps, [-1] * rows, [1.0] * rows, [None] * rows, vocab, CUDA)
    calls = []
    real = sampling._sampled_kernel(CUDA)
    assert real is not None

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(sampling, "_sampled_kernel", (lambda device: counted) if kernel else (lambda device: None))
    out = verify(logits, num_drafts, draft_ids, st, torch.Generator(device=CUDA).manual_seed(seed), **kwargs)
    monkeypatch.undo()
    assert len(calls) == int(kernel)
    return out


@pytest.mark.parametrize("vocab", [49_152, 163_840])
@pytest.mark.parametrize("batch, k", [(1, 1), (1, 5), (8, 3), (64, 5), (64, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("greedy_every", [0, 3])
def test_compiled_kernel_gives_the_torch_paths_tokens(monkeypatch, vocab, batch, k, dtype, greedy_every):
    """greedy_every 3: greedy requests (every third sequence) beside sampled ones."""
    if greedy_every and batch == 1:
        pytest.skip("a lone greedy sequence takes greedy_verify")
    # ragged: every 7th sequence shorter (none at k = 1); the first has all k, so batch 1 verifies
    num_drafts = [k if i % 7 != 6 else max(k - 2, 0) for i in range(batch)]
    for seed in range(3):
        logits, draft_ids = _step(num_drafts, vocab, seed, dtype)
        ref = _verify(monkeypatch, False, logits, num_drafts, draft_ids, seed, greedy_every)
        got = _verify(monkeypatch, True, logits, num_drafts, draft_ids, seed, greedy_every)
        differ = (got.token_ids != ref.token_ids).any(dim=1) | (got.num_accepted != ref.num_accepted)
        assert not differ.any(), (f"seed {seed}: sequences {differ.nonzero().flatten().tolist()} differ: "
                                  f"{got.token_ids[differ].tolist()} vs {ref.token_ids[differ].tolist()}")


def test_compiled_rejection_sampling_keeps_the_target_distribution(monkeypatch):
    """40,000 sequences of 2 drafts at vocab 12 in one launch: the first emitted token is distributed
    as p (the GPU twin of tests/test_kernels_sampled_verify.py's check, with many more draws)."""
    vocab, n = 12, 40_000
    g = torch.Generator().manual_seed(5)
    target = torch.randn(vocab, generator=g) * 2
    logits = target.expand(3 * n, vocab).contiguous().to(CUDA)
    draft_ids = torch.randint(0, vocab, (2 * n,), generator=g).to(CUDA)
    verified = _verify(monkeypatch, True, logits, [2] * n, draft_ids, 0)
    counts = np.bincount(verified.token_ids[:, 0].cpu().numpy(), minlength=vocab)
    # _verify's temperatures cycle over the rows; a sequence's first row is row 3i: 0.6 + 0.2 * (3i % 4)
    temps = torch.tensor([0.6 + 0.2 * ((3 * i) % 4) for i in range(4)])
    expected = torch.softmax(target[None] / temps[:, None], -1).double().mean(0).numpy()  # i % 4 cycles evenly
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue >= P_FLOOR, f"chi-square p={pvalue:.2e}"


def test_other_steps_keep_the_torch_path_on_the_gpu(monkeypatch):
    """draft_probs given: verify's rule, not the device, sends the step to the torch path."""
    import model_ops.sampling as sampling
    from model_ops.sampling import SamplingTensors, verify

    logits, draft_ids = _step([2, 3], 1000, 0, torch.float32)
    st = SamplingTensors.build([1.0] * 7, [-1] * 7, [1.0] * 7, [None] * 7, 1000, CUDA)
    monkeypatch.setattr(sampling, "_sampled_kernel", lambda device: pytest.fail("the kernel was called"))
    q = torch.softmax(torch.randn(5, 1000, device=CUDA), -1)
    verify(logits, [2, 3], draft_ids, st, torch.Generator(device=CUDA).manual_seed(0), draft_probs=q)
