"""The GPU zoo run's stage plan (eagle3_train/train_zoo.py): every stage is runnable, and each
stage's minutes are trimmed so that the stages after it still fit before the deadline."""
from __future__ import annotations

import pytest

from eagle3_train import train_zoo


def test_every_stage_has_a_runner_and_a_time_plan():
    for stage in train_zoo.STAGES:
        assert callable(getattr(train_zoo, "stage_" + stage.replace("-", "_")))
        assert train_zoo.planned_seconds(stage) > 0


@pytest.mark.parametrize("deadline,first_phase", [("20", 4.3), ("9.3", 0.0)])
def test_minutes_leave_room_for_later_stages(tmp_path, monkeypatch, deadline, first_phase):
    for name, value in {"ZOO_WORK": str(tmp_path), "ZOO_DEADLINE_MIN": deadline, "ZOO_SMOL_REGEN_MIN": "2",
                        "ZOO_SMOL_DRAFT_MIN": "4.3", "ZOO_SMOL_MORE_MIN": "7"}.items():
        monkeypatch.setenv(name, value)
    run = train_zoo.Run()
    run.report["plan"] = ["smol-convert", "smol-regen", "smol-draft", "smol-draft-more"]
    # 20 minutes hold the one-command SmolLM2 recipe in full; 9.3 (one device call) leave the
    # first draft phase nothing once the regeneration and the second phase are set aside
    assert run.minutes("smol-draft", 4.3) == pytest.approx(first_phase, abs=0.02)
    assert run.minutes("smol-draft-more", 7) == pytest.approx(min(7.0, float(deadline) - 100 / 60), abs=0.02)
