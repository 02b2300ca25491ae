"""The sampled verification kernels (kernels_rocm.sampled_verify, under TRITON_INTERPRET=1) through
verify(), against its torch path (the CPU engine's, model_ops.sampling._rejection_sample and
DraftLayout.verified): the same generator seed must give the same tokens and accepted counts."""
from __future__ import annotations

import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from chi_square import P_FLOOR, chi_square_pvalue  # noqa: E402

import model_ops.sampling as sampling  # noqa: E402
from kernels_rocm.sampled_verify import precompile, sampled_verify  # noqa: E402
from model_ops.sampling import SamplingTensors, verify  # noqa: E402

CPU = torch.device("cpu")


def _step(num_drafts: list[int], vocab: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 3.0,
          likely: float = 0.5):
    """Random logits (scaled so that drafts are accepted and rejected alike) and drafts, a share
    `likely` of them the row's most likely token (so that long accepted runs occur too)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(sum(num_drafts) + len(num_drafts), vocab, generator=g) * scale).to(dtype)
    drafts, r = [], 0
    for n in num_drafts:
        ids = torch.randint(0, vocab, (n,), generator=g)
        likely = logits[r:r + n].argmax(dim=-1)
        drafts.append(torch.where(torch.rand(n, generator=g) < likely, likely, ids))
        r += n + 1
    return logits, torch.cat(drafts)


def _tensors(rows: int, vocab: int, temperature: float | list[float] = 1.0, top_p: float = 1.0,
             generators: list | None = None) -> SamplingTensors:
    temps = temperature if isinstance(temperature, list) else [temperature] * rows
    return SamplingTensors.build(temps, [-1] * rows, [top_p] * rows, generators or [None] * rows, vocab, CPU)


def _count_kernel_calls(monkeypatch) -> list:
    """Puts the kernel into verify() on the CPU (there it has none); the list counts its calls."""
    calls = []

    def counted(*args):
        calls.append(1)
        return sampled_verify(*args)

    monkeypatch.setattr(sampling, "_sampled_kernel", lambda device: counted)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    return _count_kernel_calls(monkeypatch)


def _both_paths(monkeypatch, logits, num_drafts, draft_ids, st, seed: int, **kwargs):
    """(torch path, kernel path, kernel calls) from the same generator seed."""
    torch_path = verify(logits, num_drafts, draft_ids, st, torch.Generator().manual_seed(seed), **kwargs)
    calls = _count_kernel_calls(monkeypatch)
    kernel_path = verify(logits, num_drafts, draft_ids, st, torch.Generator().manual_seed(seed), **kwargs)
    monkeypatch.undo()
    return torch_path, kernel_path, len(calls)


@pytest.mark.parametrize("num_drafts, vocab", [([1], 1000), ([3, 0, 2], 4099), ([8, 1, 0, 7, 3], 1000),
                                               ([5, 5, 5, 5], 1027), ([2] * 17, 1000), ([0, 0, 6], 4099)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_gives_the_torch_paths_tokens(monkeypatch, num_drafts, vocab, seed):
    logits, draft_ids = _step(num_drafts, vocab, seed)
    temps = [0.7 + 0.1 * (i % 5) for i in range(len(logits))]  # per-row temperatures
    st = _tensors(len(logits), vocab, temps)
    ref, got, calls = _both_paths(monkeypatch, logits, num_drafts, draft_ids, st, seed)
    assert calls == 1
    assert torch.equal(got.token_ids, ref.token_ids) and torch.equal(got.num_accepted, ref.num_accepted)
    assert got.lists() == ref.lists()


@pytest.mark.parametrize("num_drafts", [[1], [3, 0, 2]])
def test_rows_split_into_many_chunks(monkeypatch, num_drafts):
    """Few rows split the vocabulary into up to MAX_CHUNKS chunks (here 16-entry blocks, so that the
    1,000-entry rows take 63 and 32 chunks, the merge's padding included)."""
    import kernels_rocm.sampled_verify as sv

    monkeypatch.setattr(sv, "BLOCK_V", 16)
    logits, draft_ids = _step(num_drafts, 1000, 4)
    st = _tensors(len(logits), 1000)
    ref, got, calls = _both_paths(monkeypatch, logits, num_drafts, draft_ids, st, 4)
    assert calls == 1 and torch.equal(got.token_ids, ref.token_ids)
    assert torch.equal(got.num_accepted, ref.num_accepted)


def test_bf16_logits_and_every_accepted_count(monkeypatch):
    """bf16 logits (upcast to fp32 in both paths); over seeds, every accepted count 0..K occurs."""
    num_drafts = [4] * 6
    seen = set()
    for seed in range(4):
        logits, draft_ids = _step(num_drafts, 777, seed, dtype=torch.bfloat16, scale=6.0, likely=0.9)
        st = _tensors(len(logits), 777)
        ref, got, calls = _both_paths(monkeypatch, logits, num_drafts, draft_ids, st, seed)
        assert calls == 1 and torch.equal(got.token_ids, ref.token_ids)
        assert torch.equal(got.num_accepted, ref.num_accepted)
        seen |= set(got.num_accepted.tolist())
    assert seen == set(range(5))


def test_a_certain_draft_is_accepted(monkeypatch):
    """p(d) == 1 in fp32 (the residual max(p - q, 0) is empty): the draft is always accepted; a
    -inf logit (a masked token) is a zero of p."""
    vocab, num_drafts = 300, [2, 1]
    logits, _ = _step(num_drafts, vocab, 3)
    draft_ids = torch.tensor([5, 7, 11])
    for row, token in ((0, 5), (1, 7), (3, 11)):
        logits[row, token] = 200.0
    logits[0, 9] = float("-inf")
    st = _tensors(len(logits), vocab)
    ref, got, calls = _both_paths(monkeypatch, logits, num_drafts, draft_ids, st, 0)
    assert calls == 1 and torch.equal(got.token_ids, ref.token_ids)
    assert got.num_accepted.tolist() == ref.num_accepted.tolist() == [2, 1]


def test_the_emitted_token_of_an_empty_residual_is_the_draft():
    """The kernel's row directly: p(d) == 1 and a uniform of 1 (never drawn, as rand is [0, 1),
    so the draft is rejected): the residual is empty and the row emits from p itself, i.e. d."""
    logits = torch.full((2, 50), -100.0)
    logits[0, 4] = 100.0
    layout = sampling.DraftLayout.of(logits, [1], torch.tensor([4]))
    tokens, accepted = sampled_verify(logits, torch.ones(2), torch.ones(1), torch.ones(2, 50), torch.tensor([4]),
                                      layout.row_index, layout.draft_index, layout.valid)
    assert tokens.tolist() == [[4, -1]] and accepted.tolist() == [0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_rows_beside_sampled_ones(monkeypatch, seed):
    """A greedy request's rows (temperature 0) in a sampled step: its p is the one-hot of its argmax,
    so its drafts are accepted while they are the argmax and it emits the argmax, on both paths. Two
    rows hold ties of the maximum (torch.argmax takes the first): one with the draft the later of the
    two (rejected), one the earlier (accepted)."""
    num_drafts, vocab = [3, 2, 4, 1], 1000
    logits, draft_ids = _step(num_drafts, vocab, seed, scale=2.0, likely=0.7)
    temps = [0.0 if r < 4 or 7 <= r < 12 else 0.8 for r in range(len(logits))]  # sequences 0 and 2 greedy
    logits[0, 10] = logits[0, 20] = 50.0
    logits[7, 30] = logits[7, 40] = 50.0
    draft_ids[0], draft_ids[5] = 20, 30  # sequence 0's first draft the later tie, sequence 2's the earlier
    st = _tensors(len(logits), vocab, temps)
    ref, got, calls = _both_paths(monkeypatch, logits, num_drafts, draft_ids, st, seed)
    assert calls == 1
    assert torch.equal(got.token_ids, ref.token_ids) and torch.equal(got.num_accepted, ref.num_accepted)
    assert got.token_ids[0, 0] == 10 and got.num_accepted[0] == 0 and got.num_accepted[2] >= 1


@pytest.mark.parametrize("case", ["top_p", "top_k", "seeded", "draft_probs"])
def test_other_steps_keep_the_torch_path(kernel_calls, case):
    num_drafts, vocab = [2, 3], 64
    logits, draft_ids = _step(num_drafts, vocab, 0)
    rows = len(logits)
    kwargs = {}
    if case == "top_p":
        st = _tensors(rows, vocab, top_p=0.9)
    elif case == "top_k":
        st = SamplingTensors.build([1.0] * rows, [10] * rows, [1.0] * rows, [None] * rows, vocab, CPU)
    elif case == "seeded":
        st = _tensors(rows, vocab, generators=[torch.Generator().manual_seed(1)] * 3 + [None] * (rows - 3))
    else:
        st = _tensors(rows, vocab)
        kwargs["draft_probs"] = torch.softmax(torch.randn(len(draft_ids), vocab), -1)
    verify(logits, num_drafts, draft_ids, st, torch.Generator().manual_seed(0), **kwargs)
    assert not kernel_calls


def test_rejection_sampling_keeps_the_target_distribution(kernel_calls):
    """One sequence's two drafts, repeated over 1,000 sequences (3,000 rows) in one launch, at vocab 5:
    the token a sequence emits first (its accepted first draft, or the residual's draw) is distributed
    as p (what rejection sampling guarantees). Chi-square in float64, p >= chi_square.P_FLOOR. (The
    interpreter runs ~4 ms a program: more rows would make this the file's slowest test by far.)"""
    vocab, n = 5, 1000
    target = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.2])
    logits = target.expand(3 * n, vocab).contiguous()
    draft_ids = torch.tensor([0, 3]).repeat(n)  # a draft the target finds unlikely-ish, then its favourite
    st = _tensors(3 * n, vocab, 0.8)
    verified = verify(logits, [2] * n, draft_ids, st, torch.Generator().manual_seed(11))
    assert kernel_calls == [1]
    accepted = verified.num_accepted.float().mean().item()
    assert 0.1 < accepted < 1.5  # both branches taken often
    counts = np.bincount(verified.token_ids[:, 0].numpy(), minlength=vocab)
    expected = torch.softmax(target / 0.8, -1).double().numpy()
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue >= P_FLOOR, f"chi-square p={pvalue:.2e}"


