"""The zoo's model list: where each model lives, whether it is ready, how to make it ready.

Why: tests, examples and benchmarks ask for a model by name (``resolve("tiny-kimi")``) and must
get either a folder or an error that says what to run. Two kinds of model exist:
  * converted: built on this machine into the cache, ``$ATOM_LIKE_CACHE/<name>`` or
    ``~/.cache/atom_like/zoo/<name>``: SmolLM2 from its GGUF package, tiny-kimi-mxfp4 from the
    shipped tiny-kimi;
  * shipped: trained once on a GPU (``ci/train_zoo.sh``) and committed inside the package at
    ``atom_like/zoo/models/<name>/``; a copy in the cache folder is found too (a fresh training
    run can be tried there before it is committed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from atom_like.zoo.checkpoint import checkpoint_files

PACKAGE_MODELS = Path(__file__).resolve().parent / "models"
READY_MARKER = "zoo.json"  # written last by every zoo writer


@dataclass(frozen=True)
class ZooModel:
    name: str
    role: str  # "target" or "draft"
    target: str | None  # for drafts: the target they were trained against
    summary: str
    make: str  # the command that makes it ready
    converted: bool = False  # built into the cache by ``prepare`` rather than shipped


_TRAIN = "ci/train_zoo.sh on a GPU machine (docs: atom_like/zoo/README.md), then copy its output here"
MODELS: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("smollm2-135m", "target", None,
             "SmolLM2-135M-Instruct (Llama, 30 layers, GGUF Q4_1 dequantised to bf16)",
             "python -m atom_like.zoo prepare smollm2-135m", converted=True),
    ZooModel("smollm2-135m-eagle3", "draft", "smollm2-135m",
             "EAGLE3 Llama draft for SmolLM2, draft vocab < target vocab (d2t)",
             "ZOO_STAGES=smol-convert,smol-regen,smol-draft,smol-draft-more ci/train_zoo.sh on a GPU "
             "(atom_like/zoo/README.md)"),
    ZooModel("tiny-kimi", "target", None,
             "Kimi-K2.5 architecture (MLA + MoE, sigmoid/noaux_tc routing), trained from scratch", _TRAIN),
    ZooModel("tiny-kimi-mxfp4", "target", None,
             "tiny-kimi in the released Kimi-K2.5-MXFP4 format (Quark MXFP4 W4A4 experts + MLPs, fp8 KV scales)",
             "python -m atom_like.zoo prepare tiny-kimi-mxfp4", converted=True),
    ZooModel("tiny-kimi-eagle3", "draft", "tiny-kimi", "EAGLE3 Llama (MHA) draft, full vocab", _TRAIN),
    ZooModel("tiny-kimi-eagle3-mla", "draft", "tiny-kimi", "EAGLE3 MLA draft (Eagle3DeepseekV2ForCausalLM)", _TRAIN),
    ZooModel("tiny-kimi-eagle3.1-mla", "draft", "tiny-kimi", "EAGLE3.1 MLA draft (fc_norm + norm_output)", _TRAIN),
]}


def cache_root() -> Path:
    env = os.environ.get("ATOM_LIKE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "atom_like" / "zoo"


def is_ready(path: Path) -> bool:
    """A folder is a usable model when its config and all of its weight files are present."""
    if not (path / "config.json").is_file() or not (path / READY_MARKER).is_file():
        return False
    try:
        return all(p.is_file() for p in checkpoint_files(path))
    except FileNotFoundError:
        return False


def candidates(name: str) -> list[Path]:
    """Folders searched for ``name``, in order (converted models live in the cache only)."""
    cached = cache_root() / name
    return [cached] if _spec(name).converted else [PACKAGE_MODELS / name, cached]


def locate(name: str) -> Path | None:
    return next((p for p in candidates(name) if is_ready(p)), None)


def prepare(name: str) -> Path:
    """Build a converted model into the cache."""
    if not _spec(name).converted:
        raise ValueError(f"{name!r} is not built by 'prepare'; to make it: {_spec(name).make}")
    if name == "tiny-kimi-mxfp4":
        from atom_like.zoo.tiny_kimi_mxfp4 import convert
    else:
        from atom_like.zoo.smollm2 import convert

    return convert(cache_root() / name)


def resolve(name: str, prepare_missing: bool = True) -> Path:
    """Folder of a ready zoo model; converts SmolLM2 on demand; otherwise says how to get it."""
    path = locate(name)
    if path is not None:
        return path
    if prepare_missing and _spec(name).converted:
        return prepare(name)
    where = " or ".join(str(p) for p in candidates(name))
    raise FileNotFoundError(f"zoo model {name!r} is not ready (looked in {where}); to make it: {_spec(name).make}")


def _spec(name: str) -> ZooModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"{name!r} is neither a checkpoint folder nor a zoo model; zoo models: "
                         f"{', '.join(MODELS)}") from None


def table() -> str:
    """The ``list`` command's output: name, role, status, folder."""
    rows = [("name", "role", "ready", "where")]
    for m in MODELS.values():
        path = locate(m.name)
        rows.append((m.name, m.role if m.target is None else f"draft of {m.target}",
                     "yes" if path else "no", str(path) if path else f"missing: {m.make}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)
