"""Shared fixtures: tiny random-init checkpoints written by transformers itself, so every test
compares the engine against the model code users would otherwise run.

CPU CI runs the Triton kernels in the interpreter. Triton reads TRITON_INTERPRET when a kernel
is decorated, so it is set here, before any test module imports triton.

The suite under tests/ outside tests/gpu is the CPU suite, and it runs as CI runs it on every
machine: where a GPU is present, `pytest tests` hides it (CUDA_VISIBLE_DEVICES and
HIP_VISIBLE_DEVICES empty, before anything initializes CUDA), because those tests pass CPU tensors
to the kernels and expect the CPU's defaults. On 2026-11-27 that suite run on an H100 without this
gave 601 failures, nearly all of that kind. Naming any path under tests/gpu on the command line
keeps the GPU visible, for the GPU suite and any CPU file run beside it. The choice goes to xdist
workers and subprocesses through ATOM_LIKE_TEST_GPU.
"""
from __future__ import annotations

import json
import os
import sys

if "ATOM_LIKE_TEST_GPU" not in os.environ:
    named_gpu = any("tests/gpu" in arg.replace(os.sep, "/") for arg in sys.argv[1:])
    os.environ["ATOM_LIKE_TEST_GPU"] = "1" if named_gpu else "0"
if os.environ["ATOM_LIKE_TEST_GPU"] == "0":
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HIP_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread, here and (through the environment) in the servers, workers and scripts the
# tests start: the models are tiny, so a second thread buys little, and on shared cores a parallel
# region waits for a descheduled sibling thread at every op (docs/testing.md: one file pair took
# 95 s with two threads and 29 s with one, at load average 5 on 2 cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TINY_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over w0..w{V-1}; token 0 doubles as eos so stop tests have one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0", unk_token="w1")
    # For the chat endpoint: each message's content after a role marker; words outside the vocab
    # (the role names) encode as the unk token, which is all a random model needs.
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant{% endif %}")
    fast.save_pretrained(path)


@pytest.fixture(scope="session", autouse=True)
def _engine_invariants():
    """Every LLMEngine a test builds asserts the scheduler and KV-pool invariants at each step
    (engine_checks): a leak, an over-admission or a block owned twice fails at the step it
    happens instead of as a livelock or a wrong token later."""
    from engine_checks import install_checks

    from atom_like.engine.llm_engine import LLMEngine

    init = LLMEngine.__init__

    def checked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        install_checks(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LLMEngine, "__init__", checked_init)
        yield


