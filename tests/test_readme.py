"""README stays true: it lists every engine flag, and its test command is the one CI runs."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from atom_like import EngineArgs

ROOT = Path(__file__).resolve().parent.parent


def test_every_engine_flag_is_documented():
    readme = (ROOT / "README.md").read_text()
    missing = [f.name for f in dataclasses.fields(EngineArgs) if f"`--{f.name.replace('_', '-')}`" not in readme
               and f"--{f.name.replace('_', '-')}`" not in readme]
    assert not missing, f"README's flag table lacks {missing}"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python -m pytest"))
    assert command in readme
