"""The server's engine thread in-process: admission, aborts, engine faults that must not kill it,
and the Prometheus speculation metrics (fed with synthetic counts until speculation lands)."""
from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from oracle_proposer import OracleProposer, accept_first
from prometheus_client import generate_latest

from atom_like import LLMEngine, SamplingParams
from atom_like.entrypoints.engine_loop import Admitted, EngineLoop, EngineRequest, Failed, Rejected
from atom_like.entrypoints.metrics import EngineState, ServerMetrics, SpecSnapshot

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_path):
    return LLMEngine(llama_path, max_model_len=64, num_kv_blocks=16)


def request(request_id: str, prompt_ids: list[int], params: SamplingParams = GREEDY) -> EngineRequest:
    return EngineRequest(request_id, None, prompt_ids, params)


async def started(engine) -> EngineLoop:
    loop = EngineLoop(engine, ServerMetrics(engine.stats().num_speculative_tokens), stats_interval=0)
    loop.start(asyncio.get_running_loop())
    while not loop.ready and loop.warmup_error is None:
        await asyncio.sleep(0.01)
    return loop


async def run_to_end(loop: EngineLoop, requests: list[EngineRequest]) -> list:
    """Everything the sink receives until each request finished or failed."""
    sink: asyncio.Queue = asyncio.Queue()
    loop.submit(requests, sink)
    items = [await asyncio.wait_for(sink.get(), 60)]
    done = 0
    while isinstance(items[0], Admitted) and done < len(requests):
        item = await asyncio.wait_for(sink.get(), 60)
        items.append(item)
        done += isinstance(item, Failed) or item[1].finished
    return items


def sample(metrics: ServerMetrics, name: str, labels: dict | None = None) -> float:
    return metrics.registry.get_sample_value(f"atom_like:{name}", labels)


def test_outputs_arrive_per_request_in_order(engine):
    async def main():
        loop = await started(engine)
        items = await run_to_end(loop, [request("a", [1, 2, 3]), request("b", [4, 5])])
        loop.shutdown()
        return loop, items

    loop, items = asyncio.run(main())
    assert isinstance(items[0], Admitted)
    finals = {index: out for index, out in items[1:] if out.finished}
    expected = engine.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
    assert [finals[0].token_ids, finals[1].token_ids] == [e.token_ids for e in expected]
    m = loop.metrics
    assert sample(m, "request_success_total", {"finished_reason": "length"}) == 2
    assert sample(m, "prompt_tokens_total") == 5 and sample(m, "generation_tokens_total") == 16
    assert sample(m, "time_to_first_token_seconds_count") == 2 and sample(m, "time_per_output_token_seconds_count") == 2


def test_a_rejected_batch_queues_nothing(engine):
    async def main():
        loop = await started(engine)
        items = await run_to_end(loop, [request("ok", [1, 2]), request("long", list(range(64)))])
        loop.shutdown()
        return items

    (answer,) = asyncio.run(main())
    assert isinstance(answer, Rejected) and "max_model_len" in answer.message
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks(engine):
    async def main():
        loop = await started(engine)
        sink: asyncio.Queue = asyncio.Queue()
        loop.submit([request("long", [1, 2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))], sink)
        assert isinstance(await sink.get(), Admitted)
        _, first = await sink.get()
        loop.abort(["long"])
        loop.abort(["long", "never-existed"])  # twice, and unknown ids: both harmless
        await asyncio.sleep(0.2)
        loop.shutdown()
        return loop, first

    loop, first = asyncio.run(main())
    assert not first.finished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert sample(loop.metrics, "request_success_total", {"finished_reason": "abort"}) == 1
    assert sample(loop.metrics, "kv_cache_free_blocks") == engine.block_manager.num_blocks


