"""Pieces both zoo trainers share: time-budgeted cosine LR, a CSV/PNG training log, data specs.

Why time budgets: the GPU runs these trainers under hard wall-clock limits (10 minutes a
command), so a run is given minutes, not steps; the learning-rate schedule follows the elapsed
fraction of the budget (or of ``--max-steps`` when that ends first), and every run ends on its
own, saves, and reports before its deadline.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path

import numpy as np


class Budget:
    """Progress in [0, 1] of a run bounded by ``minutes`` and/or ``max_steps`` (whichever ends first),
    shown as a tqdm bar on a terminal (silent in logs, which get the trainers' periodic lines)."""

    def __init__(self, minutes: float, max_steps: int = 0, desc: str = "train"):
        from tqdm.auto import tqdm

        if minutes <= 0 and max_steps <= 0:
            raise ValueError("give --minutes or --max-steps")
        self.start, self.seconds, self.max_steps = time.time(), 60.0 * minutes, max_steps
        self.bar = tqdm(total=100, desc=desc, unit="%", disable=None, leave=False)

    def tick(self, step: int):
        self.bar.update(int(100 * self.progress(step)) - self.bar.n)

    def elapsed(self) -> float:
        return time.time() - self.start

    def progress(self, step: int) -> float:
        parts = []
        if self.seconds > 0:
            parts.append(self.elapsed() / self.seconds)
        if self.max_steps > 0:
            parts.append(step / self.max_steps)
        return min(1.0, max(parts))

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


def cosine_lr(peak: float, progress: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warmup over the first ``warmup`` of the run, then cosine decay to ``floor * peak``."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.01)
    t = (progress - warmup) / max(1e-9, 1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


class TrainLog:
    """Rows of metrics kept in a CSV as they come, plus a PNG of the curves at the end."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []

    def add(self, **row):
        """Append a row; rows may carry different keys (train vs held-out rows), the CSV has their union."""
        self.rows.append({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
        fields = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(self.rows)

    def plot(self, png: Path, title: str, keys: list[str], x: str = "step"):
        """Curves of ``keys`` against ``x`` (rows without a key are skipped for that curve)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            pts = [(r[x], r[key]) for r in self.rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=key, linewidth=1, marker="o" if len(pts) < 20 else None)
        ax.set_xlabel(x)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=90)
        plt.close(fig)


def add_run_args(ap, *, batch_size: int, lr: float, weight_decay: float, log_every: int):
    """The arguments both trainers take: output, budget, batch shape, optimiser, logging, device."""
    import torch

    ap.add_argument("--out", required=True, help="folder for the model (the shippable folder)")
    ap.add_argument("--log-dir", default=None, help="folder for logs and plots (default: OUT-logs)")
    ap.add_argument("--minutes", type=float, default=0.0, help="training time budget (evaluation not included)")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=batch_size)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--weight-decay", type=float, default=weight_decay)
    ap.add_argument("--log-every", type=int, default=log_every)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def parse_recorded(ap, argv):
    """Parse, keeping the argument list: zoo.json records it as the command that reproduces the run."""
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def parse_data_specs(specs: list[str]) -> list[tuple[Path, str, int]]:
    """``DIR:SET[*N][,SET[*N]]`` -> [(dir, set, repeat)]; ``*N`` repeats a set N times in the mix."""
    out = []
    for spec in specs:
        folder, _, sets = spec.rpartition(":") if ":" in spec else (spec, "", "train")
        for item in sets.split(","):
            name, _, rep = item.partition("*")
            out.append((Path(folder), name, int(rep or 1)))
    return out


def load_token_mix(specs: list[str], tok) -> tuple[np.ndarray, np.ndarray, dict]:
    """Concatenate the shard sets named by ``specs`` (tokenizer-checked); returns tokens, mask, counts."""
    from eagle3_train.shards import read_set

    toks, masks, counts = [], [], {}
    for folder, name, rep in parse_data_specs(specs):
        t, m, _ = read_set(folder, name, tok)
        toks += [t] * rep
        masks += [m] * rep
        counts[f"{folder.name}:{name}"] = {"tokens": int(len(t)), "repeat": rep, "assistant_tokens": int(m.sum())}
    return np.concatenate(toks), np.concatenate(masks), counts


def fmt_seconds(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"
