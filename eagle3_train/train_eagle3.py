"""Train an EAGLE3 / EAGLE3.1 draft (Llama-MHA or MLA) against a zoo target, then measure it.

``python -m eagle3_train.train_eagle3 --target DIR --arch {llama,mla} [--fc-norm] [--norm-output]
  [--draft-vocab N] --data DIR:SET ... --out DIR --minutes M [--eval-prompts FILE]``

What a step does (the recipe of EAGLE-3 / SpecForge; conventions in docs/eagle3_semantics.md):
the frozen target (bf16, no grad) runs over a packed window and gives the aux hiddens and its
logits; the draft is unrolled ``--ttt-steps`` (default 4) chain steps over the whole window on
its own carried hiddens with the diagonal mask (``eagle3_ttt``); each step's loss is the soft
cross-entropy against the target distribution (restricted to the draft vocab), weighted 0.8^s.
The draft borrows the target's embedding (frozen); its LM head and final norm start from the
target's (rows of the draft vocab), which saves much of a short run. With a draft vocab smaller
than the target's, the draft vocab is the most frequent target tokens of the training mix
(``d2t``/``t2d``). AdamW, time-budgeted cosine LR, bf16 autocast on GPU.

Writes: ``--out`` (config.json, safetensors, zoo.json with the recipe and acceptance table: the
shippable folder), ``--log-dir`` (train_log.csv with per-step accuracy of every unrolled step,
loss.png, acceptance.json, summary.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from eagle3_train.eagle3_reference import Eagle3Draft, load_draft, make_draft_config, save_draft, target_aux
from eagle3_train.eagle3_ttt import shift_left, soft_label_loss, target_labels, unroll, valid_rows
from eagle3_train.shards import PackedWindows
from eagle3_train.targets import load_target, zoo_path
from eagle3_train.train_utils import (Budget, TrainLog, add_run_args, cosine_lr, fmt_seconds, load_token_mix,
                                       parse_recorded)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m eagle3_train.train_eagle3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target folder or zoo name (smollm2-135m, tiny-kimi)")
    ap.add_argument("--arch", choices=["llama", "mla"], required=True)
    ap.add_argument("--fc-norm", action="store_true", help="EAGLE3.1: RMSNorm per aux chunk before fc")
    ap.add_argument("--norm-output", action="store_true", help="EAGLE3.1: carry the post-norm hidden")
    ap.add_argument("--draft-vocab", type=int, default=0, help="draft vocab size (0 = the target's)")
    ap.add_argument("--data", action="append", required=True, help="DIR:SET[*N][,SET] shard sets (repeatable)")
    add_run_args(ap, batch_size=16, lr=1e-3, weight_decay=0.0, log_every=25)
    ap.add_argument("--name", default=None, help="zoo name recorded in zoo.json")
    ap.add_argument("--init", default=None, help="continue from this draft checkpoint")
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--all-tokens", action="store_true", help="train on every token, not only assistant turns")
    ap.add_argument("--intermediate-size", type=int, default=0)
    ap.add_argument("--heads", type=int, default=0)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=0)
    ap.add_argument("--aux-ids", default="", help="comma-separated HF hidden_states indices (default: (2, N//2, N-3))")
    ap.add_argument("--eval-prompts", default=None, help="eval_prompts.jsonl; omit to skip the acceptance eval")
    ap.add_argument("--eval-per-set", type=int, default=64)
    ap.add_argument("--eval-max-new", type=int, default=128)
    ap.add_argument("--ref-check", type=int, default=4, help="prompts per set also run through reference_speculate")
    return parse_recorded(ap, argv)


def choose_draft_vocab(tokens: np.ndarray, mask: np.ndarray, vocab: int, size: int, must_have) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent target ids of the trained-on tokens (plus ``must_have``), sorted;
    and the share of trained-on tokens they cover."""
    counts = np.bincount(tokens[mask], minlength=vocab).astype(np.float64)
    counts[list(must_have)] = np.inf
    chosen = np.sort(np.argsort(-counts, kind="stable")[:size])
    finite = counts.copy()
    finite[np.isinf(finite)] = 0
    return torch.from_numpy(chosen), float(finite[chosen].sum() / max(1.0, finite.sum()))


def build_draft(args, target, tok_mask_data, stop) -> tuple[Eagle3Draft, dict]:
    """A new draft sized from the target (or ``--init``), embedding borrowed, head/norm from the target."""
    tcfg = getattr(target.config, "text_config", target.config)
    if args.init:
        draft = load_draft(zoo_path(args.init), target)
        return draft, {"init": str(args.init)}
    tokens, mask = tok_mask_data
    V = tcfg.vocab_size
    size = args.draft_vocab or V
    cfg = make_draft_config(
        tcfg, args.arch, intermediate_size=args.intermediate_size or None, num_attention_heads=args.heads or None,
        num_key_value_heads=args.kv_heads or None, head_dim=args.head_dim or None, draft_vocab_size=size,
        aux_ids=[int(x) for x in args.aux_ids.split(",")] if args.aux_ids else None,
        fc_norm=args.fc_norm, norm_output=args.norm_output)
    torch.manual_seed(args.seed)
    draft = Eagle3Draft(cfg)
    info = {}
    if size < V:
        chosen, coverage = choose_draft_vocab(tokens, mask, V, size, stop)
        draft.d2t.copy_(chosen - torch.arange(size))
        draft.t2d.zero_()
        draft.t2d[chosen] = True
        info["draft_vocab_coverage"] = round(coverage, 4)
    else:
        chosen = torch.arange(V)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight.float()[chosen])
        draft.norm.weight.copy_(target.model.norm.weight.float())
    return draft, info


