"""Decode steps as CUDA/HIP graphs: the target's forward + logits, and the whole draft loop.

A pure decode step (every sequence verifies the same number of drafts v, 0..k, or decodes one
token) has the same shape for a given batch size and v, so it is captured once per batch-size
bucket and query width v + 1 and replayed from static buffers. The draft loop is captured in two
parts: its first pass over the verified rows (per bucket and width, width 1 included: a step after
a k = 0 step verifies nothing and may propose again) and its chain of single-token steps (per bucket
and number of drafts proposed), so a step may verify one k and propose another
(spec_decode/adaptive.py) with (k + 1) + (k + 1) + (k - 1) graphs per bucket, not (k + 1)^2.
A batch smaller than its bucket is padded with rows
that write no KV (slot -1) and whose block tables point at a scratch block the block manager
never hands out, which also absorbs the draft chain's writes for those rows. Every per-step
value lives in device memory; the only host values frozen into a graph are upper bounds
(max_query_len = v + 1, max_context_len = the block-table capacity), which the kernels accept.
The target's aux hidden states are written into the runner-owned buffer inside the graph, so a
replay refreshes them for the draft (ROCm/ATOM#631's graph_aux_hidden idea, without tuple plumbing).

Without a GPU the same static-buffer path "replays" by re-running the function, which keeps
the padding and buffer logic under CPU tests; `--enforce-eager` turns all of this off. Under
tensor parallelism every rank captures the same graphs, with the step's all-reduces and
all-gathers inside them (NCCL / RCCL collectives on the capturing stream).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from atom_like.engine.step_inputs import HostStep, StepBatch, StepInputs
from atom_like.models.base import CausalLM
from model_ops.attention.metadata import AttentionMetadata
from spec_decode.step_costs import StepCosts
from spec_decode.proposer import ChainProposer, DraftState, ProposeInputs, Proposer

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class _Replayable:
    """`fn` captured as a graph on CUDA (after a warm-up run that compiles its kernels), or
    simply re-run elsewhere. Calls return the outputs of the latest replay."""

    def __init__(self, fn: Callable[[], torch.Tensor], device: torch.device, pool):
        self.fn, self.graph, self.out = fn, None, None
        if device.type == "cuda":
            fn()
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = fn()

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


class DecodeGraphs:
    def __init__(self, model: CausalLM, proposer: Proposer | None, device: torch.device, block_size: int,
                 max_batch: int, width: int, scratch_block: int, draft_counts: list[int] | None = None):
        """Captures `model`'s decode step and, when `proposer` is a capturable ChainProposer, its draft first pass
        and chains, for batches up to `max_batch` sequences; `width` is the block-table width,
        `scratch_block` a block id outside the block manager's range; `draft_counts` the k a step
        may verify or propose (default 0..num_spec_tokens): graphs are captured for those only,
        and a step outside them runs eagerly."""
        self.model, self.proposer = model, proposer
        self.k = proposer.num_spec_tokens if proposer else 0  # the most drafts a step verifies or proposes
        self.qmax = self.k + 1
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        self.device = device
        self.context_bound = width * block_size
        self.bound = self.context_bound  # the max_context_len the next run passes; see load
        self.scratch_block = scratch_block
        n, t = self.buckets[-1], self.buckets[-1] * self.qmax
        dev = dict(device=self.device)
        self.input_ids = torch.zeros(t, dtype=torch.int64, **dev)
        self.positions = torch.zeros(t, dtype=torch.int64, **dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, **dev)
        self.query_start_loc = {q: (torch.arange(n + 1, **dev) * q).to(torch.int32) for q in range(1, self.qmax + 1)}
        self.context_lens = torch.full((n,), self.qmax, dtype=torch.int32, **dev)
        self.block_tables = torch.full((n, width), scratch_block, dtype=torch.int32, **dev)
        self.last_rows = torch.zeros(n, dtype=torch.int64, **dev)
        self.next_token_ids = torch.zeros(n, dtype=torch.int64, **dev)
        self.sampling = torch.arange(n, **dev)
        self.rows = torch.arange(t, **dev)  # a decode step's logits rows: every row (read only)
        self.pad_positions = {q: torch.arange(q, **dev).repeat(n) for q in range(1, self.qmax + 1)}
        self.q = self.qmax  # the width of the step loaded last
        counts = sorted(set(range(self.k + 1) if draft_counts is None else draft_counts))
        widths = [k + 1 for k in counts]

        self.captures_draft = isinstance(proposer, ChainProposer) and proposer.capturable
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.target: dict[tuple[int, int], _Replayable] = {}
        self.first_pass: dict[tuple[int, int], _Replayable] = {}
        self.chain: dict[tuple[int, int], _Replayable] = {}
        self.state: DraftState | None = None  # the first pass's outputs, which the chains read
        for bs in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool memory
            for q in reversed(widths):
                self.target[bs, q] = _Replayable(partial(self._target_step, bs, q), self.device, pool)
                # every width, 1 included: a step that verifies nothing (after a k = 0 step) may
                # propose again, and without its first pass the whole step would run eagerly
                if self.captures_draft and counts[-1]:
                    self.first_pass[bs, q] = _Replayable(partial(self._first_pass, bs, q), self.device, pool)
            for k in reversed(counts):
                if self.captures_draft and k > 1:
                    self.chain[bs, k] = _Replayable(partial(self._chain, bs, k), self.device, pool)
        if self.device.type == "cuda":
            logger.info("captured %d decode graphs: batch sizes %s, verify widths %s%s", len(self.target) + len(self.first_pass)
                        + len(self.chain), self.buckets, widths, ", draft first pass and chain" if self.captures_draft else "")

    # ------------------------------------------------------------------ captured functions

    def _meta(self, bs: int, q: int, max_context_len: int | None = None) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc[q][:bs + 1], self.context_lens[:bs], self.block_tables[:bs],
                                 self.slot_mapping[:bs * q], q, max_context_len or self.bound)

    def _target_step(self, bs: int, q: int) -> torch.Tensor:
        model, t = self.model, bs * q
        return model.compute_logits(model(self.input_ids[:t], self.positions[:t], self._meta(bs, q)))

    def _first_pass(self, bs: int, q: int) -> torch.Tensor:
        state = self.proposer.first_pass(self._propose_inputs(bs, q, self._meta(bs, q), 1))
        if self.state is None:  # static buffers for the chains, sized for the largest bucket (captured first)
            self.state = DraftState(state.token_ids.new_zeros(self.buckets[-1]),
                                    state.carry.new_zeros(self.buckets[-1], state.carry.shape[1]),
                                    state.positions.new_zeros(self.buckets[-1]), self.block_tables, self.bound)
        self.state.token_ids[:bs].copy_(state.token_ids)
        self.state.carry[:bs].copy_(state.carry)
        self.state.positions[:bs].copy_(state.positions)
        return self.state.token_ids[:bs, None]

    def _chain(self, bs: int, k: int) -> torch.Tensor:
        s = self.state
        return self.proposer.chain(DraftState(s.token_ids[:bs], s.carry[:bs], s.positions[:bs],
                                                     self.block_tables[:bs], self.bound), k)

    def _propose_inputs(self, bs: int, q: int, meta: AttentionMetadata, num_drafts: int) -> ProposeInputs:
        t = bs * q
        return ProposeInputs(self.input_ids[:t], self.positions[:t], meta, self.last_rows[:bs],
                             self.next_token_ids[:bs], self.sampling[:bs], num_drafts)

    # ------------------------------------------------------------------ replay

    def eligible(self, batch: StepBatch) -> bool:
        if not batch.seqs or len(batch.seqs) > self.buckets[-1]:
            return False
        bs, v, k = self.bucket(len(batch.seqs)), len(batch.seqs[0].spec_token_ids), batch.num_drafts
        if (bs, v + 1) not in self.target or (self.captures_draft and k and ((bs, v + 1) not in self.first_pass
                                                                           or k > 1 and (bs, k) not in self.chain)):
            return False
        # a list, not a generator: a generator costs a Python call per sequence, every step
        return all([s.samples and len(s.token_ids) == 1 and len(s.spec_token_ids) == v for s in batch.seqs])

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def load(self, host: HostStep) -> StepInputs:
        """Put a pure decode step into the static buffers; returns its inputs as views of them
        (which the runner may still change on the device, then `replay_target`)."""
        b, t = len(host.context_lens), host.num_tokens
        bs, q = self.bucket(b), t // b
        self.q = q
        pad_t = slice(t, bs * q)
        self._put(self.input_ids, host.input_ids, fill=0, upto=bs * q)
        self._put(self.positions, host.positions)
        self.positions[pad_t] = self.pad_positions[q][: bs * q - t]
        self._put(self.slot_mapping, host.slot_mapping, fill=-1, upto=bs * q)
        self._put(self.context_lens, host.context_lens, fill=q, upto=bs)
        width = host.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(torch.from_numpy(host.block_tables), non_blocking=True)
        self.block_tables[:b, width:] = self.scratch_block
        self.block_tables[b:bs] = self.scratch_block
        # off the GPU nothing is frozen, so the reference backend may gather only the true context
        if self.device.type != "cuda":
            self.bound = host.max_context_len
        return StepInputs(self.input_ids[:t], self.positions[:t], self._meta(b, q),
                          self.rows[:t], host.rows_per_seq)

    def replay_target(self, num_seqs: int) -> torch.Tensor:
        """Logits of every row of the step `load` put in place ([B * q, vocab])."""
        return self.target[self.bucket(num_seqs), self.q]()[:num_seqs * self.q]

    def replay_draft(self, fill: Callable[..., None], rows: torch.Tensor, num_accepted: torch.Tensor | None,
                     token_ids: torch.Tensor | None, num_drafts: int) -> torch.Tensor:
        """The captured draft's proposals [B, num_drafts >= 1] for the step just replayed: `fill`
        (atom_like.engine.step_inputs.draft_starts or its kernel) writes each sequence's last
        verified row and next token into the buffers, from `rows` [3, B] and the verification."""
        b = rows.shape[1]
        bs = self.bucket(b)
        fill(rows, num_accepted, token_ids, self.last_rows[:bs], self.next_token_ids[:bs], self.q)
        first = self.first_pass[bs, self.q]()
        return (first if num_drafts == 1 else self.chain[bs, num_drafts]())[:b]

    @torch.inference_mode()
    def profile(self, repeats: int = 5) -> StepCosts:
        """Device seconds of a steady-state decode step per bucket and k (verify k, propose k),
        from replays of the captured graphs (CUDA only; the buffers hold padding, so nothing is
        written but the scratch block)."""
        def seconds(graph: _Replayable) -> float:
            graph()  # warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                graph()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / repeats

        self.bound = self.context_bound
        table = []
        for bs in self.buckets:
            row = []
            for k in range(self.k + 1):
                if (bs, k + 1) not in self.target:  # a k the policy never chooses
                    row.append(float("inf"))
                    continue
                t = seconds(self.target[bs, k + 1])
                if k and self.captures_draft:
                    t += seconds(self.first_pass[bs, k + 1]) + (seconds(self.chain[bs, k]) if k > 1 else 0.0)
                row.append(t)
            table.append(row)
        return StepCosts(list(self.buckets), table, f"measured on {torch.cuda.get_device_name(self.device)}")

    def _put(self, buffer: torch.Tensor, values: np.ndarray, fill: int | None = None, upto: int = 0) -> None:
        n = len(values)
        buffer[:n].copy_(torch.from_numpy(values), non_blocking=True)  # one host-to-device copy straight into place
        if fill is not None and upto > n:
            buffer[n:upto] = fill
