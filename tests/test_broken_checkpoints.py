"""Every broken checkpoint or config gets one line naming the file or field and what to do: a
ValueError from the Python API, `error: ...` and exit status 2 (no traceback) from every
command-line entry point (atom_like.cli.entry_point)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from atom_like import LLMEngine


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _truncate(path: Path, keep: float) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:int(len(data) * keep)])


# (name, base checkpoint, how to break a copy of it, what the one line must say)
CASES = {
    "truncated safetensors": ("llama", lambda p: _truncate(p, 0.5),
                              r"model\.safetensors is not a complete safetensors file .*fetch or write this file again"),
    "empty safetensors": ("llama", lambda p: _truncate(p, 0.0), r"model\.safetensors is not a complete safetensors file"),
    "config not JSON": ("llama", lambda p: (p / "config.json").write_text('{"hidden_size": 64,'),
                        r"config\.json is not valid JSON \(.*line 1.*\): fix it or download it again"),
    "index not JSON": ("llama", lambda p: (p / "model.safetensors.index.json").write_text("{"),
                       r"model\.safetensors\.index\.json is not a safetensors index"),
    "kimi without text_config": ("kimi", lambda p: _edit_config(p, lambda c: c.pop("text_config")),
                                 r"config\.json has no text_config, which KimiK25ForConditionalGeneration needs: add it"),
    "negative rope factor": ("llama", lambda p: _edit_config(p, lambda c: c.update(
        rope_scaling={"rope_type": "linear", "factor": -4})), r"config\.json: rope_scaling\.factor is -4; it must be a positive"),
    "negative kimi rope factor": ("kimi", lambda p: _edit_config(p, lambda c: c["text_config"]["rope_parameters"].update(
        factor=-4.0)), r"text_config\.rope_parameters\.factor is -4\.0"),
    "no hidden_size": ("llama", lambda p: _edit_config(p, lambda c: c.pop("hidden_size")),
                       r"config\.json has no hidden_size, which LlamaForCausalLM needs: add it"),
    "no vocab_size": ("llama", lambda p: _edit_config(p, lambda c: c.pop("vocab_size")),
                      r"config\.json has no vocab_size, which LlamaForCausalLM needs"),
    "no kv_lora_rank": ("deepseek", lambda p: _edit_config(p, lambda c: c.pop("kv_lora_rank")),
                        r"config\.json has no kv_lora_rank, which DeepseekV3ForCausalLM needs: add it .*would fill in 512"),
    "kimi without text hidden_size": ("kimi", lambda p: _edit_config(p, lambda c: c["text_config"].pop("hidden_size")),
                                      r"has no text_config\.hidden_size, which KimiK25ForConditionalGeneration needs"),
}


@pytest.fixture(scope="module")
def bases(make_llama, make_deepseek):
    return {"llama": make_llama(tokenizer=True), "deepseek": make_deepseek("v3"),
            "kimi": make_deepseek("kimi", n_group=1, topk_group=1)}


@pytest.fixture(scope="module")
def broken(bases, tmp_path_factory):
    """name -> a broken copy of its base checkpoint."""
    out = {}
    for name, (base, breaker, _) in CASES.items():
        path = Path(shutil.copytree(bases[base], tmp_path_factory.mktemp("broken") / "ckpt"))
        breaker(path)
        out[name] = str(path)
    return out


@pytest.mark.parametrize("case", CASES)
def test_python_api_raises_one_named_value_error(broken, case):
    with pytest.raises(ValueError, match=CASES[case][2]) as err:
        LLMEngine(broken[case], max_model_len=64)
    assert "\n" not in str(err.value)


def _one_error_line(capsys, match: str) -> None:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(match, last), err[-2000:]


@pytest.mark.parametrize("case", CASES)
def test_simple_inference_exits_2_with_one_line(broken, case, capsys):
    from atom_like.examples import simple_inference

    with pytest.raises(SystemExit) as exit_:
        simple_inference.main(["--model", broken[case], "--max-model-len", "64", "--max-tokens", "2"])
    assert exit_.value.code == 2
    _one_error_line(capsys, CASES[case][2])


def test_server_and_acceptance_tool_exit_2(broken, bases, make_eagle3_llama, capsys):
    from atom_like.benchmarks import acceptance
    from atom_like.entrypoints import openai_server

    for main, argv in [(openai_server.main, ["--model", broken["no hidden_size"]]),
                       (acceptance.main, ["--model", broken["no hidden_size"],
                                          "--draft-model", make_eagle3_llama(bases["llama"])])]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        _one_error_line(capsys, CASES["no hidden_size"][2])


def test_broken_draft_is_named(bases, make_eagle3_llama, tmp_path):
    draft = Path(shutil.copytree(make_eagle3_llama(bases["llama"]), tmp_path / "draft"))
    _truncate(draft, 0.3)
    with pytest.raises(ValueError, match=rf"{draft}/model\.safetensors is not a complete safetensors file"):
        LLMEngine(bases["llama"], max_model_len=64, method="eagle3", draft_model=str(draft))


def test_benchmark_serving_names_a_broken_tokenizer(tmp_path, capsys):
    from atom_like.benchmarks import benchmark_serving

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(SystemExit) as exit_:
        benchmark_serving.main(["--tokenizer", str(tmp_path), "--base-url", "http://127.0.0.1:9"])
    assert exit_.value.code == 2
    _one_error_line(capsys, rf"the tokenizer in {tmp_path} could not be loaded \(JSONDecodeError")


def test_gsm8k_relays_the_servers_line(broken, tmp_path, capsys):
    """Also the real `python -m atom_like.entrypoints.openai_server` process: exit 2, one line."""
    from atom_like.eval import gsm8k

    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"entries": [{"name": "bad", "model": broken["config not JSON"]}]}))
    assert gsm8k.main(["--catalog", str(catalog), "--entry", "bad", "--output", str(tmp_path / "r.json"),
                       "--startup-timeout", "600"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"gsm8k bad: the server refused to start: error: {broken['config not JSON']}/config.json is not valid JSON")
    server_log = (tmp_path / "r.server.log").read_text()
    assert "Traceback" not in server_log and server_log.strip().splitlines()[-1].startswith("error: ")
