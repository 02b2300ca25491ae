"""Dependencies point one way (README layout): kernels_rocm <- model_ops <- spec_decode <- atom_like,
and the training package is never loaded by what users run."""
from __future__ import annotations

import subprocess
import sys

import pytest

LOWER = {"kernels_rocm": [], "model_ops": ["kernels_rocm"], "spec_decode": ["model_ops", "kernels_rocm"]}
SERVING = ["atom_like.entrypoints.openai_server", "atom_like.examples.simple_inference", "atom_like.eval.gsm8k",
           "atom_like.zoo"]


def loaded_after(module: str, every_submodule: bool = False) -> set[str]:
    """Top-level packages loaded by importing `module` (and, if asked, every module under it) in a
    fresh interpreter."""
    walk = (f"import importlib, pkgutil; [importlib.import_module(m.name) for m in "
            f"pkgutil.walk_packages({module}.__path__, '{module}.')]; ") if every_submodule else ""
    code = f"import sys, {module}; {walk}print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("module", SERVING)
def test_serving_never_imports_training(module):
    assert "eagle3_train" not in loaded_after(module)


@pytest.mark.parametrize("package,allowed", LOWER.items())
def test_lower_packages_import_nothing_above_them(package, allowed):
    ours = {"atom_like", "spec_decode", "model_ops", "kernels_rocm", "eagle3_train"}
    assert loaded_after(package, every_submodule=True) & ours <= {package, *allowed}