@pytest.fixture(scope="session")
def make_llama(tmp_path_factory):
    """Factory: make_llama(**config overrides, tokenizer=False) -> checkpoint folder (cached)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cache: dict[str, str] = {}

    def make(tokenizer: bool = False, seed: int = 0, **overrides) -> str:
        key = json.dumps([tokenizer, seed, sorted(overrides.items())], default=str)
        if key not in cache:
            torch.manual_seed(seed)
            config = LlamaConfig(**{**TINY_LLAMA, **overrides})
            model = LlamaForCausalLM(config).eval()
            # transformers initialises with std 0.02: make logits less flat so greedy ties are rare
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0, 0.15)
            path = str(tmp_path_factory.mktemp("llama"))
            model.save_pretrained(path)
            if tokenizer:
                _save_tokenizer(path, config.vocab_size)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_path(make_llama) -> str:
    return make_llama()


def _write_draft_config(path: str, config: dict, **flags: bool) -> str:
    """config.json of a draft; EAGLE3.1 flags (fc_norm, use_aux_norm, norm_output) only when set,
    as the public drafts spell them."""
    config.update({name: True for name, on in flags.items() if on})
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    return path


def _cached_writer(tmp_path_factory, prefix: str, write):
    """make(target_path, **options) -> write(fresh folder, target_path, **options), once per arguments."""
    cache: dict[str, str] = {}

    def make(target_path: str, **options) -> str:
        key = json.dumps([target_path, sorted(options.items())], default=str)
        if key not in cache:
            cache[key] = write(str(tmp_path_factory.mktemp(prefix)), target_path, **options)
        return cache[key]

    return make


def write_eagle3_llama_draft(path: str, target_path: str, *, seed: int = 0, hidden_size: int | None = None,
                             draft_vocab_size: int | None = None, aux_layer_ids=None, fc_norm: bool = False,
                             legacy_aux_norm: bool = False, norm_output: bool = False, with_embed: bool = True,
                             layer_prefix: str = "midlayer.") -> str:
    """A random-init LlamaForCausalLMEagle3 checkpoint in the lightseekorg/SpecForge layout,
    written tensor by tensor (independently of the engine's model code)."""
    from safetensors.torch import save_file

    target = json.load(open(os.path.join(target_path, "config.json")))
    target = target.get("text_config", target)  # Kimi-K2.5 wraps its language model's config
    ht, vocab = target["hidden_size"], target["vocab_size"]
    h = hidden_size or ht
    heads, kv_heads, head_dim, inter = 4, 2, h // 4, 2 * h
    dv = draft_vocab_size or vocab
    num_aux = len(aux_layer_ids) if aux_layer_ids else 3
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    p = layer_prefix
    t = {"fc.weight": w(h, num_aux * ht), f"{p}input_layernorm.weight": norm(h), f"{p}hidden_norm.weight": norm(h),
         f"{p}post_attention_layernorm.weight": norm(h),
         f"{p}self_attn.q_proj.weight": w(heads * head_dim, 2 * h), f"{p}self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * h),
         f"{p}self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * h), f"{p}self_attn.o_proj.weight": w(h, heads * head_dim),
         f"{p}mlp.gate_proj.weight": w(inter, h), f"{p}mlp.up_proj.weight": w(inter, h), f"{p}mlp.down_proj.weight": w(h, inter),
         "norm.weight": norm(h), "lm_head.weight": w(dv, h)}
    if with_embed:
        t["embed_tokens.weight"] = w(vocab, h)
    if fc_norm or legacy_aux_norm:
        t.update({f"fc_norm.{i}.weight": norm(ht) for i in range(num_aux)})
    if dv != vocab:
        chosen = torch.randperm(vocab, generator=g)[:dv].sort().values
        t["d2t"] = chosen - torch.arange(dv)
        t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, chosen, True)
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": target.get("max_position_embeddings", 512), "vocab_size": vocab,
              "draft_vocab_size": dv, "target_hidden_size": ht, "tie_word_embeddings": False,
              "eagle_config": {"use_aux_hidden_state": True, **({"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)} if aux_layer_ids else {})}}
    return _write_draft_config(path, config, fc_norm=fc_norm, use_aux_norm=legacy_aux_norm, norm_output=norm_output)


@pytest.fixture(scope="session")
def make_eagle3_llama(tmp_path_factory):
    """Factory: make_eagle3_llama(target_path, **options of write_eagle3_llama_draft) -> folder (cached)."""
    return _cached_writer(tmp_path_factory, "eagle3", write_eagle3_llama_draft)


def write_eagle3_mla_draft(path: str, target_path: str, *, seed: int = 0, aux_layer_ids=(0, 1, 2),
                           draft_vocab_size: int | None = None, draft_vocab_ids=None, fc_norm: bool = False,
                           legacy_aux_norm: bool = False, norm_output: bool = False, fused_qkv_a: bool = False,
                           rms_norm_eps: float = 1e-5, num_heads: int = 2) -> str:
    """A random-init Eagle3DeepseekV2ForCausalLM checkpoint in the public kimi-k2.x-eagle3-mla layout
    (unprefixed keys, `layers.0.*`, config in the pre-transformers-5 spelling with model_type
    kimi_k2), written tensor by tensor, independently of the engine's model code. Its MLA dims
    differ from the tiny targets' (so its latent rows are narrower than the target's), and its
    YaRN has mscale_all_dim (so the softmax scale carries mscale^2). `fused_qkv_a` ships
    q_a_proj and kv_a_proj_with_mqa as sglang's fused_qkv_a_proj_with_mqa (q rows first).
    `draft_vocab_ids`: the target ids a smaller draft vocabulary covers (default: random ones).
    fc_norm weights are drawn last, so drafts of one seed differ only in what their flags add."""
    from safetensors.torch import save_file

    target = json.load(open(os.path.join(target_path, "config.json")))
    target = target.get("text_config", target)
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads, q_lora, kv_lora, nope, rope, v_dim, inter = num_heads, 32, 16, 8, 8, 12, 2 * h
    dv = len(draft_vocab_ids) if draft_vocab_ids is not None else draft_vocab_size or vocab
    num_aux = len(aux_layer_ids)
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    a = "layers.0.self_attn."
    t = {"embed_tokens.weight": w(vocab, h), "fc.weight": w(h, num_aux * h),
         "layers.0.input_layernorm.weight": norm(h), "layers.0.hidden_norm.weight": norm(h),
         "layers.0.post_attention_layernorm.weight": norm(h),
         f"{a}q_a_proj.weight": w(q_lora, 2 * h), f"{a}q_a_layernorm.weight": norm(q_lora),
         f"{a}q_b_proj.weight": w(heads * (nope + rope), q_lora),
         f"{a}kv_a_proj_with_mqa.weight": w(kv_lora + rope, 2 * h),
         f"{a}kv_a_layernorm.weight": norm(kv_lora), f"{a}kv_b_proj.weight": w(heads * (nope + v_dim), kv_lora),
         f"{a}o_proj.weight": w(h, heads * v_dim), "layers.0.mlp.gate_proj.weight": w(inter, h),
         "layers.0.mlp.up_proj.weight": w(inter, h), "layers.0.mlp.down_proj.weight": w(h, inter),
         "norm.weight": norm(h), "lm_head.weight": w(dv, h)}
    if fused_qkv_a:
        t[f"{a}fused_qkv_a_proj_with_mqa.weight"] = torch.cat([t.pop(f"{a}q_a_proj.weight"),
                                                              t.pop(f"{a}kv_a_proj_with_mqa.weight")])
    if dv != vocab:
        chosen = (torch.tensor(sorted(draft_vocab_ids)) if draft_vocab_ids is not None
                  else torch.randperm(vocab, generator=g)[:dv].sort().values)
        t["d2t"] = chosen - torch.arange(dv)
        t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, chosen, True)
    if fc_norm or legacy_aux_norm:
        t.update({f"fc_norm.{i}.weight": norm(h) for i in range(num_aux)})
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": heads, "q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope,
              "qk_rope_head_dim": rope, "v_head_dim": v_dim, "hidden_act": "silu", "rms_norm_eps": rms_norm_eps,
              "rope_theta": 10000.0,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
              "max_position_embeddings": target.get("max_position_embeddings", 512), "vocab_size": vocab,
              "draft_vocab_size": dv, "target_hidden_size": h, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True}}
    return _write_draft_config(path, config, fc_norm=fc_norm, use_aux_norm=legacy_aux_norm, norm_output=norm_output)


