"""Tensor-parallel execution (`-tp N`): N ranks, one process and one device each, all running
the same ModelRunner step; the scheduler, tokenizer and HTTP server stay in the driver.

Two ways to start the ranks, both on torch.distributed (NCCL on CUDA, RCCL on ROCm, gloo on CPU):

* spawn (the default): the process that builds the LLMEngine is the driver. It starts N
  workers with torch.multiprocessing (spawn), sends each step's StepBatch (host metadata only,
  pickled once) to all of them over pipes and returns rank 0's results. Every rank samples the
  same tokens (ModelRunner's note), which the driver checks each step. The driver is not a rank,
  so while the workers sit in a collective it still watches their sentinels: a worker that raises
  sends (rank, traceback) and exits, one that dies (OOM killer, kill -9) closes its sentinel, and
  either way the driver terminates every worker and raises an error naming the rank. Workers
  ignore Ctrl-C (the driver's to handle) and exit when the driver dies, however it dies.
* torchrun (env:// rendezvous, one host or many):
      torchrun --nproc-per-node N -m atom_like.entrypoints.openai_server --model DIR -tp N
  Every rank runs the entry point; rank 0 is the driver and also rank 0's worker, and broadcasts
  each step to the others over a gloo group; ranks > 0 never return from LLMEngine(): they serve
  rank 0's steps and exit when it shuts down. torchrun's agent stops every rank when one fails.

A -tp the model cannot be split by (heads, KV heads, vocabulary, intermediate sizes, quantization
blocks) or more GPUs than exist are refused before any process starts: the model and draft are
built as meta-device skeletons for rank 0 of N, which runs every layer's own divisibility check.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from atom_like.config import EngineArgs, load_model_config, resolve_device, text_config
from atom_like.engine.model_runner import ModelRunner, ProposerFactory
from atom_like.engine.scheduler import SeqStepResult
from atom_like.engine.step_inputs import StepBatch
from atom_like.loader.quark import checkpoint_quantizer
from atom_like.loader.weights import check_tp_slices
from atom_like.models.registry import build_model, draft_model_class, target_model_class
from spec_decode.step_costs import StepCosts
from model_ops import tp

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 1.0  # after a failure, how long peers get to die too, so that a death is reported as the cause
WORKER_START_TIMEOUT_S = 3600.0  # loading a large checkpoint is slow; a dead worker is noticed at once anyway
CONTROL_TIMEOUT = timedelta(days=365)  # torchrun ranks > 0 wait for rank 0's next step however idle the server is


class StepExecutor(Protocol):
    """What LLMEngine needs of whatever runs its steps: a ModelRunner in-process (-tp 1) or
    one of the tensor-parallel executors here."""

    num_blocks: int
    vocab_size: int
    num_spec_tokens: int
    step_costs: StepCosts | None  # a decode step's device time per batch and k (with a draft; rank 0's)
    failure: str | None  # why the executor can run no more steps (a rank died); None while healthy

    def launch(self, batch: StepBatch) -> None:
        """Start a step; returns before it is done (ModelRunner.launch)."""

    def collect(self) -> list[SeqStepResult]:
        """The results of the oldest step launched and not yet collected."""

    def abandon(self) -> None:
        """Forget every step launched and not collected (after a failure)."""

    def profile(self, trace_dir: str | None, record_host: bool = True) -> None:
        """Start recording every rank's steps into trace_dir (rank<r>.trace.json); None: stop and
        write them, returning once every rank has (ModelRunner.profile)."""

    def shutdown(self) -> None: ...


class WorkerError(RuntimeError):
    """A tensor-parallel rank raised or died; the executor has stopped every rank."""


@dataclass
class WorkerInfo:
    rank: int
    device: str
    num_blocks: int
    vocab_size: int
    num_spec_tokens: int
    step_costs: StepCosts | None
    block_bytes: int  # KV bytes of one block on this rank
    param_bytes: int  # this rank's weights


def make_executor(args: EngineArgs, hf_config: PretrainedConfig, device: torch.device, dtype: torch.dtype,
                  max_model_len: int, proposer_factory: ProposerFactory | None) -> StepExecutor:
    if args.tensor_parallel_size == 1:
        return ModelRunner(args, hf_config, device, dtype, max_model_len, proposer_factory)
    launch = torchrun_launch(args.tensor_parallel_size)
    check_tensor_parallel(args, hf_config, dtype, device, count_devices=launch is None)
    if launch is None:
        return SpawnExecutor(args, dtype, max_model_len, proposer_factory)
    rank, local_rank = launch
    if rank == 0:
        return TorchrunExecutor(args, dtype, max_model_len, proposer_factory, local_rank)
    serve_torchrun_rank(rank, local_rank, args, dtype, max_model_len, proposer_factory)
    raise SystemExit(0)


# ----------------------------------------------------------------------------- checks before any process starts

def check_tensor_parallel(args: EngineArgs, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                          count_devices: bool = True) -> None:
    n = args.tensor_parallel_size
    if device.type == "cuda" and count_devices and n > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {n} needs {n} GPUs (one per rank) but torch sees "
                         f"{torch.cuda.device_count()}")
    meta = torch.device("meta")
    with tp.tp_state(0, n):
        for what, path, config, cls, quantize in _models(args, hf_config):
            try:
                check_tp_slices(build_model(cls, config, dtype, meta, quantize=quantize))
            except ValueError as exc:
                raise ValueError(f"the {what} {path} at --tensor-parallel-size {n}: {exc}") from exc


def _models(args: EngineArgs, hf_config: PretrainedConfig):
    """(what, path, config, class, quantize) of each model a rank builds, as ModelRunner builds them
    (the MoE backend left to auto: the meta device is no platform; the ranks check --moe-backend)."""
    yield ("model", args.model, text_config(hf_config), target_model_class(hf_config),
           checkpoint_quantizer(hf_config, args.mxfp4_activations, fuse_shared_experts=args.fuse_shared_experts))
    if args.method == "eagle3":
        config = load_model_config(args.draft_model, args.trust_remote_code)
        yield "draft", args.draft_model, config, draft_model_class(config), None


# ----------------------------------------------------------------------------- one rank

def init_rank(rank: int, local_rank: int, args: EngineArgs, init_method: str) -> torch.device:
    """Join the group as `rank` (device cuda:local_rank, or the CPU) and set model_ops.tp."""
    size = args.tensor_parallel_size
    if resolve_device(args.device).type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"  # RCCL under ROCm torch
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, torch.get_num_threads() // size))  # the ranks share the cores
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    tp.set_state(tp.TPState(rank, size, dist.group.WORLD, device, one_shot=_one_shot(device, args)))
    return device


def _one_shot(device: torch.device, args: EngineArgs) -> tp.OneShotAllReduce | None:
    """The small-message all-reduce over peer memory, where every rank can map every other's:
    NVIDIA GPUs of one host. Every rank reaches the same answer (same flags, same platform); if
    setting it up fails anywhere, all ranks fall back to NCCL together."""
    one_host = int(os.environ.get("LOCAL_WORLD_SIZE", args.tensor_parallel_size)) == args.tensor_parallel_size
    if device.type != "cuda" or torch.version.hip is not None or args.disable_custom_all_reduce or not one_host:
        return None
    try:
        one_shot, error = tp.OneShotAllReduce(dist.group.WORLD, device, fused_norm=args.fuse_all_reduce_norm), ""
    except RuntimeError as exc:  # no peer access between the GPUs, a torch without symmetric memory
        one_shot, error = None, str(exc).splitlines()[0]
    ok = torch.tensor([one_shot is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        logger.warning("one-shot all-reduce unavailable (%s): NCCL sums everything", error or "on another rank")
        return None
    return one_shot


def _rank_runner(args: EngineArgs, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 proposer_factory: ProposerFactory | None) -> ModelRunner:
    hf_config = load_model_config(args.model, args.trust_remote_code)
    return ModelRunner(args, hf_config, device, dtype, max_model_len, proposer_factory)


def _info(runner: ModelRunner) -> WorkerInfo:
    return WorkerInfo(tp.rank(), str(runner.device), runner.num_blocks, runner.vocab_size, runner.num_spec_tokens,
                      runner.step_costs, runner.block_bytes, runner.param_bytes)


def _log_ranks(infos: list[WorkerInfo]) -> None:
    for info in infos:
        logger.info("tensor-parallel rank %d on %s: weights %.1f MiB, KV %d blocks of %.1f KiB", info.rank,
                    info.device, info.param_bytes / 2**20, info.num_blocks, info.block_bytes / 2**10)


# ----------------------------------------------------------------------------- spawn: driver and workers

@dataclass
class _WorkerSpec:
    args: EngineArgs
    dtype: torch.dtype
    max_model_len: int
    proposer_factory: ProposerFactory | None
    init_method: str
    log_level: int


def _worker_main(rank: int, spec: _WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the driver decides
    _exit_with_parent()
    logging.basicConfig(level=spec.log_level if rank == 0 else max(spec.log_level, logging.WARNING),
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    try:
        device = init_rank(rank, rank, spec.args, spec.init_method)
        runner = _rank_runner(spec.args, device, spec.dtype, spec.max_model_len, spec.proposer_factory)
        conn.send(("ready", _info(runner)))
        while (message := pickle.loads(conn.recv_bytes())) is not None:
            if message == "collect":
                conn.send(("result", runner.collect()))
            elif message == "abandon":
                runner.abandon()
            elif isinstance(message, tuple):  # ("profile", trace_dir, record_host)
                conn.send(("profiled", _try_profile(runner, *message[1:])))
            else:
                runner.launch(message)
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the driver must hear of it before we go
        try:
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))
        except OSError:
            pass  # the driver is gone already
        raise SystemExit(1) from None
    dist.destroy_process_group()


def _try_profile(runner: ModelRunner, trace_dir: str | None, record_host: bool) -> str | None:
    """runner.profile; a refusal (already recording, nothing recording) is the caller's error to
    report, not a reason for the rank to exit."""
    try:
        runner.profile(trace_dir, record_host)
    except RuntimeError as exc:
        return str(exc)
    return None


def _exit_with_parent() -> None:
    """End this worker when the driver ends, even by SIGKILL and while blocked in a collective."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


