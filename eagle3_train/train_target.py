"""Train tiny-kimi from scratch with transformers' own DeepseekV3ForCausalLM and export it as Kimi-K2.5.

``python -m eagle3_train.train_target --data .stage/tiny-kimi --out DIR --minutes 6``

Why these choices: the model must be an honest Kimi-architecture model (see ``tiny_kimi``), so
it is trained by transformers' reference implementation rather than by our engine. MoE routing
uses DeepSeek-V3's auxiliary-loss-free balancing: after every step each router's
``e_score_correction_bias`` moves by ``--bias-rate`` toward evening out expert load, which also
leaves the shipped model with a non-zero bias that an engine must apply. A run is bounded in
minutes (time-based cosine LR); the held-out loss is measured ``--evals`` times and the best
weights are the ones exported, so a run that starts to overfit the small corpus still ships its
best point. The end of the run reports held-out perplexity (all tokens and assistant tokens),
greedy samples on held-out prompts, and checks the export twice: reloaded through our loader
and through transformers' ``Kimi_K25ForConditionalGeneration``, both must reproduce the trained
model's logits.

Writes ``--out`` (the shippable tiny-kimi folder) and ``--log-dir`` (train_log.csv, loss.png,
summary.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

from atom_like.zoo import kimi_tokenizer, tiny_kimi
from eagle3_train.shards import PackedWindows, prompt_ids, read_set
from eagle3_train.targets import stop_token_ids
from eagle3_train.train_utils import (Budget, TrainLog, add_run_args, cosine_lr, fmt_seconds, load_token_mix,
                                       parse_recorded)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m eagle3_train.train_target", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder from build_data (tokenizer/, shard sets, heldout)")
    ap.add_argument("--mix", default="sharegpt,gsm8k*3", help="shard sets to train on, SET[*N] (N = repeats)")
    add_run_args(ap, batch_size=64, lr=3e-3, weight_decay=0.1, log_every=50)
    ap.add_argument("--assistant-only", action="store_true", help="loss only on assistant tokens")
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="aux-loss-free balancing step (DeepSeek-V3)")
    ap.add_argument("--experts-impl", default="auto", help="transformers experts implementation, or 'auto' to time them")
    ap.add_argument("--evals", type=int, default=8, help="held-out evaluations during the run (best one is exported)")
    ap.add_argument("--eval-tokens", type=int, default=262144)
    ap.add_argument("--eval-prompts", default=None, help="eval_prompts.jsonl: greedy samples on the first prompts of each set")
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt set")
    ap.add_argument("--config", default="{}", help="JSON overrides of tiny_kimi.TEXT_DEFAULTS")
    return parse_recorded(ap, argv)


class RouterBalancer:
    """DeepSeek-V3 aux-loss-free load balancing: count each router's expert picks during the step,
    then nudge ``e_score_correction_bias`` up for under-loaded and down for over-loaded experts."""

    def __init__(self, model, rate: float):
        self.rate, self.gates, self.counts, self.last_imbalance = rate, [], [], 1.0
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                self.gates.append(gate)
                self.counts.append(torch.zeros(gate.e_score_correction_bias.numel(), device=gate.weight.device))
                gate.register_forward_hook(self._hook(len(self.gates) - 1))

    def _hook(self, i):
        def hook(module, args, output):
            if module.training:
                self.counts[i] += torch.bincount(output[2].flatten(), minlength=self.counts[i].numel()).float()
        return hook

    @torch.no_grad()
    def step(self):
        """Apply the bias update; keeps the step's worst max/mean expert load (1.0 = even) as a tensor."""
        loads = [c.max() / c.mean().clamp(min=1) for c in self.counts]
        self.last_imbalance = torch.stack(loads).max() if loads else 1.0
        for gate, count in zip(self.gates, self.counts):
            gate.e_score_correction_bias += self.rate * torch.sign(count.mean() - count)
            count.zero_()


