"""LLMEngine: the public, synchronous engine API (`add_request` / `step` / `generate`)."""
from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerBase

from atom_like.config import (EngineArgs, load_model_config, load_tokenizer, require_stated_fields, resolve_device,
                              resolve_dtype, resolve_max_model_len, text_config)
from atom_like.engine.block_manager import BlockManager
from atom_like.engine.detokenizer import IncrementalDetokenizer
from atom_like.engine.model_runner import ProposerFactory
from atom_like.engine.scheduler import ScheduledBatch, Scheduler
from atom_like.engine.sequence import Sequence, SequenceStatus
from atom_like.engine.step_inputs import StepBatch
from atom_like.engine.tp_executor import StepExecutor, make_executor
from atom_like.loader.weights import check_checkpoint_files
from atom_like.models.registry import target_model_class
from atom_like.sampling_params import RequestOutput, SamplingParams, Span
from spec_decode.adaptive import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from spec_decode.step_costs import StepClock
from spec_decode.stats import SpecStats

logger = logging.getLogger(__name__)

Prompt = str | list[int]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters, what a server exports (cumulative counts grow for the
    engine's lifetime; subtract two snapshots for an interval)."""
    num_running: int  # sequences in the running batch
    num_waiting: int  # queued in the scheduler, preempted ones included
    max_num_seqs: int
    num_free_blocks: int  # KV blocks, cached-free (prefix cache) ones included
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # tokens of admitted requests (0 while prefix caching is off)
    prefix_cache_hits: int  # of those, tokens found in the prefix cache
    num_speculative_tokens: int  # k (0 without a draft)
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_histogram: tuple[int, ...]  # drafts with exactly n accepted, n = 0..k
    drafted_per_position: tuple[int, ...] = ()  # drafts with a token at position i (k varies per step)
    num_drafts_in_use: int = 0  # k of the latest step: the drafts it proposes (adaptive: 0..num_speculative_tokens)


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None


class LLMEngine:
    def __init__(self, model: str | None = None, *, proposer_factory: ProposerFactory | None = None, **engine_args):
        """`engine_args` are EngineArgs fields; `proposer_factory` swaps in a custom draft
        proposer (the tests' oracle drafter, for example)."""
        self.args = EngineArgs(model=model, **engine_args)
        if self.args.model is None:
            raise ValueError("no model given: pass a checkpoint folder (--model DIR)")
        self.hf_config = load_model_config(self.args.model, self.args.trust_remote_code)
        model_class = target_model_class(self.hf_config)
        require_stated_fields(self.hf_config, self.args.model, model_class.stated_config_fields, model_class.__name__)
        if self.args.load_format != "dummy":  # dummy: config.json alone, no weight file read
            check_checkpoint_files(self.args.model)
        self.device = resolve_device(self.args.device)
        self.dtype = resolve_dtype(self.args.dtype, self.hf_config, self.device)
        self.max_model_len = resolve_max_model_len(self.args.max_model_len, self.hf_config)
        # -tp 1: a ModelRunner in this process; else tensor-parallel workers (a torchrun rank > 0
        # never returns from here: it serves rank 0's steps, then exits)
        self.runner: StepExecutor = make_executor(self.args, self.hf_config, self.device, self.dtype,
                                                  self.max_model_len, proposer_factory)
        self.tokenizer = self._load_tokenizer()
        # a draft's KV at a position is built from the token after it: cache keys take one more token
        self.block_manager = BlockManager(self.runner.num_blocks, self.args.block_size, self.args.enable_prefix_caching,
                                          lookahead=1 if self.runner.num_spec_tokens else 0)
        self.eos_token_ids = self._eos_token_ids()
        self.scheduler = Scheduler(self.block_manager, self.args.max_num_seqs, self.args.max_num_batched_tokens,
                                   self.max_model_len, self.eos_token_ids, self.runner.num_spec_tokens)
        self.requests: dict[str, _Request] = {}
        self._finished_ids: list[str] = []  # finished since the last step; the runner drops their state
        self._in_flight: tuple[ScheduledBatch, int] | None = None  # launched, not collected: (batch, step number)
        self._num_launched = 0
        # k per step: adaptive with --method eagle3 (and --speculative-adaptive); a custom proposer
        # (tests, benchmarks) proposes its full k unless its caller installs a policy here
        self.draft_policy: DraftLengthPolicy | None = None
        if self.runner.num_spec_tokens:
            adaptive = self.args.speculative_adaptive and self.args.method == "eagle3" and proposer_factory is None
            self.draft_policy = (AdaptiveDraftLength(self.runner.num_spec_tokens, self.runner.step_costs) if adaptive
                                 else FixedDraftLength(self.runner.num_spec_tokens))
        # the periods of steady decode steps, which the adaptive policy prices each k by
        self._clock = StepClock()
        self._ids = itertools.count()
        logger.info("LLMEngine ready: %s on %s (%s), max_model_len %d, prefix caching %s", self.args.model,
                    self.device, str(self.dtype).removeprefix("torch."), self.max_model_len,
                    "on" if self.args.enable_prefix_caching else "off")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(**vars(args))

    def _load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        path = self.args.tokenizer or self.args.model
        if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            logger.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", path)
            return None
        return load_tokenizer(path, self.args.trust_remote_code)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        sources = [getattr(text_config(self.hf_config), "eos_token_id", None)]
        if os.path.isfile(os.path.join(self.args.model, "generation_config.json")):
            sources.append(GenerationConfig.from_pretrained(self.args.model).eos_token_id)
        if self.tokenizer is not None:
            sources.append(self.tokenizer.eos_token_id)
        for s in sources:
            ids.update([s] if isinstance(s, int) else (s or []))
        return ids

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as a list of token ids")
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        outside = [t for t in params.logit_bias if t >= self.runner.vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {self.runner.vocab_size}): {outside[:5]}")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        # here, not in encode: add_request(prompt_ids=...), the server's path, skips encode
        if any(not isinstance(t, int) or not 0 <= t < self.runner.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.runner.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    prompt_ids: list[int] | None = None) -> str:
        """Queue one request; raises ValueError, leaving the engine untouched, on bad input.
        `prompt_ids` skips tokenization when the caller already has the ids (e.g. chat templates)."""
        params = params if params is not None else SamplingParams()
        ids = prompt_ids if prompt_ids is not None else self.encode(prompt)
        self.validate(ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))
        seq = Sequence(request_id, ids, params, stop_ids)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop) if self.tokenizer is not None else None
        self.requests[request_id] = _Request(seq, prompt if isinstance(prompt, str) else None, detok)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request.seq, "abort")
            self._finished_ids.append(request_id)

    def has_unfinished_requests(self) -> bool:
        # a step in flight that holds only finished requests is collected (and dropped) by the next step()
        return self.scheduler.has_unfinished()

    def has_request(self, request_id: str) -> bool:
        """`request_id` was added and has not finished (nor been aborted)."""
        return request_id in self.requests

    def is_waiting(self, request_id: str) -> bool:
        """`request_id` is queued (not yet running, or preempted): no step is computing it."""
        request = self.requests.get(request_id)
        return request is not None and request.seq.status is SequenceStatus.WAITING and not request.seq.in_flight

    # ------------------------------------------------------------------ introspection

    @property
    def spec_stats(self) -> SpecStats:
        """Speculation counters (all zero without a draft)."""
        return self.scheduler.spec_stats

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size: token ids are in [0, vocab_size)."""
        return self.runner.vocab_size

    @property
    def failure(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank died); None while healthy."""
        return self.runner.failure

    def stats(self) -> EngineStats:
        sched, blocks, spec = self.scheduler, self.block_manager, self.scheduler.spec_stats
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), max_num_seqs=sched.max_num_seqs,
            num_free_blocks=blocks.num_free_blocks, num_blocks=blocks.num_blocks, num_preemptions=sched.num_preemptions,
            prefix_cache_queries=blocks.num_query_tokens, prefix_cache_hits=blocks.num_hit_tokens,
            num_speculative_tokens=spec.num_speculative_tokens, num_drafts=spec.num_drafts,
            num_draft_tokens=spec.num_draft_tokens, num_accepted_tokens=spec.num_accepted_tokens,
            accepted_histogram=tuple(spec.accepted_histogram), drafted_per_position=tuple(spec.drafted_per_position),
            num_drafts_in_use=sched.num_drafts_in_flight)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an (accumulated) output for every request that got
        new tokens or finished in the step whose results this call collected.

        With overlap_scheduling the next step is scheduled and launched before the previous
        one's results are read: the device never waits for the host between steps, and outputs
        come one call later. A step whose requests need the host to know every token first
        (penalties, min_tokens, prompt logprobs: see _needs_every_token) waits for them."""
        try:
            return self._step()
        except Exception:
            # a failed launch or collect leaves the pipeline in an unknown state: drop what is in
            # flight (the caller decides what becomes of the requests it was running)
            self._in_flight = None
            self._clock.end(None)  # no period spans a failure
            self.runner.abandon()
            for seq in itertools.chain(self.scheduler.running, self.scheduler.waiting):
                seq.in_flight.clear()
            raise

    def _step(self) -> list[RequestOutput]:
        outputs = []
        self._clock.begin()
        decode = None  # (sequences, k) of a pure decode step launched by this call
        if self._in_flight is not None and (not self.args.overlap_scheduling or self._needs_every_token()):
            outputs = self._collect()
        batch = self.scheduler.schedule()
        launched = None
        if batch.seqs:
            k = self._num_drafts(batch)
            self.scheduler.num_drafts_in_flight = k
            self.runner.launch(StepBatch.from_scheduled(batch, self._finished_ids, k))
            self._finished_ids.clear()
            launched = (batch, self._num_launched)
            self._num_launched += 1
            if self.draft_policy is not None and all([item.num_new_tokens == 1 and item.samples
                                                      for item in batch.seqs]):
                decode = (len(batch.seqs), k)
        if self._in_flight is not None:
            outputs += self._collect()
        self._in_flight = launched
        if launched is not None and not self.args.overlap_scheduling:
            outputs += self._collect()
        sample = self._clock.end(decode)
        if sample is not None:
            self.draft_policy.observe_step(*sample)
        return outputs

    def _num_drafts(self, batch: ScheduledBatch) -> int:
        """k for a step: the policy's, except that a seeded sampling request pins k to its maximum
        while it runs: its draws depend on how many drafts each step verifies, and a seed promises
        the same tokens whatever else the server is doing (docs/adaptive_speculation.md)."""
        if self.draft_policy is None:
            return 0
        k = self.draft_policy.choose(self._num_launched, sum([item.samples for item in batch.seqs]))
        if not 0 <= k <= self.runner.num_spec_tokens:
            raise ValueError(f"the draft policy chose k={k}, outside 0..{self.runner.num_spec_tokens}")
        if any([item.seq.params.seed is not None and item.seq.params.temperature > 0 for item in batch.seqs]):
            return self.runner.num_spec_tokens
        return k

    def _needs_every_token(self) -> bool:
        """A request with a step in flight whose next step reads its token history on the host."""
        for seq in self.scheduler.running:
            p = seq.params
            if seq.reads_history and seq.in_flight and (p.has_penalties or seq.num_generated < p.min_tokens
                                                        or p.prompt_logprobs is not None):
                return True
        return False

    def _collect(self) -> list[RequestOutput]:
        (batch, step), self._in_flight = self._in_flight, None
        results = self.runner.collect()
        prompt_only, drafted, accepted = [], [], []
        for item, result in zip(batch.seqs, results):
            if item.spec_token_ids and item.seq.status is not SequenceStatus.FINISHED:  # as SpecStats counts them
                drafted.append(len(item.spec_token_ids))
                accepted.append(result.num_accepted)
            if result.prompt_logprobs:
                item.seq.prompt_logprobs.extend(result.prompt_logprobs)
            if item.samples and item.seq.params.max_tokens == 0:  # it wanted the prompt forward alone
                result.new_token_ids, result.logprobs, result.draft_token_ids = [], [], []
                prompt_only.append(item.seq)
        if drafted:
            self.draft_policy.observe(step, drafted, accepted)
        touched = self.scheduler.update(batch, results, self._stop_string if self.tokenizer is not None else None)
        for seq in prompt_only:
            self.scheduler.finish(seq, "length")
        return [self._output(seq) for seq in touched]

    def start_profile(self, trace_dir: str, record_host: bool = True) -> None:
        """Record every rank's steps with torch.profiler until stop_profile(), which writes
        <trace_dir>/rank<r>.trace.json (open in Perfetto). `record_host=False` records device
        kernels only: tracing host ops slows the host, which a GPU waiting on it shows as idle."""
        self.runner.profile(trace_dir, record_host)

    def stop_profile(self) -> None:
        """Stop the recording start_profile() began and write every rank's trace."""
        self.runner.profile(None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at -tp 1); also runs at interpreter exit."""
        self.runner.shutdown()

    def _stop_string(self, seq: Sequence, token: int) -> bool:
        """Detokenize a token the scheduler appends; True when it completes a stop string (the
        text is cut before it). Stop strings, like stop ids, count only from min_tokens on (as in vLLM)."""
        detokenizer = self.requests[seq.request_id].detokenizer
        generated = len(seq.token_ids) - seq.num_prompt_tokens  # num_generated: called once a token, no property call
        return detokenizer is not None and detokenizer.add(token, check_stop=generated >= seq.params.min_tokens)

    def _output(self, seq: Sequence) -> RequestOutput:
        request = self.requests[seq.request_id]
        if seq.status is SequenceStatus.FINISHED:
            del self.requests[seq.request_id]
            self._finished_ids.append(seq.request_id)
        n, p = len(seq.token_ids), seq.num_prompt_tokens
        return RequestOutput(
            request_id=seq.request_id, prompt=request.prompt, prompt_token_ids=Span(seq.token_ids, 0, p),
            text=request.detokenizer.snapshot() if request.detokenizer is not None else "",
            token_ids=Span(seq.token_ids, p, n), finish_reason=seq.finish_reason,
            logprobs=Span(seq.logprobs, 0, len(seq.logprobs)) if seq.params.logprobs is not None else None,
            prompt_logprobs=[None, *seq.prompt_logprobs] if seq.params.prompt_logprobs is not None else None,
        )

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion (batched together) and return their outputs in order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        for ids, p in zip(encoded, params):
            self.validate(ids, p)  # all or nothing: a bad prompt adds no request
        ids = [self.add_request(p, sp, prompt_ids=e) for p, sp, e in zip(prompts, params, encoded)]
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while len(final) < len(ids):
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]
