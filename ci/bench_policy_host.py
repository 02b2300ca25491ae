"""Host time of the adaptive draft-length policy's calls a step (issue 19), on this machine's CPU:
`choose` and `observe_step` as the engine makes them, k = 0 and k = 3 in steady state, batch 1 and 32,
with the SmolLM2 zoo pair's graph buckets. Why it matters: where speculation is in doubt the steps are
host-bound, and the policy's time is then the step's (docs/adaptive_speculation.md).

    python ci/bench_policy_host.py [--steps 20000] [--policy path/to/adaptive.py]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spec_decode.step_costs import StepCosts  # noqa: E402

BUCKETS = [1, 2, 4, 8, 16, 24, 32]  # the SmolLM2 pair's graph buckets on an H100 (bench_adaptive's zoo part)


def measure(policy_class, batch: int, k_steady: int, steps: int) -> tuple[float, float]:
    """Mean µs a step of choose and of observe_step, after 400 steps of history (every k priced)."""
    costs = StepCosts(BUCKETS, [[0.5e-3 + 0.1e-3 * k for k in range(6)] for _ in BUCKETS], "measured on a model")
    policy, rng = policy_class(5, costs), random.Random(0)
    for step in range(400):
        k = policy.choose(step, batch)
        if k:
            policy.observe(step, [k] * batch, [rng.randint(0, 1) for _ in range(batch)])
        policy.observe_step(batch, step % 6 if step < 200 else k_steady, 1.25e-3 * rng.uniform(0.9, 1.1))
    choose = observe_step = 0.0
    for step in range(400, 400 + steps):
        start = time.perf_counter()
        policy.choose(step, batch)
        choose += time.perf_counter() - start
        if k_steady:
            policy.observe(step, [k_steady] * batch, [rng.randint(0, k_steady) for _ in range(batch)])
        host = 1.2e-3 * rng.uniform(0.95, 1.05)
        start = time.perf_counter()
        policy.observe_step(batch, k_steady, host + 0.05e-3)
        observe_step += time.perf_counter() - start
    return choose / steps * 1e6, observe_step / steps * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--policy", help="a saved spec_decode/adaptive.py to measure instead of this tree's")
    args = parser.parse_args(argv)
    if args.policy:
        from gpu_timing import load_kernel_version

        policy_class = load_kernel_version(Path(args.policy), "adaptive_measured", package="spec_decode").AdaptiveDraftLength
    else:
        from spec_decode.adaptive import AdaptiveDraftLength as policy_class
    rows = []
    print("| batch | steady k | choose µs | observe_step µs | a step µs |\n|---:|---:|---:|---:|---:|")
    for batch in (1, 32):
        for k in (0, 3):
            choose, observe = measure(policy_class, batch, k, args.steps)
            rows.append(dict(batch=batch, k=k, choose_us=choose, observe_step_us=observe))
            print(f"| {batch} | {k} | {choose:.1f} | {observe:.1f} | {choose + observe:.1f} |")
    return rows


if __name__ == "__main__":
    main()
