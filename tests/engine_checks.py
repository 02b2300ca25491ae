"""Invariants of the scheduler and the KV pool, asserted at every step of a test's engine, so a
leak, an over-admission or a stray KV write fails at the step it happens (within seconds)
instead of as a livelock or a wrong token far downstream. conftest installs them on every
LLMEngine a test builds; tests add the KV sentinel and bound their steps:

    checks = install_checks(engine, sentinel=True)   # counters: steps, max_running, max_batch_tokens
    outs = run_checked(engine, prompts, params)      # generate, with a step bound instead of a hang

Checked after every schedule(): running <= max_num_seqs, scheduled tokens <= the token budget,
each sequence scheduled at most once and running, a step samples exactly when it reaches the
sequence's last known token, the KV slots the step writes (its draft chain's included) are
inside the sequence's blocks,
no block table wider than the runner's block-table rows (max_blocks_per_seq). Checked after
every schedule(), update() and abort: free + owned == total blocks, no block owned twice or both
owned and free, waiting and finished sequences own nothing (the passes over the free list run
every 16th step on pools above 4096 blocks). With the sentinel, the plain free blocks of every
KV pool are filled with a finite sentinel before each model step and must keep its bytes after
it, and the cached-free blocks (prefix cache) must keep theirs: nothing may write a block no running
sequence owns (only the graphs' scratch block, which the block manager never
hands out, absorbs padded rows). Tensor-parallel engines (-tp N) keep their pools and block-table
rows in the worker processes: there the scheduler and pool-accounting checks run, the sentinel
and the block-table width check do not (asking for the sentinel is an error).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from atom_like import LLMEngine, SamplingParams
from atom_like.engine.model_runner import ModelRunner
from atom_like.engine.sequence import SequenceStatus


@dataclass
class Checks:
    sentinel: bool = False
    steps: int = 0
    max_running: int = 0
    max_batch_tokens: int = 0


def assert_pool_consistent(engine: LLMEngine, full: bool = True) -> None:
    """free + owned == total, a block's reference count is its number of owners (prefix-cache
    hits share blocks; no sequence holds one twice), no block both owned and free, ids in the pool.
    Free blocks are the plain free list plus the cached-free LRU (`evictable`). `full=False` skips
    the passes over the free lists (the count still catches every leak)."""
    bm, sched = engine.block_manager, engine.scheduler
    owners: dict[int, int] = {}
    for seq in sched.running:
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"
        for b in seq.block_table:
            owners[b] = owners.get(b, 0) + 1
    num_free = len(bm.free_blocks) + len(bm.evictable)
    assert num_free + len(owners) == bm.num_blocks, (
        f"block leak: {num_free} free + {len(owners)} owned by running sequences != {bm.num_blocks} blocks")
    if owners:
        assert min(owners) >= 0 and max(owners) < bm.num_blocks, "an owned block id outside the pool"
    if full:
        bad = [b for b, n in owners.items() if bm.ref_counts[b] != n]
        assert not bad, f"blocks {bad[:8]} have reference counts that differ from their number of owners"
        free = list(bm.free_blocks) + list(bm.evictable)
        free_set = set(free)
        assert len(free_set) == len(free), "a block is on the free lists twice"
        assert not owners.keys() & free_set, f"blocks both free and owned: {sorted(owners.keys() & free_set)[:8]}"
        assert not free or (min(free_set) >= 0 and max(free_set) < bm.num_blocks), "a free block id outside the pool"
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table, f"{seq} waits holding blocks"
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING, f"{seq} is in the running list"


def _block_dim(pool: torch.Tensor, num_blocks: int) -> int:
    dims = [d for d, n in enumerate(pool.shape) if n == num_blocks + 1]  # + the graphs' scratch block
    assert len(dims) == 1, f"cannot tell the block dimension of a pool of shape {tuple(pool.shape)}"
    return dims[0]


# Exact in every KV dtype (fp32, bf16, fp16, fp8 e4m3fn/fnuz) and large enough that a row which
# attends over a free block gets visibly wrong numbers.
FREE_BLOCK_SENTINEL = 240.0

_installed: "weakref.WeakKeyDictionary[LLMEngine, Checks]" = weakref.WeakKeyDictionary()


def install_checks(engine: LLMEngine, sentinel: bool = False) -> Checks:
    """Wrap `engine` (once) so every step checks the invariants above; returns the step counters.
    conftest installs the checks on every engine a test builds; tests add the sentinel. The
    wrappers hold the engine weakly and call the classes' methods, so no reference cycle keeps a
    dropped engine's KV pool alive until the garbage collector runs."""
    in_process = isinstance(engine.runner, ModelRunner)  # else tensor-parallel workers hold the pools
    assert in_process or not sentinel, "the KV sentinel reads the pools: it needs -tp 1 (an in-process runner)"
    if engine in _installed:
        _installed[engine].sentinel |= sentinel
        return _installed[engine]
    checks = _installed[engine] = Checks(sentinel)
    ref = weakref.ref(engine)
    schedule, update = type(engine.scheduler).schedule, type(engine.scheduler).update
    abort = type(engine).abort_request
    # a test drafter may watch the launches (tests/oracle_proposer.py): the checks wrap its watcher
    watcher = vars(engine.runner).get("launch") if in_process else None
    launch = type(engine.runner).launch if watcher is None else (lambda runner, batch: watcher(batch))

    def checked_schedule():
        engine = ref()
        sched, runner, bm = engine.scheduler, engine.runner, engine.block_manager
        batch = schedule(sched)
        assert len(sched.running) <= sched.max_num_seqs, (
            f"{len(sched.running)} running sequences > max_num_seqs {sched.max_num_seqs}")
        num_tokens = sum(item.num_new_tokens + len(item.spec_token_ids) for item in batch.seqs)
        assert num_tokens <= sched.max_num_batched_tokens, (
            f"step schedules {num_tokens} tokens > budget {sched.max_num_batched_tokens}")
        seqs = [item.seq for item in batch.seqs]
        assert len({id(s) for s in seqs}) == len(seqs), "a sequence scheduled twice in one step"
        for item in batch.seqs:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING, f"scheduled {seq}"
            assert item.num_new_tokens >= 1
            assert len(seq.in_flight) <= 2, f"{seq}: {len(seq.in_flight)} steps in flight (overlap allows 2)"
            end = item.start + item.num_new_tokens
            if item.shift_bound is None:
                assert item.start == seq.num_computed_tokens + sum(n for n, _ in list(seq.in_flight)[:-1]), (
                    f"{seq}: starts at {item.start}, not after its computed and in-flight tokens")
                assert end <= seq.num_tokens, f"{seq}: schedules tokens it does not have"
                assert item.samples == (end == seq.num_tokens), (
                    f"{seq}: samples={item.samples} but the step ends at token {end} of {seq.num_tokens}")
            else:  # follows a sampling step in flight: one unseen token, at most shift_bound drafts later
                assert item.samples and item.num_new_tokens == 1 and len(seq.in_flight) == 2
                assert item.start == seq.num_tokens and item.shift_bound == seq.in_flight[0][1]
                end += item.shift_bound
            assert not item.spec_token_ids or item.samples, f"{seq}: drafts verified in a prompt chunk"
            # a sampling step's draft chain writes k - 1 slots past the last token it verifies
            chain = sched.num_spec_tokens - 1 if item.samples and sched.num_spec_tokens else 0
            writes_to = end + len(item.spec_token_ids) + chain
            assert len(seq.block_table) * bm.block_size >= writes_to, (
                f"{seq}: writes KV up to slot {writes_to} with {len(seq.block_table)} blocks")
            assert not in_process or len(seq.block_table) <= runner.max_blocks_per_seq, (
                f"{seq}: {len(seq.block_table)} blocks > max_blocks_per_seq {runner.max_blocks_per_seq}")
        checks.steps += 1
        # the passes over the free list every step on small pools, every 16th on big ones
        assert_pool_consistent(engine, full=bm.num_blocks <= 4096 or checks.steps % 16 == 0)
        checks.max_running = max(checks.max_running, len(sched.running))
        checks.max_batch_tokens = max(checks.max_batch_tokens, num_tokens)
        return batch

    def checked_update(batch, results, stop_string=None):
        engine = ref()
        touched = update(engine.scheduler, batch, results, stop_string)
        for item in batch.seqs:
            if item.seq.finished:
                assert not item.seq.block_table, f"{item.seq} finished holding blocks"
        assert_pool_consistent(engine, full=False)
        return touched

    def checked_launch(batch):
        """On CPU a launch runs the whole step before it returns, so its writes are checked here."""
        engine = ref()
        runner, bm = engine.runner, engine.block_manager
        if not checks.sentinel:
            return launch(runner, batch)
        # Every block nobody owns is compared bytewise: the plain free ones are first filled with
        # a finite sentinel, not NaN, because a stray row that reads a NaN block (a padded graph
        # row on a stale block table) writes NaN back, which a NaN check cannot tell apart.
        free = torch.tensor(list(bm.free_blocks) + list(bm.evictable), dtype=torch.long)
        num_plain = len(bm.free_blocks)
        pools = [(p, _block_dim(p, bm.num_blocks)) for p in runner.kv_caches.values()]
        kept = []
        for pool, dim in pools:
            pool.index_fill_(dim, free[:num_plain].to(pool.device), FREE_BLOCK_SENTINEL)
            kept.append(pool.index_select(dim, free.to(pool.device)))
        launch(runner, batch)
        for name, (pool, dim), before in zip(runner.kv_caches, pools, kept):
            same = pool.index_select(dim, free.to(pool.device)).view(torch.uint8) == before.view(torch.uint8)
            written = free[~same.movedim(dim, 0).flatten(1).all(1).cpu()].tolist()
            assert not written, f"the step wrote {name} blocks {written[:8]} that no running sequence owns"

    def checked_abort(request_id):
        engine = ref()
        abort(engine, request_id)
        assert_pool_consistent(engine)

    engine.scheduler.schedule, engine.scheduler.update = checked_schedule, checked_update
    engine.runner.launch, engine.abort_request = checked_launch, checked_abort
    return checks


def run_checked(engine: LLMEngine, prompts: list, params: SamplingParams | list[SamplingParams],
                max_steps: int | None = None, request_ids: list[str] | None = None) -> list:
    """engine.generate with every invariant checked and a bound on the steps (a livelock fails
    as an assertion, not a timeout): outputs in prompt order."""
    install_checks(engine)
    params = params if isinstance(params, list) else [params] * len(prompts)
    request_ids = request_ids or [None] * len(prompts)
    ids = [engine.add_request(p, sp, request_id=r) for p, sp, r in zip(prompts, params, request_ids)]
    if max_steps is None:  # every step advances some sequence; recompute after preemption may triple the work
        lens = [len(p) if not isinstance(p, str) else 64 for p in prompts]
        max_steps = 3 * sum(n + sp.max_tokens for n, sp in zip(lens, params)) + 20
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests(), f"no end after {max_steps} steps: livelock?"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks not returned"
    return [final[i] for i in ids]
