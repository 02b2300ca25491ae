"""The draft loop's metadata across the first pass and the chain steps after partial acceptance:
which tokens, positions, slots and context lengths each draft forward sees."""
from __future__ import annotations

import torch
from transformers import AutoConfig

from atom_like.models.eagle3_llama import Eagle3LlamaForCausalLM
from atom_like.models.registry import build_model
from model_ops.attention.metadata import AttentionMetadata, slots_for_positions
from spec_decode.aux_layers import AuxHiddenStates
from spec_decode.proposer import Eagle3Proposer, ProposeInputs, chain_step_metadata, first_pass_input_ids

BS = 4


def test_first_pass_shifts_tokens_and_places_next_tokens():
    ids = torch.tensor([10, 11, 12, 20, 21, 22, 23])  # seq A: prompt chunk; seq B: [last, d1, d2, d3]
    last_rows = torch.tensor([2, 4])  # B accepted one draft: its last verified row is 3 + 1
    shifted = first_pass_input_ids(ids, last_rows, torch.tensor([13, 99]))
    assert shifted[:5].tolist() == [11, 12, 13, 21, 99]  # A: next prompt token; B: d1 then the new token


def test_chain_metadata_from_block_table():
    tables = torch.tensor([[7, 3, 70_000], [5, 6, 0]], dtype=torch.int32)
    pos = torch.tensor([9, 2])
    meta = chain_step_metadata(tables, pos, BS, max_context_len=12)
    assert meta.query_start_loc.tolist() == [0, 1, 2]
    assert meta.context_lens.tolist() == [10, 3]
    assert meta.slot_mapping.tolist() == [70_000 * BS + 1, 5 * BS + 2]
    assert meta.slot_mapping.dtype == torch.int64


def test_propose_metadata_after_partial_acceptance(tmp_path, make_llama, make_eagle3_llama):
    target = make_llama(num_hidden_layers=8, seed=1)
    config = AutoConfig.from_pretrained(make_eagle3_llama(target))
    draft = build_model(Eagle3LlamaForCausalLM, config, torch.float32, torch.device("cpu"))
    k, hidden = 3, config.hidden_size
    aux = AuxHiddenStates([2, 4, 5], 16, hidden, torch.float32, torch.device("cpu"))
    aux.buffer.normal_()
    proposer = Eagle3Proposer(draft, aux, k, BS, torch.float32, torch.device("cpu"))
    pool = proposer.builder.allocate_kv_cache_tensors(32)["eagle3_kv_cache"]
    for m in draft.modules():
        proposer.builder.build_kv_cache_tensor(m)
    pool.normal_()

    # seq 0: a middle prompt chunk at positions 4..6; seq 1: verify of [last, d1, d2, d3] at 9..12,
    # of which one draft was accepted (new token 55 follows row 3 + 1 = 4).
    tables = torch.tensor([[1, 2, 0, 0], [8, 9, 10, 11]], dtype=torch.int32)
    positions = torch.tensor([4, 5, 6, 9, 10, 11, 12])
    seq_of_row = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    meta = AttentionMetadata(torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([7, 13], dtype=torch.int32),
                             tables, slots_for_positions(tables[seq_of_row], positions, BS), 4, 13)
    context_before = meta.context_lens.clone()
    calls = []
    original = draft.forward

    def spy(input_ids, pos, hidden_in, m):
        calls.append((input_ids.clone(), pos.clone(), m))
        return original(input_ids, pos, hidden_in, m)

    draft.forward = spy
    out = proposer.propose(ProposeInputs(
        input_ids=torch.tensor([30, 31, 32, 40, 41, 42, 43]), positions=positions, meta=meta,
        last_rows=torch.tensor([2, 4]), next_token_ids=torch.tensor([33, 55]),
        sampling=torch.tensor([1]), num_drafts=k))

    assert out.shape == (1, k)
    assert len(calls) == k
    first_ids, first_pos, first_meta = calls[0]
    assert first_ids.tolist()[:5] == [31, 32, 33, 41, 55] and first_pos.tolist() == positions.tolist()
    assert first_meta is meta  # same slots and block tables as the target step
    for step, (ids, pos, m) in enumerate(calls[1:], start=1):
        assert ids.tolist() == [int(out[0, step - 1])]  # the previous draft token
        assert pos.tolist() == [10 + step]  # row 4 sits at position 10
        assert m.context_lens.tolist() == [11 + step]
        assert m.slot_mapping.tolist() == [int(tables[1, (10 + step) // BS]) * BS + (10 + step) % BS]
        assert m.block_tables.tolist() == [tables[1].tolist()]
        assert m.max_context_len >= 11 + step
    assert torch.equal(meta.context_lens, context_before)  # the target's metadata is left untouched