@pytest.fixture(scope="session")
def make_eagle3_mla(tmp_path_factory):
    """Factory: make_eagle3_mla(target_path, **options of write_eagle3_mla_draft) -> folder (cached)."""
    return _cached_writer(tmp_path_factory, "eagle3_mla", write_eagle3_mla_draft)


# MLA + MoE with every routing feature on: groups (topk_group < n_group), a q LoRA, YaRN with
# mscale / mscale_all_dim, a dense first layer; callers override per variant.
TINY_DEEPSEEK = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                     kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                     routed_scaling_factor=2.5, max_position_embeddings=512, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.8,
                                      "beta_fast": 32, "beta_slow": 1},
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
TINY_KIMI_VISION = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                        pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)


def _randomize(model: torch.nn.Module, std: float) -> None:
    """Peaked logits (greedy ties are rare) and a non-zero MoE correction bias (transformers
    initialises it to zero, which would hide a bias applied in the wrong place)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.3)


@pytest.fixture(scope="session")
def make_deepseek(tmp_path_factory):
    """Factory: make_deepseek(arch="v3" | "v2" | "kimi", seed=0, std=0.15, dtype=torch.float32,
    **text-config overrides) -> checkpoint folder written by transformers' save_pretrained (cached)."""
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                              Kimi_K25Config, Kimi_K25ForConditionalGeneration)

    cache: dict[str, str] = {}

    def make(arch: str = "v3", seed: int = 0, std: float = 0.15, dtype: torch.dtype = torch.float32,
             **overrides) -> str:
        key = json.dumps([arch, seed, std, str(dtype), sorted(overrides.items())], default=str)
        if key not in cache:
            torch.manual_seed(seed)
            text = {**TINY_DEEPSEEK, **overrides}
            if arch == "v3":
                model = DeepseekV3ForCausalLM(DeepseekV3Config(**text))
            elif arch == "v2":
                model = DeepseekV2ForCausalLM(DeepseekV2Config(**text))
            else:
                # text_config defaults to deepseek_v3 (test_deepseek_loading covers the hub's kimi_k2 spelling)
                config = Kimi_K25Config(text_config=text, vision_config=TINY_KIMI_VISION, projection_hidden_size=16,
                                        tie_word_embeddings=text["tie_word_embeddings"])
                model = Kimi_K25ForConditionalGeneration(config)
            _randomize(model.eval(), std)
            model.to(dtype)
            path = str(tmp_path_factory.mktemp(f"deepseek_{arch}"))
            model.save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make