def test_an_engine_fault_fails_its_requests_and_the_loop_keeps_serving(engine, monkeypatch):
    real_launch = engine.runner.launch
    faults = iter([True])

    def launch_failing_once(batch):
        # Raised after scheduling, as a device fault would be: blocks are taken, nothing updated.
        if next(faults, False):
            raise RuntimeError("simulated device fault")
        return real_launch(batch)

    async def main():
        loop = await started(engine)
        monkeypatch.setattr(engine.runner, "launch", launch_failing_once)
        broken = await run_to_end(loop, [request("x", [1, 2, 3]), request("y", [4, 5, 6])])
        healthy = await run_to_end(loop, [request("z", [7, 8])])
        assert loop.ready  # still healthy: the fault was the request's, not the server's
        loop.shutdown()
        return loop, broken, healthy

    loop, broken, healthy = asyncio.run(main())
    assert isinstance(broken[0], Admitted)
    assert [type(item) for item in broken[1:]] == [Failed, Failed]
    assert "simulated device fault" in broken[1].message
    assert isinstance(healthy[0], Admitted) and healthy[-1][1].finish_reason == "length"
    assert sample(loop.metrics, "request_success_total", {"finished_reason": "error"}) == 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_failed_warm_up_marks_the_server_unhealthy_but_requests_still_get_answers(engine, monkeypatch):
    def broken_step():  # fails before scheduling anything: no request is running when it does
        raise RuntimeError("no device")

    async def main():
        monkeypatch.setattr(engine, "step", broken_step)
        loop = await started(engine)
        items = await run_to_end(loop, [request("a", [1, 2])])
        loop.shutdown()
        return loop, items

    loop, items = asyncio.run(main())
    assert not loop.ready and "no device" in loop.warmup_error
    assert isinstance(items[0], Admitted) and isinstance(items[1], Failed)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_speculation_metrics_follow_the_engine(llama_path):
    k, m, steps = 3, 2, 4
    params = SamplingParams(temperature=0, max_tokens=1 + (m + 1) * steps, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5]]
    greedy = [o.token_ids for o in LLMEngine(llama_path, max_model_len=64).generate(prompts, params, use_tqdm=False)]
    # An oracle draft that gets the first m of every k proposals right: each verify accepts exactly m.
    continuations = defaultdict(list, {f"r{i}": tokens for i, tokens in enumerate(greedy)})
    engine = LLMEngine(llama_path, max_model_len=64,
                       proposer_factory=lambda runner: OracleProposer(runner, continuations, k, accept_first(m)))

    async def main():
        loop = await started(engine)
        items = await run_to_end(loop, [request(f"r{i}", p, params) for i, p in enumerate(prompts)])
        loop.shutdown()
        return loop, items

    loop, items = asyncio.run(main())
    assert [out.token_ids for _, out in sorted(item for item in items[1:] if item[1].finished)] == greedy
    metrics, stats = loop.metrics, engine.scheduler.spec_stats
    assert sample(metrics, "spec_decode_num_drafts_total") == stats.num_drafts == 2 * steps
    assert sample(metrics, "spec_decode_num_draft_tokens_total") == stats.num_draft_tokens == 2 * steps * k
    assert sample(metrics, "spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens == 2 * steps * m
    assert sample(metrics, "spec_decode_acceptance_rate") == pytest.approx(m / k)
    assert sample(metrics, "spec_decode_mean_acceptance_length") == pytest.approx(1 + m)
    assert [sample(metrics, "spec_decode_per_position_acceptance", {"position": str(i)}) for i in range(k)] == [1, 1, 0]
    assert SpecSnapshot.parse(generate_latest(metrics.registry).decode()).accepted_per_position == [8, 8, 0]


def _state(histogram: list[int]) -> EngineState:
    k = len(histogram) - 1
    drafts = sum(histogram)
    accepted = sum(n * c for n, c in enumerate(histogram))
    return EngineState(1, 0, 10, 16, 0, drafts, drafts * k, accepted, histogram)


def test_speculation_metrics_from_spec_stats():
    metrics = ServerMetrics(3)
    metrics.update(_state([0, 0, 0, 0]))
    page = generate_latest(metrics.registry).decode()
    assert 'atom_like:spec_decode_per_position_acceptance{position="2"} 0.0' in page
    assert SpecSnapshot.parse(page).num_speculative_tokens == 3

    metrics.update(_state([1, 1, 0, 2]))  # 4 drafts: 0, 1, 3 and 3 accepted of 3
    before = SpecSnapshot.parse(generate_latest(metrics.registry).decode())
    metrics.update(_state([1, 1, 0, 6]))  # 4 more, all accepted
    after = SpecSnapshot.parse(generate_latest(metrics.registry).decode())

    assert (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens) == (4, 12, 7)
    assert before.accepted_per_position == [3, 2, 2]
    assert before.per_position_acceptance == [0.75, 0.5, 0.5]
    assert before.mean_acceptance_length == pytest.approx(1 + 7 / 4)
    window = after.minus(before)
    assert (window.num_drafts, window.acceptance_rate, window.mean_acceptance_length) == (4, 1.0, 4.0)
    assert sample(metrics, "spec_decode_acceptance_rate") == pytest.approx(19 / 24)
    assert sample(metrics, "spec_decode_per_position_acceptance", {"position": "0"}) == pytest.approx(7 / 8)
    assert sample(metrics, "spec_decode_mean_acceptance_length") == pytest.approx(1 + 19 / 8)
    assert sample(metrics, "kv_cache_usage_perc") == pytest.approx(6 / 16)


def test_engine_stats_follow_a_request(engine):
    """LLMEngine.stats(), what the server reads off the engine: a request is waiting, then
    running and holding blocks, then gone with every block back; a snapshot never changes."""
    assert engine.stats().num_free_blocks == engine.stats().num_blocks == 16
    engine.add_request([5, 6, 7], GREEDY, request_id="stats")
    queued = engine.stats()
    assert (queued.num_waiting, queued.num_running) == (1, 0) and engine.is_waiting("stats")
    engine.step()
    running = engine.stats()
    assert (running.num_waiting, running.num_running) == (0, 1) and not engine.is_waiting("stats")
    assert running.num_free_blocks < running.num_blocks and engine.has_request("stats")
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.stats()
    assert not engine.has_request("stats") and done.num_free_blocks == done.num_blocks and done.num_running == 0
    assert queued.num_waiting == 1
    with pytest.raises(FrozenInstanceError):
        done.num_running = 1  # type: ignore[misc]
    assert engine.vocab_size == 128 and engine.failure is None


def test_the_server_reads_only_public_engine_api():
    """The server code reaches the engine through LLMEngine's public methods and properties, never
    its scheduler, block manager, runner or request table (which the engine may change freely)."""
    entrypoints = Path(__file__).parents[1] / "atom_like" / "entrypoints"
    internal = re.compile(r"engine\.(scheduler|block_manager|runner|requests|_\w+)\b")
    found = [f"{path.name}: {m.group(0)}" for path in sorted(entrypoints.glob("*.py"))
             for m in internal.finditer(path.read_text())]
    assert not found, found
