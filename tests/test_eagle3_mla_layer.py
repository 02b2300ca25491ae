"""The MLA draft's layer on random inputs, through the engine's paged path, against direct torch
computations: the plain-PyTorch draft of eagle3_train.eagle3_reference (what the zoo trains),
and explicit RMSNorm / fc math for the EAGLE3.1 flags: fc_norm touches only the target's aux
input, norm_output only the carried hidden."""
from __future__ import annotations

import pytest
import torch

from atom_like import LLMEngine
from eagle3_train import eagle3_reference as R
from model_ops.attention.metadata import AttentionMetadata
from spec_decode.eagle3 import Eagle3Draft
from spec_decode.proposer import Eagle3Proposer, chain_step_metadata

T = 20  # first-pass rows: more than ABSORBED_MAX_QUERY_LEN, so it takes the expanded MLA form
EPS = 0.1  # rms_norm_eps: large, so an eps taken from the wrong field (e.g. the latent norms') shows
BLOCK = 16


@pytest.fixture(scope="module")
def target(make_deepseek):
    return make_deepseek("v3")


def load(target: str, draft_path: str) -> Eagle3Draft:
    """The engine's draft, built, loaded and bound to its KV pool by an idle engine."""
    engine = LLMEngine(target, max_model_len=48, num_kv_blocks=4, method="eagle3", draft_model=draft_path,
                       num_speculative_tokens=3)
    return engine.runner.proposer.draft


def first_pass_meta(n: int) -> AttentionMetadata:
    """One sequence of n new tokens at positions 0..n-1 in blocks 0, 1, ... of the idle pool."""
    return AttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             context_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(4, dtype=torch.int32)[None], slot_mapping=torch.arange(n),
                             max_query_len=n, max_context_len=n)


def random_inputs(draft: Eagle3Draft, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    eagle, hidden = draft.eagle, draft.config.hidden_size
    ids = torch.randint(0, draft.config.vocab_size, (T + 1,), generator=g)
    aux = 3 * torch.randn(T, eagle.num_aux * eagle.target_hidden_size, generator=g)
    return ids, torch.arange(T + 1), aux, torch.randn(T, hidden, generator=g)


def engine_rows(draft: Eagle3Draft, ids, positions, aux):
    """Post-norm and carried hidden of a first pass over T rows, then one chain step at position T."""
    post, pre = draft(ids[:T], positions[:T], draft.combine_hidden_states(aux), first_pass_meta(T))
    carry = draft.carry(post, pre)
    meta = chain_step_metadata(first_pass_meta(T).block_tables, positions[T:], BLOCK, T + 1)
    post2, pre2 = draft(ids[T:], positions[T:], carry[-1:], meta)
    return torch.cat([post, post2]), torch.cat([carry, draft.carry(post2, pre2)])


def reference_rows(ref: R.Eagle3Draft, ids, positions, aux):
    """The same two steps with the reference module: causal attention over every row so far."""
    def rows(n, hidden):
        x, residual = ref.layer_input(ids[None, :n], hidden)
        attn = ref.midlayer.self_attn
        q, k, v = attn.project(x, positions[None, :n])
        return ref.finish(residual, R.attention(q, k, v, attn.scale, torch.ones(n, n, dtype=torch.bool).tril()))

    with torch.no_grad():
        g = ref.combine(aux[None])
        logits, carry = rows(T, g)
        logits2, carry2 = rows(T + 1, torch.cat([g, carry[:, -1:]], dim=1))
    return torch.cat([logits[0], logits2[0, -1:]]), torch.cat([carry[0], carry2[0, -1:]])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("flags", [{}, dict(fc_norm=True), dict(legacy_aux_norm=True), dict(norm_output=True),
                                   dict(fc_norm=True, norm_output=True, draft_vocab_size=48)])
def test_draft_matches_the_reference_module(target, make_eagle3_mla, flags):
    path = make_eagle3_mla(target, rms_norm_eps=EPS, **flags)
    draft, ref = load(target, path), R.load_draft(path)
    ids, positions, aux, _ = random_inputs(draft)
    with torch.no_grad():
        post, carry = engine_rows(draft, ids, positions, aux)
        logits, tokens = draft.compute_logits(post), draft.draft_token_ids(post)
    ref_logits, ref_carry = reference_rows(ref, ids, positions, aux)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(carry, ref_carry, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, ref.to_target(ref_logits.argmax(-1)))  # target ids, through d2t when present


def test_fc_norm_touches_only_the_aux_input(target, make_eagle3_mla, monkeypatch):
    plain, normed = (load(target, make_eagle3_mla(target, rms_norm_eps=EPS, fc_norm=flag)) for flag in (False, True))
    _, positions, aux, hidden = random_inputs(normed)
    ids = positions[:T] % 100
    fc = normed.fc.weight
    with torch.no_grad():
        chunks = aux.chunk(3, dim=-1)
        expected = torch.cat([rms_norm(c, n.weight) for c, n in zip(chunks, normed.fc_norm)], dim=-1) @ fc.T
        torch.testing.assert_close(normed.combine_hidden_states(aux), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain.combine_hidden_states(aux), aux @ fc.T, rtol=1e-5, atol=1e-5)
        # a carried hidden goes straight into the layer: the same outputs with or without fc_norm
        for a, b in zip(plain(ids, positions[:T], hidden, first_pass_meta(T)),
                        normed(ids, positions[:T], hidden, first_pass_meta(T))):
            assert torch.equal(a, b)

    # in the engine, fc_norm runs once per proposal (the first pass), never in the k - 1 chain steps
    calls = {"propose": 0, "fc_norm": 0}
    first_pass = Eagle3Proposer.first_pass

    def counting(self, inputs):
        calls["propose"] += 1
        return first_pass(self, inputs)

    monkeypatch.setattr(Eagle3Proposer, "first_pass", counting)
    engine = LLMEngine(target, max_model_len=64, method="eagle3", num_speculative_tokens=3,
                       draft_model=make_eagle3_mla(target, fc_norm=True))
    count = lambda *_: calls.__setitem__("fc_norm", calls["fc_norm"] + 1)  # noqa: E731
    engine.runner.proposer.draft.fc_norm[0].register_forward_hook(count)
    engine.generate([[3, 1, 4, 1, 5]], use_tqdm=False)
    assert calls["fc_norm"] == calls["propose"] > 1


def test_norm_output_changes_only_the_carried_hidden(target, make_eagle3_mla):
    pre_carry, post_carry = (load(target, make_eagle3_mla(target, rms_norm_eps=EPS, norm_output=flag))
                             for flag in (False, True))
    _, positions, _, hidden = random_inputs(pre_carry)
    ids = positions[:T] % 100
    with torch.no_grad():
        post, pre = pre_carry(ids, positions[:T], hidden, first_pass_meta(T))
        post_n, pre_n = post_carry(ids, positions[:T], hidden, first_pass_meta(T))
        assert torch.equal(post, post_n) and torch.equal(pre, pre_n)
        logits = pre_carry.compute_logits(post)
        assert torch.equal(logits, post_carry.compute_logits(post_n))  # identical: the carry is never normed twice
        torch.testing.assert_close(post, rms_norm(pre, pre_carry.norm.weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, post @ pre_carry.lm_head.weight.T, rtol=1e-5, atol=1e-5)
    assert pre_carry.carry(post, pre) is pre  # EAGLE3: the pre-norm residual sum
    assert post_carry.carry(post_n, pre_n) is post_n  # EAGLE3.1 norm_output: the final norm's output
