"""The one-kernel advance of a step's inputs (kernels_rocm.step_advance, under TRITON_INTERPRET=1)
against the torch version the CPU engine runs (atom_like.engine.step_inputs.advance_followers)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from atom_like.engine.step_inputs import advance_followers  # noqa: E402
from kernels_rocm.step_advance import advance  # noqa: E402


def _case(k: int, seed: int):
    """A previous step of 5 sequences (k drafts each) and a step of 4 whose rows 0, 2, 3 follow it
    (in another order), each with q = k + 1 input columns; block ids past 65,535."""
    g = torch.Generator().manual_seed(seed)
    block_size, width, q = 16, 8, k + 1
    accepted = torch.randint(0, k + 1, (5,), generator=g)
    token_ids = torch.randint(0, 50_000, (5, k + 1), generator=g)
    drafts = torch.randint(0, 50_000, (5, k), generator=g).int() if k else None
    follow_src, follow_seq = [4, 0, 2], [0, 2, 3]
    starts = [b * q for b in follow_seq]
    index = torch.tensor([follow_src, follow_seq, starts])
    positions = torch.randint(0, width * block_size - 2 * q - 1, (4 * q,), generator=g)
    step = dict(input_ids=torch.randint(0, 9, (4 * q,), generator=g), positions=positions,
                context_lens=(positions.view(4, q)[:, -1] + 1).int(),
                block_tables=torch.randint(60_000, 200_000, (4, width), generator=g).int(),
                slot_mapping=torch.randint(0, 10**6, (4 * q,), generator=g))
    return index, accepted, token_ids, drafts, step, block_size


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_kernel_matches_the_torch_version(k):
    index, accepted, token_ids, drafts, step, block_size = _case(k, seed=k)
    mine, ref = ({n: t.clone() for n, t in step.items()} for _ in range(2))
    advance(index, accepted, token_ids, drafts, *mine.values(), block_size)
    advance_followers(index, accepted, token_ids, drafts, *ref.values(), block_size)
    for name in step:
        assert torch.equal(mine[name], ref[name]), name
    assert not torch.equal(mine["slot_mapping"], step["slot_mapping"])  # it did move something
    untouched = 1 * (k + 1)  # batch row 1 follows nothing: its columns stay as they were
    assert torch.equal(mine["input_ids"][untouched:2 * untouched], step["input_ids"][untouched:2 * untouched])


def test_refuses_a_malformed_index():
    index, accepted, token_ids, drafts, step, block_size = _case(1, seed=0)
    with pytest.raises(ValueError, match=r"index has shape \(2, 3\)"):
        advance(index[:2], accepted, token_ids, drafts, *step.values(), block_size)
