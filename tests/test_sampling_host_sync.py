"""The greedy path learns "every row is greedy" on the host: on a GPU, reading it back from the
device (bool(tensor)) is a stream synchronization every step. Sampling tensors on the meta device
stand in for device memory the host must not read: any read raises."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from model_ops.sampling import SamplingTensors, verify


def _meta_tensors(temperature: list[float]) -> SamplingTensors:
    st = SamplingTensors.build(temperature, [-1] * len(temperature), [1.0] * len(temperature),
                               [None] * len(temperature), 16, torch.device("cpu"))
    return SamplingTensors(st.temperature.to("meta"), st.top_k.to("meta"), st.top_p.to("meta"), st.generators,
                           st.all_greedy)


def test_greedy_verification_reads_no_sampling_tensor():
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    drafts = [[3], [], [7, 1]]  # 2 + 1 + 3 rows
    st = _meta_tensors([0.0] * 6)
    assert st.all_greedy
    verified = verify(logits, [1, 0, 2], torch.tensor([3, 7, 1]), st, torch.Generator())
    assert verified.lists()[1][1] == [int(logits[2].argmax())]


def test_all_greedy_is_the_rows_fact():
    assert not SamplingTensors.build([0.0, 0.7], [-1, -1], [1.0, 1.0], [None, None], 16, torch.device("cpu")).all_greedy
    assert SamplingTensors.build([0.0, 0.0], [-1, 5], [1.0, 0.5], [None, None], 16, torch.device("cpu")).all_greedy


class _NoHostWait(TorchFunctionMode):
    """Fails on what makes a GPU host wait for the device: reading a device value, or indexing
    with a Python list (a blocking upload) or a boolean mask (its count is read back)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__") else ()
        parts = index if isinstance(index, tuple) else (index,)
        if name in ("item", "tolist", "nonzero", "__bool__", "masked_select") or any(
                isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts):
            raise AssertionError(f"{name} would make the host wait for the device")
        return func(*args, **(kwargs or {}))


def test_sampling_verification_never_waits_for_the_device():
    """Rejection sampling, with and without drafts, with and without per-request generators."""
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    for num_drafts, draft_ids in (([1, 0, 2], torch.tensor([3, 7, 1])), ([0] * 6, torch.zeros(0, dtype=torch.long))):
        rows = sum(num_drafts) + len(num_drafts)
        for generators in ([None] * rows, [None, torch.Generator().manual_seed(1)] * (rows // 2)):
            st = SamplingTensors.build([0.8] * rows, [-1] * rows, [1.0] * rows, generators, 16, torch.device("cpu"))
            with _NoHostWait():
                verified = verify(logits[:rows], num_drafts, draft_ids, st, torch.Generator().manual_seed(2))
            assert verified.token_ids.shape == (len(num_drafts), max(num_drafts) + 1)


def test_a_repeated_draft_pattern_reuses_its_layout():
    """DraftLayout's index tensors depend on the draft counts alone: a batch that keeps its pattern
    uploads them once, not every step; another pattern gets its own, and the drafts are read anew."""
    from model_ops.sampling import DraftLayout

    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    first = DraftLayout.of(logits, [1, 0, 2], torch.tensor([3, 7, 1]))
    again = DraftLayout.of(logits, [1, 0, 2], torch.tensor([4, 8, 2]))
    assert again.row_index is first.row_index and again.valid is first.valid and again.draft_index is first.draft_index
    kept = [[d for d, v in zip(ds, vs) if v] for ds, vs in zip(again.drafts.tolist(), again.valid.tolist())]
    assert kept == [[4], [], [8, 2]]  # this call's drafts (entries past a sequence's drafts are masked)
    other = DraftLayout.of(logits, [2, 1, 0], torch.tensor([3, 7, 1]))
    assert other.row_index is not first.row_index and other.row_index.tolist() == [[0, 1, 2], [3, 4, 4], [5, 5, 5]]


def test_a_step_without_drafts_samples_as_the_verification_did():
    """With no draft at all, verify samples plainly: the same tokens as the rejection path it skips, from
    the same generator state, which it leaves where that path left it (no draw for the empty drafts)."""
    from model_ops.sampling import DraftLayout, _rejection_sample

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seeded = torch.Generator().manual_seed(7)
    st = SamplingTensors.build([0.8, 1.0, 1.3], [-1, 10, -1], [1.0, 1.0, 0.9], [None, seeded, None], 50,
                               torch.device("cpu"))
    no_drafts = torch.zeros(0, dtype=torch.int64)
    fast_shared, slow_shared = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    seeded_state = seeded.get_state()
    fast = verify(logits, [0, 0, 0], no_drafts, st, fast_shared)
    fast_seeded = seeded.get_state()
    seeded.set_state(seeded_state)
    emitted, _ = _rejection_sample(logits, DraftLayout.of(logits, [0, 0, 0], no_drafts), st, slow_shared, None)
    assert fast.token_ids[:, 0].tolist() == emitted.tolist() and fast.num_accepted.tolist() == [0, 0, 0]
    assert torch.equal(fast_shared.get_state(), slow_shared.get_state()) and torch.equal(fast_seeded, seeded.get_state())
