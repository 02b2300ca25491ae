"""The server through the real `openai` client: completions, chat, streaming, stop, usage, logprobs."""
from __future__ import annotations

import os

import httpx
import openai
import pytest
from server_process import running_server

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(make_llama, tmp_path_factory):
    with running_server(make_llama(tokenizer=True), "--max-model-len", str(MAX_MODEL_LEN),
                        log_dir=tmp_path_factory.mktemp("server")) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_and_health(server, client, make_llama):
    (card,) = client.models.list().data
    assert card.id == os.path.basename(make_llama(tokenizer=True))
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def test_completion_and_usage(client, model):
    out = client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    (choice,) = out.choices
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert len(choice.text.split()) == 8
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 8, 11)


def test_default_max_tokens_fills_the_context(client, model):
    out = client.completions.create(model=model, prompt="w1 w2 w3", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_MODEL_LEN - 3 and out.choices[0].finish_reason == "length"


def test_stop_token_ids(client, model):
    """vLLM's extension: generation ends on any of these ids, which stay in the output."""
    free = client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text.split()
    stop_id = int(free[3].removeprefix("w"))
    cut = free[: free.index(free[3]) + 1]  # through the first occurrence of that token
    out = client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert out.choices[0].text.split() == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(cut)


def test_token_id_prompts_and_batches(client, model):
    single = [client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0).choices[0].text
              for p in ([1, 2, 3], [4, 5])]
    batch = client.completions.create(model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == single
    assert batch.usage.prompt_tokens == 5
    words = client.completions.create(model=model, prompt=["w1 w2 w3", "w4 w5"], max_tokens=6, temperature=0)
    assert [c.text for c in words.choices] == single


def _streamed(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


@pytest.mark.parametrize("stop", [None, "w94", ["w94 w112", "zzz"]])
def test_streaming_text_equals_non_streaming(client, model, stop):
    kwargs = dict(model=model, prompt="w1 w2 w3", max_tokens=12, temperature=0, stop=stop)
    whole = client.completions.create(**kwargs)
    text, chunks = _streamed(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_sequences(client, model):
    full = client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    # a stop string made of two tokens, and one that ends mid-token; the text ends before it
    for stop in (f"{words[3]} {words[4]}", words[2][:2]):
        out = client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=10, temperature=0, stop=[stop])
        assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_chat(client, model):
    messages = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w5 w6"}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    (choice,) = out.choices
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    # the test template renders "system w7 user w5 w6 assistant": 6 words, 6 tokens
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == len(choice.message.content.split())
    # chat is the completion of the rendered template
    same = client.completions.create(model=model, prompt="system w7 user w5 w6 assistant", max_tokens=6, temperature=0)
    assert choice.message.content == same.choices[0].text


def test_chat_streaming_equals_non_streaming(client, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "w9 w10"}], max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


def test_completion_logprobs(client, model):
    out = client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert "".join(" " + t for t in lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert top[token] == pytest.approx(logprob) == pytest.approx(max(top.values()))  # greedy picks the argmax
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=model, prompt="w1 w2 w3", max_tokens=5, temperature=0, logprobs=3, stream=True) if c.choices]
    assert [t for s in streamed if s for t in s.tokens] == lp.tokens


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w3"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


def test_seed_makes_sampling_reproducible(client, model):
    texts = {client.completions.create(model=model, prompt="w1", max_tokens=8, temperature=1.0, seed=7).choices[0].text
             for _ in range(2)}
    assert len(texts) == 1


def test_metrics_page(server, client, model):
    client.completions.create(model=model, prompt="w1", max_tokens=2)
    names = ["atom_like:request_success_total", "atom_like:prompt_tokens_total", "atom_like:generation_tokens_total",
             "atom_like:time_to_first_token_seconds_count", "atom_like:time_per_output_token_seconds_count",
             "atom_like:e2e_request_latency_seconds_count", "atom_like:num_requests_running",
             "atom_like:num_requests_waiting", "atom_like:kv_cache_usage_perc", "atom_like:kv_cache_free_blocks",
             "atom_like:kv_cache_total_blocks", "atom_like:spec_decode_num_drafts_total",
             "atom_like:spec_decode_num_draft_tokens_total", "atom_like:spec_decode_num_accepted_tokens_total",
             "atom_like:spec_decode_acceptance_rate", "atom_like:spec_decode_mean_acceptance_length"]
    assert server.metric("atom_like:request_success_total", '{finished_reason="length"}') >= 1
    for name in names[1:]:
        server.metric(name)
    assert server.metric("atom_like:spec_decode_num_drafts_total") == 0  # speculation is off here
    assert server.metric("atom_like:e2e_request_latency_seconds_count") >= 1
