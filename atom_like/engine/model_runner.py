"""ModelRunner: builds and loads the model, owns the KV pool, and runs one step.

The KV pool is sized, allocated and bound only through KV-cache builders (the target's, plus
one per draft), so this file has no knowledge of any cache layout or of drafts.
"""
from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from atom_like.config import EngineArgs, text_config
from atom_like.engine.sampler import row_sampling_tensors, token_logprobs
from atom_like.engine.scheduler import ScheduledBatch, SeqStepResult
from atom_like.engine.speculative import build_eagle3_proposer
from atom_like.loader.weights import iter_checkpoint, load_weights
from atom_like.models.base import CausalLM
from atom_like.models.registry import build_model, target_model_class
from model_ops.attention.kv_builder import KVCacheBuilder, PagedKVCacheBuilder
from model_ops.attention.metadata import AttentionMetadata
from spec_decode.proposer import ProposeInputs, Proposer
from spec_decode.rejection import verify

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30  # default CPU pool cap when --num-kv-blocks is not given


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # rows of the step's hidden states that need logits, grouped by sequence
    rows_per_seq: list[int]  # how many of logits_rows each scheduled sequence owns (0 when it does not sample)


ProposerFactory = Callable[["ModelRunner"], Proposer]


class ModelRunner:
    def __init__(self, args: EngineArgs, hf_config: PretrainedConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, proposer_factory: ProposerFactory | None = None):
        """`proposer_factory` replaces the EAGLE3 proposer (tests and benchmarks use an oracle)."""
        self.args, self.device, self.dtype = args, device, dtype
        self.block_size, self.max_model_len = args.block_size, max_model_len
        self.model: CausalLM = build_model(target_model_class(hf_config), text_config(hf_config), dtype, device)
        load_weights(self.model, iter_checkpoint(args.model), self.model.weight_map())
        self.vocab_size = self.model.config.vocab_size

        self.proposer: Proposer | None = None
        if proposer_factory is not None:
            self.proposer = proposer_factory(self)
        elif args.method == "eagle3":
            self.proposer = build_eagle3_proposer(args, self.model, dtype, device)
        self.num_spec_tokens = self.proposer.num_spec_tokens if self.proposer else 0

        self.builders: list[KVCacheBuilder] = [
            PagedKVCacheBuilder(self.model.attention_layers(), args.block_size, dtype, device, role="target")
        ] + (self.proposer.kv_builders() if self.proposer else [])
        # a verify step plus its draft chain reaches 2k slots past the last verified token
        self.max_blocks_per_seq = math.ceil((max_model_len + 2 * self.num_spec_tokens) / args.block_size)
        self.generator = torch.Generator(device=device).manual_seed(args.seed)
        self.num_blocks = self._plan_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                    self.num_blocks * self.block_bytes / 2**20)

    # ------------------------------------------------------------------ KV pool

    @property
    def block_bytes(self) -> int:
        return sum(b.compute_block_bytes() for b in self.builders)

    def _allocate_kv_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for builder in self.builders:
            new = builder.allocate_kv_cache_tensors(num_blocks)
            clash = tensors.keys() & new.keys()
            if clash:
                raise ValueError(f"two KV builders allocate the same key(s) {sorted(clash)}: namespace them")
            tensors.update(new)
        modules = itertools.chain(self.model.modules(), self.proposer.modules_to_bind() if self.proposer else ())
        for module in modules:
            for builder in self.builders:
                if builder.build_kv_cache_tensor(module) is not None:
                    break
        return tensors

    def _plan_num_blocks(self) -> int:
        needed = self.max_blocks_per_seq
        if self.args.num_kv_blocks is not None:
            num_blocks = self.args.num_kv_blocks
        elif self.device.type == "cpu":
            num_blocks = min(self.args.max_num_seqs * needed, max(needed, CPU_KV_CACHE_BYTES // self.block_bytes))
        else:
            num_blocks = self._profile_gpu_blocks()
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * self.block_size} tokens) but one sequence of "
                f"--max-model-len {self.max_model_len} needs {needed}: lower --max-model-len, or raise "
                f"{'--num-kv-blocks' if self.args.num_kv_blocks or self.device.type == 'cpu' else '--gpu-memory-utilization'}"
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_gpu_blocks(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the GPU after weights and the peak
        activations of the largest step (measured by running it on a temporary pool)."""
        num_tokens = min(self.args.max_num_batched_tokens, self.args.max_num_seqs * self.max_model_len)
        num_seqs = min(self.args.max_num_seqs, num_tokens)
        temp_blocks = num_seqs * self.max_blocks_per_seq
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocate_kv_cache(temp_blocks)
        step = self.dummy_step(num_tokens, num_seqs)
        hidden = self.model(step.input_ids, step.positions, step.meta)
        self.model.compute_logits(hidden[:num_seqs]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - temp_blocks * self.block_bytes
        self._allocate_kv_cache(0)  # rebinding every layer to an empty pool frees the temporary one
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.args.gpu_memory_utilization - peak - outside_torch
        logger.info("GPU memory: total %.1f GiB, peak use %.1f GiB, outside torch %.1f GiB, KV budget %.1f GiB",
                    total / 2**30, peak / 2**30, outside_torch / 2**30, budget / 2**30)
        return max(0, int(budget // self.block_bytes))

    def dummy_step(self, num_tokens: int, num_seqs: int) -> StepInputs:
        """A prefill of `num_tokens` random tokens split over `num_seqs` sequences with contiguous blocks."""
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        tables, next_block = [], 0
        for n in lens:
            blocks = math.ceil(n / self.block_size)
            tables.append(list(range(next_block, next_block + blocks)))
            next_block += blocks
        return self.build_inputs(
            tokens=[np.random.randint(0, self.vocab_size, n) for n in lens],
            starts=[0] * num_seqs, tables=tables, logits_rows=[[n - 1] for n in lens],
        )

    # ------------------------------------------------------------------ one step

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        tokens, starts, tables, logits_rows = [], [], [], []
        for item in batch.seqs:
            seq = item.seq
            c, n = seq.num_computed_tokens, item.num_new_tokens
            tokens.append(np.array(seq.token_ids[c:c + n] + item.spec_token_ids, dtype=np.int64))
            starts.append(c)
            tables.append(seq.block_table)
            logits_rows.append(list(range(n - 1, n + len(item.spec_token_ids))) if item.samples else [])
        return self.build_inputs(tokens, starts, tables, logits_rows)

    def build_inputs(self, tokens: list[np.ndarray], starts: list[int], tables: list[list[int]],
                      logits_rows: list[list[int]]) -> StepInputs:
        """Flat step tensors. `logits_rows[b]` are row offsets within sequence b."""
        lens = np.array([len(t) for t in tokens], dtype=np.int64)
        qsl = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        width = max(1, max(len(t) for t in tables))
        block_tables = np.zeros((len(tokens), width), dtype=np.int64)
        positions, slots = [], []
        for b, (start, table) in enumerate(zip(starts, tables)):
            block_tables[b, :len(table)] = table
            pos = np.arange(start, start + lens[b], dtype=np.int64)
            positions.append(pos)
            slots.append(block_tables[b, pos // self.block_size] * self.block_size + pos % self.block_size)
        rows = np.array([qsl[b] + r for b, rs in enumerate(logits_rows) for r in rs], dtype=np.int64)
        context_lens = np.array(starts, dtype=np.int64) + lens

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a).to(device=self.device, dtype=dtype, non_blocking=True)

        meta = AttentionMetadata(
            query_start_loc=dev(qsl, torch.int32),
            context_lens=dev(context_lens, torch.int32),
            block_tables=dev(block_tables, torch.int32),
            slot_mapping=dev(np.concatenate(slots), torch.int64),
            max_query_len=int(lens.max()),
            max_context_len=int(context_lens.max()),
        )
        return StepInputs(dev(np.concatenate(tokens), torch.int64), dev(np.concatenate(positions), torch.int64),
                          meta, dev(rows, torch.int64), [len(r) for r in logits_rows])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SeqStepResult]:
        step = self.prepare(batch)
        hidden = self.model(step.input_ids, step.positions, step.meta)
        results = [SeqStepResult() for _ in batch.seqs]
        sampling = [i for i, n in enumerate(step.rows_per_seq) if n]
        if sampling:
            self._verify(batch, step, hidden, sampling, results)
        if self.proposer is not None:
            self._propose(batch, step, sampling, results)
        return results

    def _verify(self, batch: ScheduledBatch, step: StepInputs, hidden: torch.Tensor, sampling: list[int],
                results: list[SeqStepResult]) -> None:
        """Sample each sampling sequence's next token, verifying its draft tokens first if it has any."""
        logits = self.model.compute_logits(hidden[step.logits_rows])
        items = [batch.seqs[i] for i in sampling]
        rows = [step.rows_per_seq[i] for i in sampling]
        st = row_sampling_tensors([item.seq for item in items], rows, self.vocab_size, logits.device)
        verified = verify(logits, [item.spec_token_ids for item in items], st, self.generator)
        starts = list(itertools.accumulate([0] + rows[:-1]))
        row_of_token = [start + j for start, toks in zip(starts, verified.token_ids) for j in range(len(toks))]
        seq_of_token = [b for b, toks in enumerate(verified.token_ids) for _ in toks]
        flat = torch.tensor([t for toks in verified.token_ids for t in toks], device=logits.device)
        logprobs = token_logprobs(logits[row_of_token], flat, [items[b].seq.params.logprobs for b in seq_of_token])
        n = 0
        for i, item, accepted, toks in zip(sampling, items, verified.num_accepted, verified.token_ids):
            results[i].new_token_ids, results[i].num_accepted = toks, accepted
            if item.seq.params.logprobs is not None:
                results[i].logprobs = logprobs[n:n + len(toks)]
            n += len(toks)

    def _propose(self, batch: ScheduledBatch, step: StepInputs, sampling: list[int],
                 results: list[SeqStepResult]) -> None:
        qsl = step.meta.query_start_loc.tolist()
        last_rows, next_tokens = [], []
        for b, item in enumerate(batch.seqs):
            res = results[b]
            last_rows.append(qsl[b] + item.num_new_tokens - 1 + res.num_accepted)
            if item.samples:
                next_tokens.append(res.new_token_ids[-1])
            else:  # an unfinished prompt: its next chunk starts with this token
                next_tokens.append(item.seq.token_ids[item.seq.num_computed_tokens + item.num_new_tokens])
        proposals = self.proposer.propose(ProposeInputs(
            input_ids=step.input_ids, positions=step.positions, meta=step.meta,
            last_rows=torch.tensor(last_rows, device=self.device),
            next_token_ids=torch.tensor(next_tokens, device=self.device),
            sampling=torch.tensor(sampling, dtype=torch.long, device=self.device),
            request_ids=[batch.seqs[i].seq.request_id for i in sampling],
            num_generated=[batch.seqs[i].seq.num_generated + len(results[i].new_token_ids) for i in sampling],
        )).tolist()
        for i, drafts in zip(sampling, proposals):
            results[i].draft_token_ids = drafts
