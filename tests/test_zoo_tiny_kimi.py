"""tiny-kimi: a Kimi_K25 config transformers builds, the checkpoint layout it loads, a 3-step training run."""

import json

import pytest
import torch

import zoo_micro
from atom_like.zoo import tiny_kimi
from eagle3_train import train_target
from atom_like.zoo.checkpoint import load_tensors

_single_thread = pytest.fixture(scope="module", autouse=True)(zoo_micro.single_thread)

transformers = pytest.importorskip("transformers")
needs_kimi = pytest.mark.skipif(not hasattr(transformers, "Kimi_K25ForConditionalGeneration"),
                                reason="this transformers has no Kimi_K25 classes (5.17+ has them)")


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kimi")
    tok = zoo_micro.tokenizer(tmp)
    folder, model = zoo_micro.kimi_target(tmp, tok)
    return tmp, tok, folder, model


@needs_kimi
def test_default_config_is_kimi_k25_with_mla_moe_and_yarn(micro):
    _, tok, _, _ = micro
    cfg = tiny_kimi.kimi_config(tiny_kimi.text_config(tok), tok)
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["model_type"] == "kimi_k2" and text["q_lora_rank"] and text["rope_scaling"]["type"] == "yarn"
    assert (text["scoring_func"], text["topk_method"], text["n_shared_experts"], text["first_k_dense_replace"]) == \
        ("sigmoid", "noaux_tc", 1, 1)
    hf = transformers.Kimi_K25Config(**cfg)
    assert type(hf.text_config).__name__ == "DeepseekV3Config"
    assert hf.text_config.rope_parameters["rope_type"] == "yarn" and hf.tie_word_embeddings is False
    full_size = tiny_kimi.build_model(dict(text, vocab_size=8192))  # the shipped vocabulary
    assert sum(p.numel() for p in full_size.parameters()) * 2 < 18e6  # bf16 bytes: fits the 40 MB family budget


@needs_kimi
def test_export_layout_loads_in_kimi_k25_with_identical_logits(micro):
    _, tok, folder, model = micro
    tensors = load_tensors(folder)
    assert all(k.startswith("language_model.model.") for k in tensors if k != "language_model.lm_head.weight")
    assert "language_model.lm_head.weight" in tensors
    assert "language_model.model.layers.1.mlp.experts.3.gate_proj.weight" in tensors
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in tensors  # first layer dense
    bias = tensors["language_model.model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    assert tensors["language_model.model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tiny_kimi.verify_with_kimi_k25(folder, model) < 1e-4
    ids = torch.randint(0, len(tok), (1, 12))
    with torch.no_grad():
        assert (tiny_kimi.load_text_model(folder)(ids).logits - model(ids).logits).abs().max() < 1e-4


def test_train_target_three_steps_exports_a_checked_model(micro, tmp_path):
    tmp, tok, _, _ = micro
    data = zoo_micro.kimi_data(tmp, tok)
    out = tmp_path / "tiny-kimi"
    rc = train_target.main(["--data", str(data), "--out", str(out), "--max-steps", "3", "--seq-len", "64", "--experts-impl", "eager",
                            "--batch-size", "2", "--evals", "1", "--eval-tokens", "512", "--log-every", "1",
                            "--config", json.dumps({k: v for k, v in zoo_micro.MICRO_KIMI.items()}),
                            "--eval-prompts", str(zoo_micro.eval_prompts(tmp_path, 1)), "--samples", "1",
                            "--device", "cpu"])
    assert rc == 0
    summary = json.loads((out / "zoo.json").read_text())
    assert summary["steps"] == 3 and summary["checks"]["ok"] and summary["heldout_ppl"] > 1
    assert len(summary["samples"]) == 2
    assert (tmp_path / "tiny-kimi-logs" / "loss.png").is_file()
    bias = load_tensors(out)["language_model.model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0  # the aux-loss-free balancing moved it
