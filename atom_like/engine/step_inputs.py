"""One step's inputs. The scheduler's batch becomes a StepBatch (host values only: what the
runner needs of each sequence, so it pickles small for tensor-parallel workers), then flat
arrays on the host, then device tensors: fresh ones (eager) or a decode graph's static buffers
(see cuda_graph.py)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from atom_like.engine.scheduler import ScheduledBatch
from atom_like.engine.sequence import Sequence
from atom_like.sampling_params import SamplingParams
from model_ops.attention.metadata import AttentionMetadata, slots_for_positions
from model_ops.sampling import segment_ranks


@dataclass
class SeqStep:
    """One scheduled sequence as the runner sees it. Lists a processor or prompt logprobs need
    are sent only while a request asks for them, so a plain request's step stays a few ids."""
    request_id: str
    token_ids: list[int]  # the known tokens computed this step (a prompt chunk, or the last sampled token)
    spec_token_ids: list[int]  # draft tokens verified after them
    start: int  # position of token_ids[0]: the tokens already in the KV cache (a prefix-cache hit included)
    block_table: list[int]
    samples: bool  # the step ends at the sequence's last known token, so it yields a new token
    next_token_id: int | None  # a prompt chunk that does not sample: the prompt token after it (the draft's input)
    params: SamplingParams
    num_generated: int  # tokens generated before this step
    num_prompt_tokens: int
    num_prompt_logprobs: int = 0  # prompt positions already scored (params.prompt_logprobs): not scored again
    stop_ids: list[int] = field(default_factory=list)  # what min_tokens holds back, while it does
    prompt_ids: list[int] = field(default_factory=list)  # the prompt, for the repetition penalty
    output_ids: list[int] = field(default_factory=list)  # the generated tokens, for the penalties
    # Overlapped scheduling: the sequence continues from the previous step, whose results the host
    # has not read yet. Its token and drafts are that step's outputs, still on the device:
    # token_ids / spec_token_ids hold placeholders (-1), `start` and num_generated assume none of
    # that step's `shift_bound` drafts was accepted, and the runner shifts by the accepted count.
    follows: bool = False
    shift_bound: int = 0

    @classmethod
    def of(cls, seq: Sequence, start: int, num_new_tokens: int, spec_token_ids: list[int], samples: bool,
           shift_bound: int | None) -> "SeqStep":
        """`shift_bound` None: the host knows every token; else the step follows one in flight."""
        c, p, generated = start, seq.params, len(seq.token_ids) - seq.num_prompt_tokens  # num_generated, without a call
        end = c + num_new_tokens
        follows = shift_bound is not None
        return cls(seq.request_id, [-1] * num_new_tokens if follows else seq.token_ids[c:end], spec_token_ids, c,
                   seq.block_table, samples, None if samples else seq.token_ids[end], p, generated,
                   seq.num_prompt_tokens,
                   num_prompt_logprobs=len(seq.prompt_logprobs) if seq.prompt_logprobs else 0,
                   stop_ids=seq.stop_ids if generated < p.min_tokens else [],
                   prompt_ids=seq.token_ids[:seq.num_prompt_tokens] if p.repetition_penalty != 1.0 else [],
                   # reads_history (a plain attribute) first: has_penalties is a property call a sequence
                   output_ids=seq.generated_ids if seq.reads_history and p.has_penalties else [],
                   follows=follows, shift_bound=shift_bound or 0)


@dataclass
class StepBatch:
    """What every rank needs of one step: host values only, so it pickles small for the
    tensor-parallel workers (at -tp 1 the in-process ModelRunner takes the same object)."""
    seqs: list[SeqStep]
    # requests finished since the previous step: the runner drops their state (seeded generators)
    finished_request_ids: list[str] = field(default_factory=list)
    num_drafts: int = 0  # k: drafts the step proposes per sampling sequence, for the next step to verify

    @classmethod
    def from_scheduled(cls, batch: ScheduledBatch, finished_request_ids: list[str], num_drafts: int = 0) -> "StepBatch":
        # the block tables are the sequences' own lists (no copies): the runner reads them before
        # the scheduler moves on, and pickling copies them for workers
        return cls([SeqStep.of(item.seq, item.start, item.num_new_tokens, item.spec_token_ids, item.samples,
                                item.shift_bound) for item in batch.seqs], list(finished_request_ids), num_drafts)


@dataclass
class HostStep:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int64
    context_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, width] int64
    logits_rows: np.ndarray  # rows that need logits, grouped by sequence
    rows_per_seq: list[int]  # logits rows per sequence (0 when it does not sample)
    max_context_len: int  # an upper bound: context_lens of steps that follow one in flight grow on the device

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    rows_per_seq: list[int]


def host_step(tokens: list[np.ndarray], starts: list[int], tables: list[list[int]], logits_rows: list[list[int]],
              block_size: int, shifts: list[int] | None = None) -> HostStep:
    """Sequence b computes `tokens[b]` at positions starts[b]..; `logits_rows[b]` are offsets within
    it; `shifts[b]` bounds how far the device may still move it (see SeqStep.follows)."""
    lens = np.fromiter(map(len, tokens), np.int64, len(tokens))
    qsl = _query_start_loc(lens)
    rows = np.array([qsl[b] + r for b, rs in enumerate(logits_rows) for r in rs], dtype=np.int64)
    return _assemble(np.concatenate(tokens).astype(np.int64), lens, qsl, np.array(starts, dtype=np.int64), tables,
                     rows, [len(r) for r in logits_rows], np.array(shifts or 0, dtype=np.int64), block_size)


