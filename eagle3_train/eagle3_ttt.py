"""Training-time test (TTT): the draft unrolled for several chain steps over a whole sequence at once.

Why: at inference the draft's later chain steps run on its *own* carried hidden, not the
target's, so a draft trained only on target hiddens drifts after one step. EAGLE-3 and SpecForge
therefore train on the unrolled chain: step s at base row i takes token t_{i+1+s} and the hidden
the draft itself produced at step s-1, runs at position i+s, and predicts t_{i+2+s}. Its
attention sees the step-0 keys of rows <= i (the KV the first pass writes at inference) and
its own earlier steps' keys of the same base row (the provisional chain KV): the "diagonal" mask.
Computing every base row in parallel this way is exactly what sequential chains from every
position would compute, which is also why ``acceptance`` uses it to measure acceptance for all
positions in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3_train.eagle3_reference import Eagle3Draft, attention


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, n:] padded at the end with ``fill`` back to x's length."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def unroll(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, steps: int):
    """Yield ``(s, logits_s)`` for s = 0..steps-1; ``logits_s[:, i]`` is the draft's prediction of
    t_{i+2+s} from base row i (teacher-forced tokens, own carried hiddens).

    tokens [B, T] (target ids), aux [B, T, n_aux * H_t]. Rows with i + 1 + s >= T have no input
    token (padded with 0) and must be ignored by the caller; being past every valid row in the
    causal order, they cannot affect valid rows.
    """
    B, T = tokens.shape
    attn = draft.midlayer.self_attn
    base = torch.arange(T, device=tokens.device).unsqueeze(0).expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
    hidden = draft.combine(aux)
    diag = []
    for s in range(steps):
        x, residual = draft.layer_input(shift_left(tokens, 1 + s, 0), hidden)
        q, k, v = attn.project(x, base + s)
        if s == 0:
            k0, v0 = k, v
        else:
            diag.append((k, v))
        logits, hidden = draft.finish(residual, attention(q, k0, v0, attn.scale, causal, diag))
        yield s, logits


def valid_rows(T: int, s: int, device) -> torch.Tensor:
    """[T] bool: base rows whose step-s target token t_{i+2+s} lies inside the window."""
    return torch.arange(T, device=device) + 2 + s <= T - 1


def target_labels(target_logits: torch.Tensor, draft_to_target: torch.Tensor):
    """The target's side of the loss, computed once per batch (before the per-step shifts).

    Returns ``(probs, argmax, draftable)``: the target distribution restricted to the draft vocab
    and renormalised [B, T, V_d] (bf16 to halve memory), the target's greedy token [B, T], and
    whether that token exists in the draft vocab [B, T] (rows where it does not can never be
    accepted and, as in SpecForge, are left out of the loss).
    """
    in_vocab = torch.zeros(target_logits.shape[-1], dtype=torch.bool, device=target_logits.device)
    in_vocab[draft_to_target] = True
    argmax = target_logits.argmax(-1)
    probs = F.softmax(target_logits[..., draft_to_target].float(), dim=-1).to(torch.bfloat16)
    return probs, argmax, in_vocab[argmax]


def soft_label_loss(logits, probs, argmax, rows, draft_to_target):
    """Soft cross-entropy of one unrolled step against (already shifted) target labels.

    Returns (loss summed over ``rows``, number of rows, rows where the draft's greedy token equals
    the target's greedy token).
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    loss = -(probs.float() * logp).sum(-1)
    correct = (draft_to_target[logits.argmax(-1)] == argmax) & rows
    return (loss * rows).sum(), rows.sum(), correct.sum()
