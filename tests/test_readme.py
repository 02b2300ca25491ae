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


def test_readme_setup_commands_are_what_ci_runs():
    """The README's two set-up commands (its first two bash blocks) are the last two lines of
    .ci/run, verbatim: CI walks the newcomer's path."""
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:3]]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert blocks == ci[-2:]
    assert blocks[0].endswith("python -m atom_like.examples.simple_inference")
    assert "python -m pytest tests" in blocks[1]
