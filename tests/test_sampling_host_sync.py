"""The greedy path learns "every row is greedy" on the host: on a GPU, reading it back from the
device (bool(tensor)) is a stream synchronization every step. Sampling tensors on the meta device
stand in for device memory the host must not read: any read raises."""
from __future__ import annotations

import torch

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
