"""Decode steps as CUDA/HIP graphs: the target's forward + logits, and the whole draft loop.

A pure decode step (every sequence verifies k drafts, or decodes one token without
speculation) has the same shape for a given batch size, so it is captured once per batch-size
bucket and replayed from static buffers. A batch smaller than its bucket is padded with rows
that write no KV (slot -1) and whose block tables point at a scratch block the block manager
never hands out, which also absorbs the draft chain's writes for those rows. Every per-step
value lives in device memory; the only host values frozen into a graph are upper bounds
(max_query_len = k + 1, max_context_len = the block-table capacity), which the kernels accept.
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
from spec_decode.proposer import ProposeInputs, Proposer

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
                 max_batch: int, width: int, scratch_block: int):
        """Captures `model`'s decode step and, when `proposer` is capturable, its draft loop, for
        batches up to `max_batch` sequences; `width` is the block-table width, `scratch_block` a
        block id outside the block manager's range."""
        self.model, self.proposer = model, proposer
        self.q = (proposer.num_spec_tokens if proposer else 0) + 1
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        self.device = device
        self.bound = width * block_size  # the max_context_len the next run passes; see load
        self.scratch_block = scratch_block
        n, t = self.buckets[-1], self.buckets[-1] * self.q
        dev = dict(device=self.device)
        self.input_ids = torch.zeros(t, dtype=torch.int64, **dev)
        self.positions = torch.zeros(t, dtype=torch.int64, **dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, **dev)
        self.query_start_loc = (torch.arange(n + 1, **dev) * self.q).to(torch.int32)
        self.context_lens = torch.full((n,), self.q, dtype=torch.int32, **dev)
        self.block_tables = torch.full((n, width), scratch_block, dtype=torch.int32, **dev)
        self.last_rows = torch.arange(n, **dev) * self.q
        self.next_token_ids = torch.zeros(n, dtype=torch.int64, **dev)
        self.sampling = torch.arange(n, **dev)
        self.pad_positions = torch.arange(self.q, **dev).repeat(n)

        self.captures_draft = proposer is not None and proposer.capturable
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.target: dict[int, _Replayable] = {}
        self.draft: dict[int, _Replayable] = {}
        for bs in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool memory
            self.target[bs] = _Replayable(partial(self._target_step, bs), self.device, pool)
            if self.captures_draft:
                self.draft[bs] = _Replayable(partial(self._draft_loop, bs), self.device, pool)
        if self.device.type == "cuda":
            logger.info("captured decode graphs for batch sizes %s (%d tokens per sequence%s)", self.buckets,
                        self.q, ", draft loop included" if self.captures_draft else "")

    # ------------------------------------------------------------------ captured functions

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc[:bs + 1], self.context_lens[:bs], self.block_tables[:bs],
                                 self.slot_mapping[:bs * self.q], self.q, self.bound)

    def _target_step(self, bs: int) -> torch.Tensor:
        t = bs * self.q
        return self.model.compute_logits(self.model(self.input_ids[:t], self.positions[:t], self._meta(bs)))

    def _draft_loop(self, bs: int) -> torch.Tensor:
        t = bs * self.q
        return self.proposer.propose(ProposeInputs(self.input_ids[:t], self.positions[:t], self._meta(bs),
                                                   self.last_rows[:bs], self.next_token_ids[:bs], self.sampling[:bs]))

    # ------------------------------------------------------------------ replay

    def eligible(self, batch: StepBatch) -> bool:
        k = self.q - 1
        return (len(batch.seqs) <= self.buckets[-1]
                and all(s.samples and len(s.token_ids) == 1 and len(s.spec_token_ids) == k for s in batch.seqs))

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def load(self, host: HostStep) -> StepInputs:
        """Put a pure decode step into the static buffers; returns its inputs as views of them
        (which the runner may still change on the device, then `replay_target`)."""
        b, t = len(host.context_lens), host.num_tokens
        bs = self.bucket(b)
        pad_t = slice(t, bs * self.q)
        self._put(self.input_ids, host.input_ids, fill=0, upto=bs * self.q)
        self._put(self.positions, host.positions)
        self.positions[pad_t] = self.pad_positions[: bs * self.q - t]
        self._put(self.slot_mapping, host.slot_mapping, fill=-1, upto=bs * self.q)
        self._put(self.context_lens, host.context_lens, fill=self.q, upto=bs)
        width = host.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(torch.from_numpy(host.block_tables).to(self.device, non_blocking=True))
        self.block_tables[:b, width:] = self.scratch_block
        self.block_tables[b:bs] = self.scratch_block
        # off the GPU nothing is frozen, so the reference backend may gather only the true context
        if self.device.type != "cuda":
            self.bound = host.max_context_len
        return StepInputs(self.input_ids[:t], self.positions[:t], self._meta(b),
                          torch.arange(t, device=self.device), host.rows_per_seq)

    def replay_target(self, num_seqs: int) -> torch.Tensor:
        """Logits of every row of the step `load` put in place ([B * q, vocab])."""
        return self.target[self.bucket(num_seqs)]()[:num_seqs * self.q]

    def replay_draft(self, inputs: ProposeInputs) -> torch.Tensor:
        """The captured draft loop's proposals for the step just replayed: `inputs` are that step's
        (views of the buffers `load` filled), with each sequence's last verified row and next token."""
        b = inputs.last_rows.shape[0]
        bs = self.bucket(b)
        self.last_rows[:b].copy_(inputs.last_rows)
        self.last_rows[b:bs] = torch.arange(b, bs, device=self.device) * self.q
        self.next_token_ids[:b].copy_(inputs.next_token_ids)
        self.next_token_ids[b:bs] = 0
        return self.draft[bs]()[:b]

    def _put(self, buffer: torch.Tensor, values: np.ndarray, fill: int | None = None, upto: int = 0) -> None:
        n = len(values)
        buffer[:n].copy_(torch.from_numpy(values).to(self.device, non_blocking=True))
        if fill is not None and upto > n:
            buffer[n:upto] = fill
