"""Adaptive draft length vs no speculation vs each fixed k (issue 19's benchmark).

Part "forced": the Llama-3.1-8B shape, random weights (--load-format dummy: config.json alone),
bf16, decode graphs, EAGLE3 with k at most 5 and a real random draft running every step, while
verification accepts exactly min(m, drafted) drafts (spec_decode.testing.ForcedAcceptance), for
m = 0..5 and batch 1/8/32/64/128: decode tokens/s without speculation, at fixed k = 1..5 and
adaptive (spec_decode/adaptive.py). Graphs are captured once: the fixed and adaptive modes are
draft policies swapped on the same speculative engine (k = j every step is exactly a fixed-k
engine's work); no speculation is k = 0 on that engine and batch, and a plain engine is measured
against it at equal context once a point.

Part "zoo": the SmolLM2 pair (smollm2-135m + smollm2-135m-eagle3 from $ATOM_LIKE_CACHE, as
ci/nightly_gsm8k.sh uses them) on GSM8K questions (ShareGPT if GSM8K is not installed), at
temperature 0 and 1: the same modes on real acceptance. Skipped, with a note, where the pair is
not in the cache.

Each point runs the modes interleaved on one running batch (`interleaved`): a batch prefilled on
both engines, `--warm` untimed steps of every mode, then `--rounds` rounds in which every mode
runs `--settle` untimed and `--window` timed steps (zoo: `--zoo-rounds`, `--zoo-window`), modes
forwards then backwards. Why: SmolLM2's steps are host-bound, and one mode's windows minutes apart
moved by up to 1.6x (docs/benchmarks.md section 11), more than the differences measured; turns of
a fraction of a second put the machine's drift on every mode alike and every mode sees the same
contexts. tokens/s = the median over a mode's pairs of rounds (forwards, then backwards: the same
mean position in the round for every mode) of the tokens the pair's turns generated / their wall
time (the machine slowed single turns by 10-17% now and then, device-bound steps too). Every mode also
records each round's tokens/s, its median step overall and per k, the steps that ran eagerly
instead of replaying graphs, and the full (generation 2) garbage collections that fell inside its
windows. `--policy-b FILE` adds the adaptive policy of a saved spec_decode/adaptive.py as a mode
(`git show REV:spec_decode/adaptive.py > FILE`): two policies A/B in one run. It repeats: several
candidates in one run, each a mode (one run of the same policy moved its worst point by ~0.1x on the
host-bound SmolLM2 pair, so a candidate is judged against its peers in the same turns).

    python ci/bench_adaptive.py                 # GPU, ~7 min on one H100
    python ci/bench_adaptive.py --smoke         # CPU, tiny model, < 1 min (tests/test_bench_adaptive.py)
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import tempfile
import statistics
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, installed or not
from spec_decode.adaptive import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from spec_decode.stats import SpecCounts

from bench_adaptive_report import pair_rates, write_report  # noqa: E402  (ci/ is on the path: a script's folder)

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def write_configs(folder: Path, shape: dict, dtype: str) -> tuple[str, str]:
    """config.json of a Llama target and of an EAGLE3 draft shaped like its layers (dummy weights)."""
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    n = shape["num_hidden_layers"]
    target = dict(architectures=["LlamaForCausalLM"], model_type="llama", **shape, head_dim=h // heads,
                  max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                  torch_dtype=dtype, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    draft = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", **{**shape, "num_hidden_layers": 1},
                 head_dim=h // heads, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False, torch_dtype=dtype, target_hidden_size=h, draft_vocab_size=shape["vocab_size"],
                 eagle_config={"eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3] if n >= 7 else [0, 1, n],
                               "use_aux_hidden_state": True})
    paths = []
    for name, config in (("target", target), ("draft", draft)):
        path = folder / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config))
        paths.append(str(path))
    return paths[0], paths[1]


def forced_engine(target: str, draft: str, k: int, **engine_args):
    """A speculative engine whose verification accepts exactly min(m, drafted); returns (engine, set_m)."""
    from atom_like import LLMEngine
    from spec_decode.testing import ForcedAcceptance

    engine = LLMEngine(target, method="eagle3", draft_model=draft, num_speculative_tokens=k, speculative_adaptive=True,
                       **engine_args)
    forced = engine.runner.sampler.verifier = ForcedAcceptance(0)

    def set_m(m: int) -> None:
        forced.m = m

    return engine, set_m


class Watch:
    """What a timed window did besides its steps: steps that ran eagerly instead of replaying the
    decode graphs (counted where the runner decides), and full garbage collections (gc.callbacks)."""

    def __init__(self, engine):
        self.eager, self.gc2, self.gc2_seconds, self._start = 0, 0, 0.0, 0.0
        self.graphs = engine.runner.graphs  # None with --enforce-eager: every step is eager anyway
        if self.graphs is not None:
            self.graphs.eligible = self._eligible
        gc.callbacks.append(self._gc)

    def _eligible(self, batch) -> bool:
        ok = type(self.graphs).eligible(self.graphs, batch)
        self.eager += not ok
        return ok

    def _gc(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._start = time.perf_counter()
            else:
                self.gc2, self.gc2_seconds = self.gc2 + 1, self.gc2_seconds + time.perf_counter() - self._start

    def close(self) -> dict:
        gc.callbacks.remove(self._gc)
        if self.graphs is not None:
            del self.graphs.eligible  # the class's own again
        return dict(eager_steps=self.eager, gc2=self.gc2, gc2_ms=self.gc2_seconds * 1e3)


def prefill(engine, prompts: list[list[int]], params, tag: str) -> list[str]:
    ids = [engine.add_request(None, params, request_id=f"{tag}-{i}", prompt_ids=p) for i, p in enumerate(prompts)]
    running = engine.scheduler.running
    while any(s.num_generated == 0 for s in running) or len(running) < len(prompts):  # every prompt prefilled
        engine.step()
    return ids


def finish(engine, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()  # collects the step in flight


class Rotation(DraftLengthPolicy):
    """The speculative engine's policy through a whole point, while the modes take turns on it: the
    current mode's policy chooses, and each step's verifications go to the policy that chose it,
    numbered in its own steps (0, 1, 2 ...). So an adaptive policy's acceptance weights decay over
    its own steps only, as if the other windows had not run between its own. Its step samples are
    dropped for the first two steps of a window: the first spans the other windows since its last.

    Each change of k by an adaptive mode ("adaptive" and the saved policies of --policy-b, "adaptive-<name>":
    every saved version has `step_times` and `tracker`) is logged in `choices` with what the policy chose by:
    (its own step, the new k, its step times T(batch, k) in ms for every k, E[accepted | k] for every k);
    ~7 µs of host time an entry (a 2-core CPU machine, 2026-11-27), paid at the few percent of steps that
    change k. Why: the JSON's final prices did not explain the zoo run's drafting at batch 64, T = 1, where
    the policy drafted 42% of its steps with final prices that put every k >= 1 above k = 0
    (docs/benchmarks.md section 11, "The zoo part's verdict run")."""

    FRESH_STEPS = 2

    def __init__(self, policies: dict[str, DraftLengthPolicy]):
        self.policies = policies
        self.max_drafts = max(p.max_drafts for p in policies.values())
        self.mode, self._fresh = next(iter(policies)), 0
        self._chooser: dict[int, tuple[str, int]] = {}  # engine step -> (the mode that chose it, its own step)
        self._steps = collections.Counter()
        self.choices: dict[str, list] = collections.defaultdict(list)

    def switch(self, mode: str) -> None:
        self.mode, self._fresh = mode, self.FRESH_STEPS

    def choose(self, step: int, num_seqs: int) -> int:
        own = self._steps[self.mode]
        self._steps[self.mode] += 1
        self._chooser[step] = (self.mode, own)
        self._chooser.pop(step - 16, None)  # observed long since (two steps of lag)
        self._fresh -= 1
        policy = self.policies[self.mode]
        k = policy.choose(own, num_seqs)
        if self.mode.startswith("adaptive"):
            log = self.choices[self.mode]
            if not log or log[-1][1] != k:
                log.append((own, k, [round(t * 1e3, 4) for t in policy.step_times(num_seqs)],
                            [round(g, 3) for g in policy.tracker.expected_accepted()]))
        return k

    def observe(self, step: int, drafted: list[int], accepted: list[int]) -> None:
        if step in self._chooser:  # (not the prefill's steps)
            mode, own = self._chooser[step]
            self.policies[mode].observe(own, drafted, accepted)

    def observe_step(self, num_seqs: int, k: int, period_seconds: float) -> None:
        if self._fresh < 0:
            self.policies[self.mode].observe_step(num_seqs, k, period_seconds)


def window(engine, settle: int, steps: int) -> dict:
    """`settle` untimed steps (the pipeline and a policy's two-step lag turn over to this window's
    mode), then `steps` timed ones: tokens collected, seconds (to the device's end of the last
    step), each step's period and k, speculation counts, eager steps and full GCs, and the CPU
    seconds the process spent meanwhile (a wall time far above them: the host was descheduled)."""
    for _ in range(settle):
        engine.step()
    running = engine.scheduler.running
    before, spec0 = sum(s.num_generated for s in running), engine.spec_stats.snapshot()
    watch, times, ks = Watch(engine), [], []
    cpu0 = time.process_time()
    last = time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
        ks.append(engine.scheduler.num_drafts_in_flight)
    sync()  # (no sync before: the first timed step follows a settled one)
    times[-1] += time.perf_counter() - last
    return dict(tokens=sum(s.num_generated for s in running) - before, times=times, ks=ks,
                cpu_seconds=time.process_time() - cpu0,
                spec=engine.spec_stats.snapshot().minus(spec0), **watch.close())


def interleaved(plain, spec, policies: dict[str, DraftLengthPolicy], prompt_sets: list[list[list[int]]], params,
                args, tag: str) -> dict[str, dict]:
    """Every policy of `policies` (k = 0, the fixed ks, the adaptive ones) on one running batch of
    `spec`, in turns: `args.rounds` rounds, forwards then backwards, each policy `args.window` timed
    steps a round after `args.settle` untimed ones; `args.warm` untimed steps of each first (first
    uses of what the graphs leave out), `args.adaptive_warm` more of each adaptive policy (a
    server's policy has seen many steps before: it learns its prices online). The machine's drift
    (host-bound steps moved by up to 1.6x between windows minutes apart) then falls on every mode
    alike, and every mode runs at the same contexts. That is why no speculation is k = 0 on the
    same engine and batch: a plain engine's batch would grow by one token a step while the
    speculative one grows by several, and at batch 128 on the 8B shape the longer contexts alone
    cost 1.4 ms of a 9 ms step (2026-11-27). The plain engine ("off") is measured against k = 0 once,
    right after both prefilled the same prompts (two turns each, in turns): the price of a
    speculative engine that proposes nothing. Per mode: tokens/s over all its timed steps, each
    round's, the median step overall and per k (steps at the k of the step before), and what each
    adaptive policy priced steps by. Each of `prompt_sets` is one batch run so, one after another
    (the policies keep what they learnt, as a server's would), their turns pooled."""
    rotation = Rotation(policies)
    spec.draft_policy = rotation
    windows = {mode: [] for mode in ["off", *policies]}
    calibration = []
    for n, prompts in enumerate(prompt_sets):
        set_tag = f"{tag}r{n}"
        ids = {"off": prefill(plain, prompts, params, f"{set_tag}p"), "spec": prefill(spec, prompts, params, f"{set_tag}s")}
        rotation.switch("k=0")
        for _ in range(args.warm):
            plain.step()
            spec.step()
        for first in ("off", "k=0", "k=0", "off"):
            calibration.append((first, window(plain if first == "off" else spec, args.settle, args.window)))
        for mode in policies:  # untimed
            rotation.switch(mode)
            warm = args.warm + (args.adaptive_warm if mode.startswith("adaptive") and n == 0 else 0)
            for _ in range(warm):
                spec.step()
        for rnd in range(args.rounds):
            for mode in policies if rnd % 2 == 0 else list(policies)[::-1]:
                rotation.switch(mode)
                windows[mode].append(window(spec, args.settle, args.window))
        for engine in (plain, spec):  # a request that finished or was preempted would have shrunk the batch
            sched = engine.scheduler
            if len(sched.running) != len(prompts):
                pool = sched.block_manager.num_blocks * sched.block_manager.block_size
                raise RuntimeError(f"{set_tag}: {len(sched.running)} of {len(prompts)} requests still running, "
                                   f"{len(sched.waiting)} preempted (the KV pool holds {pool} tokens): "
                                   "lower --rounds / --window / --warm, or raise max_tokens")
        finish(plain, ids["off"])
        finish(spec, ids["spec"])
    windows["off"] = [w for mode, w in calibration if mode == "off"]
    rows = {mode: summarize(ws, policies.get(mode), len(prompt_sets[0])) for mode, ws in windows.items()}
    for mode, log in rotation.choices.items():
        rows[mode]["choices"] = log
    k0 = summarize([w for mode, w in calibration if mode == "k=0"], None, len(prompt_sets[0]))
    rows["off"]["vs_k0_same_context"] = rows["off"]["tokens_per_s"] / k0["tokens_per_s"]
    return rows


def summarize(windows: list[dict], policy: DraftLengthPolicy | None, num_seqs: int) -> dict:
    times = [t for w in windows for t in w["times"]]
    ks = [k for w in windows for k in w["ks"]]
    by_k = collections.defaultdict(list)
    for w in windows:
        for prev, k, t in zip([None, *w["ks"]], w["ks"], w["times"]):
            if prev == k:
                by_k[k].append(t)
    spec = windows[0]["spec"]
    for w in windows[1:]:
        spec = SpecCounts(spec.num_drafts + w["spec"].num_drafts, 0, spec.num_accepted_tokens + w["spec"].num_accepted_tokens)
    tokens, seconds = sum(w["tokens"] for w in windows), sum(times)
    adaptive = policy is not None and not isinstance(policy, FixedDraftLength)
    seen = policy.times.observed(num_seqs) if adaptive else {}  # the step prices an adaptive policy chose by
    rounds = [w["tokens"] / sum(w["times"]) for w in windows]
    # The median over pairs of rounds (one forwards, the next backwards) of the pair's tokens over its
    # time. A pair puts every mode at the same mean position in the round, so a drift linear in time
    # (contexts grow every step) falls on every mode alike. A median of single turns took the middle
    # round's, where the modes that run first see shorter contexts: at batch 128 and m = 4 on the 8B
    # shape, one round of 7 modes x 11 steps adds ~385 tokens to every context, and k = 0's turns
    # went 12194 -> 8897 -> 8902 tokens/s over three rounds (2026-11-27). The median over pairs keeps
    # what the median turn was for: a pair the machine slowed down (seen: 10-17% in single turns)
    # does not move it.
    # tokens_per_s_all is every turn's tokens over their time.
    pairs = pair_rates([w["tokens"] for w in windows], [sum(w["times"]) for w in windows])
    return dict(tokens_per_s=statistics.median(pairs), tokens_per_s_all=tokens / seconds, tokens=tokens,
                seconds=seconds, mean_k=sum(ks) / len(ks),
                k_steps=dict(collections.Counter(ks)), median_step_ms=statistics.median(times) * 1e3,
                median_step_ms_by_k={k: statistics.median(v) * 1e3 for k, v in sorted(by_k.items())},
                mean_acceptance_length=spec.mean_acceptance_length if spec.num_drafts else 1.0,
                round_tokens_per_s=rounds, round_tokens=[w["tokens"] for w in windows],
                round_median_step_ms=[statistics.median(w["times"]) * 1e3 for w in windows],
                round_cpu_per_wall=[w["cpu_seconds"] / sum(w["times"]) for w in windows],
                price_ms_by_k={k: 1e3 * t for k, t in seen.items()},
                # an adaptive mode's every step (its k, its call's wall ms), window by window: what a
                # change of k costs the steps after it (docs/benchmarks.md section 11)
                steps=[[(k, round(t * 1e3, 4)) for k, t in zip(w["ks"], w["times"])] for w in windows] if adaptive else None,
                eager_steps=sum(w["eager_steps"] for w in windows), gc2=sum(w["gc2"] for w in windows),
                gc2_ms=sum(w["gc2_ms"] for w in windows))


def policies_for(engine, args) -> dict[str, DraftLengthPolicy]:
    """Fixed k = 0..args.k and the adaptive policy; with --policy-b the adaptive policy of each saved
    version of spec_decode/adaptive.py too, as "adaptive-<name>" (an A/B in one run)."""
    k, costs = engine.runner.num_spec_tokens, engine.runner.step_costs
    policies: dict[str, DraftLengthPolicy] = {f"k={j}": FixedDraftLength(j) for j in range(k + 1)}
    policies["adaptive"] = AdaptiveDraftLength(k, costs)
    if args.policy_b:
        from gpu_timing import load_kernel_version

        for path, name in zip(args.policy_b, args.policy_b_name):
            module = load_kernel_version(Path(path), f"adaptive_{name}", package="spec_decode")
            policies[f"adaptive-{name}"] = module.AdaptiveDraftLength(k, costs)
    return policies


def step_costs(engine) -> dict:
    costs = engine.runner.step_costs
    return dict(source=costs.source, buckets=costs.buckets, seconds=costs.seconds)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def tokens_per_request(args, num_modes: int, tokens_per_step: int) -> int:
    """Generated tokens a request of an interleaved point may need: the speculative engine's steps
    (`num_modes` policies' warm and timed turns) at `tokens_per_step` at most, and some slack."""
    steps = num_modes * (args.warm + args.rounds * (args.settle + args.window)) + 2 * args.adaptive_warm
    return (steps + args.warm + 2 * (args.settle + args.window) + 8) * tokens_per_step  # and k = 0's calibration turns


def forced_tokens(args, k: int, m: int, num_adaptive: int) -> int:
    """Tokens a request of a forced point (m drafts accepted) generates on the speculative engine at
    most: each fixed k = j's turns at min(j, m) + 1 tokens a step, each adaptive policy's at m + 1,
    and k = 0's calibration turns."""
    turns = args.warm + args.rounds * (args.settle + args.window)
    fixed = sum(min(j, m) + 1 for j in range(k + 1)) * turns
    return fixed + num_adaptive * (m + 1) * (turns + args.adaptive_warm) + args.warm + 2 * (args.settle + args.window) + 8


def run_forced(args, out: dict) -> None:
    from atom_like import LLMEngine, SamplingParams

    shape, dtype = (TINY, "float32") if args.smoke else (LLAMA_8B, "bfloat16")
    target, draft = write_configs(Path(tempfile.mkdtemp()), shape, dtype)
    k, batches, ms = args.k, args.batches, list(range(args.k + 1))
    max_tokens = tokens_per_request(args, k + 3, k + 1)  # k = 0..k and up to two adaptive policies
    common = dict(load_format="dummy", max_model_len=args.prompt_len + max_tokens + 2 * k + 16,
                  max_num_seqs=max(batches), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = out.setdefault("forced", [])
    # both engines stay up (the plain one needs a batch's KV for the "off" windows alone)
    plain = LLMEngine(target, **common, **({} if args.smoke else dict(gpu_memory_utilization=0.25)))
    spec, set_m = forced_engine(target, draft, k, **common, **({} if args.smoke else dict(gpu_memory_utilization=0.68)))
    gc.collect()
    gc.freeze()  # as the server does once its engine is built
    out["meta"]["forced_step_costs"] = step_costs(spec)
    pool = spec.block_manager.num_blocks * spec.block_manager.block_size
    num_adaptive = len(policies_for(spec, args)) - (k + 1)
    for bs in batches:
        prompts = random_prompts(bs, args.prompt_len, shape["vocab_size"], bs)
        for m in ms:
            # a point whose contexts would outgrow the KV pool (more modes, more accepted drafts) would
            # preempt requests after minutes of turns: say so and go on with the next point
            need = bs * (args.prompt_len + forced_tokens(args, k, m, num_adaptive))
            if need > pool:
                note = f"batch {bs}, m = {m}: {need} tokens of KV needed, the pool holds {pool}"
                out["meta"].setdefault("forced_skipped", []).append(note)
                print(f"forced {note}: skipped (fewer --rounds or modes fit)", flush=True)
                continue
            set_m(m)
            for mode, r in interleaved(plain, spec, policies_for(spec, args), [prompts], params, args, f"b{bs}m{m}").items():
                rows.append(dict(batch=bs, forced=m, mode=mode, **r))
            line = [r for r in rows if r["batch"] == bs and r["forced"] == m]
            print(f"forced batch {bs} m={m}: " + ", ".join(f"{r['mode']} {r['tokens_per_s']:.0f}" for r in line), flush=True)
    del plain, spec
    gc.unfreeze()  # a frozen engine's reference cycles are never collected: its GPU memory would stay held
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def zoo_prompts(engine, n: int) -> list[list[int]] | None:
    from atom_like.benchmarks.acceptance import chat_ids, eval_prompts

    for dataset in ("gsm8k", "sharegpt"):
        try:
            return chat_ids(engine, eval_prompts(dataset, n))
        except (FileNotFoundError, OSError, ValueError) as e:
            print(f"zoo prompts: {dataset} unavailable ({e})")
    return None


def resolve_zoo_pair() -> tuple[str, str] | str:
    """(target, draft) of the SmolLM2 pair, or why this machine's cache lacks it."""
    from atom_like.zoo.registry import resolve

    try:
        draft = str(resolve("smollm2-135m-eagle3", prepare_missing=False))  # trained by ci/train_zoo.sh, not shipped
        return str(resolve("smollm2-135m")), draft  # the target: converted from a pip package on demand
    except Exception as e:  # noqa: BLE001 - the pair is not in this machine's cache
        return f"{type(e).__name__}: {e}"


def run_zoo(args, out: dict) -> None:
    from atom_like import LLMEngine, SamplingParams

    pair = resolve_zoo_pair()
    if isinstance(pair, str):
        out["meta"]["zoo_skipped"] = pair
        print(f"zoo part skipped: {pair}")
        return
    target, draft = pair
    k, batches = args.k, args.batches
    zoo = argparse.Namespace(**{**vars(args), "rounds": args.zoo_rounds, "window": args.zoo_window})
    # every draft accepted at every step, as rare as it is: the pair's acceptance length is ~2 (docs/zoo.md),
    # but with --zoo-sets 4 one of 512 GSM8K prompts ran past a budget of 3 tokens a step (H100, 2026-11-27);
    # contexts grow only as far as the tokens generated, and the KV pool holds the worst case at batch 128
    max_tokens = tokens_per_request(zoo, k + 3, k + 1)
    common = dict(dtype="bfloat16", max_model_len=max_tokens + 1024, max_num_seqs=max(batches), enable_prefix_caching=False)
    rows = out.setdefault("zoo", [])
    plain = LLMEngine(target, **common, gpu_memory_utilization=0.2)
    prompts = zoo_prompts(plain, max(max(batches) * args.zoo_sets, args.zoo_min_seqs))
    if prompts is None:
        out["meta"]["zoo_skipped"] = "no GSM8K or ShareGPT prompts installed"
        return
    spec = LLMEngine(target, method="eagle3", draft_model=draft, num_speculative_tokens=k, speculative_adaptive=True,
                     **common, gpu_memory_utilization=0.4)
    out["meta"]["zoo_step_costs"] = step_costs(spec)
    gc.collect()
    gc.freeze()  # as the server does once its engine is built: full collections skip the start-up heap
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=None)
        for bs in batches:
            # small batches run several batches of other prompts in turn: at batch 1 a turn verifies one
            # draft a step, and acceptance alone moved 16-step turns by 10-30% (2026-11-27)
            sets = [[prompts[(i * bs + j) % len(prompts)] for j in range(bs)]
                    for i in range(max(1, args.zoo_sets, args.zoo_min_seqs // bs))]
            for mode, r in interleaved(plain, spec, policies_for(spec, args), sets, params, zoo,
                                       f"z{bs}t{temperature}").items():
                rows.append(dict(batch=bs, temperature=temperature, mode=mode, **r))
            line = [r for r in rows if r["batch"] == bs and r["temperature"] == temperature]
            print(f"zoo T={temperature} batch {bs}: " + ", ".join(f"{r['mode']} {r['tokens_per_s']:.0f}" for r in line),
                  flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 model on CPU, batches 1 and 4, k <= 2, forced part only")
    parser.add_argument("--parts", default="forced,zoo")
    parser.add_argument("--k", type=int, default=5, help="the most drafts a step proposes")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--warm", type=int, default=6, help="untimed steps of every mode before a point's rounds")
    parser.add_argument("--adaptive-warm", type=int, default=30, help="more untimed steps of each adaptive policy")
    parser.add_argument("--rounds", type=int, default=6, help="forced: turns of every mode a point (even: pairs)")
    parser.add_argument("--window", type=int, default=6, help="forced: timed steps of a mode's turn")
    parser.add_argument("--settle", type=int, default=3, help="untimed steps opening every turn")
    # zoo: many short turns. The SmolLM2 pair's steps are host-bound, and the GPU host had slow phases
    # (every mode's steps 1.6-2x longer for a minute, 2026-11-27): 8 turns of 16 steps put such a
    # phase on some modes' turns and not others', moving single points by 10-15%
    parser.add_argument("--zoo-rounds", type=int, default=24, help="zoo: turns of every mode a point (even: pairs)")
    parser.add_argument("--zoo-window", type=int, default=5, help="zoo: timed steps of a mode's turn")
    parser.add_argument("--zoo-min-seqs", type=int, default=8,
                        help="zoo: a point below this batch runs min-seqs / batch batches of other prompts in turn")
    parser.add_argument("--zoo-sets", type=int, default=1,
                        help="zoo: at least this many batches of other prompts a point, in turn, their turns pooled "
                             "(more samples without longer contexts)")
    parser.add_argument("--policy-b", action="append", default=[],
                        help="a saved spec_decode/adaptive.py whose AdaptiveDraftLength runs as one more mode (repeatable)")
    parser.add_argument("--policy-b-name", action="append", default=[],
                        help="the mode of the i-th --policy-b is adaptive-<the i-th name> (default: b, c, d ...)")
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args(argv)
    if args.smoke:
        args.k, args.batches, args.warm, args.prompt_len = 2, "1,4", 3, 8
        args.parts = "forced"
        args.rounds, args.window, args.settle, args.adaptive_warm = 2, 3, 2, 3
    if args.rounds % 2 or args.zoo_rounds % 2:
        parser.error(f"--rounds {args.rounds} / --zoo-rounds {args.zoo_rounds}: must be even (a mode's tokens/s is "
                     "the median over pairs of rounds, one forwards and one backwards)")
    if len(args.policy_b_name) > len(args.policy_b):
        parser.error(f"{len(args.policy_b_name)} --policy-b-name for {len(args.policy_b)} --policy-b")
    args.policy_b_name += [chr(ord("b") + i) for i in range(len(args.policy_b_name), len(args.policy_b))]
    if len(set(args.policy_b_name)) < len(args.policy_b_name):
        parser.error(f"--policy-b-name: the modes' names repeat ({', '.join(args.policy_b_name)})")
    args.batches = [int(b) for b in args.batches.split(",")]
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = dict(meta=dict(device=device, date=time.strftime("%Y-%m-%d"), k=args.k, warm=args.warm,
                         adaptive_warm=args.adaptive_warm, rounds=args.rounds, window=args.window, settle=args.settle,
                         zoo_rounds=args.zoo_rounds, zoo_window=args.zoo_window, zoo_min_seqs=args.zoo_min_seqs,
                         zoo_sets=args.zoo_sets,
                         policy_b=args.policy_b,
                         command=" ".join(["python ci/bench_adaptive.py", *(sys.argv[1:] if argv is None else argv)])))
    start = time.perf_counter()
    try:
        if "forced" in args.parts:
            run_forced(args, out)
        if "zoo" in args.parts:
            run_zoo(args, out)
    except Exception as e:  # keep the points measured before the failure (each is whole), then fail
        out["meta"]["error"] = f"{type(e).__name__}: {e}"
        print(write_report(out, out_dir))
        raise
    gc.unfreeze()  # the zoo part froze its engines' heaps; a caller's process gets its collector back
    out["meta"]["seconds"] = time.perf_counter() - start
    print(write_report(out, out_dir))
    return out


if __name__ == "__main__":
    main()
