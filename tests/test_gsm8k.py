"""The GSM8K job: lm_eval-compatible scoring, the catalog, the gates, and a run end to end on 20
problems against a server it starts itself (a random model scores ~0; the plumbing is the point)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from atom_like.entrypoints.metrics import SpecSnapshot
from atom_like.eval import gsm8k

REFERENCE = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nSo 48+24 = <<48+24=72>>72 altogether.\n#### 72"


@pytest.mark.parametrize("completion,strict,flexible", [
    (" She sold 24 + 48 = 72 clips.\n#### 72", "72", "72"),
    (" The total is $1,250.\n#### 1,250\n\n", "1,250", "1,250"),
    (" It costs $18.", "[invalid]", "$18."),
    (" 5 apples and 7 pears, 12 fruits", "[invalid]", "12"),
    (" #### -3 and then 40 more", "-3", "40"),
    (" Answer: 3.50 dollars", "[invalid]", "3.50"),
    (" no numbers at all", "[invalid]", "[invalid]"),
    (" ####72 has no space", "[invalid]", "72"),
    (" 7", "[invalid]", "7"),
])
def test_extraction_matches_lm_eval(completion, strict, flexible):
    assert gsm8k.strict_extract(completion) == strict
    assert gsm8k.flexible_extract(completion) == flexible


@pytest.mark.parametrize("extracted,reference,correct", [
    ("72", REFERENCE, True),
    ("72.", REFERENCE, True),  # a final "." is ignored
    ("$72", REFERENCE, True),
    ("7,2", REFERENCE, True),  # commas are dropped, wherever they are (as lm_eval does)
    ("72.0", REFERENCE, False),  # exact match, not numeric equality
    ("[invalid]", REFERENCE, False),
    ("1,250", "#### 1250", True),
])
def test_exact_match_after_lm_eval_normalisation(extracted, reference, correct):
    assert gsm8k.is_correct(extracted, reference) is correct


def test_fewshot_prompt_layout():
    shots = [{"question": "Q1?", "answer": "A1\n#### 1"}, {"question": "Q2?", "answer": "A2\n#### 2"}]
    assert gsm8k.fewshot_prompt("Q?", shots) == ("Question: Q1?\nAnswer: A1\n#### 1\n\n"
                                                 "Question: Q2?\nAnswer: A2\n#### 2\n\nQuestion: Q?\nAnswer:")
    assert len(gsm8k.load_exemplars(8)) == 8 and gsm8k.load_exemplars(5) == gsm8k.load_exemplars(8)[:5]
    assert len(gsm8k.load_problems(None)) == 1319 and gsm8k.load_problems(20)[0]["answer"].endswith("#### 18")


def test_the_shipped_catalog():
    catalog = gsm8k.load_catalog(gsm8k.DEFAULT_CATALOG)
    kimi = catalog["kimi-k2.5-eagle3-mi355x"]
    assert (kimi.accuracy_threshold, kimi.acceptance_threshold, kimi.accuracy_metric) == (0.91, 0.67, "flexible-extract")
    assert kimi.requires and "-tp" in kimi.server_args and "fp8" in kimi.server_args
    assert {"smollm2-135m", "smollm2-135m-eagle3", "tiny-kimi", "tiny-kimi-eagle3"} <= set(catalog)
    assert catalog["smollm2-135m-eagle3"].draft == "zoo:smollm2-135m-eagle3"
    assert gsm8k.main(["--entry", "kimi-k2.5-eagle3-mi355x"]) == gsm8k.EXIT_NO_HARDWARE


def test_thresholds():
    entry = gsm8k.CatalogEntry("e", "m", accuracy_threshold=0.5, acceptance_threshold=0.6)
    accuracy = {"strict-match": 0.2, "flexible-extract": 0.55}
    good = SpecSnapshot(10, 30, 20, [8, 7, 5], 3)
    assert gsm8k.check_thresholds(entry, accuracy, good) == []
    assert gsm8k.check_thresholds(entry, {**accuracy, "flexible-extract": 0.4}, good) == [
        "flexible-extract accuracy 0.4000 < 0.5"]
    assert gsm8k.check_thresholds(entry, accuracy, SpecSnapshot(10, 30, 15, [6, 5, 4], 3)) == [
        "acceptance rate 0.5000 < 0.6"]
    assert "speculation did not run" in gsm8k.check_thresholds(entry, accuracy, SpecSnapshot())[0]
    report_only = gsm8k.CatalogEntry("e", "m")
    assert gsm8k.check_thresholds(report_only, {"strict-match": 0, "flexible-extract": 0}, SpecSnapshot()) == []


def _write_catalog(path: Path, entries: list[dict]) -> Path:
    path.write_text(json.dumps({"entries": entries}))
    return path


def _tiny_entry(name: str, model: str, **overrides) -> dict:
    # 1 shot keeps prompts inside the tiny model's context; 16 tokens keep the run short.
    return {"name": name, "model": model, "server_args": ["--max-model-len", "512"], "num_fewshot": 1,
            "limit": 20, "max_tokens": 16, "concurrency": 8, **overrides}


def test_end_to_end_on_20_problems(make_llama, tmp_path, capsys):
    catalog = _write_catalog(tmp_path / "catalog.json",
                             [_tiny_entry("tiny", make_llama(tokenizer=True), accuracy_threshold=1.0)])
    report_path = tmp_path / "report.json"
    code = gsm8k.main(["--catalog", str(catalog), "--entry", "tiny", "--output", str(report_path)])
    assert code == gsm8k.EXIT_THRESHOLD, capsys.readouterr()  # a random model cannot reach 1.0
    report = json.loads(report_path.read_text())
    assert report["num_problems"] == len(report["samples"]) == 20
    assert report["passed"] is False and report["failures"][0].startswith("flexible-extract accuracy")
    assert set(report["accuracy"]) == {"strict-match", "flexible-extract"}
    for sample in report["samples"]:
        assert sample["extracted"]["flexible-extract"] == gsm8k.flexible_extract(sample["completion"])
    assert report["speculation"]["num_draft_tokens"] == 0 and "acceptance_rate" in report["speculation"]
    assert report["throughput"]["output_tokens"] > 0 and report["throughput"]["wall_time_s"] > 0
    assert report["prefix_cache"]["hits"] > 0  # every prompt starts with the same exemplar
    assert report["ttft_ms"]["p99"] >= report["ttft_ms"]["p50"] > 0 and report["ttft_ms"]["mean"] > 0
    assert "FAIL" in capsys.readouterr().out
    assert gsm8k.main(["--summarize", str(report_path)]) == gsm8k.EXIT_PASSED
    assert report_path.with_suffix(".server.log").read_text()


def test_a_server_that_cannot_start_is_a_run_failure(tmp_path, capsys):
    (tmp_path / "not-a-checkpoint").mkdir()
    catalog = _write_catalog(tmp_path / "catalog.json", [_tiny_entry("missing", str(tmp_path / "no-such-model")),
                                                         _tiny_entry("broken", str(tmp_path / "not-a-checkpoint"))])
    for name, reason in (("missing", "does not exist"), ("broken", "no config.json")):
        code = gsm8k.main(["--catalog", str(catalog), "--entry", name, "--output", str(tmp_path / "r.json"),
                           "--startup-timeout", "120"])
        assert code == gsm8k.EXIT_ERROR and not (tmp_path / "r.json").exists()
        assert reason in capsys.readouterr().err


def test_speculation_on_and_off_give_identical_answers(make_llama, make_eagle3_llama, tmp_path, capsys):
    target = make_llama(tokenizer=True)
    # random: it proposes badly, but greedy output must not change; aux layers fit the 2-layer target
    draft = make_eagle3_llama(target, aux_layer_ids=[0, 1, 2])
    spec_args = ["--max-model-len", "512", "--method", "eagle3", "--num-speculative-tokens", "3"]
    catalog = _write_catalog(tmp_path / "catalog.json", [
        _tiny_entry("off", target), _tiny_entry("on", target, draft=draft, server_args=spec_args)])
    reports = {}
    for name in ("off", "on"):
        path = tmp_path / f"{name}.json"
        assert gsm8k.main(["--catalog", str(catalog), "--entry", name, "--output", str(path)]) == gsm8k.EXIT_PASSED
        reports[name] = json.loads(path.read_text())
    assert [s["completion"] for s in reports["on"]["samples"]] == [s["completion"] for s in reports["off"]["samples"]]
    capsys.readouterr()
    assert gsm8k.main(["--summarize", str(tmp_path / "off.json"), str(tmp_path / "on.json")]) == gsm8k.EXIT_PASSED
    assert "on                           vs off: same completion 20/20, same extracted answers 20/20" in capsys.readouterr().out
    spec = reports["on"]["speculation"]
    assert spec["num_speculative_tokens"] == 3 and spec["num_draft_tokens"] > 0
    assert 0 <= spec["acceptance_rate"] <= 1 and len(spec["per_position_acceptance"]) == 3


def test_agreement_between_two_reports():
    def report(name, completions, questions=("q1", "q2", "q3")):
        return {"entry": {"name": name}, "samples": [
            {"question": q, "completion": c, "extracted": {m: gsm8k.flexible_extract(c) for m in gsm8k.METRICS}}
            for q, c in zip(questions, completions)]}

    off = report("off", ["so 4. #### 4", "it is 7", "12"])
    on = report("on", ["so 4. #### 4", "it is 7 apples", "13"])
    assert gsm8k.agreement_line(on, off).endswith("vs off: same completion 1/3, same extracted answers 2/3")
    assert "not comparable" in gsm8k.agreement_line(report("x", ["1", "2", "3"], ("q1", "q2", "other")), off)
    assert "not comparable" in gsm8k.agreement_line(report("y", ["1", "2"]), off)


def _report(name: str, completions: list[str], **fields) -> dict:
    samples = [{"question": f"q{i}", "completion": c, "extracted": {m: c for m in gsm8k.METRICS}}
               for i, c in enumerate(completions)]
    return {"entry": {"name": name}, "samples": samples, "num_problems": len(samples),
            "accuracy": {m: 0.5 for m in gsm8k.METRICS}, "speculation": SpecSnapshot().as_dict(),
            "throughput": {"output_tokens_per_s": 10.0, "wall_time_s": 2.0}, "passed": True, "failures": [], **fields}


def test_server_args_make_a_variant_run(monkeypatch, tmp_path, capsys):
    catalog = _write_catalog(tmp_path / "catalog.json", [_tiny_entry("tiny", "unused")])
    seen = []

    def fake_run(entry, base_url, log_path, startup_timeout):
        seen.append(list(entry.server_args))
        return _report(entry.name, ["1"])

    monkeypatch.setattr(gsm8k, "run_entry", fake_run)
    path = tmp_path / "off.json"
    assert gsm8k.main(["--catalog", str(catalog), "--entry", "tiny", "--output", str(path),
                       "--server-args=--no-enable-prefix-caching --seed 3"]) == gsm8k.EXIT_PASSED
    assert seen == [["--max-model-len", "512", "--no-enable-prefix-caching", "--seed", "3"]]
    assert json.loads(path.read_text())["run"] == "tiny --no-enable-prefix-caching --seed 3"
    assert capsys.readouterr().out.startswith("tiny --no-enable-prefix-caching --seed 3 n=1")
    with pytest.raises(SystemExit):  # a running server's flags are not ours to change
        gsm8k.main(["--catalog", str(catalog), "--entry", "tiny", "--base-url", "http://x", "--server-args=--y"])


def test_summary_pairs_runs_of_an_entry_and_tabulates_them(tmp_path, capsys):
    cache = {"queries": 400.0, "hits": 300.0, "hit_rate": 0.75}
    ttft = {"mean": 12.5, "p50": 10.0, "p99": 40.0}
    reports = [_report("a", ["1", "2"], run="a --no-enable-prefix-caching"), _report("b", ["1", "3"]),
               _report("a", ["1", "3"], run="a", prefix_cache=cache, ttft_ms=ttft)]
    paths = []
    for i, report in enumerate(reports):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(report))
    assert gsm8k.main(["--summarize", *map(str, paths)]) == gsm8k.EXIT_PASSED
    out = capsys.readouterr().out.splitlines()
    assert "prefix-cache hits 75.0%" in out[2]
    assert out[3].startswith("b ") and out[3].endswith("vs a --no-enable-prefix-caching: same completion 1/2, same extracted answers 1/2")
    assert out[4].startswith("a ") and out[4].endswith("vs a --no-enable-prefix-caching: same completion 1/2, same extracted answers 1/2")
    assert out[7] == "| a --no-enable-prefix-caching | 0.5000 | 0.5000 | - | - | - | - | 10.0 | 2.0 |"
    assert out[9] == "| a | 0.5000 | 0.5000 | - | - | 75.0% (300/400) | 12.5 / 10.0 / 40.0 | 10.0 | 2.0 |"
