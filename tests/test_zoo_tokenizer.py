"""tiny-kimi's tokenizer: trains on a tiny corpus, loads with AutoTokenizer, Kimi chat layout round-trips."""

import pytest
from transformers import AutoTokenizer

import zoo_micro
from atom_like.zoo import kimi_tokenizer
from eagle3_train import shards

_single_thread = pytest.fixture(scope="module", autouse=True)(zoo_micro.single_thread)


def test_tokenizer_and_chat_template_round_trip(tmp_path):
    texts = ["The cat sat on the mat.", "What is 12 plus 30? It is 42.", "Hello there, how are you?"] * 50
    kimi_tokenizer.train_tokenizer(texts, 300, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for special in kimi_tokenizer.SPECIAL_TOKENS:
        assert tok(special, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(special)]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 12 and 30."},
            {"role": "assistant", "content": "42"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == ("[BOS]<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>"
                    "Add 12 and 30.<|im_end|><|im_assistant|>assistant<|im_middle|>42<|im_end|>")
    prompt = tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>") and text.startswith(prompt)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    digits = tok("12345", add_special_tokens=False)["input_ids"]
    assert len(digits) == 5  # one token per digit
    assert shards.prompt_ids(tok, chat[:2]) == tok(prompt, add_special_tokens=False)["input_ids"]