class SpawnExecutor:
    def __init__(self, args: EngineArgs, dtype: torch.dtype, max_model_len: int,
                 proposer_factory: ProposerFactory | None):
        self.size = args.tensor_parallel_size
        self.failure: str | None = None
        try:
            pickle.dumps(proposer_factory)
        except Exception as exc:
            raise ValueError(f"proposer_factory must be picklable (a module-level function or class) to reach "
                             f"the --tensor-parallel-size {self.size} workers: {exc}") from exc
        self._store = tempfile.mkdtemp(prefix="atom_like_tp_")
        spec = _WorkerSpec(args, dtype, max_model_len, proposer_factory, f"file://{self._store}/rendezvous",
                           logging.getLogger().getEffectiveLevel())
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        for rank in range(self.size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, spec, theirs), name=f"atom_like-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._store)
        infos: list[WorkerInfo] = self._collect("ready", timeout=WORKER_START_TIMEOUT_S)
        _log_ranks(infos)
        self.infos = infos
        self.num_blocks, self.vocab_size = infos[0].num_blocks, infos[0].vocab_size
        self.num_spec_tokens, self.step_costs = infos[0].num_spec_tokens, infos[0].step_costs
        logger.info("tensor parallel: %d workers (pids %s)", self.size, [p.pid for p in self.procs])

    def launch(self, batch: StepBatch) -> None:
        self._send(batch)

    def collect(self) -> list[SeqStepResult]:
        self._send("collect")
        per_rank: list[list[SeqStepResult]] = self._collect("result")
        self._check_agreement(per_rank)
        return per_rank[0]

    def abandon(self) -> None:
        if self.failure is None:  # else the workers are gone
            self._send("abandon")

    def profile(self, trace_dir: str | None, record_host: bool = True) -> None:
        self._send(("profile", trace_dir, record_host))
        refused = [why for why in self._collect("profiled") if why is not None]
        if refused:
            raise RuntimeError(refused[0])

    def _send(self, message: StepBatch | str | tuple) -> None:
        """To every worker: a step to launch, "collect" (reply with the oldest step's results),
        "abandon" (forget the steps not collected) or ("profile", ...) (reply when done)."""
        if self.failure is not None:
            raise WorkerError(self.failure)
        data = pickle.dumps(message)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError:
            pass  # a worker is gone: _collect names it

    def _collect(self, kind: str, timeout: float | None = None) -> list:
        """One `kind` reply from every rank, watching every worker's sentinel meanwhile."""
        replies: dict[int, object] = {}
        while len(replies) < self.size:
            pending = [r for r in range(self.size) if r not in replies]
            ready = multiprocessing.connection.wait([self.conns[r] for r in pending] + [p.sentinel for p in self.procs],
                                                    timeout)
            if not ready:
                self._fail(f"tensor-parallel ranks {pending} sent nothing for {timeout:.0f} s")
            for r, (conn, proc) in enumerate(zip(self.conns, self.procs)):
                if conn in ready or proc.sentinel in ready:
                    message = _receive(conn)
                    if message is None or message[0] == "error":
                        self._report_failure(kind, {r: message} if message else {})
                    replies[r] = message[1]
        return [replies[r] for r in range(self.size)]

    def _report_failure(self, kind: str, errors: dict[int, tuple]) -> None:
        """Name the root cause: a rank that died outright (its peers then fail in their
        collectives, and may say so first) before a rank that raised."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for r, conn in enumerate(self.conns):
            if r not in errors and (message := _receive(conn)) is not None and message[0] == "error":
                errors[r] = message
        died = [r for r, proc in enumerate(self.procs) if proc.exitcode is not None and r not in errors]
        for r, (_, exc_type, text, trace) in sorted(errors.items()):
            logger.error("tensor-parallel rank %d failed:\n%s", r, trace)
        if died:
            proc = self.procs[died[0]]
            self._fail(f"tensor-parallel rank {died[0]} (pid {proc.pid}) died: {_exit_reason(proc.exitcode)}")
        if not errors:
            self._fail("a tensor-parallel worker closed its pipe but is still running")
        r, (_, exc_type, text, _) = min(errors.items())
        self._fail(f"tensor-parallel rank {r} failed: {exc_type}: {text}",
                   ValueError if exc_type == "ValueError" and kind == "ready" else WorkerError)

    def _check_agreement(self, per_rank: list[list[SeqStepResult]]) -> None:
        tokens = [[(r.new_token_ids, r.num_accepted, r.draft_token_ids) for r in results] for results in per_rank]
        for rank in range(1, self.size):
            if tokens[rank] != tokens[0]:
                self._fail(f"tensor-parallel rank {rank} sampled other tokens than rank 0 ({tokens[rank]} vs "
                           f"{tokens[0]}): the ranks' logits or RNG states diverged")

    def _fail(self, message: str, error: type[Exception] = WorkerError) -> None:
        self.failure = message
        self._finalizer()  # stops every worker, including those blocked in a collective
        raise error(message)

    def shutdown(self) -> None:
        self._finalizer()


def _receive(conn: multiprocessing.connection.Connection) -> tuple | None:
    """The next message on `conn`, None when the worker closed it (it exited)."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _stop_workers(procs: list[multiprocessing.Process], conns: list[multiprocessing.connection.Connection],
                  store: str, timeout: float = 10.0) -> None:
    """Ask every worker to finish, then terminate (and kill) whatever is left; never raises."""
    stop = pickle.dumps(None)
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout if proc.exitcode is None else 0)
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(store, ignore_errors=True)


