"""EAGLE3 / EAGLE3.1 draft models in plain PyTorch, their checkpoint format, and the eager
speculation loop that the engine's accepted counts are checked against.

Why a reference: acceptance parity ("the engine accepts exactly what an eager loop accepts")
needs an eager loop whose every convention is written down once. This module is that loop and
the draft math; the trainer (``train_eagle3``) trains these very modules, so a trained draft
and its reference are the same code. Its RMSNorm and Eagle3Draft are deliberately not the
serving ones (model_ops.layernorm.RMSNorm, spec_decode.eagle3.Eagle3Draft): they are the
independent oracle the paged engine draft is checked against, and they train (the serving
RMSNorm has frozen weights and runs a Triton kernel on a GPU). Only the default aux ids are
shared (spec_decode.aux_layers). The conventions (docs/eagle3_semantics.md):

* Aux hidden states are HF ``output_hidden_states[k]`` (the residual stream entering layer k;
  index 0 = embeddings) for ``k`` in ``eagle_config.eagle_aux_hidden_state_layer_ids``,
  concatenated in ascending order.
* One draft step: ``g = fc(aux)`` on the first pass only (EAGLE3.1 ``fc_norm``: an RMSNorm per
  aux chunk before ``fc``); then ``residual = g; x = cat(input_layernorm(embed(tok)),
  hidden_norm(g)); h1 = residual + o_proj(attn(x)); out = h1 + mlp(post_attention_layernorm(h1));
  logits = lm_head(norm(out)); carry = norm(out) if norm_output else out``.
* Draft row i pairs token t_{i+1} with the target's aux hidden h_i at position i (the target's
  positions) and predicts t_{i+2}; chain step s from base position p runs at position p + s.
* Llama draft: HF Llama attention and RoPE (``rope_scaling`` included), scale head_dim^-0.5.
  MLA draft: DeepSeek-V3 MLA with 2H-wide ``q_a_proj``/``kv_a_proj_with_mqa``, interleaved RoPE,
  DeepSeek YaRN, softmax scale qk_head_dim^-0.5 * mscale^2, as transformers' DeepseekV3Attention.
* ``draft_vocab_size < vocab_size``: ``lm_head`` covers the draft vocab, ``target = draft +
  d2t[draft]``; ``t2d`` marks the target ids the draft vocab contains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from atom_like.zoo.checkpoint import load_tensors, save_sharded
from spec_decode.aux_layers import default_aux_layer_ids

LLAMA_ARCH = "LlamaForCausalLMEagle3"
MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as transformers' Llama/DeepSeek."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_neox(x, cos, sin):
    """Llama RoPE (rotate_half); x [B, h, T, d], cos/sin [B, T, d]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def _rope_interleaved(x, cos, sin):
    """DeepSeek RoPE on pairs (x0, x1), (x2, x3)...; output laid out [even | odd] as transformers'
    ``apply_rotary_pos_emb_interleave`` (applied to q and k alike, so dot products are unchanged)."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def yarn_mscale_squared(rope_parameters: dict) -> float:
    """DeepSeek's softmax-scale factor mscale^2 (1.0 without YaRN / without ``mscale_all_dim``)."""
    if rope_parameters.get("rope_type", "default") == "default" or not rope_parameters.get("mscale_all_dim"):
        return 1.0
    factor = rope_parameters["factor"]
    m = 0.1 * rope_parameters["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
    return m * m


class LlamaDraftAttention(nn.Module):
    """Llama MHA/GQA attention whose projections read the 2H-wide [embed, hidden] input."""

    def __init__(self, cfg: dict):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or H // nh
        self.q_proj = nn.Linear(2 * H, nh * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(nh * self.head_dim, H, bias=False)
        self.num_heads, self.num_kv_heads = nh, nkv
        self.scale = self.head_dim ** -0.5
        self.rotary = LlamaRotaryEmbedding(config=LlamaConfig(
            hidden_size=H, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=self.head_dim,
            max_position_embeddings=cfg["max_position_embeddings"], rope_theta=cfg["rope_theta"],
            rope_scaling=cfg.get("rope_scaling")))

    def project(self, x, positions):
        """x [B, T, 2H] -> q [B, h, T, d], k/v [B, h_kv, T, d] (RoPE applied at ``positions`` [B, T])."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(q, positions)
        return _rope_neox(q, cos, sin), _rope_neox(k, cos, sin), v


class MLADraftAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention whose down-projections read the 2H-wide input.

    Keys and values are returned expanded per head (what the latent cache decompresses to);
    the math equals transformers' ``DeepseekV3Attention``.
    """

    def __init__(self, cfg: dict):
        super().__init__()
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        if cfg.get("q_lora_rank") is None:
            raise ValueError("the MLA draft needs q_lora_rank in its config (sglang/vLLM/ATOM require it)")
        H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        self.num_heads = self.num_kv_heads = nh
        self.nope, self.rope, self.vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.kv_lora_rank = cfg["kv_lora_rank"]
        eps = cfg["rms_norm_eps"]
        self.q_a_proj = nn.Linear(2 * H, cfg["q_lora_rank"], bias=False)
        self.q_a_layernorm = RMSNorm(cfg["q_lora_rank"], eps)
        self.q_b_proj = nn.Linear(cfg["q_lora_rank"], nh * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope + self.vdim), bias=False)
        self.o_proj = nn.Linear(nh * self.vdim, H, bias=False)
        hf = DeepseekV3Config(
            hidden_size=H, num_attention_heads=nh, num_key_value_heads=nh, q_lora_rank=cfg["q_lora_rank"],
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.nope, qk_rope_head_dim=self.rope,
            v_head_dim=self.vdim, max_position_embeddings=cfg["max_position_embeddings"],
            rope_theta=cfg["rope_theta"], rope_scaling=cfg.get("rope_scaling"))
        self.rotary = DeepseekV3RotaryEmbedding(config=hf)
        self.scale = (self.nope + self.rope) ** -0.5 * yarn_mscale_squared(hf.rope_parameters)

    def project(self, x, positions):
        B, T, _ = x.shape
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, nh, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, nh, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        cos, sin = self.rotary(q, positions)
        q_pe = _rope_interleaved(q_pe, cos, sin)
        k_pe = _rope_interleaved(k_pe.unsqueeze(1), cos, sin).expand(B, nh, T, self.rope)
        return torch.cat([q_nope, q_pe], dim=-1), torch.cat([k_nope, k_pe], dim=-1), v


def attention(q, k, v, scale: float, mask=None, diag=()):
    """Softmax attention of q over keys k (with ``mask`` [.., T, S], True = visible) plus, per
    query row, extra same-row keys ``diag`` = [(k_j, v_j) of shape [B, h_kv, T, d]].

    The extra keys are how training-time test lets step s at base row i see its own earlier
    steps; a plain causal call passes none. Returns [B, T, h * d_v].
    """
    B, h, T, _ = q.shape
    rep = h // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        diag = [(kj.repeat_interleave(rep, 1), vj.repeat_interleave(rep, 1)) for kj, vj in diag]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    extra = [(q * kj).sum(-1, keepdim=True).float() * scale for kj, _ in diag]
    probs = torch.softmax(torch.cat([scores, *extra], dim=-1), dim=-1).to(v.dtype)
    S = k.shape[2]
    out = torch.matmul(probs[..., :S], v)
    for j, (_, vj) in enumerate(diag):
        out = out + probs[..., S + j: S + j + 1] * vj
    return out.transpose(1, 2).reshape(B, T, -1)


class DraftLayer(nn.Module):
    def __init__(self, cfg: dict, mla: bool):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = MLADraftAttention(cfg) if mla else LlamaDraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, cfg["intermediate_size"])


