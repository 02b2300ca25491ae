"""transformers' own model as the oracle for what the engine samples from and reports: the
next-token logits after any context (fp32 forward, returned in float64), and the exact
distribution a request with (temperature, top_k, top_p) samples from, written out directly in
numpy (top-k first, then the smallest prefix of the renormalised top-k set whose mass reaches
top_p, always keeping the most likely token: the order of vLLM and transformers' warpers)."""
from __future__ import annotations

import numpy as np
import torch
from scipy import stats


class HFReference:
    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def next_logits(self, contexts: list[list[int]]) -> np.ndarray:
        """[len(contexts), V] float64: the logits after each context."""
        out = np.empty((len(contexts), self.model.config.vocab_size))
        by_len: dict[int, list[int]] = {}
        for i, c in enumerate(contexts):
            by_len.setdefault(len(c), []).append(i)
        for rows in by_len.values():
            ids = torch.tensor([contexts[i] for i in rows])
            out[rows] = self.model(ids).logits[:, -1].double().numpy()
        return out

    @torch.no_grad()
    def generated_logprobs(self, prompt: list[int], generated: list[int]) -> np.ndarray:
        """[len(generated), V] float64: log_softmax of the raw logits that scored each generated token."""
        logits = self.model(torch.tensor([prompt + generated])).logits[0].double()
        return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(generated)], dim=-1).numpy()


def sampling_distribution(logits: np.ndarray, temperature: float, top_k: int = -1, top_p: float = 1.0) -> np.ndarray:
    """The distribution plain sampling with these settings draws from (float64, sums to 1)."""
    logits = np.asarray(logits, dtype=np.float64)
    out = np.zeros_like(logits)
    if temperature == 0:
        out[np.argmax(logits)] = 1.0
        return out
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    q = p[order] / p[order].sum()
    mass_before = np.cumsum(q) - q
    kept = order[(mass_before < top_p) | (np.arange(len(order)) == 0)]
    out[kept] = p[kept]
    return out / out.sum()


def chisquare_pvalue(tokens: list[int] | np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of sampled `tokens` to the distribution `expected` (float64).
    Tokens outside its support fail outright (p = 0). Cells expected below `min_expected` times
    are pooled into one; `expected` is normalised to the observed total, in float64, so scipy's
    sum check holds exactly."""
    expected = np.asarray(expected, dtype=np.float64)
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=len(expected)).astype(np.float64)
    support = expected > 0
    if counts[~support].sum() > 0:
        return 0.0
    f_exp = expected[support] / expected[support].sum() * counts.sum()
    f_obs = counts[support]
    big = f_exp >= min_expected
    if (~big).any():
        f_obs = np.append(f_obs[big], f_obs[~big].sum())
        f_exp = np.append(f_exp[big], f_exp[~big].sum())
    if len(f_exp) < 2:
        return 1.0  # one cell: nothing to test beyond the support
    return float(stats.chisquare(f_obs, f_exp).pvalue)
