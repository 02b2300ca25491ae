"""Which target layers feed an EAGLE3 draft, and the runner-owned buffer they are captured into.

Id k means the residual stream entering target layer k (= transformers' `output_hidden_states[k]`
for k < N; id N is the stream after the last layer, before the final norm). Drafts ship ids in
two conventions (docs/eagle3_semantics.md): "input of layer X" (EAGLE reference, vLLM, ATOM;
defaults (2, N//2, N-3)) and "output of layer X" (TorchSpec training ids, e.g. [1, 29, 57] for
Kimi). As in sgl-project/sglang#25454, a first id of 1 marks the second convention and every id
shifts by +1; otherwise ids are used as given.

Ids may repeat: targets shallower than 7 layers get repeated defaults (a 6-layer target: 2, 3, 3),
which vLLM, SGLang and ATOM accept as they are. A repeated id fills one column block per
occurrence, so the draft's fc reads len(ids) * hidden_size columns, the layout a trainer that
indexes `output_hidden_states` with those ids produces. Ids must not decrease: every engine
concatenates captures in layer order, so a descending list has no unambiguous meaning.
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
        if len(set(ids)) < len(ids) and ids == sorted(ids):
            logger.info("%s gives capture ids %s: a target this shallow repeats a layer, captured once per id "
                        "(vLLM, SGLang and ATOM use the same defaults)", source, ids)
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
    if any(a > b for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{source} gives capture ids {ids}, which are not in ascending order (engines concatenate "
                         "captures in layer order)"
                         + ("; pass explicit ids for so shallow a target" if layer_ids is None else ""))
    return ids


class AuxHiddenStates:
    """Runner-owned buffer [max_tokens, len(layer_ids) * hidden_size]; the columns of layer_ids[i]
    are i * hidden_size ..., so `get` is the ascending-id concatenation the draft's fc reads (a
    repeated id fills each of its blocks). `capture` only copies into a fixed buffer (no
    allocation, no host sync), so it can run inside a captured graph and replays refill the same
    memory."""

    def __init__(self, layer_ids: list[int], max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        self.buffer = torch.zeros(max_tokens, len(self.layer_ids) * hidden_size, dtype=dtype, device=device)
        self._columns: dict[int, list[int]] = {}
        for i, layer in enumerate(self.layer_ids):
            self._columns.setdefault(layer, []).append(i * hidden_size)

    def capture(self, layer_idx: int, stream: torch.Tensor) -> None:
        """Store the stream [T, H] entering layer `layer_idx`; a no-op for layers not captured."""
        for start in self._columns.get(layer_idx, ()):
            self.buffer[: stream.shape[0], start:start + self.hidden_size].copy_(stream)

    def get(self, num_tokens: int) -> torch.Tensor:
        return self.buffer[:num_tokens]
