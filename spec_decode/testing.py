"""Forced acceptance for benchmarks (never used in serving), like ATOM's
--spec-decode-acceptance-length: the engine's speed at an exact acceptance length, with the real
draft running (its cost, captured graphs included), free of the bf16 near-tie flips that make a
precomputed continuation drift on random-weight models. Not lossless.

A benchmark installs it in place of the engine's verifier and may change `m` between steps:

    forced = ForcedAcceptance(m)
    engine.runner.sampler.verifier = forced
"""
from __future__ import annotations

import torch

from model_ops.logits_processors import LogitsProcessors
from model_ops.sampling import DraftLayout, SamplingTensors, Verified, greedy_tokens


class ForcedAcceptance:
    """A Verifier (model_ops.sampling) that accepts each sequence's first min(m, its drafts)
    drafts whatever they are, then emits the argmax of the row after them (taken as `verify`
    takes it). Device work only, like `verify`, so it runs inside an overlapped step."""

    def __init__(self, m: int):
        self.m = m

    def __call__(self, logits: torch.Tensor, num_drafts: list[int], draft_ids: torch.Tensor, st: SamplingTensors,
                 shared: torch.Generator, processors: LogitsProcessors | None = None) -> Verified:
        layout = DraftLayout.of(logits, num_drafts, draft_ids)
        first_m = torch.arange(layout.valid.shape[1], device=logits.device) < self.m
        return layout.verified(greedy_tokens(logits), layout.valid & first_m[None, :])
