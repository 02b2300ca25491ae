"""Which target layers feed an EAGLE3 draft, and the runner-owned buffer they are written to.

An aux hidden state k is the residual stream entering layer k, i.e. transformers'
`output_hidden_states[k]` (k = 0 is the embedding output, k = N the stream after the last layer).
Draft checkpoints number them two ways (seed 003, sglang #25454): ids starting at 1 mean
"output of layer X" and are shifted by +1; any other list is used as given.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    if layer_ids is None:
        ids = default_aux_layer_ids(num_layers)
        logger.info("EAGLE3 aux layers: default %s (input of each layer)", ids)
    elif len(layer_ids) and layer_ids[0] == 1:
        ids = [i + 1 for i in layer_ids]
        logger.info("EAGLE3 aux layers %s use the output-of-layer convention: capturing inputs of %s", list(layer_ids), ids)
    else:
        ids = list(layer_ids)
        logger.info("EAGLE3 aux layers: %s (input of each layer)", ids)
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > num_layers:
        source = f"eagle_aux_hidden_state_layer_ids {list(layer_ids)}" if layer_ids is not None else \
            "the default (2, N//2, N-3); set eagle_aux_hidden_state_layer_ids in the draft config"
        raise ValueError(f"aux layers {ids} from {source} must be ascending, unique and within 0..{num_layers} "
                         f"for a target with {num_layers} layers")
    return ids


class AuxHiddenStates:
    """[max_tokens, len(layer_ids) * hidden] buffer; column block i holds layer_ids[i]'s stream.

    Owned by the runner and filled in place by the target's forward, so a captured graph's
    replay refreshes it; readers take `get(num_tokens)`, already concatenated in id order.
    """

    def __init__(self, layer_ids: list[int], max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        self.buffer = torch.zeros(max_tokens, len(layer_ids) * hidden_size, dtype=dtype, device=device)
        self._column = {layer: i for i, layer in enumerate(self.layer_ids)}

    def capture(self, layer_idx: int, stream: torch.Tensor) -> None:
        col = self._column.get(layer_idx)
        if col is not None:
            self.buffer[: stream.shape[0], col * self.hidden_size:(col + 1) * self.hidden_size].copy_(stream)

    def get(self, num_tokens: int) -> torch.Tensor:
        return self.buffer[:num_tokens]
