"""Text with a byte-level BPE (tiny-kimi's tokenizer, shipped in the repo): multi-byte characters
split over several tokens (世 and 界 over three byte pieces each, 😀 over three pieces whose
first also carries the space before it). Streamed text never shows a partial character as
U+FFFD and only ever grows; stop strings made of such characters cut text and tokens exactly;
the same through the HTTP server's streaming.

The model is a real Llama checkpoint whose weights make it a bigram machine: attention and MLP
outputs are zero, so the last hidden state is the current token's embedding, and the LM head maps
each token of SCRIPT to the next one (cyclically) with a margin of ~50 logits. Greedy (or any
sampling) output is therefore SCRIPT, known in advance, on every backend and batch shape.
"""
from __future__ import annotations

import openai
import pytest
import torch
from engine_checks import install_checks
from oracle_proposer import OracleProposer
from server_process import running_server

from atom_like import LLMEngine, SamplingParams
from atom_like.zoo import resolve

SCRIPT = "Grün, 世界! café 😀 fin."


@pytest.fixture(scope="module")
def bigram(tmp_path_factory) -> tuple[str, list[int]]:
    """(checkpoint folder, SCRIPT's token ids)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(resolve("tiny-kimi")))
    ids = tok(SCRIPT, add_special_tokens=False).input_ids
    assert len(set(ids)) == len(ids) and tok.decode(ids) == SCRIPT  # each token has one successor
    assert sum(tok.decode([t]).endswith("\ufffd") for t in ids) >= 6  # byte pieces of split characters
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embed = torch.randn(len(tok), 64, generator=g)
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(len(tok), 64)
        for t, nxt in zip(ids, ids[1:] + ids[:1]):
            head[nxt] += 10 * embed[t] / embed[t].norm()  # logit 10 * sqrt(64) = 80 after the final norm
        model.lm_head.weight.copy_(head)
    path = tmp_path_factory.mktemp("bigram")
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path), ids


def expected_text(ids: list[int], prompt_len: int, n: int, tokenizer) -> tuple[list[int], str]:
    cycle = ids * (2 + n // len(ids))
    generated = cycle[prompt_len:prompt_len + n]
    prompt_text = tokenizer.decode(cycle[:prompt_len])
    return generated, tokenizer.decode(cycle[:prompt_len + n])[len(prompt_text):]


def stream(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    install_checks(engine)
    engine.add_request(None, params, prompt_ids=prompt)
    outs = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        outs += engine.step()
    assert outs and outs[-1].finished
    return outs


def engine_for(path: str, ids: list[int], drafts: bool) -> LLMEngine:
    if not drafts:
        return LLMEngine(path, max_model_len=128)
    from collections import defaultdict
    path_after_first = defaultdict(lambda: (ids * 8)[1:])  # the script's own continuation: every draft accepted
    return LLMEngine(path, max_model_len=128, proposer_factory=lambda r: OracleProposer(r, path_after_first, 3))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("drafts", [False, True])
def test_streamed_text_grows_by_whole_characters(bigram, drafts):
    path, ids = bigram
    engine = engine_for(path, ids, drafts)
    n = 2 * len(ids) + 3  # more than twice round the script
    generated, text = expected_text(ids, 1, n, engine.tokenizer)
    outs = stream(engine, ids[:1], SamplingParams(temperature=0, max_tokens=n))
    assert outs[-1].token_ids == generated and outs[-1].text == text
    seen = ""
    for out in outs:
        assert "\ufffd" not in out.text, f"a partial character was emitted: {out.text!r}"
        assert out.text.startswith(seen), f"streamed text was taken back: {seen!r} -> {out.text!r}"
        seen = out.text
    held = [len(a.token_ids) > len(b.token_ids) and a.text == b.text for b, a in zip(outs, outs[1:])]
    assert any(held) or drafts  # without drafts, some steps end inside a character and add no text


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stop", ["界", "世界!", "😀", "é 😀", "n, 世"])
@pytest.mark.parametrize("drafts", [False, True])
def test_multibyte_stop_strings(bigram, stop, drafts):
    """The text ends right before the stop string; the tokens end with the one that completed it."""
    path, ids = bigram
    engine = engine_for(path, ids, drafts)
    generated, text = expected_text(ids, 1, 40, engine.tokenizer)
    decode = engine.tokenizer.decode
    last = next(n for n in range(len(generated)) if stop in decode(ids[:1] + generated[:n + 1])[1:])
    out = stream(engine, ids[:1], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[-1]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert out.token_ids == generated[:last + 1]


@pytest.fixture(scope="module")
def client(bigram, tmp_path_factory):
    with running_server(bigram[0], "--max-model-len", "128", log_dir=tmp_path_factory.mktemp("server")) as proc:
        yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stop", [None, "😀", "界!"])
def test_server_streams_whole_characters(bigram, client, stop):
    from transformers import AutoTokenizer

    path, ids = bigram
    _, text = expected_text(ids, 1, 40, AutoTokenizer.from_pretrained(path))
    want = text if stop is None else text[:text.index(stop)]
    model = client.models.list().data[0].id
    chunks = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=ids[:1], max_tokens=40, temperature=0, stop=stop, stream=True) if c.choices]
    assert all("\ufffd" not in c for c in chunks), chunks
    assert "".join(chunks) == want
    whole = client.completions.create(model=model, prompt=ids[:1], max_tokens=40, temperature=0, stop=stop)
    assert whole.choices[0].text == want


@pytest.mark.parametrize("rust", [True, False], ids=["decode_stream", "python_window"])
def test_a_run_of_skipped_special_tokens_reaches_no_decoder(rust, monkeypatch):
    """An ignore_eos request that repeats EOS: the text is what decoding everything at once gives,
    and the skipped tokens never reach the decoder (each one grew its window, and every later
    token's decode with it), in Rust (DecodeStream) and in the Python window alike (what a
    tokenizer whose decode is not plain takes)."""
    from transformers import AutoTokenizer

    from atom_like.engine import detokenizer
    from atom_like.engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve("tiny-kimi")))
    script = tok(SCRIPT, add_special_tokens=False).input_ids
    eos = tok.eos_token_id
    generated = script[:4] + [eos] * 500 + script[4:] + [eos] * 500 + script
    assert detokenizer.plain_backend(tok) is not None  # the fast tokenizer takes the Rust path
    if not rust:
        monkeypatch.setattr(detokenizer, "plain_backend", lambda tokenizer: None)
    detok = IncrementalDetokenizer(tok, [], [])
    assert detok._skipped
    seen = []
    if rust:
        stream = detok._stream

        class Counting:
            def step(self, backend, token_id):
                seen.append(token_id)
                return stream.step(backend, token_id)

        detok._stream = Counting()
    else:
        decode = detok._decode
        detok._decode = lambda ids: seen.append(len(ids)) or decode(ids)
    for t in generated:
        detok.add(t)
    assert detok.text == tok.decode(generated, skip_special_tokens=True)
    assert eos not in seen if rust else max(seen) <= 8, seen


@pytest.mark.parametrize("stop", ["世界", "ün, 世", "G", "fin.", "😀 f"])
def test_the_text_in_pieces_cuts_at_a_stop_and_keeps_earlier_snapshots(stop):
    """The detokenizer keeps its text as pieces (a token's each) and hands outputs TextSpans of them:
    a stop string across several pieces cuts exactly where decoding everything at once puts it,
    and every snapshot taken before the cut still reads the text of its own token."""
    from transformers import AutoTokenizer

    from atom_like.engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve("tiny-kimi")))
    ids = tok(SCRIPT + SCRIPT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, [], [stop])
    snapshots, texts = [], []
    for n, t in enumerate(ids):
        stopped = detok.add(t)
        snapshots.append(detok.snapshot())
        texts.append(detok.text)
        if stopped:
            break
    assert stopped and detok.text == SCRIPT[:SCRIPT.index(stop)]
    assert all(a == b[:len(a)] for a, b in zip(texts, texts[1:-1])) and SCRIPT.startswith(texts[-2] if n else "")
    assert [s.read() for s in snapshots[::-1]] == texts[::-1]  # a later one read first: earlier ones still theirs
    assert [s.read() for s in snapshots] == texts