def test_refuses_mismatched_noise():
    logits, draft_ids = _step([2], 40, 0)
    layout = sampling.DraftLayout.of(logits, [2], draft_ids)
    with pytest.raises(ValueError, match="noise"):
        sampled_verify(logits, torch.ones(3), torch.rand(2), torch.ones(3, 39), draft_ids, layout.row_index,
                       layout.draft_index, layout.valid)


def test_precompile_launches():
    precompile(CPU, 3, (torch.float32, torch.bfloat16))


class _Launches:
    """Stands in for a kernel: counts its launches and runs nothing (for counting host work)."""

    def __init__(self, counter: collections.Counter):
        self.counter = counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter["launches"] += 1
        return launch


class _Ops(TorchDispatchMode):
    """Non-view torch ops dispatched (ci/profile_host.py's OpCount convention): on a GPU each is about
    one launch or copy, host time that a host-bound step pays."""

    def __init__(self, counter: collections.Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _VIEWS:
            self.counter["ops"] += 1
        return func(*args, **(kwargs or {}))


_VIEWS = {"slice", "view", "select", "as_strided", "unsqueeze", "squeeze", "expand", "alias", "t", "transpose",
          "permute", "_unsafe_view", "detach", "unbind", "split", "narrow", "_reshape_alias", "lift_fresh"}


@pytest.mark.parametrize("num_drafts", [[1], [5] * 8])
def test_the_kernel_path_dispatches_a_few_ops(monkeypatch, num_drafts):
    """The host work verify() leaves on a GPU at temperature 1: torch ops plus kernel launches, the
    torch path against the kernel path (its launches stubbed). The layout's cached, so warmed first."""
    import kernels_rocm.sampled_verify as sv

    logits, draft_ids = _step(num_drafts, 1000, 0)
    st = _tensors(len(logits), 1000)
    verify(logits, num_drafts, draft_ids, st, torch.Generator().manual_seed(0))  # the layout cache
    counts = {}
    for path in ("torch", "kernel"):
        counter = collections.Counter()
        if path == "kernel":
            monkeypatch.setattr(sampling, "_sampled_kernel", lambda device: sampled_verify)
            monkeypatch.setattr(sv, "_chunk_stats_kernel", _Launches(counter))
            monkeypatch.setattr(sv, "_sampled_tokens_kernel", _Launches(counter))
        with _Ops(counter):
            verify(logits, num_drafts, draft_ids, st, torch.Generator().manual_seed(0))
        counts[path] = counter["ops"] + counter["launches"]
    print(f"num_drafts {num_drafts}: {counts}")
    assert counts["kernel"] <= 12 < 30 <= counts["torch"], counts
