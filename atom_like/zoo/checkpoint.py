"""Safetensors checkpoints in the Hugging Face layout, sharded to a size limit.

Why our own writer: the zoo's checkpoints must come back from the GPU machine as files of at
most 16 MiB, and ship inside the package, so every writer here shards at ``max_shard_bytes``
(default 15 MiB) using HF's naming (``model-00001-of-00002.safetensors`` plus
``model.safetensors.index.json``); a checkpoint under the limit is one ``model.safetensors``.
Any HF-style loader (transformers, vLLM, sglang, the engine) reads both forms.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MAX_SHARD_BYTES = 15 * 2**20
INDEX_NAME = "model.safetensors.index.json"


def save_sharded(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write ``tensors`` (key order kept) into shards of at most ``max_shard_bytes`` each.

    A single tensor larger than the limit gets a shard of its own. Returns the files written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in list(out_dir.glob("model*.safetensors")) + list(out_dir.glob(INDEX_NAME)):
        old.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        path = out_dir / "model.safetensors"
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        path = out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        paths.append(path)
        weight_map.update({k: path.name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (one file, or the shards its index names)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or {INDEX_NAME} in {model_dir}")


def load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint_files(model_dir))
