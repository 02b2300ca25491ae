"""ModelRunner: builds and loads the model, owns the KV pool, and runs one step.

The KV pool is sized, allocated and bound only through KV-cache builders (the target's, plus
the proposer's), so this file knows no cache layout. Speculation is not hidden from it: it
builds the proposer, verifies draft tokens before sampling and runs the draft after the
target. One extra block beyond those the block manager hands out serves as scratch for padded
graph rows.

Under tensor parallelism one ModelRunner runs in each rank's process (engine/tp_executor.py)
on the same StepBatch: the model's collectives give every rank identical logits, the batch
carries everything the logits processors read, and the runner owns every RNG sampling draws
from (the shared one seeded with --seed, one per seeded request), so every rank samples,
verifies and proposes the same tokens.
"""
from __future__ import annotations

import functools
import gc
import itertools
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from transformers import PretrainedConfig

from atom_like.config import EngineArgs, resolve_kv_cache_dtype, text_config
from atom_like.engine.cuda_graph import BUCKETS, DecodeGraphs
from atom_like.engine.sampler import DeviceLogprobs, Sampled, Sampler, token_logprobs
from atom_like.engine.scheduler import SeqStepResult
from atom_like.engine.speculative import build_eagle3_proposer
from atom_like.engine.step_inputs import (HostStep, StepBatch, StepInputs, advance_followers, batch_host_step,
                                         draft_starts, host_step, upload)
from atom_like.loader.dummy import init_dummy_weights
from atom_like.loader.kv_scales import read_kv_scales
from atom_like.loader.quark import checkpoint_quantizer
from atom_like.loader.weights import iter_checkpoint, load_weights
from atom_like.models.base import CausalLM
from atom_like.models.registry import build_model, target_model_class
from model_ops import tp
from model_ops.attention.kv_builder import KVCacheBuilder, PagedKVCacheBuilder
from model_ops.quant.fp8 import FP8_KV_DTYPES
from model_ops.sampling import segment_ranks
from spec_decode.step_costs import StepCosts
from spec_decode.proposer import ProposeInputs, Proposer

logger = logging.getLogger(__name__)

# Default CPU pool when --num-kv-blocks is not given: max_num_seqs sequences of max_model_len,
# capped at the size of the target's weights clamped to [64 MiB, 2 GiB]. CPU memory is not
# profiled as GPU memory is, and a CPU runs few sequences at a time: a pool the size of the
# model keeps a small model's cache small and a large one's within reach of its RAM.
CPU_KV_CACHE_MIN_BYTES, CPU_KV_CACHE_MAX_BYTES = 64 << 20, 2 << 30

ProposerFactory = Callable[["ModelRunner"], Proposer]


@functools.cache
def _step_kernels() -> ModuleType:
    """kernels_rocm.step_advance: advance_followers and draft_starts in one kernel each (triton is
    installed wherever torch has CUDA or ROCm)."""
    from kernels_rocm import step_advance

    return step_advance


@dataclass
class _LastOutputs:
    """A step's sampled tokens and drafts on the device, by request: the inputs of the step after it."""
    row_of: dict[str, int]  # request id -> row of the tensors below
    token_ids: torch.Tensor  # [S, K + 1] accepted drafts, the emitted token, -1 padding
    num_accepted: torch.Tensor  # [S]
    drafts: torch.Tensor | None  # [S, k]


@dataclass
class _InFlight:
    """A launched step: what `collect` reads back once the device is done with it."""
    batch: StepBatch
    sampling: list[int]  # indices into batch.seqs of the sequences that sampled
    width: int  # K + 1: the token columns of `packed`
    packed: torch.Tensor  # host [S, K + 2 + k]: token_ids, num_accepted, drafts (one copy, not yet waited for)
    done: torch.cuda.Event | None  # recorded after the copy (None off CUDA: the copy is already done)
    logprobs: DeviceLogprobs | None
    prompt_logprobs: tuple[DeviceLogprobs, list[tuple[int, int]]] | None  # scores, (sequence, count) owners