class Eagle3Draft(nn.Module):
    """One-layer EAGLE3 draft (Llama or MLA attention), EAGLE3.1 flags from the config."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg
        self.mla = cfg["architectures"][0] == MLA_ARCH
        H, V = cfg["hidden_size"], cfg["vocab_size"]
        Ht = cfg.get("target_hidden_size") or H
        self.aux_ids = aux_layer_ids(cfg)
        self.draft_vocab = cfg.get("draft_vocab_size") or V
        self.norm_output = bool(cfg.get("norm_output", False))
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(len(self.aux_ids) * Ht, H, bias=False)
        use_fc_norm = cfg.get("fc_norm", cfg.get("use_aux_norm", False))
        self.fc_norm = nn.ModuleList([RMSNorm(Ht, cfg["rms_norm_eps"]) for _ in self.aux_ids]) if use_fc_norm else None
        self.midlayer = DraftLayer(cfg, self.mla)
        self.norm = RMSNorm(H, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(H, self.draft_vocab, bias=False)
        if self.draft_vocab < V:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux hiddens [.., n_aux * H_t] -> draft hidden [.., H] (first pass only)."""
        if self.fc_norm is not None:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def layer_input(self, token_ids, hidden):
        """The 2H-wide attention input and the residual (the un-normed hidden)."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(self.embed_tokens(token_ids)), layer.hidden_norm(hidden)], dim=-1)
        return x, hidden

    def finish(self, residual, attn_out):
        """o_proj + residual + MLP -> (logits over the draft vocab, carried hidden)."""
        layer = self.midlayer
        h1 = residual + layer.self_attn.o_proj(attn_out)
        out = h1 + layer.mlp(layer.post_attention_layernorm(h1))
        normed = self.norm(out)
        return self.lm_head(normed), (normed if self.norm_output else out)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


def aux_layer_ids(cfg: dict) -> list[int]:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError("draft config has no eagle_config.eagle_aux_hidden_state_layer_ids")
    return list(ids)


def training_aux_layer_ids(num_layers: int) -> list[int]:
    """The aux ids written into a draft we train: the engines' default (2, N//2, N-3) where its
    ids are distinct. On targets shallower than 7 layers that default repeats a layer (the engine
    accepts that), so a draft trained here gets three distinct layers spread over 2..N-1 instead,
    which tell it more: never 1, since a first id of 1 marks the "output of layer" numbering that
    engines shift by one, and never N, since HF hidden_states[N] is post-norm."""
    ids = default_aux_layer_ids(num_layers)
    if ids == sorted(set(ids)):
        return ids
    if num_layers < 5:
        raise ValueError(f"a {num_layers}-layer target is too shallow for three aux layers in 2..N-1")
    return [round(2 + i * (num_layers - 3) / 2) for i in range(3)]


def legacy_rope_scaling(rope_parameters: dict) -> dict | None:
    """transformers' ``rope_parameters`` -> the ``rope_scaling`` dict real checkpoints carry."""
    kind = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if kind == "default":
        return None
    return {"type": kind, **{k: v for k, v in rope_parameters.items() if k not in ("rope_theta", "rope_type", "type")}}


