"""Which target layers feed an EAGLE3 draft, and the runner-owned buffer they are captured into.

Id k means the residual stream entering target layer k (= transformers' `output_hidden_states[k]`
for k < N; id N is the stream after the last layer, before the final norm). Drafts ship ids in
two conventions (seed 003): "input of layer X" (EAGLE reference, vLLM, ATOM; defaults
(2, N//2, N-3)) and "output of layer X" (TorchSpec training ids, e.g. [1, 29, 57] for Kimi).
As in sglang PR #25454, a first id of 1 marks the second convention and every id shifts by +1;
otherwise ids are used as given.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

FIELD = "eagle_aux_hidden_state_layer_ids"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """Capture ids in the input-of-layer convention, validated against a target of `num_layers`."""
    if layer_ids is None:
        ids = default_aux_layer_ids(num_layers)
        source = f"default (2, N//2, N-3) for num_hidden_layers={num_layers}"
    else:
        given = list(layer_ids)
        if not given:
            raise ValueError(f"{FIELD} is empty: an EAGLE3 draft needs at least one target layer")
        if given[0] == 1:
            ids = [i + 1 for i in given]
            logger.info("%s %s start at 1: 'output of layer X' convention, capturing the inputs of layers %s",
                        FIELD, given, ids)
        else:
            ids = given
            logger.info("%s %s: 'input of layer X' convention, used as given", FIELD, given)
        source = f"{FIELD} {given}"
    if any(not isinstance(i, int) or not 0 <= i <= num_layers for i in ids):
        raise ValueError(f"{source} gives capture ids {ids}, outside [0, {num_layers}] for a target of "
                         f"{num_layers} layers (id {num_layers} = the output of the last layer)")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{source} gives capture ids {ids}, which are not strictly ascending (sorted, unique)"
                         + ("; pass explicit ids for so shallow a target" if layer_ids is None else ""))
    return ids


class AuxHiddenStates:
    """Runner-owned buffer [max_tokens, len(layer_ids) * hidden_size]; the columns of layer_ids[i]
    are i * hidden_size ..., so `get` is the ascending-id concatenation the draft's fc reads.
    `capture` only copies into a fixed buffer (no allocation, no host sync), so it can run inside
    a captured graph and replays refill the same memory."""

    def __init__(self, layer_ids: list[int], max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        self.buffer = torch.zeros(max_tokens, len(self.layer_ids) * hidden_size, dtype=dtype, device=device)
        self._column = {layer: i * hidden_size for i, layer in enumerate(self.layer_ids)}

    def capture(self, layer_idx: int, stream: torch.Tensor) -> None:
        """Store the stream [T, H] entering layer `layer_idx`; a no-op for layers not captured."""
        start = self._column.get(layer_idx)
        if start is not None:
            self.buffer[: stream.shape[0], start:start + self.hidden_size].copy_(stream)

    def get(self, num_tokens: int) -> torch.Tensor:
        return self.buffer[:num_tokens]
