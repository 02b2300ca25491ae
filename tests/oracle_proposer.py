"""The oracle drafter of the speculation tests.

It proposes the target's own greedy continuation, known in advance, corrupting the tokens at
the positions `corrupt(request_id, num_generated, position)` chooses. Under greedy verification
the accepted count of a step is then exactly the index of its first corrupted position, which
lets tests drive every acceptance length 0..k (mixed within one batch), exactly in fp32.

A proposer sees only the step's device tensors; the oracle also needs each row's request, so it
watches the runner's launches for the StepBatch. A sequence's generated count it reads from the
device: a step that follows one in flight (overlapped scheduling, SeqStep.follows) does not know
on the host how many drafts that step accepted, but its device positions, already moved by that
count, do. Those reads wait for the device, which only a test drafter may do.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from atom_like.engine.model_runner import ModelRunner
from atom_like.engine.step_inputs import StepBatch
from spec_decode.proposer import ProposeInputs, Proposer

Corruption = Callable[[str, int, int], bool]


def accept_first(m: int) -> Corruption:
    """Corrupt every position from m on: each verify step accepts exactly min(m, k) drafts."""
    return lambda request_id, num_generated, position: position >= m


class OracleProposer(Proposer):
    def __init__(self, runner: ModelRunner, continuations: dict[str, list[int]], num_spec_tokens: int,
                 corrupt: Corruption = accept_first(1 << 30)):
        """Built by a proposer_factory: `runner` is the one it is given."""
        self.continuations, self.num_spec_tokens, self.corrupt = continuations, num_spec_tokens, corrupt
        self.vocab_size = runner.vocab_size
        self.batch: StepBatch | None = None  # the step being launched
        # the class's method through a weak reference: no cycle keeps a dropped runner's KV pool alive
        launch, ref = type(runner).launch, weakref.ref(runner)

        def watched(batch: StepBatch) -> None:
            self.batch = batch
            launch(ref(), batch)

        runner.launch = watched

    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        seqs = [self.batch.seqs[b] for b in inputs.sampling.tolist()]
        # each sequence's last verified token; the token this step emits follows it
        last = inputs.positions[inputs.last_rows[inputs.sampling]].tolist()
        rows = []
        for seq, position in zip(seqs, last):
            done, cont = position + 2 - seq.num_prompt_tokens, self.continuations[seq.request_id]
            row = []
            for j in range(inputs.num_drafts):
                token = cont[done + j] if done + j < len(cont) else 0
                row.append((token + 1) % self.vocab_size if self.corrupt(seq.request_id, done, j) else token)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long, device=inputs.input_ids.device).reshape(len(rows), inputs.num_drafts)