def make_draft_config(target_cfg, arch: str, *, intermediate_size: int | None = None,
                      num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                      head_dim: int | None = None, draft_vocab_size: int | None = None,
                      aux_ids: list[int] | None = None, fc_norm: bool = False, norm_output: bool = False) -> dict:
    """A draft ``config.json`` for a transformers text config ``target_cfg``, in the field layout of
    the public drafts: ``LlamaForCausalLMEagle3``/``llama`` or ``Eagle3DeepseekV2ForCausalLM``/``kimi_k2``.

    The draft's width equals the target's (it shares the target's embedding); RoPE (theta and
    scaling) is copied from the target; the MLA draft copies the target's MLA dims. EAGLE3.1 flags
    are written only when set, as in the public checkpoints.
    """
    H, V = target_cfg.hidden_size, target_cfg.vocab_size
    rp = target_cfg.rope_parameters
    cfg = {
        "hidden_size": H, "intermediate_size": intermediate_size or target_cfg.intermediate_size,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": rp["rope_theta"], "rope_scaling": legacy_rope_scaling(rp),
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": V, "draft_vocab_size": draft_vocab_size or V, "target_hidden_size": H,
        "tie_word_embeddings": False, "bos_token_id": target_cfg.bos_token_id,
        "eos_token_id": target_cfg.eos_token_id, "pad_token_id": target_cfg.pad_token_id,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids or training_aux_layer_ids(target_cfg.num_hidden_layers)),
                         "use_aux_hidden_state": True},
    }
    heads = num_attention_heads or target_cfg.num_attention_heads
    if arch == "llama":
        cfg.update(architectures=[LLAMA_ARCH], model_type="llama", num_attention_heads=heads,
                   num_key_value_heads=num_key_value_heads or getattr(target_cfg, "num_key_value_heads", heads),
                   head_dim=head_dim or getattr(target_cfg, "head_dim", None) or H // heads)
    elif arch == "mla":
        cfg.update(architectures=[MLA_ARCH], model_type="kimi_k2", num_attention_heads=heads, num_key_value_heads=heads,
                   **{k: getattr(target_cfg, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                          "qk_rope_head_dim", "v_head_dim")})
    else:
        raise ValueError(f"arch must be 'llama' or 'mla', not {arch!r}")
    if fc_norm:
        cfg["fc_norm"] = True
    if norm_output:
        cfg["norm_output"] = True
    return cfg


def target_aux(hidden_states, ids) -> torch.Tensor:
    """HF ``output_hidden_states`` -> the draft's aux input [B, T, n_aux * H_t]."""
    return torch.cat([hidden_states[i] for i in ids], dim=-1)


# ---------------------------------------------------------------------------------------------
# Checkpoint format (identical to the public SpecForge / lightseekorg drafts)


def _ckpt_name(name: str, mla: bool) -> str:
    return "layers.0." + name[len("midlayer."):] if mla and name.startswith("midlayer.") else name


def _module_name(key: str, mla: bool) -> str:
    return "midlayer." + key[len("layers.0."):] if mla and key.startswith("layers.0.") else key


def draft_state(draft: Eagle3Draft, target_embed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: bf16 weights, int64 ``d2t``, bool ``t2d``. ``embed_tokens.weight`` is
    always written for MLA drafts (their loaders require it) and for Llama drafts only when it
    differs from ``target_embed`` (engines then borrow the target's embedding)."""
    out = {}
    for name, t in draft.state_dict().items():
        if name == "embed_tokens.weight" and not draft.mla and target_embed is not None and \
                torch.equal(t.to(torch.bfloat16), target_embed.to(t.device, torch.bfloat16)):
            continue
        out[_ckpt_name(name, draft.mla)] = t if name in ("d2t", "t2d") else t.to(torch.bfloat16)
    return out


def save_draft(draft: Eagle3Draft, out_dir: Path, target_embed: torch.Tensor | None, manifest: dict) -> list[Path]:
    out_dir = Path(out_dir)
    files = save_sharded(draft_state(draft, target_embed), out_dir)
    (out_dir / "config.json").write_text(json.dumps(draft.config, indent=2))
    (out_dir / "zoo.json").write_text(json.dumps(manifest, indent=2))
    return files


def load_draft(model_dir: Path, target=None, dtype=torch.float32) -> Eagle3Draft:
    """Load a draft (ours or SpecForge's); a missing ``embed_tokens`` is borrowed from ``target``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    draft = Eagle3Draft(cfg)
    state = {_module_name(k, draft.mla): v for k, v in load_tensors(model_dir).items()}
    if "embed_tokens.weight" not in state:
        if target is None:
            raise ValueError(f"{model_dir} has no embed_tokens.weight: pass the target to borrow its embedding")
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    draft.load_state_dict(state, strict=True)
    return draft.to(dtype).eval()


# ---------------------------------------------------------------------------------------------
# The eager speculation loop


class _DraftKV:
    """The draft's KV cache for one sequence: keys/values per position, truncatable."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self):
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, n: int):
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)


def _draft_rows(draft: Eagle3Draft, cache: _DraftKV, token_ids, hidden, start: int):
    """Run the draft on rows at positions start.. (appending their KV); causal over the cache."""
    T = token_ids.shape[1]
    positions = torch.arange(start, start + T, device=token_ids.device).unsqueeze(0)
    x, residual = draft.layer_input(token_ids, hidden)
    attn = draft.midlayer.self_attn
    q, k, v = attn.project(x, positions)
    cache.append(k, v)
    S = len(cache)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    return draft.finish(residual, attention(q, cache.k, cache.v, attn.scale, mask))


@torch.no_grad()
def reference_speculate(target, draft: Eagle3Draft, prompt_ids, k: int, max_new_tokens: int, stop_ids=()):
    """Greedy chain speculation with a transformers target and a plain-module draft.

    Each round: the draft runs a first pass over every position the target verified since the
    last round (token shifted by one, target aux hidden through ``fc``), then k-1 chain steps on
    its own tokens and carried hidden; the target verifies ``[next, d_1..d_k]`` in one forward;
    drafts are accepted while they equal the target's argmax; the correction (or bonus) token
    comes from the same forward. A stop token ends the output (drafts after an accepted stop
    token are not counted). Returns ``(new tokens, accepted drafts per verify step)``.

    Lossless: in exact arithmetic the tokens equal plain greedy decoding of the target.
    """
    from transformers import DynamicCache

    device = next(target.parameters()).device
    stop = set(int(s) for s in stop_ids)
    ids = torch.tensor([list(prompt_ids)], device=device)
    tcache = DynamicCache()
    out = target(input_ids=ids, past_key_values=tcache, use_cache=True, output_hidden_states=True)
    aux = target_aux(out.hidden_states, draft.aux_ids)
    seq = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    new_rows = len(prompt_ids)  # positions [len(seq)-1-new_rows, len(seq)-1) await the draft's first pass
    dcache, counts = _DraftKV(), []
    while seq[-1] not in stop and len(seq) - len(prompt_ids) < max_new_tokens:
        first = len(seq) - 1 - new_rows
        dcache.truncate(first)
        tokens = torch.tensor([seq[first + 1:]], device=device)
        logits, carry = _draft_rows(draft, dcache, tokens, draft.combine(aux), first)
        drafts = [int(draft.to_target(logits[0, -1].argmax()))]
        hidden = carry[:, -1:]
        for s in range(1, k):
            tok = torch.tensor([[drafts[-1]]], device=device)
            logits, hidden = _draft_rows(draft, dcache, tok, hidden, len(seq) - 2 + s)
            drafts.append(int(draft.to_target(logits[0, -1].argmax())))
        verify = torch.tensor([[seq[-1]] + drafts], device=device)
        out = target(input_ids=verify, past_key_values=tcache, use_cache=True, output_hidden_states=True)
        greedy = out.logits[0].argmax(-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == greedy[accepted]:
            accepted += 1
            if drafts[accepted - 1] in stop:
                break
        counts.append(accepted)
        seq += drafts[:accepted]
        if not (accepted and drafts[accepted - 1] in stop):
            seq.append(greedy[accepted])
        tcache.crop(len(seq) - 1 - tcache.get_seq_length())  # negative: drop the rejected rows
        aux = target_aux(out.hidden_states, draft.aux_ids)[:, : accepted + 1]
        new_rows = accepted + 1
    new = seq[len(prompt_ids):][:max_new_tokens]
    if any(t in stop for t in new):
        new = new[: next(i for i, t in enumerate(new) if t in stop) + 1]
    return new, counts