@torch.no_grad()
def heldout_loss(model, tokens, mask, seq_len: int, batch_size: int, device, cuda: bool) -> tuple[float, float]:
    """Mean next-token loss over all held-out tokens and over assistant tokens only."""
    model.eval()
    n = len(tokens) // seq_len
    total = [0.0, 0.0]
    count = [0, 0]
    for lo in range(0, n, batch_size):
        idx = torch.arange(lo, min(n, lo + batch_size)).unsqueeze(1) * seq_len + torch.arange(seq_len)
        ids = torch.from_numpy(tokens)[idx].to(device)
        m = torch.from_numpy(mask)[idx].to(device)[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=ids).logits
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        total[0] += nll.sum().item()
        count[0] += nll.numel()
        total[1] += nll[m.flatten()].sum().item()
        count[1] += int(m.sum())
    model.train()
    return total[0] / max(1, count[0]), total[1] / max(1, count[1])


def pick_experts_impl(model, batch, cuda: bool, requested: str, step_fn) -> str:
    """Use ``requested``, or with 'auto' time the implementations that run here and keep the fastest."""
    candidates = ["grouped_mm", "eager"] if requested == "auto" else [requested]
    timings = {}
    for impl in candidates:
        try:
            model.set_experts_implementation(impl)
            for i in range(3):
                if i == 1:
                    torch.cuda.synchronize() if cuda else None
                    t = time.time()
                step_fn(batch, update=False)
            torch.cuda.synchronize() if cuda else None
            timings[impl] = (time.time() - t) / 2
        except Exception as e:  # an implementation missing for this torch/GPU/dtype: try the next
            print(f"[train_target] experts implementation {impl!r} failed here: {type(e).__name__}: {e}", flush=True)
    if not timings:
        raise RuntimeError(f"no experts implementation of {candidates} runs on this machine")
    best = min(timings, key=timings.get)
    model.set_experts_implementation(best)
    print(f"[train_target] experts implementation: {best} (seconds/step: {timings})", flush=True)
    return best


def samples(model, tok, prompt_file, per_set: int, stop, device) -> list[dict]:
    from eagle3_train.acceptance import load_eval_prompts
    from eagle3_train.regenerate import greedy_generate

    out = []
    was_training = model.training
    model.eval()
    for name, chats in load_eval_prompts(prompt_file, per_set).items():
        prompts = [prompt_ids(tok, c) for c in chats]
        for chat, reply in zip(chats, greedy_generate(model, prompts, 96, stop, tok.pad_token_id, 8)):
            out.append({"set": name, "prompt": chat[-1]["content"][:300], "reply": tok.decode(reply)})
    model.train(was_training)
    return out


