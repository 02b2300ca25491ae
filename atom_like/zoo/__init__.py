"""The model zoo: one real pretrained target (SmolLM2-135M), one Kimi-architecture target trained
from scratch (tiny-kimi, and tiny-kimi-mxfp4 converted from it as AMD converts Kimi-K2.5), and
EAGLE3 drafts for both. The tools that trained them live in the separate `eagle3_train` package
(``pip install -e ".[train]"``), so a server never imports training code.

Python API: ``resolve(name) -> Path`` (converts SmolLM2 on demand, else says how to get the
model), ``MODELS`` (the list). Command line: ``python -m atom_like.zoo list|prepare NAME``.
Training tools: ``python -m eagle3_train.build_data``, ``.train_target``, ``.train_eagle3``, ``.regenerate``.
"""

import os

from atom_like.zoo.registry import MODELS, cache_root, locate, prepare, resolve

__all__ = ["MODELS", "cache_root", "locate", "model_path", "prepare", "resolve"]

DEFAULT_TARGET, DEFAULT_DRAFT = "tiny-kimi", "tiny-kimi-eagle3"  # the embedded default pair


def model_path(name_or_dir: str) -> str:
    """A checkpoint folder as given, else the folder of the zoo model of that name."""
    return name_or_dir if os.path.isdir(name_or_dir) else str(resolve(name_or_dir))