def train(args) -> dict:
    t_start = time.time()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    target, tok, stop = load_target(args.target, torch.bfloat16 if cuda else torch.float32, device)
    for p in target.parameters():
        p.requires_grad_(False)
    tokens, mask, data_counts = load_token_mix(args.data, tok)
    draft, info = build_draft(args, target, (tokens, mask), stop)
    draft = draft.to(device)
    draft.embed_tokens.weight.requires_grad_(False)
    d2t_ids = draft.to_target(torch.arange(draft.draft_vocab, device=device))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    log_dir = Path(args.log_dir or f"{args.out}-logs")
    log = TrainLog(log_dir / "train_log.csv")
    batches = PackedWindows(tokens, mask, args.seq_len, args.seed).batches(args.batch_size)
    S, T = args.ttt_steps, args.seq_len
    budget = Budget(args.minutes, args.max_steps, args.name or "eagle3 draft")
    print(f"[train_eagle3] target {args.target} | draft {draft.config['architectures'][0]} "
          f"vocab {draft.draft_vocab} | {sum(p.numel() for p in params) / 1e6:.2f}M trainable | "
          f"{len(tokens) / 1e6:.1f}M tokens {data_counts} | setup {time.time() - t_start:.0f}s", flush=True)
    # running sums stay on the device: no host sync per step except at log time
    step, seen, since = 0, 0, 0
    acc_sum, n_sum, loss_sum = (torch.zeros(S, device=device), torch.zeros(S, device=device), torch.zeros((), device=device))
    draft.train()
    while not budget.done(step):
        lr = cosine_lr(args.lr, budget.progress(step))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, m = (x.to(device, non_blocking=True) for x in next(batches))
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
            aux = target_aux(out.hidden_states, draft.aux_ids)
            probs, argmax, draftable = target_labels(out.logits, d2t_ids)
            del out
        loss = 0.0
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            for s, logits in unroll(draft, ids, aux, S):
                rows = valid_rows(T, s, device) & shift_left(draftable, 1 + s, False)
                if not args.all_tokens:
                    rows = rows & shift_left(m, 2 + s, False)
                l_sum, n, c = soft_label_loss(logits, shift_left(probs, 1 + s, 0), shift_left(argmax, 1 + s, -1),
                                              rows, d2t_ids)
                loss = loss + (0.8 ** s) * l_sum / n.clamp(min=1)
                acc_sum[s] += c
                n_sum[s] += n
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        budget.tick(step)
        seen += ids.numel()
        loss_sum += loss.detach()
        since += 1
        if step % args.log_every == 0 or budget.done(step):
            acc = (acc_sum / n_sum.clamp(min=1)).tolist()
            mean_loss = loss_sum.item() / since
            log.add(step=step, seconds=round(budget.elapsed(), 1), lr=lr, loss=mean_loss,
                    tokens=seen, **{f"acc{s}": a for s, a in enumerate(acc)})
            print(f"[train_eagle3] step {step} {fmt_seconds(budget.elapsed())} loss {mean_loss:.3f} "
                  f"acc {' '.join(f'{a:.3f}' for a in acc)} lr {lr:.2e} {seen / budget.elapsed():.0f} tok/s", flush=True)
            acc_sum.zero_(), n_sum.zero_(), loss_sum.zero_()
            since = 0
    draft.eval()
    train_seconds = budget.elapsed()
    summary = {"name": args.name, "target": str(args.target), "steps": step, "tokens": seen,
               "train_seconds": round(train_seconds, 1), "device": torch.cuda.get_device_name() if cuda else "cpu",
               "data": data_counts, "final_acc_per_step": log.rows[-1] if log.rows else None, **info,
               "recipe": {k: v for k, v in vars(args).items() if k not in ("device", "argv")},
               "command": "python -m eagle3_train.train_eagle3 " + " ".join(args.argv)}
    target_embed = target.get_input_embeddings().weight
    files = save_draft(draft.float(), Path(args.out), target_embed, summary)  # saved before the eval can overrun
    if log.rows:
        log.plot(log_dir / "loss.png", f"EAGLE3 draft ({draft.config['architectures'][0]}) on {Path(str(args.target)).name}",
                 ["loss"] + [f"acc{s}" for s in range(S)])
    if args.eval_prompts:
        from eagle3_train.acceptance import evaluate, format_table, load_eval_prompts

        t_eval = time.time()
        ev_draft = draft.to(target.dtype)
        report = evaluate(target, ev_draft, tok, load_eval_prompts(args.eval_prompts, args.eval_per_set), stop,
                          max_new_tokens=args.eval_max_new, ref_check=args.ref_check)
        summary["acceptance"] = report
        summary["eval_seconds"] = round(time.time() - t_eval, 1)
        print(format_table(report), flush=True)
        (log_dir / "acceptance.json").write_text(json.dumps(report, indent=2))
        (Path(args.out) / "zoo.json").write_text(json.dumps(summary, indent=2))
    summary["files"] = [str(f) for f in files]
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[train_eagle3] done: {step} steps in {fmt_seconds(train_seconds)}, total {fmt_seconds(time.time() - t_start)} -> {args.out}", flush=True)
    return summary


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