def train(args) -> dict:
    t_start = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    data = Path(args.data)
    tok = kimi_tokenizer.load(data / "tokenizer")
    tokens, mask, mix = load_token_mix([f"{data}:{args.mix}"], tok)
    ho_tokens, ho_mask, _ = read_set(data, "heldout", tok)
    ho_tokens, ho_mask = ho_tokens[: args.eval_tokens], ho_mask[: args.eval_tokens]
    text_cfg = tiny_kimi.text_config(tok, **json.loads(args.config))
    model = tiny_kimi.build_model(text_cfg, seed=args.seed).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    balancer = RouterBalancer(model, args.bias_rate)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=cuda)
    batches = PackedWindows(tokens, mask, args.seq_len, args.seed).batches(args.batch_size)

    def step_fn(batch, update=True):
        ids, m = (x.to(device, non_blocking=True) for x in batch)
        labels = ids.masked_fill(~m, -100) if args.assistant_only else ids
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if update:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            balancer.step()
        return loss.detach()

    impl = pick_experts_impl(model, next(batches), cuda, args.experts_impl, step_fn)
    for c in balancer.counts:
        c.zero_()
    log_dir = Path(args.log_dir or f"{args.out}-logs")
    log = TrainLog(log_dir / "train_log.csv")
    print(f"[train_target] tiny-kimi {n_params / 1e6:.2f}M params | {len(tokens) / 1e6:.1f}M train tokens, "
          f"{len(ho_tokens) / 1e3:.0f}k held-out | setup {time.time() - t_start:.0f}s", flush=True)
    budget = Budget(args.minutes, args.max_steps, "tiny-kimi")
    step, seen, since, loss_sum = 0, 0, 0, torch.zeros((), device=device)
    best = {"loss": math.inf}
    next_eval = 1.0 / max(1, args.evals)
    while True:
        done = budget.done(step)
        if budget.progress(step) >= next_eval or done:
            ho_all, ho_asst = heldout_loss(model, ho_tokens, ho_mask, args.seq_len, args.batch_size, device, cuda)
            log.add(step=step, seconds=round(budget.elapsed(), 1), heldout_loss=ho_all, heldout_assistant_loss=ho_asst)
            print(f"[train_target] step {step} held-out loss {ho_all:.3f} (ppl {math.exp(ho_all):.1f}), "
                  f"assistant {ho_asst:.3f} (ppl {math.exp(ho_asst):.1f})", flush=True)
            if ho_all < best["loss"]:
                best = {"loss": ho_all, "assistant_loss": ho_asst, "step": step,
                        "state": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}}
            next_eval += 1.0 / max(1, args.evals)
        if done:
            break
        lr = cosine_lr(args.lr, budget.progress(step))
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum += step_fn(next(batches))
        step += 1
        budget.tick(step)
        since += 1
        seen += args.batch_size * args.seq_len
        if step % args.log_every == 0:
            mean_loss = loss_sum.item() / since
            log.add(step=step, seconds=round(budget.elapsed(), 1), lr=lr, loss=mean_loss, tokens=seen,
                    epoch=seen / len(tokens), router_imbalance=float(balancer.last_imbalance))
            print(f"[train_target] step {step} {fmt_seconds(budget.elapsed())} loss {mean_loss:.3f} lr {lr:.2e} "
                  f"epoch {seen / len(tokens):.2f} {seen / budget.elapsed():.0f} tok/s", flush=True)
            loss_sum.zero_()
            since = 0
    train_seconds = budget.elapsed()
    model.load_state_dict(best.pop("state"))
    model.eval()
    stop = stop_token_ids(data / "tokenizer", tok)
    summary = {
        "model": "tiny-kimi", "params": n_params, "data": mix, "steps": step, "tokens": seen, "epochs": round(seen / len(tokens), 2),
        "train_seconds": round(train_seconds, 1), "device": torch.cuda.get_device_name() if cuda else "cpu",
        "experts_implementation": impl, "best_step": best["step"],
        "heldout_loss": round(best["loss"], 4), "heldout_ppl": round(math.exp(best["loss"]), 2),
        "heldout_assistant_ppl": round(math.exp(best["assistant_loss"]), 2),
        "recipe": {k: v for k, v in vars(args).items() if k not in ("device", "argv")},
        "command": "python -m eagle3_train.train_target " + " ".join(args.argv),
    }
    if args.eval_prompts:
        summary["samples"] = samples(model, tok, args.eval_prompts, args.samples, stop, device)
        for s in summary["samples"]:
            print(f"[train_target] sample ({s['set']}) {s['prompt'][:80]!r} -> {s['reply'][:200]!r}", flush=True)
    cfg = tiny_kimi.kimi_config(text_cfg, tok)
    files = tiny_kimi.export(model, cfg, data / "tokenizer", Path(args.out), summary)
    summary["checks"] = check_export(model.float().cpu(), Path(args.out))
    summary["files"] = {f.name: f.stat().st_size for f in files}
    (Path(args.out) / "zoo.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "files"}, indent=2))
    log.plot(log_dir / "loss.png", "tiny-kimi training", ["loss", "heldout_loss"])
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[train_target] held-out ppl {summary['heldout_ppl']} (assistant {summary['heldout_assistant_ppl']}), "
          f"checks {summary['checks']}, {step} steps in {fmt_seconds(train_seconds)} -> {args.out}", flush=True)
    return summary


def check_export(model, out: Path) -> dict:
    """Reload the export two ways and compare logits with the trained model whose weights are rounded
    to bf16 as exported (the router bias is exported in fp32, so it stays exact)."""
    ref = copy.deepcopy(model).eval()  # eval: the router-balancing hooks only count in training mode
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    ids = torch.randint(0, ref.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (tiny_kimi.load_text_model(out)(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    checks = {"reload_max_abs_logit_diff": diff}
    try:
        checks["kimi_k25_max_abs_logit_diff"] = tiny_kimi.verify_with_kimi_k25(out, ref)
    except ImportError as e:
        checks["kimi_k25"] = f"skipped: {e}"
    ok = all(v < 1e-3 for k, v in checks.items() if k.endswith("diff"))
    checks["ok"] = ok
    if not ok:
        print(f"[train_target] EXPORT CHECK FAILED: {checks}", flush=True)
    return checks


def main(argv=None):
    summary = train(parse_args(argv))
    return 0 if summary["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