# ----------------------------------------------------------------------------- torchrun

def torchrun_launch(tp_size: int) -> tuple[int, int] | None:
    """(rank, local rank) when this process is one of a torchrun launch's ranks, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or "RANK" not in os.environ:
        return None
    if world != tp_size:
        raise ValueError(f"launched by torchrun with WORLD_SIZE {world} but --tensor-parallel-size {tp_size}: "
                         f"each torchrun rank is one tensor-parallel rank, pass -tp {world}")
    return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))


def _torchrun_rank(rank: int, local_rank: int, args: EngineArgs) -> tuple[torch.device, dist.ProcessGroup]:
    device = init_rank(rank, local_rank, args, "env://")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # host messages: steps, shutdown
    return device, control


class TorchrunExecutor:
    """Rank 0 of a torchrun launch: runs its own ModelRunner and broadcasts every step first."""

    def __init__(self, args: EngineArgs, dtype: torch.dtype, max_model_len: int,
                 proposer_factory: ProposerFactory | None, local_rank: int):
        device, self.control = _torchrun_rank(0, local_rank, args)
        self.runner = _rank_runner(args, device, dtype, max_model_len, proposer_factory)
        self.num_blocks, self.vocab_size = self.runner.num_blocks, self.runner.vocab_size
        self.num_spec_tokens, self.step_costs = self.runner.num_spec_tokens, self.runner.step_costs
        self.failure: str | None = None
        _log_ranks([_info(self.runner)])
        # at the latest at interpreter exit: the other ranks wait for rank 0's word to exit cleanly
        self._finalizer = weakref.finalize(self, _release_torchrun_ranks, self.control)

    def launch(self, batch: StepBatch) -> None:
        dist.broadcast_object_list([batch], src=0, group=self.control)
        self.runner.launch(batch)

    def collect(self) -> list[SeqStepResult]:
        dist.broadcast_object_list(["collect"], src=0, group=self.control)
        return self.runner.collect()

    def abandon(self) -> None:
        dist.broadcast_object_list(["abandon"], src=0, group=self.control)
        self.runner.abandon()

    def profile(self, trace_dir: str | None, record_host: bool = True) -> None:
        self.runner.profile(trace_dir, record_host)  # first: a refusal here reaches no other rank
        dist.broadcast_object_list([("profile", trace_dir, record_host)], src=0, group=self.control)
        dist.barrier(group=self.control)  # every rank's trace is written

    def shutdown(self) -> None:
        self._finalizer()


def _release_torchrun_ranks(control: dist.ProcessGroup) -> None:
    """Tell the other ranks to exit; never raises (a rank already gone is torchrun's agent's to stop)."""
    try:
        dist.broadcast_object_list([None], src=0, group=control)
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - shutdown path: report, do not mask what ended the server
        logger.warning("tensor parallel: could not release the other torchrun ranks (%s)", exc)


def serve_torchrun_rank(rank: int, local_rank: int, args: EngineArgs, dtype: torch.dtype, max_model_len: int,
                        proposer_factory: ProposerFactory | None) -> None:
    """A torchrun rank > 0: run every step rank 0 broadcasts until it sends None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 shuts down, then releases us
    device, control = _torchrun_rank(rank, local_rank, args)
    runner = _rank_runner(args, device, dtype, max_model_len, proposer_factory)
    _log_ranks([_info(runner)])
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        if message[0] is None:
            break
        if message[0] == "collect":
            runner.collect()  # every rank reads its results back, so none runs ahead unboundedly
        elif message[0] == "abandon":
            runner.abandon()
        elif isinstance(message[0], tuple):  # ("profile", trace_dir, record_host): rank 0 accepted it
            why = _try_profile(runner, *message[0][1:])
            if why is not None:
                logger.warning("rank %d: %s", rank, why)
            dist.barrier(group=control)
        else:
            runner.launch(message[0])
    dist.destroy_process_group()
