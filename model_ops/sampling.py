"""Token sampling math shared by the sampler and speculative verification.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw
from p, needs no cumsum/searchsorted, and lets each request draw its noise from its own seeded
generator, so a seeded request gets the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-row sampling settings; a row with temperature 0 is greedy."""
    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64, vocab size when off
    top_p: torch.Tensor  # [R] float32
    generators: list[torch.Generator | None]  # per-row RNG (None: the shared one)
    # every row is greedy: known on the host, so the greedy path never reads it back from the device
    all_greedy: bool

    @classmethod
    def build(cls, temperature: list[float], top_k: list[int], top_p: list[float],
              generators: list[torch.Generator | None], vocab_size: int, device: torch.device) -> "SamplingTensors":
        def upload(values: list, dtype: torch.dtype) -> torch.Tensor:
            # a blocking host-to-GPU copy synchronizes the stream (the host waits for every queued
            # kernel); this one is ordered before the kernels that read it, and the source is
            # pageable memory the driver stages before returning, so nothing waits
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=upload(temperature, torch.float32),
            top_k=upload([vocab_size if k < 1 else min(k, vocab_size) for k in top_k], torch.int64),
            top_p=upload(top_p, torch.float32),
            generators=generators,
            all_greedy=all(t == 0 for t in temperature),
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    def rows(self, index: torch.Tensor) -> "SamplingTensors":
        idx = index.tolist()
        temperature = self.temperature[index]
        return SamplingTensors(temperature, self.top_k[index], self.top_p[index], [self.generators[i] for i in idx],
                               self.all_greedy or bool((temperature == 0).all()))


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) restricted to its top-k,
    then to the smallest prefix whose mass reaches top-p (always keeping the most likely token).
    Greedy rows get the one-hot of their argmax."""
    vocab = logits.shape[-1]
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits.float() / temp[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= st.top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill((mass_before >= st.top_p[:, None]) & (rank > 0), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(st.greedy[:, None], one_hot, probs)


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                      shared: torch.Generator, device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device)
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    if shared_rows:
        noise[shared_rows] = torch.empty(len(shared_rows), shape[1], device=device).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise.clamp_min_(1e-20)


def uniform_noise(n: int, generators: list[torch.Generator | None], shared: torch.Generator,
                  device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row, from the row's generator."""
    out = torch.empty(n, device=device)
    shared_rows = [i for i, g in enumerate(generators) if g is None]
    if shared_rows:
        out[shared_rows] = torch.rand(len(shared_rows), device=device, generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand(1, device=device, generator=g)[0]
    return out


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    """One exact draw per row of `probs` (rows need not be normalised)."""
    noise = exponential_noise(tuple(probs.shape), generators, shared, probs.device)
    return (probs / noise).argmax(dim=-1)