def batch_host_step(batch: StepBatch, block_size: int) -> HostStep:
    """host_step for a StepBatch, in bulk: numpy over the batch rather than calls per sequence (the
    host's time per decode step is what bounds small models at large batches)."""
    seqs = batch.seqs
    ids = [s.token_ids + s.spec_token_ids for s in seqs]
    lens = np.fromiter(map(len, ids), np.int64, len(seqs))
    qsl = _query_start_loc(lens)
    # a sampling sequence's logits rows: its last known token and its drafts, the last rows it computes
    per_seq = np.fromiter(map(len, [s.spec_token_ids for s in seqs]), np.int64, len(seqs)) + 1
    per_seq *= np.fromiter([s.samples for s in seqs], np.bool_, len(seqs))
    rows = np.repeat(qsl[1:] - per_seq, per_seq) + segment_ranks(per_seq)
    return _assemble(np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(qsl[-1])), lens, qsl,
                     np.array([s.start for s in seqs], dtype=np.int64), [s.block_table for s in seqs], rows,
                     per_seq.tolist(), np.array([s.shift_bound for s in seqs], dtype=np.int64), block_size)


def _query_start_loc(lens: np.ndarray) -> np.ndarray:
    qsl = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    return qsl


def _assemble(input_ids: np.ndarray, lens: np.ndarray, qsl: np.ndarray, starts: np.ndarray, tables: list[list[int]],
              rows: np.ndarray, rows_per_seq: list[int], shifts: np.ndarray, block_size: int) -> HostStep:
    table_lens = np.fromiter(map(len, tables), np.int64, len(tables))
    block_tables = np.zeros((len(tables), max(1, int(table_lens.max()))), dtype=np.int64)
    block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), np.int64, int(table_lens.sum()))
    positions = np.repeat(starts, lens) + segment_ranks(lens)
    slots = block_tables[np.repeat(np.arange(len(lens)), lens), positions // block_size] * block_size + positions % block_size
    context_lens = starts + lens
    return HostStep(input_ids, positions, slots, qsl, context_lens, block_tables, rows, rows_per_seq,
                    int((context_lens + shifts).max()))


def upload(step: HostStep, device: torch.device) -> StepInputs:
    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    meta = AttentionMetadata(
        query_start_loc=dev(step.query_start_loc, torch.int32),
        context_lens=dev(step.context_lens, torch.int32),
        block_tables=dev(step.block_tables, torch.int32),
        slot_mapping=dev(step.slot_mapping, torch.int64),
        max_query_len=step.max_query_len,
        max_context_len=step.max_context_len,
    )
    return StepInputs(dev(step.input_ids, torch.int64), dev(step.positions, torch.int64), meta,
                      dev(step.logits_rows, torch.int64), step.rows_per_seq)


def advance_followers(index: torch.Tensor, num_accepted: torch.Tensor, token_ids: torch.Tensor,
                      drafts: torch.Tensor | None, input_ids: torch.Tensor, positions: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor,
                      block_size: int) -> None:
    """Give the sequences that follow the previous step what it sampled, in place (torch ops; on a
    GPU the runner takes kernels_rocm.step_advance.advance, one kernel). index [3, F] int64: for
    each following sequence, its row in the previous step's outputs, its batch row in this step
    and its first input column. num_accepted [S], token_ids [S, K + 1] (accepted drafts then the
    emitted token), drafts [S, k] or None: the previous step's outputs. The rest are this step's
    inputs (input_ids, positions, slot_mapping [T]; context_lens [B] int32; block_tables [B, W])."""
    src, seqs, starts = index
    accepted = num_accepted[src]
    first = token_ids[src].gather(1, accepted[:, None])
    q = 1 + (drafts.shape[1] if drafts is not None else 0)
    ids = torch.cat([first, drafts[src]], dim=1) if q > 1 else first
    cols = starts[:, None] + torch.arange(q, device=starts.device)
    input_ids[cols] = ids
    moved = positions[cols] + accepted[:, None]
    positions[cols] = moved
    context_lens[seqs] += accepted.to(context_lens.dtype)
    tables = block_tables[seqs].repeat_interleave(q, dim=0)
    slot_mapping[cols] = slots_for_positions(tables, moved.reshape(-1), block_size).view(-1, q)


def draft_starts(rows: torch.Tensor, num_accepted: torch.Tensor | None, token_ids: torch.Tensor | None,
                 last_rows: torch.Tensor, next_tokens: torch.Tensor, pad_stride: int) -> None:
    """The draft's first inputs, in place (torch ops; on a GPU the runner takes
    kernels_rocm.step_advance.draft_starts, one kernel): each sequence's last verified row and the
    token after it. rows [3, B] int64, per sequence: its last row before this step's verification,
    its row in the verification's outputs (-1: it samples nothing) and, for one that samples
    nothing, the token after it. num_accepted [S], token_ids [S, K + 1]: the verification (None:
    none). last_rows / next_tokens [N >= B] int64: rows B.. (graph padding) get b * pad_stride and 0."""
    base, src, host_next = rows
    b, n = rows.shape[1], last_rows.shape[0]
    last_rows[:b], next_tokens[:b] = base, host_next
    if num_accepted is not None and num_accepted.numel():
        sampling = src >= 0
        s = src.clamp(min=0)
        accepted = torch.where(sampling, num_accepted[s], 0)
        last_rows[:b] += accepted
        next_tokens[:b] = torch.where(sampling, token_ids[s, accepted], host_next)
    last_rows[b:] = torch.arange(b, n, device=last_rows.device) * pad_stride
    next_tokens[b:] = 0
