"""Turns logits rows into tokens (and logprobs) for the sequences they belong to."""
from __future__ import annotations

import torch

from atom_like.engine.sequence import Sequence
from atom_like.sampling_params import TokenLogprobs
from model_ops.sampling import SamplingTensors, sample_tokens


def sampling_tensors(seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingTensors:
    return SamplingTensors.build(
        [s.params.temperature for s in seqs], [s.params.top_k for s in seqs], [s.params.top_p for s in seqs],
        [s.generator for s in seqs], vocab_size, device,
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int | None]) -> list[TokenLogprobs | None]:
    """Logprob of each chosen token and the `top_n` most likely ones, under the model's raw
    (untempered) distribution, as OpenAI's API reports them."""
    if all(n is None for n in top_n):
        return [None] * len(top_n)
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    width = max(n or 0 for n in top_n)
    top_vals, top_ids = logp.topk(width, dim=-1) if width else (None, None)
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(top_n):
        if n is None:
            out.append(None)
            continue
        top = dict(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist())) if n else {}
        out.append(TokenLogprobs(int(tokens[row]), chosen[row], top))
    return out


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
        st = sampling_tensors(seqs, logits.shape[-1], logits.device)
        tokens = sample_tokens(logits, st, self.generator)
        return tokens.tolist(), token_logprobs(logits, tokens, [s.params.logprobs for s in seqs])
