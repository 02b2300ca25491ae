"""Bad requests get 400 (401 without the API key, 413 when too large, 408 when too slow) with an
OpenAI-style body naming the field, and the server keeps answering normal requests; hostile
ones (huge bodies, half-sent requests) do not stall it."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_process import running_server

MAX_MODEL_LEN = 64
MAX_SEQUENCES = 16
READ_TIMEOUT = 3
KEY = "sk-test"
OK = {"prompt": "w1 w2 w3", "max_tokens": 3, "temperature": 0}
CHAT_OK = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(make_llama, tmp_path_factory):
    with running_server(make_llama(tokenizer=True), "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-sequences-per-request", str(MAX_SEQUENCES), "--read-timeout", str(READ_TIMEOUT),
                        api_key=KEY, log_dir=tmp_path_factory.mktemp("server")) as proc:
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
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": MAX_SEQUENCES + 1}, "n"),
    ("/v1/completions", {"prompt": ["w1"] * (MAX_SEQUENCES + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["w1"] * 4, "n": 2, "best_of": 5}, "best_of"),  # 4 x 5 > 16
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"suffix": "w9"}, "suffix"),
    ("/v1/completions", {"prompt": "\ud800x"}, "prompt"),  # a lone surrogate
    ("/v1/completions", {"prompt": ["w1", "w2\udfff"]}, "prompt"),
    ("/v1/completions", {"stop": "\ud800"}, "stop"),
    ("/v1/completions", {"temperature": float("inf")}, "temperature"),
    ("/v1/completions", {"temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"top_p": float("nan")}, "top_p"),
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"w5": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"128": 1}}, "logit_bias"),  # outside the vocabulary
    ("/v1/completions", {"logit_bias": {"5": float("-inf")}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": 4}, "min_tokens"),  # more than max_tokens 3
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"stop": ["w"] * 65}, "stop"),
    ("/v1/completions", {"stop": "w" * 4097}, "stop"),
    ("/v1/completions", {"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ("/v1/completions", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options"),
    ("/v1/completions", {"model": "gpt-4"}, "model"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/completions", {"stop_token_ids": 3}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": ["w0"]}, "stop_token_ids"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"seed": "x"}, "seed"),
    ("/v1/completions", {"logprobs": 50}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"stream_options": {"include_usage": 1}}, "stream_options"),
    ("/v1/chat/completions", {"messages": "w1"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}, {"content": "w1"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"n": MAX_SEQUENCES + 1}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "w1"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1", "name": "bob"}]}, "messages"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),  # a completions field
    ("/v1/chat/completions", {"temperature": float("-inf")}, "temperature"),
    ("/v1/chat/completions", {"seed": 2**70}, "seed"),
    ("/v1/chat/completions", {"logit_bias": {"3": -200}}, "logit_bias"),
    ("/v1/chat/completions", {"model": "nope"}, "model"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_field_is_a_400_naming_it(http, model, endpoint, changes, param, stream):
    body = {**(OK if endpoint == "/v1/completions" else CHAT_OK), "model": model, "stream": stream}
    # json.dumps, as Python clients send it: NaN and Infinity as bare words, surrogates as \u escapes
    response = http.post(endpoint, content=json.dumps({**body, **changes}), headers={"content-type": "application/json"})
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


@pytest.mark.parametrize("headers", [[], [("Authorization", "Bearer wrong")], [("Authorization", KEY)],
                                     [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")],
                                     [("Authorization", f"Bearer {KEY} extra")], [("Authorization", f"bearer {KEY}")]])
@pytest.mark.parametrize("path,body", [("/v1/completions", OK), ("/v1/chat/completions", CHAT_OK),
                                       ("/v1/completions", None)])
def test_api_key_required(server, http, headers, path, body):
    response = httpx.post(f"{server.base_url}{path}", json=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    for open_by_default in ("/v1/models", "/metrics", "/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{server.base_url}{open_by_default}", headers=headers).status_code == 401
    assert_serving(http)


def test_only_health_needs_no_key(server, http):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert http.get("/metrics").status_code == 200 and http.get("/openapi.json").status_code == 200


def test_unimplemented_fields_sent_as_null_are_unset(http, model):
    response = http.post("/v1/completions", json={**OK, "model": model, "suffix": None, "user": "u-1"})
    assert response.status_code == 200, response.text


def test_tiny_temperature_is_greedy(http, model):
    greedy = http.post("/v1/completions", json={**OK, "max_tokens": 6}).json()["choices"][0]["text"]
    for t in (1e-40, 3e-38, 1e-6):  # below 1e-5: greedy, not NaN probabilities and an empty answer
        response = http.post("/v1/completions", json={**OK, "max_tokens": 6, "temperature": t})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == greedy


def test_errors_carry_the_request_id(server, http):
    response = http.post("/v1/completions", json={**OK, "suffix": "x"})
    assert response.status_code == 400 and len(response.headers["x-request-id"]) == 32


# ----------------------------------------------------------------------------- hostile clients

def _health_latencies(server, stop: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        while not stop.is_set():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    return latencies


def _while_probing_health(server, work) -> tuple[object, list[float]]:
    stop, latencies = threading.Event(), []
    prober = threading.Thread(target=lambda: latencies.extend(_health_latencies(server, stop)))
    prober.start()
    try:
        time.sleep(0.2)
        result = work()
    finally:
        stop.set()
        prober.join()
    return result, latencies


def test_a_10_mb_request_is_refused_while_health_answers(server, http):
    body = json.dumps({"prompt": "x " * 5_000_000, "max_tokens": 1}).encode()
    response, latencies = _while_probing_health(server, lambda: http.post("/v1/completions", content=body))
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert "--max-request-bytes" in response.json()["error"]["message"]
    chunked, more = _while_probing_health(server, lambda: http.post(  # no Content-Length: counted while read
        "/v1/completions", content=(body[i:i + 65536] for i in range(0, len(body), 65536))))
    assert chunked.status_code == 413
    assert latencies and more and max(latencies + more) < 1.0
    assert_serving(http)


def test_tokenizing_a_big_prompt_does_not_block_the_event_loop(server, http):
    """3 MB of text under the body limit: tokenized on a worker thread, then refused as too long."""
    body = json.dumps({"prompt": "w5 " * 1_000_000, "max_tokens": 1}).encode()
    response, latencies = _while_probing_health(server, lambda: http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}))
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


def _raw_connection(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT + 10)
    return sock


def test_half_sent_headers_are_dropped(server, http):
    sock = _raw_connection(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic")
    start = time.monotonic()
    assert sock.recv(1024) == b""  # closed by the server, with nothing to say
    assert READ_TIMEOUT - 0.5 < time.monotonic() - start < READ_TIMEOUT + 5
    sock.close()
    assert_serving(http)


def test_half_sent_body_gets_a_408(server, http):
    sock = _raw_connection(server)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":".encode())
    start = time.monotonic()
    reply = b""
    while chunk := sock.recv(4096):
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    assert READ_TIMEOUT - 0.5 < time.monotonic() - start < READ_TIMEOUT + 5
    sock.close()
    assert_serving(http)


def _read_response(sock) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return head + body


@pytest.mark.parametrize("auth", [True, False])
def test_a_refused_upload_is_drained_not_reset(server, auth):
    """A 413 (or 401) sent before the body is read must not close the socket under the client
    (the reset can destroy the response, seen as a flaky 'peer closed connection'): the rest of
    the body is discarded and the same connection serves the next request."""
    sock = _raw_connection(server)
    body = b"x" * (12 << 20)
    key = f"Authorization: Bearer {KEY}\r\n" if auth else ""
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{key}Content-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode())
    sender = threading.Thread(target=sock.sendall, args=(body,))
    sender.start()
    reply = _read_response(sock)
    sender.join()
    assert reply.startswith(b"HTTP/1.1 413" if auth else b"HTTP/1.1 401"), reply[:200]
    assert b"connection: close" not in reply.lower()
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _read_response(sock).startswith(b"HTTP/1.1 200")
    sock.close()


def test_chat_content_with_special_token_text_is_served(http):
    response = http.post("/v1/chat/completions", json={**CHAT_OK, "messages": [{"role": "user", "content": "w0 w1"}]})
    assert response.status_code == 200, response.text


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
