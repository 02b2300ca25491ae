"""The one thread that owns the LLMEngine.

The engine is synchronous and not thread-safe, so HTTP handlers never call it. They hand
commands (submit, abort, a call such as start_profile) to this thread through a thread-safe
queue; the thread applies them between engine steps, steps the engine while it has work and
sleeps on the queue while it has none. Results go back to each HTTP request's asyncio.Queue (its "sink") through
`loop.call_soon_threadsafe`, one call per step for all requests.

Fair admission: an admitted submit's requests wait here, not in the engine's queue, and are
handed to the engine round-robin across submits, only as many as the scheduler can start in
its next step (so the engine's waiting queue holds at most max(1, max_num_seqs - running)
sequences). A request with 2,000 prompts therefore takes turns with a one-prompt request sent
after it instead of queueing all 2,000 ahead of it: the small one enters the engine after at most
one more of the big one's sequences, and starts after at most max_num_seqs + 1 of them.

What a sink receives, in order: `Admitted` or `Rejected` (the answer to the submit), then
`(index, RequestOutput)` for every step that changed request `index` of the submit, the last one
finished; or `Failed` when the engine broke while running it. An exception inside the engine
never ends the thread: the requests it touched fail, the rest keep running.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from atom_like.entrypoints.metrics import EngineState, ServerMetrics, StatsLogger
from atom_like.sampling_params import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: str | None  # the text, when the client sent text (echoed in RequestOutput.prompt)
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Admitted:
    """All requests of a submit are queued in the engine."""


@dataclass(frozen=True)
class Rejected:
    """The engine refused a request of the submit (a ValueError); none of them was queued."""
    message: str


@dataclass(frozen=True)
class Failed:
    """The engine raised while running this request; it was aborted."""
    message: str


SinkItem = Admitted | Rejected | Failed | tuple[int, RequestOutput]


@dataclass(frozen=True)
class _Submit:
    requests: list[EngineRequest]
    sink: asyncio.Queue
    arrival: float


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class _Call:
    fn: Callable[[object], object]  # given the engine, on the engine thread
    future: concurrent.futures.Future


_STOP = object()


@dataclass
class _Live:
    """Engine-thread bookkeeping of one admitted request."""
    sink: asyncio.Queue
    index: int
    arrival: float
    num_prompt_tokens: int
    in_engine: bool = False  # else still waiting for its turn in `_pending`
    first_token_time: float | None = None
    num_generated: int = 0


@dataclass
class _Pending:
    """An admitted submit's requests not yet handed to the engine."""
    sink: asyncio.Queue
    requests: deque[EngineRequest] = field(default_factory=deque)


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics, stats_interval: float = 10.0):
        self.engine = engine
        self.metrics = metrics
        self.stats = StatsLogger(metrics, stats_interval)
        self.warmup_error: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._pending: deque[_Pending] = deque()  # round-robin order
        self._warm = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ event-loop side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="atom-like-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """A forward has run and the thread is serving."""
        return self._warm.is_set() and self.warmup_error is None and self._thread is not None and self._thread.is_alive()

    def submit(self, requests: list[EngineRequest], sink: asyncio.Queue) -> None:
        self._commands.put(_Submit(requests, sink, time.monotonic()))

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(_Abort(request_ids))

    def call(self, fn: Callable[[object], object]) -> concurrent.futures.Future:
        """fn(engine) on the engine thread between steps; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        return future

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        self._warm_up()
        self.metrics.update(self._state())
        while True:
            try:
                if not self._apply_commands(block=not self._has_work()):
                    return
                self._feed()
                if self.engine.has_unfinished_requests():
                    self._step()
                self.stats.maybe_log(time.monotonic(), self._state())
            except Exception:  # a bug in this loop itself: log it, keep the server alive
                logger.exception("engine loop error")

    def _warm_up(self) -> None:
        """One real forward before /health turns green: lazy initialisation (kernels, graphs,
        allocator) happens here rather than in a client's request, and a broken device shows up
        as an unhealthy server rather than as a failed request."""
        start = time.monotonic()
        try:
            self.engine.add_request(None, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                    "warmup", prompt_ids=[0])
            while self.engine.has_unfinished_requests():
                self.engine.step()
            logger.info("warm-up forward done in %.2f s; serving", time.monotonic() - start)
        except Exception as exc:
            logger.exception("warm-up forward failed")
            self.warmup_error = f"{type(exc).__name__}: {exc}"
            self.engine.abort_request("warmup")
        self._warm.set()

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; when `block`, first wait for one (the engine is idle).
        Returns False when asked to stop."""
        try:
            if block:
                command = self._commands.get(timeout=self.stats.seconds_until_due(time.monotonic()))
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return True
        deliveries: list[tuple[asyncio.Queue, SinkItem]] = []
        while command is not _STOP:
            if isinstance(command, _Submit):
                deliveries.append((command.sink, self._admit(command)))
            elif isinstance(command, _Call):
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as exc:  # the caller's to report; the engine keeps serving
                    command.future.set_exception(exc)
            else:
                self._abort(command.request_ids)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self.metrics.update(self._state())
        self._deliver(deliveries)
        return command is not _STOP

    def _has_work(self) -> bool:
        return bool(self._pending) or self.engine.has_unfinished_requests()

    def _state(self) -> EngineState:
        return EngineState.read(self.engine, num_pending=sum(len(p.requests) for p in self._pending))

    def _admit(self, command: _Submit) -> SinkItem:
        """All or nothing: a batch with one bad prompt queues none of its prompts."""
        try:
            for r in command.requests:
                self.engine.validate(r.prompt_ids, r.params)
                if r.request_id in self._live or self.engine.has_request(r.request_id):
                    raise ValueError(f"request id {r.request_id!r} is already in use")
        except ValueError as exc:
            return Rejected(str(exc))
        for index, r in enumerate(command.requests):
            self._live[r.request_id] = _Live(command.sink, index, command.arrival, len(r.prompt_ids))
        self._pending.append(_Pending(command.sink, deque(command.requests)))
        return Admitted()

    def _feed(self) -> None:
        """Hand pending requests to the engine, one per submit in turn, while the scheduler could
        start more sequences in its next step than it has waiting."""
        deliveries: list[tuple[asyncio.Queue, SinkItem]] = []
        while self._pending and self._engine_has_room():
            pending = self._pending.popleft()
            r = pending.requests.popleft()
            if pending.requests:
                self._pending.append(pending)
            try:
                self.engine.add_request(r.prompt, r.params, r.request_id, prompt_ids=r.prompt_ids)
                self._live[r.request_id].in_engine = True
            except Exception as exc:  # validated at admission: a bug, fail this submit's requests
                logger.exception("engine add_request failed")
                deliveries += self._fail([r.request_id] + [x.request_id for x in pending.requests],
                                         f"the engine could not queue the request ({type(exc).__name__}: {exc})")
        self._deliver(deliveries)

    def _engine_has_room(self) -> bool:
        s = self.engine.stats()
        return s.num_waiting < max(1, s.max_num_seqs - s.num_running)

    def _abort(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        for live in self._remove(request_ids):
            self._finished(live, "abort", now)

    def _remove(self, request_ids: list[str]) -> list[_Live]:
        """Take live requests out of the engine or the pending queue (ids that already finished
        are skipped); returns their bookkeeping."""
        removed, not_fed = [], set()
        for request_id in request_ids:
            live = self._live.pop(request_id, None)
            if live is None:
                continue
            removed.append(live)
            if live.in_engine:
                self.engine.abort_request(request_id)
            else:
                not_fed.add(request_id)
        if not_fed:
            for pending in self._pending:
                pending.requests = deque(r for r in pending.requests if r.request_id not in not_fed)
            self._pending = deque(p for p in self._pending if p.requests)
        return removed

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was running, serving the rest")
            self._fail_running(f"the engine failed while running this request ({type(exc).__name__}: {exc}); "
                               "other requests were not affected")
            outputs = []
        now = time.monotonic()
        deliveries: list[tuple[asyncio.Queue, SinkItem]] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            num_tokens = out.num_tokens
            if live.first_token_time is None and num_tokens:
                live.first_token_time = now
                self.metrics.first_token(now - live.arrival, live.num_prompt_tokens)
            self.metrics.generated(num_tokens - live.num_generated)
            live.num_generated = num_tokens
            if out.finished:
                del self._live[out.request_id]
                self._finished(live, out.finish_reason, now)
            deliveries.append((live.sink, (live.index, out)))
        self.metrics.update(self._state())
        self._deliver(deliveries)

    def _fail_running(self, message: str) -> None:
        """Abort the requests the failed step may have touched: all but those still waiting (a
        waiting request was not in the batch, so its state is intact). When no request was
        running, the fault is not tied to a batch and would recur on every step: fail them all."""
        touched = [request_id for request_id, live in self._live.items()
                   if live.in_engine and not self.engine.is_waiting(request_id)]
        self._deliver(self._fail(touched or list(self._live), message))

    def _fail(self, request_ids: list[str], message: str) -> list[tuple[asyncio.Queue, SinkItem]]:
        now = time.monotonic()
        deliveries: list[tuple[asyncio.Queue, SinkItem]] = []
        for live in self._remove(request_ids):
            self._finished(live, "error", now)
            deliveries.append((live.sink, Failed(message)))
        return deliveries

    def _finished(self, live: _Live, reason: str, now: float) -> None:
        decode_time = now - live.first_token_time if live.first_token_time is not None else None
        self.metrics.finished(reason, now - live.arrival, decode_time, live.num_generated)

    def _deliver(self, deliveries: list[tuple[asyncio.Queue, SinkItem]]) -> None:
        if not deliveries:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, deliveries)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


def _put_all(deliveries: list[tuple[asyncio.Queue, SinkItem]]) -> None:
    for sink, item in deliveries:
        sink.put_nowait(item)
