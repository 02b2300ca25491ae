"""The one-kernel greedy verification (kernels_rocm.greedy_verify, under TRITON_INTERPRET=1) against the
torch version the CPU engine runs (model_ops.sampling.DraftLayout.verified), and through verify()."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import model_ops.sampling as sampling  # noqa: E402
from kernels_rocm.greedy_verify import greedy_verify, precompile  # noqa: E402
from model_ops.sampling import DraftLayout, SamplingTensors, verify  # noqa: E402


def _step(num_drafts: list[int], seed: int, vocab: int = 40):
    """Logits whose argmax follows each sequence's drafts for a random number of positions (so every
    accepted count from 0 to all occurs), then random."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(num_drafts) + len(num_drafts)
    logits = torch.randn(rows, vocab, generator=g)
    drafts, r = [], 0
    for n in num_drafts:
        ids = torch.randint(0, vocab, (n,), generator=g)
        follow = int(torch.randint(0, n + 1, (1,), generator=g))
        for j in range(follow):  # row r + j scores draft j: make it the argmax
            logits[r + j, ids[j]] = 10.0
        drafts.append(ids)
        r += n + 1
    return logits, (torch.cat(drafts) if drafts else torch.zeros(0, dtype=torch.int64))


@pytest.mark.parametrize("num_drafts", [[1], [3, 0, 2], [5, 5, 5, 5], [8, 1, 0, 7, 3], [2] * 17])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_the_torch_verification(num_drafts, seed):
    logits, draft_ids = _step(num_drafts, seed)
    layout = DraftLayout.of(logits, num_drafts, draft_ids)
    emitted = logits.argmax(dim=-1)
    ref = layout.verified(emitted, layout.valid & (layout.drafts == emitted[layout.row_index[:, :-1]]))
    tokens, accepted = greedy_verify(emitted, draft_ids, layout.row_index, layout.draft_index, layout.valid)
    assert torch.equal(tokens, ref.token_ids) and torch.equal(accepted, ref.num_accepted)
    if seed == 0 and len(num_drafts) > 2:
        assert len(set(accepted.tolist())) > 1  # the case does vary the accepted counts


def test_a_match_after_a_mismatch_is_not_accepted():
    """Drafts 5, 6, 7 against argmaxes 9, 6, 7, 2: the first differs, so none is kept, and the
    sequence emits 9, though the later two match."""
    logits = torch.zeros(4, 12)
    for row, token in enumerate([9, 6, 7, 2]):
        logits[row, token] = 1.0
    draft_ids = torch.tensor([5, 6, 7])
    layout = DraftLayout.of(logits, [3], draft_ids)
    tokens, accepted = greedy_verify(logits.argmax(-1), draft_ids, layout.row_index, layout.draft_index, layout.valid)
    assert tokens.tolist() == [[9, -1, -1, -1]] and accepted.tolist() == [0]
    logits[0] = 0.0
    logits[0, 5] = 1.0  # now the first matches too: all three kept, then the last row's 2
    tokens, accepted = greedy_verify(logits.argmax(-1), draft_ids, layout.row_index, layout.draft_index, layout.valid)
    assert tokens.tolist() == [[5, 6, 7, 2]] and accepted.tolist() == [3]


def test_verify_takes_the_kernel_where_there_is_one(monkeypatch):
    """verify() on a greedy step through the kernel gives what the torch path gives (sampled rows keep
    the rejection path; a step without drafts samples plainly)."""
    num_drafts = [4, 0, 2, 3]
    logits, draft_ids = _step(num_drafts, seed=5)
    st = SamplingTensors.build([0.0] * len(logits), [-1] * len(logits), [1.0] * len(logits), [None] * len(logits), 40,
                               torch.device("cpu"))
    torch_path = verify(logits, num_drafts, draft_ids, st, torch.Generator())
    calls = []

    def kernel(*args):
        calls.append(1)
        return greedy_verify(*args)

    monkeypatch.setattr(sampling, "_greedy_verify_kernel", lambda device: kernel)
    kernel_path = verify(logits, num_drafts, draft_ids, st, torch.Generator())
    assert calls and torch.equal(kernel_path.token_ids, torch_path.token_ids)
    assert torch.equal(kernel_path.num_accepted, torch_path.num_accepted) and kernel_path.lists() == torch_path.lists()


def test_refuses_a_malformed_layout():
    logits, draft_ids = _step([2, 1], seed=0)
    layout = DraftLayout.of(logits, [2, 1], draft_ids)
    with pytest.raises(ValueError, match=r"row_index \(2, 2\)"):
        greedy_verify(logits.argmax(-1), draft_ids, layout.row_index[:, :2], layout.draft_index, layout.valid)


def test_precompile_launches():
    precompile(torch.device("cpu"), 8)  # widths 1, 3, 7, 15: every block of draft widths up to 8
