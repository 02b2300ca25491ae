"""EAGLE3 drafts: attention equals transformers', the trainer writes the public checkpoint layout,
reference_speculate is lossless, and the fast acceptance replay equals the reference loop."""

import json

import pytest
import torch

import zoo_micro
from eagle3_train import acceptance, train_eagle3
from eagle3_train import eagle3_reference as R
from atom_like.zoo.checkpoint import load_tensors
from eagle3_train.regenerate import engine_generate, greedy_generate
from eagle3_train.shards import prompt_ids
from eagle3_train.targets import load_target

_single_thread = pytest.fixture(scope="module", autouse=True)(zoo_micro.single_thread)

LLAMA_KEYS = {"fc.weight", "norm.weight", "lm_head.weight"} | {f"midlayer.{k}.weight" for k in (
    "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
MLA_KEYS = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"} | {f"layers.0.{k}.weight" for k in (
    "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_a_proj", "self_attn.q_a_layernorm",
    "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle3")
    tok = zoo_micro.tokenizer(tmp)
    return {"tmp": tmp, "tok": tok, "data": zoo_micro.data(tmp, tok), "llama": zoo_micro.llama_target(tmp, tok),
            "mla": zoo_micro.kimi_target(tmp, tok)[0]}


def _copy_into_wider(hf_attn, ours, names):
    """Copy our projections into a transformers attention built with hidden_size = 2H; its o_proj
    maps to 2H, so ours fills the first H output rows."""
    with torch.no_grad():
        for n in names:
            getattr(hf_attn, n).weight.copy_(getattr(ours, n).weight)
        hf_attn.o_proj.weight.zero_()
        hf_attn.o_proj.weight[: ours.o_proj.weight.shape[0]] = ours.o_proj.weight


def _ours(attn, x, pos):
    q, k, v = attn.project(x, pos)
    T = x.shape[1]
    return attn.o_proj(R.attention(q, k, v, attn.scale, torch.ones(T, T, dtype=torch.bool).tril()))


@pytest.mark.parametrize("rope_scaling", [None, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}])
def test_llama_draft_attention_matches_transformers(rope_scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    torch.manual_seed(0)
    H = 32
    cfg = {"hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e4,
           "rope_scaling": rope_scaling, "max_position_embeddings": 256}
    ours = R.LlamaDraftAttention(cfg)
    hf_cfg = LlamaConfig(hidden_size=2 * H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
                         rope_scaling=rope_scaling, max_position_embeddings=256, attn_implementation="sdpa")
    hf = LlamaAttention(hf_cfg, layer_idx=0)
    _copy_into_wider(hf, ours, ["q_proj", "k_proj", "v_proj"])
    x, pos = torch.randn(2, 9, 2 * H), torch.arange(30, 39).repeat(2, 1)
    with torch.no_grad():
        ref = hf(x, LlamaRotaryEmbedding(hf_cfg)(x, pos), None)[0][..., :H]
        assert (_ours(ours, x, pos) - ref).abs().max() < 1e-5


def test_mla_draft_attention_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    torch.manual_seed(0)
    H = 32
    dims = dict(num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8, rope_theta=5e4, max_position_embeddings=1024,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    ours = R.MLADraftAttention({"hidden_size": H, "rms_norm_eps": 1e-6, **dims})
    for norm in (ours.q_a_layernorm, ours.kv_a_layernorm):
        norm.weight.data.uniform_(0.5, 1.5)
    hf_cfg = DeepseekV3Config(hidden_size=2 * H, num_key_value_heads=2, attn_implementation="sdpa", **dims)
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0)
    _copy_into_wider(hf, ours, ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"])
    assert abs(ours.scale - hf.scaling) < 1e-9  # qk_head_dim^-0.5 * mscale^2
    x, pos = torch.randn(2, 9, 2 * H), torch.arange(100, 109).repeat(2, 1)
    with torch.no_grad():
        ref = hf(x, DeepseekV3RotaryEmbedding(hf_cfg)(x, pos), None)[0][..., :H]
        assert (_ours(ours, x, pos) - ref).abs().max() < 1e-5


@pytest.mark.parametrize("target,flags", [
    ("llama", []),
    ("llama", ["--draft-vocab", "200"]),
    ("mla", ["--arch", "mla"]),
    ("mla", ["--arch", "mla", "--fc-norm", "--norm-output", "--draft-vocab", "200"]),
    ("mla", ["--arch", "llama", "--fc-norm", "--heads", "4", "--kv-heads", "4", "--head-dim", "16"]),
])
def test_trainer_writes_the_public_checkpoint_layout(micro, tmp_path, target, flags):
    args = ["--target", str(micro[target]), "--arch", "llama", "--data", f"{micro['data']}:train", "--out",
            str(tmp_path / "draft"), "--max-steps", "3", "--seq-len", "64", "--batch-size", "2", "--log-every", "1",
            "--intermediate-size", "96", "--device", "cpu", *flags]
    summary = train_eagle3.train(train_eagle3.parse_args(args))
    assert summary["steps"] == 3
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    tensors = load_tensors(tmp_path / "draft")
    mla = "--arch" in flags and flags[flags.index("--arch") + 1] == "mla"
    expected = set(MLA_KEYS if mla else LLAMA_KEYS)
    if "--fc-norm" in flags:
        expected |= {f"fc_norm.{i}.weight" for i in range(3)}
    small_vocab = "--draft-vocab" in flags
    if small_vocab:
        expected |= {"d2t", "t2d"}
    assert set(tensors) == expected  # llama drafts omit embed_tokens: it equals the target's
    target_cfg = json.loads((micro[target] / "config.json").read_text())
    target_cfg = target_cfg.get("text_config", target_cfg)
    H, V = target_cfg["hidden_size"], target_cfg["vocab_size"]
    assert cfg["architectures"] == (["Eagle3DeepseekV2ForCausalLM"] if mla else ["LlamaForCausalLMEagle3"])
    assert cfg["model_type"] == ("kimi_k2" if mla else "llama")
    assert (cfg["num_hidden_layers"], cfg["vocab_size"], cfg["target_hidden_size"], cfg["tie_word_embeddings"]) == (1, V, H, False)
    assert cfg["draft_vocab_size"] == (200 if small_vocab else V)
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == R.training_aux_layer_ids(target_cfg["num_hidden_layers"])
    assert cfg.get("fc_norm", False) == ("--fc-norm" in flags) and cfg.get("norm_output", False) == ("--norm-output" in flags)
    assert tensors["fc.weight"].shape == (H, 3 * H) and tensors["lm_head.weight"].shape[0] == cfg["draft_vocab_size"]
    if mla:
        assert cfg["q_lora_rank"] and tensors["layers.0.self_attn.q_a_proj.weight"].shape[1] == 2 * H
        assert tensors["layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape[1] == 2 * H
    else:
        assert {k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                            "rms_norm_eps", "rope_theta", "max_position_embeddings")} <= set(cfg)
        assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    if small_vocab:
        d2t, t2d = tensors["d2t"], tensors["t2d"]
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (V,) and int(t2d.sum()) == 200
        assert t2d[torch.arange(200) + d2t].all()
    model, _, _ = load_target(micro[target])
    assert isinstance(R.load_draft(tmp_path / "draft", model), R.Eagle3Draft)


def _random_draft(model, arch, **kw):
    torch.manual_seed(1)
    draft = R.Eagle3Draft(R.make_draft_config(getattr(model.config, "text_config", model.config), arch, **kw))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return draft.eval()


@pytest.mark.parametrize("target,arch,kw", [("llama", "llama", {}), ("mla", "mla", {"fc_norm": True, "norm_output": True})])
def test_reference_speculate_is_lossless_and_replay_matches_it(micro, target, arch, kw):
    """reference_speculate's tokens equal the target's plain greedy generation (fp32), and the fast
    evaluator's accepted counts equal the eager loop's, step for step.

    A random draft over a 3-token draft vocab (the target's most frequent continuation tokens)
    accepts some drafts and rejects others, without any training."""
    model, tok, stop = load_target(micro[target])
    prompts = [prompt_ids(tok, c[:1]) for c in zoo_micro.chats(2, seed=5)]
    conts = greedy_generate(model, prompts, 24 + 6, stop, tok.pad_token_id)
    frequent = torch.bincount(torch.tensor([t for c in conts for t in c]), minlength=len(tok)).argsort(descending=True)[:3]
    draft = _random_draft(model, arch, draft_vocab_size=3, **kw)
    chosen = frequent.sort().values
    draft.d2t.copy_(chosen - torch.arange(3))
    draft.t2d[chosen] = True
    seqs = [p + c for p, c in zip(prompts, conts)]
    hits = acceptance.draft_hits(model, draft, seqs, 5)
    total = 0
    for k in (1, 4):
        for h, s, p in zip(hits, seqs, prompts):
            ref_tokens, ref_counts = R.reference_speculate(model, draft, p, k, 24, stop)
            assert ref_tokens == s[len(p):][:24]  # lossless: plain greedy decoding
            assert acceptance.replay(h, s, len(p), k, 24, stop) == ref_counts
            total += sum(ref_counts)
    assert total > 0  # the comparison covered accepted drafts, not only rejections


def test_training_aux_layer_ids():
    assert R.training_aux_layer_ids(61) == [2, 30, 58] and R.training_aux_layer_ids(30) == [2, 15, 27]
    assert R.training_aux_layer_ids(5) == [2, 3, 4]  # tiny-kimi
    for n in range(5, 65):
        ids = R.training_aux_layer_ids(n)
        assert len(set(ids)) == 3 and ids == sorted(ids) and ids[0] == 2 and ids[-1] <= n - 1
    with pytest.raises(ValueError, match="too shallow"):
        R.training_aux_layer_ids(4)


def test_engine_regeneration_equals_transformers_generate(micro):
    """The engine path of regeneration (continuous batching, paged KV) returns transformers'
    greedy replies token for token in fp32 (on the Kimi-architecture micro target), cut after the first stop token the same way.

    The stop token is one the untrained model actually emits mid-reply, so both the stop and the
    length ending are covered."""
    model, tok, _ = load_target(micro["mla"])
    prompts = [prompt_ids(tok, c[:1]) for c in zoo_micro.chats(6, seed=11)]
    free = greedy_generate(model, prompts, 16, [], tok.pad_token_id, batch_size=4)
    stop = [next(t for r in free for t in r[1:] if sum(t in other for other in free) < len(free))]
    ref = greedy_generate(model, prompts, 16, stop, tok.pad_token_id, batch_size=4)
    assert any(r[-1] in stop and len(r) < 16 for r in ref) and any(len(r) == 16 for r in ref)
    assert engine_generate(micro["mla"], prompts, 16, stop, batch_size=4, device="cpu", dtype="float32") == ref
