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


def _starts_case(b: int, n: int, seed: int):
    """b sequences padded to n rows; every other one samples (its row in a verification of S rows,
    in another order), the rest carry their next token; token ids and rows past 2^31."""
    g = torch.Generator().manual_seed(seed)
    sampling = list(range(0, b, 2))
    order = torch.randperm(len(sampling), generator=g).tolist()
    src = torch.full((b,), -1, dtype=torch.int64)
    src[sampling] = torch.tensor(order, dtype=torch.int64)
    base = torch.randint(0, 2**33, (b,), generator=g)
    host_next = torch.randint(0, 2**33, (b,), generator=g)
    host_next[sampling] = 0
    k = 4
    num_accepted = torch.randint(0, k + 1, (len(sampling),), generator=g)
    token_ids = torch.randint(0, 2**33, (len(sampling), k + 1), generator=g)
    return torch.stack([base, src, host_next]), num_accepted, token_ids, n


@pytest.mark.parametrize("b, n", [(1, 1), (1, 16), (5, 8), (37, 64)])
@pytest.mark.parametrize("verified", [True, False])
def test_draft_starts_kernel_matches_the_torch_version_and_the_rule(b, n, verified):
    from atom_like.engine.step_inputs import draft_starts as reference
    from kernels_rocm.step_advance import draft_starts

    rows, num_accepted, token_ids, n = _starts_case(b, n, seed=b + n)
    if not verified:
        num_accepted = token_ids = None
    out = {name: [torch.full((n,), -7, dtype=torch.int64) for _ in range(2)] for name in ("kernel", "torch")}
    draft_starts(rows, num_accepted, token_ids, *out["kernel"], 3)
    reference(rows, num_accepted, token_ids, *out["torch"], 3)
    assert all(torch.equal(x, y) for x, y in zip(out["kernel"], out["torch"]))
    # the rule, sequence by sequence: a sampling one moves past its accepted drafts and takes the token after them
    last, nxt = out["kernel"]
    for i in range(b):
        s = int(rows[1, i])
        if s >= 0 and verified:
            a = int(num_accepted[s])
            assert last[i] == rows[0, i] + a and nxt[i] == token_ids[s, a]
        else:
            assert last[i] == rows[0, i] and nxt[i] == rows[2, i]
    assert last[b:].tolist() == [3 * i for i in range(b, n)] and nxt[b:].tolist() == [0] * (n - b)  # graph padding


def test_draft_starts_refuses_outputs_shorter_than_the_batch():
    from kernels_rocm.step_advance import draft_starts

    rows, num_accepted, token_ids, _ = _starts_case(5, 8, seed=0)
    with pytest.raises(ValueError, match=r"rows \(3, 5\), last_rows \(4,\)"):
        draft_starts(rows, num_accepted, token_ids, torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 1)


def test_precompile_launches_every_variant(monkeypatch):
    """precompile (run at start-up on a GPU) launches the advance kernel for every verify width and the
    draft-start kernel for every block of rows up to the batch limit, with and without a verification;
    none of the latter for an engine without drafts."""
    import kernels_rocm.step_advance as step_advance

    blocks = []
    real = step_advance.draft_starts

    def spy(rows, num_accepted, token_ids, last_rows, next_tokens, pad_stride):
        blocks.append((last_rows.shape[0], num_accepted is not None))
        real(rows, num_accepted, token_ids, last_rows, next_tokens, pad_stride)

    monkeypatch.setattr(step_advance, "draft_starts", spy)
    step_advance.precompile(torch.device("cpu"), 2, 16, 40)
    assert blocks == [(16, False), (16, True), (32, False), (32, True), (64, False), (64, True)]
    blocks.clear()
    step_advance.precompile(torch.device("cpu"), 2, 16, 0)
    assert blocks == []
