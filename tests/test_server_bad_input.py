"""Bad requests get 400 (401 without the API key) with an OpenAI-style body naming the field, and
the server keeps answering normal requests."""
from __future__ import annotations

import httpx
import pytest
from server_process import running_server

MAX_MODEL_LEN = 64
KEY = "sk-test"
OK = {"prompt": "w1 w2 w3", "max_tokens": 3, "temperature": 0}
CHAT_OK = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(make_llama, tmp_path_factory):
    with running_server(make_llama(tokenizer=True), "--max-model-len", str(MAX_MODEL_LEN), api_key=KEY,
                        log_dir=tmp_path_factory.mktemp("server")) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def assert_serving(http):
    response = http.post("/v1/completions", json=OK)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


LONG_PROMPT = " ".join(["w5"] * MAX_MODEL_LEN)


@pytest.mark.parametrize("endpoint,changes,param", [
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/completions", {"prompt": [1, "w2"]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 999]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 128]}, "prompt"),  # = the vocab size: one past the last id
    ("/v1/completions", {"prompt": [[1, 2], [-1]]}, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, "prompt"),
    ("/v1/completions", {"prompt": ["w1", LONG_PROMPT]}, "prompt"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"max_tokens": MAX_MODEL_LEN - 2}, "max_tokens"),  # 3 prompt tokens + 62 > 64
    ("/v1/completions", {"temperature": -0.1}, "temperature"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"n": 2}, "n"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"model": "gpt-4"}, "model"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/completions", {"stop_token_ids": 3}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": ["w0"]}, "stop_token_ids"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"seed": "x"}, "seed"),
    ("/v1/completions", {"logprobs": 50}, "logprobs"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"stream_options": {"include_usage": 1}}, "stream_options"),
    ("/v1/chat/completions", {"messages": "w1"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}, {"content": "w1"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"n": 3}, "n"),
    ("/v1/chat/completions", {"model": "nope"}, "model"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_field_is_a_400_naming_it(http, model, endpoint, changes, param, stream):
    body = {**(OK if endpoint == "/v1/completions" else CHAT_OK), "model": model, "stream": stream}
    response = http.post(endpoint, json={**body, **changes})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert_serving(http)


@pytest.mark.parametrize("content,content_type", [
    (b'{"prompt": "w1",', "application/json"),
    (b"not json at all", "application/json"),
    (b"[1, 2]", "application/json"),
    (b"", "application/json"),
    (b"prompt=w1", "application/x-www-form-urlencoded"),
])
def test_malformed_body_is_a_400(http, content, content_type):
    response = http.post("/v1/completions", content=content, headers={"content-type": content_type})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert_serving(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
@pytest.mark.parametrize("path,body", [("/v1/completions", OK), ("/v1/chat/completions", CHAT_OK),
                                       ("/v1/completions", None)])
def test_api_key_required(server, http, headers, path, body):
    response = httpx.post(f"{server.base_url}{path}", json=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/v1/models", headers=headers).status_code == 401
    assert_serving(http)


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_unknown_route_is_an_openai_style_404(http):
    response = http.get("/v1/engines")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_no_request_was_left_behind(server, http):
    assert_serving(http)
    total = server.metric("atom_like:kv_cache_total_blocks")
    assert server.wait_for_metric("atom_like:kv_cache_free_blocks", lambda free: free == total) == total
    assert server.metric("atom_like:request_success_total", '{finished_reason="error"}') == 0


def test_whole_numbers_are_fine_where_floats_are_expected(http):
    response = http.post("/v1/completions", json={**OK, "temperature": 1, "top_p": 1})
    assert response.status_code == 200, response.text


def test_top_k_zero_means_off(http):
    """vLLM clients send top_k 0 for "no top-k": the same tokens as -1 for a seeded request."""
    seeded = {**OK, "temperature": 1.0, "seed": 11, "max_tokens": 8}
    texts = []
    for top_k in (-1, 0):
        response = http.post("/v1/completions", json={**seeded, "top_k": top_k})
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