class ModelRunner:
    failure: str | None = None  # StepExecutor: an in-process runner never becomes unusable

    def __init__(self, args: EngineArgs, hf_config: PretrainedConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, proposer_factory: ProposerFactory | None = None):
        """`proposer_factory` replaces the EAGLE3 proposer (see LLMEngine)."""
        self.args, self.device, self.dtype = args, device, dtype
        self.block_size, self.max_model_len = args.block_size, max_model_len
        if device.type == "cuda":
            gc.collect()  # engines dropped by the caller die in reference cycles: free them before measuring
            torch.cuda.empty_cache()
        # GPU memory other live objects of this process hold (another engine, a reference model)
        self.baseline_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        quantize = checkpoint_quantizer(hf_config, args.mxfp4_activations, args.moe_backend,
                                        args.fuse_shared_experts)
        self.model: CausalLM = build_model(target_model_class(hf_config), text_config(hf_config), dtype, device,
                                           quantize=quantize)
        weight_map = self.model.weight_map()
        if args.load_format == "dummy":
            init_dummy_weights(self.model, args.seed)
        else:
            load_weights(self.model, iter_checkpoint(args.model), weight_map)
        self.vocab_size = self.model.config.vocab_size

        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device)
        self.proposer: Proposer | None = None
        if proposer_factory is not None:
            self.proposer = proposer_factory(self)
        elif args.method == "eagle3":
            self.proposer = build_eagle3_proposer(args, self.model, dtype, device, self.kv_cache_dtype)
        self.num_spec_tokens = self.proposer.num_spec_tokens if self.proposer else 0

        layers = self.model.attention_layers()
        kv_scales = (read_kv_scales(args.model, self.model, layers, weight_map, "target")
                     if self.kv_cache_dtype in FP8_KV_DTYPES and args.load_format != "dummy" else None)
        self.builders: list[KVCacheBuilder] = [
            PagedKVCacheBuilder(layers, args.block_size, self.kv_cache_dtype, device, role="target",
                                backend=args.attention_backend, kv_scales=kv_scales)
        ] + (self.proposer.kv_builders() if self.proposer else [])
        # a verify step plus its draft chain reaches 2k slots past the last verified token
        self.max_blocks_per_seq = math.ceil((max_model_len + 2 * self.num_spec_tokens) / args.block_size)
        self.sampler = Sampler(self.vocab_size, device, args.seed)
        self._in_flight: deque[_InFlight] = deque()  # launched, not collected (oldest first)
        self._last: _LastOutputs | None = None  # the latest launched step's outputs, for steps that follow it
        self.num_blocks = tp.agree_min(self._plan_num_blocks())  # every rank holds the same blocks
        self.kv_caches = self._allocate_kv_cache(self.num_blocks + 1)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                    self.num_blocks * self.block_bytes / 2**20)
        if self.kv_cache_dtype != dtype:
            ratio = dtype.itemsize / self.kv_cache_dtype.itemsize
            logger.info("KV cache in %s: %d bytes a block instead of %d in %s, so the same memory holds %.1fx "
                        "the tokens (%d here)", self.kv_cache_dtype, self.block_bytes, round(self.block_bytes * ratio),
                        dtype, ratio, self.num_blocks * self.block_size)
        self.graphs: DecodeGraphs | None = None
        # (on the CPU nothing is captured: the graphs' static-buffer path runs with any backend)
        uncapturable = ([] if device.type == "cpu" else
                        sorted({b.backend.name for b in self.builders if not b.backend.capturable}))
        if uncapturable and not args.enforce_eager:
            logger.warning("attention backend %s: its calls read each step's metadata back to the host, which a "
                           "graph cannot capture; decode runs eagerly, as with --enforce-eager",
                           ", ".join(uncapturable))
        if not args.enforce_eager and not uncapturable:
            max_batch = min(args.max_num_seqs, args.max_num_batched_tokens // (self.num_spec_tokens + 1))
            # a fixed k verifies and proposes k every decode step; an adaptive one any k in 0..k
            counts = None if args.speculative_adaptive else [self.num_spec_tokens]
            self.graphs = DecodeGraphs(self.model, self.proposer, device, self.block_size, max_batch,
                                       self.max_blocks_per_seq, scratch_block=self.num_blocks, draft_counts=counts)
        if device.type == "cuda":  # every verify width's and batch's step kernels now, not mid-serving
            from kernels_rocm import greedy_verify, sampled_verify, step_advance

            step_advance.precompile(device, self.num_spec_tokens + 1, self.block_size,
                                    args.max_num_seqs if self.num_spec_tokens else 0)
            if self.num_spec_tokens:
                greedy_verify.precompile(device, self.num_spec_tokens)
                # the logits' dtype, and fp32 where logits processors upcast them
                sampled_verify.precompile(device, self.num_spec_tokens, tuple(dict.fromkeys((dtype, torch.float32))))
        self.step_costs: StepCosts | None = self._step_costs() if self.num_spec_tokens else None
        self._profiler: tuple[torch.profiler.profile, str] | None = None  # recording, and where it goes

    def _step_costs(self) -> StepCosts:
        """A decode step's device time per batch bucket and k, for the adaptive k policy: measured by
        replaying the captured graphs (cached on disk: a restart on the same model and device
        reuses the numbers), else a fixed table."""
        if (self.graphs is None or self.device.type != "cuda" or not self.graphs.captures_draft
                or not self.args.speculative_adaptive):
            return StepCosts.fixed(list(BUCKETS), self.num_spec_tokens)
        key = dict(model=self.args.model, draft=self.args.draft_model, device=torch.cuda.get_device_name(self.device),
                   dtype=str(self.dtype), kv_cache_dtype=str(self.kv_cache_dtype), k=self.num_spec_tokens,
                   buckets=self.graphs.buckets, tp=self.args.tensor_parallel_size, torch=torch.__version__,
                   attention_backend=self.args.attention_backend, proposer=type(self.proposer).__name__)
        costs = StepCosts.load(key)
        if costs is None:
            costs = self.graphs.profile()
            costs.save(key)
        logger.info("decode step costs (%s), ms at k = 0..%d: %s", costs.source, self.num_spec_tokens,
                    "; ".join(f"batch {b}: " + " ".join(f"{t * 1e3:.2f}" for t in row)
                              for b, row in zip(costs.buckets, costs.seconds)))
        return costs

    # ------------------------------------------------------------------ KV pool

    @property
    def block_bytes(self) -> int:
        return sum(b.compute_block_bytes() for b in self.builders)

    @property
    def param_bytes(self) -> int:
        """Bytes of this rank's weights, target and draft (a tensor they share counted once)."""
        params = {id(p): p for p in self.model.parameters()}
        if self.proposer is not None:
            params.update((id(p), p) for m in self.proposer.modules_to_bind() for p in m.parameters(recurse=False))
        return sum(p.numel() * p.element_size() for p in params.values())

    def shutdown(self) -> None:
        """Nothing to release in-process (the tensor-parallel executors stop their workers)."""

    def profile(self, trace_dir: str | None, record_host: bool = True) -> None:
        """StepExecutor: start recording this rank's steps with torch.profiler (device kernels, and
        host ops when `record_host`: tracing those slows the host, so a device waiting on it looks
        idle longer than it is); None: wait for the device, stop, and write the recording to
        <trace_dir>/rank<r>.trace.json (Chrome trace format: Perfetto or chrome://tracing)."""
        from torch.profiler import ProfilerActivity

        if trace_dir is not None:
            if self._profiler is not None:
                raise RuntimeError(f"a profile is already recording (into {os.path.dirname(self._profiler[1])})")
            activities = [ProfilerActivity.CPU] if record_host or self.device.type != "cuda" else []
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            os.makedirs(trace_dir, exist_ok=True)
            recorder = torch.profiler.profile(activities=activities)
            recorder.start()
            self._profiler = recorder, os.path.join(trace_dir, f"rank{tp.rank()}.trace.json")
            return
        if self._profiler is None:
            raise RuntimeError("no profile is recording: start one first")
        (recorder, path), self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels of every step launched so far
        recorder.stop()
        recorder.export_chrome_trace(path)
        logger.info("profile of this rank's steps written to %s", path)

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
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            cap = min(max(weights, CPU_KV_CACHE_MIN_BYTES), CPU_KV_CACHE_MAX_BYTES)
            num_blocks = min(self.args.max_num_seqs * needed, max(needed, cap // self.block_bytes))
            logger.info("KV cache on CPU sized from the model: %d blocks = %.1f MiB (cap: the weights' %.1f MiB "
                        "clamped to [64 MiB, 2 GiB]), %.1f sequences of max_model_len %d; --num-kv-blocks overrides",
                        num_blocks, num_blocks * self.block_bytes / 2**20, weights / 2**20, num_blocks / needed,
                        self.max_model_len)
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
        """Blocks that fit in `gpu_memory_utilization` of the GPU after this engine's weights and
        the peak activations of its largest step (measured by running it on a temporary pool),
        and in what is actually free, keeping room for those activations to come back."""
        num_tokens = min(self.args.max_num_batched_tokens, self.args.max_num_seqs * self.max_model_len)
        num_seqs = min(self.args.max_num_seqs, num_tokens)
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        tables = np.split(np.arange(sum(math.ceil(n / self.block_size) for n in lens)),
                          np.cumsum([math.ceil(n / self.block_size) for n in lens])[:-1])
        temp_blocks = sum(len(t) for t in tables)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocate_kv_cache(temp_blocks)
        rng = np.random.default_rng(0)  # the same tokens on every tensor-parallel rank (MoE routing sizes buffers)
        step = upload(host_step([rng.integers(0, self.vocab_size, n) for n in lens], [0] * num_seqs,
                                [t.tolist() for t in tables], [[n - 1] for n in lens], self.block_size), self.device)
        hidden = self.model(step.input_ids, step.positions, step.meta)
        self.model.compute_logits(hidden[step.logits_rows]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - temp_blocks * self.block_bytes
        del step, hidden
        self._allocate_kv_cache(0)  # rebinding every layer to an empty pool frees the temporary one
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)  # other processes, CUDA context
        activations = peak - resident
        budget = min(total * self.args.gpu_memory_utilization - (peak - self.baseline_bytes) - outside_torch,
                     free - activations - (256 << 20))
        logger.info("GPU memory: total %.1f GiB, this engine's peak %.1f GiB, outside torch %.1f GiB, "
                    "free %.1f GiB -> KV budget %.1f GiB", total / 2**30, (peak - self.baseline_bytes) / 2**30,
                    outside_torch / 2**30, free / 2**30, budget / 2**30)
        return max(0, int(budget // self.block_bytes) - 1)  # one block is the graphs' scratch

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> None:
        """Queue one step on the device: forward, sampling and verification, the draft. Nothing
        here waits for the device (no host read of a device value), so the host is free to
        prepare the next step while this one runs; `collect` reads the results back."""
        self.sampler.drop(batch.finished_request_ids)
        host = batch_host_step(batch, self.block_size)
        graphed = self.graphs is not None and self.graphs.eligible(batch)
        step = self.graphs.load(host) if graphed else upload(host, self.device)
        self._follow_last_step(batch, host, step)
        if graphed:
            logits = self.graphs.replay_target(len(batch.seqs))
        else:
            hidden = self.model(step.input_ids, step.positions, step.meta)
            logits = self.model.compute_logits(hidden[step.logits_rows]) if len(host.logits_rows) else None
        prompt_logprobs = None if graphed else self._prompt_logprobs(batch, host, hidden)  # a decode graph runs no prompt
        sampling = [i for i, n in enumerate(step.rows_per_seq) if n]
        sampled = self._sample(batch, step, logits, sampling) if sampling else None
        # k = 0 on a pure decode step skips the draft; a prompt chunk still gets its draft KV (spec_decode/adaptive.py)
        drafting = self.proposer is not None and (batch.num_drafts > 0 or any(s.start < s.num_prompt_tokens
                                                                             for s in batch.seqs))
        drafts = self._propose(batch, host, step, sampling, sampled, graphed) if drafting else None
        width = sampled.verified.token_ids.shape[1] if sampled else 1
        parts = [sampled.verified.token_ids, sampled.verified.num_accepted[:, None]] if sampled else []
        if drafts is not None and sampling:
            parts.append(drafts.long())
        packed = torch.cat(parts, dim=1) if parts else torch.zeros(0, width + 1, dtype=torch.long)
        # the step's one device-to-host copy, into pinned memory so that it does not wait either
        out = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=self.device.type == "cuda")
        out.copy_(packed, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        if sampled:
            self._last = _LastOutputs({batch.seqs[i].request_id: r for r, i in enumerate(sampling)},
                                      sampled.verified.token_ids, sampled.verified.num_accepted, drafts)
        self._in_flight.append(_InFlight(batch, sampling, width, out, done, sampled.logprobs if sampled else None,
                                         prompt_logprobs))

    def collect(self) -> list[SeqStepResult]:
        """The results of the oldest step launched and not collected (waits for the device)."""
        f = self._in_flight.popleft()
        if f.done is not None:
            f.done.synchronize()
        results = [SeqStepResult() for _ in f.batch.seqs]
        rows, width = f.packed.tolist(), f.width
        logprobs = f.logprobs.to_host() if f.logprobs is not None else None
        for r, i in enumerate(f.sampling):
            row, accepted = rows[r], rows[r][width]
            res = results[i]
            res.new_token_ids, res.num_accepted = row[:accepted + 1], accepted
            res.draft_token_ids = row[width + 1:]
            if logprobs is not None and f.batch.seqs[i].params.logprobs is not None:
                res.logprobs = logprobs[r * width:r * width + accepted + 1]
        if f.prompt_logprobs is not None:
            scores, owners = f.prompt_logprobs
            scored, n = scores.to_host(), 0
            for b, count in owners:
                results[b].prompt_logprobs = scored[n:n + count]
                n += count
        return results

    def abandon(self) -> None:
        """Forget every step launched and not collected (after a failure)."""
        self._in_flight.clear()
        self._last = None

    def _follow_last_step(self, batch: StepBatch, host: HostStep, step: StepInputs) -> None:
        """Give the sequences that follow the previous step (SeqStep.follows) what it sampled, on
        the device: their first token is its emitted token, their drafts its proposals, and their
        positions, slots and context lengths move by its accepted count."""
        follow = [b for b, s in enumerate(batch.seqs) if s.follows]
        if not follow:
            return
        last = self._last
        # one host-to-device copy of the three index rows, then one kernel on a GPU (~20 without)
        index = torch.tensor([[last.row_of[batch.seqs[b].request_id] for b in follow], follow,
                              host.query_start_loc[follow].tolist()]).to(self.device, non_blocking=True)
        advance = _step_kernels().advance if self.device.type == "cuda" else advance_followers
        advance(index, last.num_accepted, last.token_ids, last.drafts, step.input_ids, step.positions,
                step.meta.context_lens, step.meta.block_tables, step.meta.slot_mapping, self.block_size)

    def _sample(self, batch: StepBatch, step: StepInputs, logits: torch.Tensor, sampling: list[int]) -> Sampled:
        """Sample each sampling sequence's next token, verifying its draft tokens first if it has any
        (the drafts are read from the step's device inputs: the host may not know them yet)."""
        items = [batch.seqs[i] for i in sampling]
        rows = [step.rows_per_seq[i] for i in sampling]
        counts = np.array(rows, dtype=np.int64) - 1  # each sequence's drafts: its rows but the last
        if counts.any():
            draft_rows = np.repeat(np.cumsum(counts + 1) - counts - 1, counts) + segment_ranks(counts)
            draft_ids = step.input_ids[step.logits_rows[torch.from_numpy(draft_rows).to(self.device, non_blocking=True)] + 1]
        else:  # nothing to verify (no speculation, or k = 0): four ops on empty tensors a step saved
            draft_ids = step.input_ids.new_empty(0)
        return self.sampler.sample(logits, items, draft_ids)

    def _prompt_logprobs(self, batch: StepBatch, host: HostStep,
                         hidden: torch.Tensor) -> tuple[DeviceLogprobs, list[tuple[int, int]]] | None:
        """Logprobs of the prompt tokens this step's chunks predict (position p scores token p + 1),
        for sequences that ask: from this very forward's hidden states, so they are the engine's
        own numbers. Positions already scored (before a preemption) are skipped."""
        rows, targets, top_n, owners = [], [], [], []
        for b, item in enumerate(batch.seqs):
            if item.params.prompt_logprobs is None:
                continue
            c, n = item.start, len(item.token_ids)
            assert c <= item.num_prompt_logprobs, "prompt logprobs need every prompt position computed (no cache hit)"
            start, end = max(c, item.num_prompt_logprobs), min(c + n, item.num_prompt_tokens - 1)
            if start >= end:
                continue
            # tokens c .. c + n: the chunk, then the prompt token after it when the chunk does not end the prompt
            known = item.token_ids if item.next_token_id is None else item.token_ids + [item.next_token_id]
            rows.extend(range(host.query_start_loc[b] + start - c, host.query_start_loc[b] + end - c))
            targets.extend(known[start + 1 - c:end + 1 - c])
            top_n.extend([item.params.prompt_logprobs] * (end - start))
            owners.append((b, end - start))
        if not rows:
            return None
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        return token_logprobs(logits, torch.tensor(targets, device=hidden.device), top_n), owners

    def _propose(self, batch: StepBatch, host: HostStep, step: StepInputs, sampling: list[int],
                 sampled: Sampled | None, graphed: bool) -> torch.Tensor:
        """The draft's proposals [S, k] for the sampling sequences, on the device. Each sequence's
        last verified row and the token after it depend on how many drafts this step accepted,
        which only the device knows."""
        b = len(batch.seqs)
        # per sequence: its last row before the verification, its row in the verification's outputs
        # (-1: none), the token after it if it samples nothing; one upload, then one kernel on a GPU
        rows = np.empty((3, b), dtype=np.int64)
        known = np.fromiter(map(len, [item.token_ids for item in batch.seqs]), np.int64, b)
        rows[0] = host.query_start_loc[:-1] + known - 1
        rows[1] = -1
        rows[1, sampling] = np.arange(len(sampling))
        rows[2] = [0 if item.samples else item.next_token_id for item in batch.seqs]
        rows_t = torch.from_numpy(rows).to(self.device, non_blocking=True)
        verified = (sampled.verified.num_accepted, sampled.verified.token_ids) if sampled is not None else (None, None)
        fill = _step_kernels().draft_starts if self.device.type == "cuda" else draft_starts
        if graphed and batch.num_drafts and self.graphs.captures_draft:
            return self.graphs.replay_draft(fill, rows_t, *verified, batch.num_drafts)
        last_rows, next_tokens = torch.empty(2, b, dtype=torch.int64, device=self.device)
        fill(rows_t, *verified, last_rows, next_tokens, 0)
        inputs = ProposeInputs(input_ids=step.input_ids, positions=step.positions, meta=step.meta,
                               last_rows=last_rows, next_token_ids=next_tokens,
                               sampling=torch.tensor(sampling, dtype=torch.long).to(self.device, non_blocking=True),
                               num_drafts=batch.num_drafts)
        return self.proposer.propose(inputs)
