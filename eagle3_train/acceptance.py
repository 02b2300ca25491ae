"""Acceptance of an EAGLE3 draft under greedy chain speculation, for k = 1..5, measured fast.

Why not just run ``reference_speculate`` on every prompt: it is a per-prompt Python loop (one
target verify and k draft calls per round), far too slow for hundreds of prompts x five k's
inside a GPU time budget. In exact arithmetic it needs no loop at all: speculation is lossless,
so its output is the target's greedy continuation, and the drafts proposed from a base position
depend only on the text before it. So we (1) generate the greedy continuations in batches,
(2) run the target once over prompt + continuation for the aux hiddens, (3) unroll the draft
``kmax`` steps over every position at once (``eagle3_ttt.unroll``, teacher-forced: until its first
miss a chain's own tokens *are* the continuation), and (4) replay the verify rounds of the
sequential loop for each k from the per-position hit table. A CPU test checks that this replay
gives exactly the accepted counts of ``reference_speculate`` in fp32; ``ref_check`` repeats that
comparison (statistically, bf16 flips near-ties) on the GPU.

Metrics as vLLM reports them: mean acceptance length = 1 + accepted / verify steps (includes the
bonus token), acceptance rate = accepted / (steps * k), per-position rate i = share of steps with
at least i accepted drafts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from atom_like.zoo.data import read_jsonl
from eagle3_train.eagle3_reference import Eagle3Draft, reference_speculate, target_aux
from eagle3_train.eagle3_ttt import unroll
from eagle3_train.regenerate import greedy_generate
from eagle3_train.shards import prompt_ids


@torch.no_grad()
def draft_hits(target, draft: Eagle3Draft, seqs: list[list[int]], kmax: int, batch_size: int = 16) -> list[np.ndarray]:
    """Per sequence a bool table [kmax, len]: hits[s, i] = the draft's step-s prediction from base
    row i equals token i + 2 + s of the sequence."""
    device = next(target.parameters()).device
    out = []
    for lo in range(0, len(seqs), batch_size):
        chunk = seqs[lo: lo + batch_size]
        T = max(len(seq) for seq in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.long, device=device)
        for b, seq in enumerate(chunk):  # right padding: causal rows before it are unaffected
            ids[b, : len(seq)] = torch.tensor(seq, device=device)
        aux = target_aux(target(input_ids=ids, output_hidden_states=True).hidden_states, draft.aux_ids)
        hits = torch.zeros(len(chunk), kmax, T, dtype=torch.bool, device=device)
        for step, logits in unroll(draft, ids, aux.to(next(draft.parameters()).dtype), kmax):
            pred = draft.to_target(logits.argmax(-1))
            hits[:, step, : T - 2 - step] = pred[:, : T - 2 - step] == ids[:, 2 + step:]
        for b, seq in enumerate(chunk):
            h = hits[b, :, : len(seq)].cpu().numpy()
            for step in range(kmax):  # nothing after the sequence's end can be hit
                h[step, max(0, len(seq) - 2 - step):] = False
            out.append(h)
    return out


def replay(hits: np.ndarray, seq: list[int], prompt_len: int, k: int, max_new_tokens: int, stop_ids) -> list[int]:
    """The accepted counts that ``reference_speculate(k, max_new_tokens)`` produces on ``seq``
    (prompt + the target's greedy continuation), read off the hit table."""
    stop = set(stop_ids)
    counts, generated, base = [], 1, prompt_len - 1  # the prefill already produced seq[prompt_len]
    while generated < max_new_tokens and base + 1 < len(seq) and seq[base + 1] not in stop:
        a = 0
        while a < k and a < hits.shape[0] and hits[a, base]:
            a += 1
            if seq[base + 1 + a] in stop:
                break
        counts.append(a)
        if seq[base + 1 + a] in stop and a:
            break
        generated += a + 1
        base += a + 1
    return counts


def summarize(counts: list[int], k: int) -> dict:
    steps = len(counts)
    c = np.asarray(counts)
    return {"k": k, "steps": steps, "accepted": int(c.sum()),
            "mean_acceptance_length": 1.0 + float(c.mean()) if steps else 1.0,
            "acceptance_rate": float(c.sum()) / (steps * k) if steps else 0.0,
            "per_position": [float((c >= i).mean()) if steps else 0.0 for i in range(1, k + 1)]}


def evaluate(target, draft: Eagle3Draft, tok, prompt_sets: dict[str, list], stop_ids, ks=(1, 2, 3, 4, 5),
             max_new_tokens: int = 128, gen_batch: int = 64, ref_check: int = 0) -> dict:
    """Acceptance table per prompt set and k; with ``ref_check`` > 0, also the mean acceptance length
    of ``reference_speculate`` (k = 3) on that many prompts of each set, next to the replayed one."""
    kmax = max(ks)
    report = {}
    for name, chats in prompt_sets.items():
        prompts = [prompt_ids(tok, c) for c in chats]
        conts = greedy_generate(target, prompts, max_new_tokens + kmax + 1, stop_ids, tok.pad_token_id or 0, gen_batch)
        seqs = [p + c for p, c in zip(prompts, conts)]
        hits = draft_hits(target, draft, seqs, kmax)
        entry = {"prompts": len(prompts)}
        for k in ks:
            counts = [c for h, s, p in zip(hits, seqs, prompts)
                      for c in replay(h, s, len(p), k, max_new_tokens, stop_ids)]
            entry[f"k{k}"] = summarize(counts, k)
        if ref_check:
            ref, rep = [], []
            for h, s, p in list(zip(hits, seqs, prompts))[:ref_check]:
                ref += reference_speculate(target, draft, p, 3, max_new_tokens, stop_ids)[1]
                rep += replay(h, s, len(p), 3, max_new_tokens, stop_ids)
            entry["ref_check"] = {"prompts": min(ref_check, len(prompts)), "k": 3,
                                  "reference_mean_acceptance_length": summarize(ref, 3)["mean_acceptance_length"],
                                  "replayed_mean_acceptance_length": summarize(rep, 3)["mean_acceptance_length"]}
        report[name] = entry
    return report


def format_table(report: dict) -> str:
    lines = ["set        k   mean_acc_len  acc_rate  per_position"]
    for name, entry in report.items():
        for key, r in entry.items():
            if key.startswith("k"):
                pos = " ".join(f"{p:.2f}" for p in r["per_position"])
                lines.append(f"{name:<10} {r['k']}   {r['mean_acceptance_length']:.3f}         {r['acceptance_rate']:.3f}     {pos}")
        if "ref_check" in entry:
            rc = entry["ref_check"]
            lines.append(f"{name:<10} reference_speculate k=3 on {rc['prompts']} prompts: "
                         f"{rc['reference_mean_acceptance_length']:.3f} (replayed: {rc['replayed_mean_acceptance_length']:.3f})")
    return "\n".join(lines)


def load_eval_prompts(path: Path, per_set: int | None = None) -> dict[str, list]:
    """``eval_prompts.jsonl`` (written by build_data) -> {set name: [chat, ...]}."""
    sets: dict[str, list] = {}
    for rec in read_jsonl(Path(path)):
        sets.setdefault(rec["set"], []).append(rec["messages"])
    return {k: v[:per_set] if per_set else v for k, v in sets.items()}


def main(argv=None):
    from eagle3_train.eagle3_reference import load_draft
    from eagle3_train.targets import load_target, zoo_path

    ap = argparse.ArgumentParser(prog="python -m eagle3_train.acceptance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target folder or zoo name")
    ap.add_argument("--draft", required=True, help="draft folder or zoo name")
    ap.add_argument("--prompts", required=True, help="eval_prompts.jsonl from build_data")
    ap.add_argument("--per-set", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ref-check", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target, tok, stop = load_target(args.target, dtype, args.device)
    draft = load_draft(zoo_path(args.draft), target, dtype).to(args.device)
    report = evaluate(target, draft, tok, load_eval_prompts(args.prompts, args.per_set), stop,
                      max_new_tokens=args.max_new_tokens, ref_check=args.ref_check)
    print(format_table(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
