"""`symphony serve` over HTTP: the endpoints' shapes, auth, errors and SIGTERM, with the real
`openai` client and raw HTTP (httpx2, the client the openai package itself uses), against a
real server process on a real kernel. Generation itself (n, stop, seeds, logprobs, schemas,
concurrency) is tests/test_serve_generation.py's.
"""

from __future__ import annotations

import asyncio
import json
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from daemon import ROOT, SYMPHONY, start_daemon, start_server, wait_for

from lips.openai_server import EventStream

KEY = "test-key"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model_name(daemon):
    with daemon.connect() as k:
        return k.model_info().name


def assert_alive(server, model_name) -> None:
    assert [m.id for m in server.client.models.list().data] == [model_name]


def test_models_lists_the_kernels_model(server, model_name, k):
    models = server.client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(model_name, "model", "symphony")]
    card = server.client.models.retrieve(model_name)
    assert card.max_model_len == k.model_info().context_length
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("no-such-model")


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200
    assert "symphony:num_requests_running" in metrics.text


def test_tokenize_and_detokenize_are_the_kernels(http, k):
    text = "Hello, world: 1 2 3"
    r = http.post("/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == k.tokenize(text, add_special=True)
    assert r["count"] == len(r["tokens"])
    assert r["max_model_len"] == k.model_info().context_length
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == k.tokenize(text)
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == k.tokenize(messages=MESSAGES, add_generation_prompt=True)
    back = http.post("/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": k.detokenize(plain["tokens"])} == {"prompt": text}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"},
                                     {"Authorization": "Basic dGVzdC1rZXk="}])
@pytest.mark.parametrize("request_", [("GET", "/v1/models", None),
                                      ("POST", "/v1/chat/completions", {"messages": MESSAGES}),
                                      ("POST", "/tokenize", {"prompt": "x"})])
def test_a_missing_or_wrong_key_is_401(server, headers, request_):
    method, path, body = request_
    r = httpx.request(method, server.url + path, headers=headers, json=body)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


def raw_request(server, head: str, body_chunks: int = 0) -> bytes:
    """A request written on a socket by hand: its head, then up to `body_chunks` chunks of a
    chunked body (1 MiB of spaces each) while the server has not answered; the response's
    first bytes."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n")
        body = (b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))) * body_chunks
        sock.setblocking(False)
        while True:
            readable, writable, _ = select.select([sock], [sock] if body else [], [], 30)
            if readable or not writable:
                sock.settimeout(30)
                return http_response(sock)
            body = body[sock.send(body):]


def http_response(sock: socket.socket) -> bytes:
    """A response's head and body (by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def test_the_key_is_checked_before_the_body_is_read(server):
    """A client without the key is refused on its headers: the server does not wait for
    (or hold) the 10 GB it announces."""
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 10000000000\r\n")
    assert raw_request(server, head).startswith(b"HTTP/1.1 401 ")


def test_a_body_past_the_limit_is_413(server, daemon, model_name):
    """With the key: a Content-Length past the limit is refused on the headers, and a
    chunked body (no length given) once it passes the limit (2048 prompts of the whole
    context as token ids, and a MiB)."""
    with daemon.connect() as k:
        limit = 2048 * k.model_info().context_length * 8 + (1 << 20)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    assert raw_request(server, head + f"Content-Length: {limit + 1}\r\n").startswith(
        b"HTTP/1.1 413 ")
    # A length past int()'s 4300 digits: over the limit too, not a 500.
    assert raw_request(server, head + f"Content-Length: {'9' * 5000}\r\n").startswith(
        b"HTTP/1.1 4")
    answer = raw_request(server, head + "Transfer-Encoding: chunked\r\n",
                         body_chunks=(limit >> 20) + 2)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"--max-body-bytes" in answer
    assert_alive(server, model_name)


def test_the_openai_client_with_a_wrong_key_gets_401(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_an_unknown_model_is_404(server, model_name):
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert_alive(server, model_name)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
BAD_CHAT = [
    ({"temperature": 5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_p": -0.1}, "top_p"),  # 0 is allowed: OpenAI's range is [0, 1]
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    # [] asks nothing of tools and functions alone: of these it is no value they take
    ({"function_call": []}, "function_call"), ({"audio": []}, "audio"),
    ({"prediction": []}, "prediction"), ({"reasoning_effort": []}, "reasoning_effort"),
    ({"verbosity": []}, "verbosity"), ({"web_search_options": []}, "web_search_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": False}}},
     "response_format.json_schema.schema"),
    ({"top_k": 100000}, "top_k"),  # past the vocabulary
    # JSON can carry a lone surrogate; UTF-8 text (the kernel's tokenizer) cannot
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ({"stop": ["ok", "\udfff"]}, "stop[1]"),
    # strict types, as OpenAI's: a string or a boolean is no number, 2.0 no integer
    ({"temperature": True}, "temperature"),
    ({"n": True}, "n"),
    ({"max_tokens": "2"}, "max_tokens"),
    ({"max_completion_tokens": 2.0}, "max_completion_tokens"),
    ({"logprobs": 1}, "logprobs"),
    ({"stream": "true"}, "stream"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"add_special_tokens": 1}, "add_special_tokens"),
    ({"seed": 2**63}, "seed"),  # pred's seed is a signed 64-bit integer
    ({"seed": "1"}, "seed"),
    # OpenAI's fields that change nothing here are still type-checked, as OpenAI's
    ({"user": 5}, "user"),
    ({"user": {"a": 1}}, "user"),
    ({"store": "yes"}, "store"),
    ({"metadata": {"a": 1}}, "metadata.a"),
    ({"service_tier": 1}, "service_tier"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "Hi", "name": 5}]}, "messages[0].name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"verbosity": "low"}, "verbosity"),
]
BAD_COMPLETION = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["one", [1, 2]]}, "prompt"),  # texts and token ids mixed
    ({"prompt": [[1, 2], 3]}, "prompt"),
    ({"prompt": [["one"]]}, "prompt"),
    ({"prompt": ["one", ""]}, "prompt[1]"),
    ({"prompt": [[1, 2], [3, 10**6]]}, "prompt[1]"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"prompt": ["Hi"] * 17, "n": 128}, "n"),  # 2176 choices, past 2048
    ({"logit_bias": {"0" * 4301: 1}}, "logit_bias"),  # past int()'s digit limit: was a 500
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**70}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"model": "m\ud800"}, "model"),
    # strict types, as OpenAI's: a boolean is no integer (logprobs false is not 0, true not
    # 1), a string no number or boolean, 2.0 no integer
    ({"logprobs": False}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "3"}, "max_tokens"),
    ({"temperature": "0"}, "temperature"),
    ({"top_p": False}, "top_p"),
    ({"echo": "yes"}, "echo"),
    ({"stream": 1}, "stream"),
    ({"n": 2.0}, "n"),
    ({"top_k": 1.0}, "top_k"),
    ({"ignore_eos": 0}, "ignore_eos"),
    ({"model": 3}, "model"),
    ({"seed": 2**64}, "seed"),  # was folded modulo 2**64: the same text as seed 0
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"user": 5}, "user"),
]


def post_json(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """As http.post(json=body), but with JSON's escapes: a lone surrogate stays "\\ud800"
    (httpx would fail to encode it as UTF-8)."""
    return http.post(path, content=json.dumps(body),
                     headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("fields,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_a_bad_chat_field_is_400_naming_it(http, server, model_name, fields, param):
    r = post_json(http, "/v1/chat/completions",
                  {"model": model_name, "messages": MESSAGES, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert error["message"].startswith(param)
    assert_alive(server, model_name)


@pytest.mark.parametrize("fields,param", BAD_COMPLETION, ids=[p for _, p in BAD_COMPLETION])
def test_a_bad_completion_field_is_400_naming_it(http, server, model_name, fields, param):
    r = post_json(http, "/v1/completions",
                  {"model": model_name, "prompt": "Hi", "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert_alive(server, model_name)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("path,fields", [("/v1/completions", {"prompt": "Hi"}),
                                         ("/v1/chat/completions", {"messages": MESSAGES})])
def test_nan_and_infinity_are_400_saying_a_number_must_be_finite(http, model_name, value,
                                                                 path, fields):
    """JSON's parser takes NaN and Infinity: they were refused as "less than or equal to
    2", or, as a logit_bias, not at all checked for being a number."""
    for field in ({"temperature": value}, {"top_p": value}, {"logit_bias": {"5": value}}):
        r = post_json(http, path, {"model": model_name, "max_tokens": 2, **fields, **field})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        name = next(iter(field))
        assert error["param"].startswith(name), error
        assert error["message"].endswith("Input should be a finite number"), error


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {"prompt": ["Hi", "Ho"], "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 5000},
     "max_completion_tokens")])
def test_max_tokens_past_the_context_alone_is_named(http, model_name, k, path, fields, param):
    """A completion that alone leaves no room for any prompt names its field, not the
    prompt (which was named, though it was one token long)."""
    assert 5000 >= k.model_info().context_length
    r = post_json(http, path, {"model": model_name, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    assert error["message"].startswith("This model's maximum context length is"), error


UNKNOWN = [
    ("/v1/chat/completions", {"foo_bar": 1}, "foo_bar"),
    ("/v1/chat/completions", {"foo_bar": None}, "foo_bar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "foo": 1}]},
     "messages[0].foo"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True,
                                                                "foo": 1}},
     "stream_options.foo"),
    ("/v1/chat/completions", {"response_format": {"type": "text", "foo": 1}},
     "response_format.foo"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "foo": 1}}},
     "response_format.json_schema.foo"),
    ("/v1/completions", {"foo_bar": 1}, "foo_bar"),
    ("/v1/completions", {"store": True}, "store"),  # chat's, not the legacy API's
    ("/tokenize", {"foo_bar": 1}, "foo_bar"),
]
BASE = {"/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2},
        "/v1/completions": {"prompt": "Hi", "max_tokens": 2}, "/tokenize": {"prompt": "Hi"}}


@pytest.mark.parametrize("path,fields,name", UNKNOWN, ids=[f"{p}:{n}" for p, _, n in UNKNOWN])
def test_an_unknown_field_is_400_as_openai_s(http, path, fields, name):
    """As OpenAI's server: a field it does not know is refused, never ignored (a client's
    misspelt or unsupported option would have silently done nothing)."""
    r = post_json(http, path, {**BASE[path], **fields})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": f"Unrecognized request argument supplied: {name}",
                                  "type": "invalid_request_error", "param": name,
                                  "code": None}}


def test_openai_s_fields_that_change_nothing_are_taken(server, http, model_name):
    """user, store, metadata and the like are OpenAI's: declared, so they are type-checked,
    and taken; the openai client sends them as its own arguments."""
    r = server.client.chat.completions.create(
        model=model_name, max_tokens=2, user="u-1", store=False, metadata={"k": "v"},
        service_tier="auto", parallel_tool_calls=True,
        messages=[{"role": "system", "content": "Be brief.", "name": "rules"},
                  {"role": "user", "content": "Hi", "name": "ann"},
                  {"role": "assistant", "content": None, "refusal": "no"},
                  {"role": "user", "content": "Hi"}])
    assert r.choices[0].message.role == "assistant"
    r = post_json(http, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 2, "prompt_cache_key": "k",
        "safety_identifier": "s", "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "thing", "description": "a thing", "strict": True,
            "schema": {"type": "object"}}}})
    assert r.status_code == 200, r.text
    r = server.client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                         user="u-1")
    assert len(r.choices) == 1


# What lm-eval 0.4's local-completions and local-chat-completions send, less "model" (its
# `_create_payload`, printed from lm-eval 0.4.9, for a generate_until task whose
# generation_kwargs are until ["\n\n"], max_gen_toks 4, do_sample false, temperature 0; and
# for a log-likelihood). Written out: lm-eval is a client the tester runs, not a dependency.
LM_EVAL_PAYLOADS = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0,
                         "stop": ["\n\n", "</s>"], "seed": 1234}),
    ("/v1/completions", {"prompt": [[1, 2, 3]], "temperature": 0,
                         "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4,
                              "temperature": 0, "stop": ["\n\n", "</s>"], "seed": 1234}),
]


@pytest.mark.parametrize("path,payload", LM_EVAL_PAYLOADS)
def test_lm_eval_s_payloads_are_taken(http, model_name, path, payload):
    r = post_json(http, path, {**payload, "model": model_name})
    assert r.status_code == 200, (payload, r.text)


def test_numbers_as_clients_send_them_are_taken(http, model_name):
    """Strict types keep what clients send: a JSON integer where a number is expected
    (temperature 1, a logit_bias of 2), null for a field's default."""
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 2, "temperature": 1,
            "top_p": 1, "min_p": 0, "logit_bias": {"5": 2}, "presence_penalty": 0,
            "frequency_penalty": 0, "seed": -(2**63), "logprobs": None, "echo": None,
            "n": None, "stream": False}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = http.post("/v1/chat/completions", json={
        "model": model_name, "messages": MESSAGES, "max_completion_tokens": 2,
        "temperature": 0, "top_p": 1, "seed": 2**63 - 1, "logprobs": False,
        "top_logprobs": None, "stream_options": None})
    assert r.status_code == 200, r.text


def test_the_openai_client_sees_a_bad_field_as_bad_request(server, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=model_name, messages=MESSAGES,
                                              temperature=-1)
    assert e.value.param == "temperature"


def test_a_body_that_is_not_json_is_400(http, model_name):
    r = http.post("/v1/chat/completions", content=b"{not json",
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [b"{bad", b'{"prompt": "Hi",\n  "max_tokens": 2,,}'])
def test_bad_json_is_400_with_pythons_error_and_its_place(http, body):
    """It said only "the body is not valid JSON: JSON decode error"."""
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(body)
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", None), error
    assert error["message"] == f"the body is not valid JSON: {parsed.value}", error
    assert "line " in error["message"] and "column " in error["message"]


def test_a_body_not_utf8_is_400_naming_the_bytes_offset(http):
    """It was FastAPI's "There was an error parsing the body", not the documented error."""
    r = http.post("/v1/completions", content=b'{"prompt":"\xff\xfe"}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", None), error
    assert error["message"] == ("the body is not valid JSON: it is not valid UTF-8 (byte 0xff "
                                "at offset 11: invalid start byte)"), error


def test_a_logit_bias_out_of_range_names_the_token_and_the_bias(http, model_name):
    """It said "the bias of 5 must be in [-100, 100]", as if the bias were 5."""
    for bias, shown in [(101, "101"), (-100.5, "-100.5")]:
        r = post_json(http, "/v1/chat/completions", {"model": model_name, "messages": MESSAGES,
                                                     "logit_bias": {"5": bias}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logit_bias", error
        assert error["message"] == (f"logit_bias: token 5's bias {shown} is not in "
                                    "[-100, 100]"), error


def test_a_json_schema_without_schema_is_a_json_object(http, model_name):
    """OpenAI's json_schema.schema is optional, and its structured output is an object: with
    none, the output is held as json_object holds it (it was any JSON value)."""
    def content(response_format: dict, seed: int) -> str:
        r = post_json(http, "/v1/chat/completions", {
            "model": model_name, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0,
            "seed": seed, "response_format": response_format})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    for seed in range(4):
        schemaless = content({"type": "json_schema", "json_schema": {"name": "x"}}, seed)
        assert schemaless.startswith("{"), schemaless
        assert schemaless == content({"type": "json_object"}, seed)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body,says", [(b"", "the body is not valid JSON: it is empty"),
                                       (b"null", "the body must be a JSON object")])
def test_an_empty_or_null_body_is_400_saying_so(http, path, body, says):
    """An empty body was "invalid request body: Field required", as if a field were missing."""
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", None), error
    assert error["message"].startswith(says), error


@pytest.mark.parametrize("content,says", [
    ([], "a message needs content"),  # as "content": null; OpenAI's refuses [] too
    ([{"type": "text"}], 'no "text"'),
])
def test_empty_content_and_a_text_part_without_text_are_named(http, model_name, content,
                                                               says):
    r = post_json(http, "/v1/chat/completions",
                  {"model": model_name, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_is_400_naming_the_content_type(http, model_name,
                                                                content_type):
    """curl -d sends a form's Content-Type: FastAPI does not read that body as JSON."""
    body = json.dumps({"model": model_name, "messages": MESSAGES}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    r = http.post("/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "Content-Type: application/json" in error["message"], error
    assert (content_type or "no Content-Type") in error["message"], error


def test_top_p_0_is_the_most_likely_token_alone(server, model_name):
    """OpenAI's top_p is in [0, 1]; 0 keeps a nucleus of mass 0, the most likely token
    (the kernel's own top_p 0 would mean no limit: a hot sample)."""
    def text(**fields) -> list[str]:
        r = server.client.completions.create(model=model_name, prompt="Once upon a",
                                             max_tokens=12, n=3, seed=5,
                                             extra_body={"ignore_eos": True}, **fields)
        return [c.text for c in r.choices]

    greedy = text(temperature=0)
    assert len(set(greedy)) == 1
    assert text(temperature=2, top_p=0) == greedy
    assert text(temperature=2, top_p=1) != greedy  # hot sampling does differ


def test_a_prompt_past_the_context_is_400_with_the_lengths(server, model_name, k):
    context = k.model_info().context_length
    prompt = [7] * (context - 10)
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=model_name, prompt=prompt, max_tokens=16)
    assert e.value.code == "context_length_exceeded"
    assert (f"maximum context length is {context} tokens. However, you requested "
            f"{context + 6} tokens ({context - 10} in the prompt, 16 in the completion)"
            ) in e.value.message
    long = [{"role": "user", "content": "a b c d " * context}]
    n = len(k.tokenize(messages=long, add_generation_prompt=True))
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=model_name, messages=long, max_tokens=5)
    assert f"({n} in the messages, 5 in the completion)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # no max_tokens: the prompt alone
        server.client.chat.completions.create(model=model_name, messages=long)
    assert f"your messages resulted in {n} tokens" in e.value.message
    assert_alive(server, model_name)


def test_chat_completion_shape_null_is_default(server, model_name):
    r = server.client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_completion_tokens=3, temperature=0,
        extra_body={"n": None, "top_p": None, "stop": None})
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == model_name and r.created > 0
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_shape_with_echo_and_token_ids(server, model_name, k):
    prompt = k.tokenize("Once upon", add_special=True)
    r = server.client.completions.create(model=model_name, prompt=[prompt], max_tokens=2,
                                         temperature=0, echo=True, logprobs=2)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    (choice,) = r.choices
    assert choice.text.startswith(k.detokenize(prompt))
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1] <= 0
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == len(prompt)


def test_a_stream_is_events_ending_with_done(http, model_name):
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 3, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.iter_text()]
    text = "".join(events)
    assert text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n")[:-2]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    firsts = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        firsts.setdefault(choice["index"], choice["delta"])
        assert c["usage"] is None
    assert {i: d.get("role") for i, d in firsts.items()} == {0: "assistant", 1: "assistant"}
    finished = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6


def send_completion(url: str, body: dict) -> socket.socket:
    """A completion request on a connection of its own, its response left unread."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return conn


def held(k, server) -> tuple[int, int]:
    """The pages and files of the server's kernel process (`symphony serve` runs the
    program as its child)."""
    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    (proc,) = [p for p in k.ps() if parent(p.os_pid) == server.proc.pid]
    return proc.pages, proc.fds


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_mid_request_has_its_generation_freed(server, model_name, k, stream):
    """Its KV file is closed, without waiting for max_tokens: the server's process holds
    what it held before the request."""
    before = held(k, server)
    longest = k.model_info().context_length - 8
    with send_completion(server.url, {"prompt": "x", "max_tokens": longest,
                                      "ignore_eos": True, "stream": stream}):
        wait_for(lambda: held(k, server)[0] > before[0], what="the request's pages")
    wait_for(lambda: held(k, server) == before, what="the pages freed")
    assert_alive(server, model_name)


def generated_tokens(server) -> float:
    """The server's symphony:generation_tokens_total."""
    (line,) = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
               if line.startswith("symphony:generation_tokens_total")]
    return float(line.rsplit(" ", 1)[1])


def test_a_client_gone_from_a_silent_stream_has_its_generation_cancelled(server, model_name,
                                                                         k):
    """A stream that writes no event (its every token held back as the start of a stop
    string) still notices its client going: the generation is cancelled long before its
    max_tokens, not when it ends and its last event cannot be written."""
    (a,) = k.tokenize("a")
    longest = k.model_info().context_length - 8
    before, tokens = held(k, server), generated_tokens(server)
    body = {"prompt": "x", "max_tokens": longest, "ignore_eos": True, "stream": True,
            "temperature": 0, "logit_bias": {str(a): 100}, "stop": ["a" * (longest + 1)]}
    with send_completion(server.url, body):
        wait_for(lambda: held(k, server)[0] > before[0], what="the request's pages")
    wait_for(lambda: held(k, server) == before, what="the pages freed")
    assert generated_tokens(server) - tokens < longest
    assert_alive(server, model_name)


def test_an_event_stream_ends_when_its_client_goes_though_it_writes_nothing():
    """EventStream listens for http.disconnect itself: Starlette's StreamingResponse, under
    an ASGI server of spec 2.4, would wait for its next write to fail, which a stream that
    writes nothing never does (its generation and pages held meanwhile)."""
    async def silent() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()  # no event, ever
        yield b""

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    async def send(_message: dict) -> None:
        pass

    async def main() -> None:
        closed = asyncio.Event()

        async def on_close() -> None:
            closed.set()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
        await asyncio.wait_for(EventStream(silent(), on_close)(scope, gone, send), 30)
        assert closed.is_set()

    asyncio.run(main())


def test_serve_help_is_the_programs():
    out = subprocess.run([*SYMPHONY, "serve", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--api-key" in out.stdout and "/v1/chat/completions" in out.stdout
    # its curl example must run as written: without the header the body is not JSON
    assert "-H 'Content-Type: application/json'" in out.stdout


def test_a_port_out_of_range_or_taken_is_refused_by_name(daemon):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        for flags, status, words in ((["--port", "70000"], 2, "--port must be in 0..65535"),
                                     (["--port", str(busy)], 1, f"127.0.0.1:{busy}")):
            out = subprocess.run([*SYMPHONY, "serve", "--socket", str(daemon.socket), *flags],
                                 capture_output=True, text=True, cwd=ROOT, timeout=60)
            assert out.returncode == status and words in out.stderr, out.stderr
            assert "Traceback" not in out.stderr


def test_sigterm_ends_streams_with_done_answers_the_rest_503_and_exits_0(daemon, k):
    s = start_server(daemon, "--model-name", "served-name")
    try:
        assert [m.id for m in s.client.models.list().data] == ["served-name"]
        longest = k.model_info().context_length - 8  # runs until SIGTERM ends it
        body = {"model": "served-name", "prompt": "x", "max_tokens": longest,
                "ignore_eos": True}
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", s.url + "/v1/completions", json={**body, "stream": True},
                headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            streaming = held(k, s)[1]
            with send_completion(s.url, body) as waiting:  # not streamed: still running
                wait_for(lambda: held(k, s)[1] > streaming, what="its file")
                s.proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
                answer = b"".join(iter(lambda: waiting.recv(65536), b""))
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # cut short
        assert answer.startswith(b"HTTP/1.1 503 ") and b"shutting down" in answer
        assert s.proc.wait(60) == 0, s.log_text()
    finally:
        s.stop()


def test_health_and_metrics_are_503_while_the_kernel_does_not_answer(server, daemon):
    """A kernel stopped with SIGSTOP answers nothing: /health and /metrics wait 5 s for it,
    then say 503 (they waited for ever), and 200 again once it goes on."""
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        for path in ("/health", "/metrics"):
            start = time.monotonic()
            r = httpx.get(server.url + path, timeout=30)
            assert r.status_code == 503, (path, r.text)
            error = r.json()["error"]
            assert error["type"] == "overloaded_error", error
            assert error["message"] == "the kernel did not answer within 5 s", error
            assert time.monotonic() - start < 20
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_kernel_that_stops_or_dies_ends_the_server(model, tmp_path, how):
    """`symphony stop` (SIGTERM) or a crash (SIGKILL): the server's session has gone for
    good, so the server ends as a SIGTERM would: an open stream ends with [DONE], every
    request meanwhile is a 503, never a 500, and it exits 1 saying why in one line (it ran
    on, answering 500 with a traceback in its log), the only line of its stderr (a line
    per open request's file it could not close followed it)."""
    d = start_daemon(model, tmp_path)
    s = start_server(d)
    try:
        body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True}
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
            with client.stream("POST", s.url + "/v1/completions",
                               json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                if how == "stop":
                    d.process.send_signal(signal.SIGTERM)
                else:
                    d.process.kill()
                assert [line for line in lines if line][-1] == "data: [DONE]"
            deadline = time.monotonic() + 30
            while s.proc.poll() is None and time.monotonic() < deadline:
                try:
                    r = client.post(s.url + "/v1/completions", json=body)
                except httpx.TransportError:  # it has closed its socket
                    break
                assert r.status_code == 503, r.text
                assert r.json()["error"]["type"] == "overloaded_error"
        assert s.proc.wait(30) == 1
        log = s.log_text()
        assert "Traceback" not in log, log
        said = log.splitlines()  # that line alone: no word of the open request's files
        assert len(said) == 1 and said[0].startswith(
            "symphony serve: the kernel has gone ("), log
        assert said[0].endswith("); the server exits"), log
    finally:
        s.stop()
        d.stop()


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_a_deeply_nested_field_is_no_500(http, model_name):
    """JSON nested 600 deep (the parser takes up to about 1000) in a field the server
    does not know: the check of its strings, before any field's, walked it by recursion
    and failed with a 500."""
    r = post_json(http, "/v1/completions", {"model": model_name, "prompt": "Hi",
                                           "max_tokens": 1, "x": nested(600)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x"


def test_a_schema_past_llguidance_s_parser_limits_is_a_400(http, model_name):
    """A schema that compiles, whose parser then passes a limit as the output grows (3000
    alternatives in one row, at most 2000): a 400 naming response_format, not a 500."""
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}},
                         "required": [f"k{i}"]} for i in range(3000)]}
    r = post_json(http, "/v1/chat/completions", {
        "model": model_name, "messages": MESSAGES, "max_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": schema}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_the_server_answers_while_a_large_schema_compiles(server, model_name):
    """llguidance takes seconds on 300 property patterns: that runs in a thread, so /health
    is answered meanwhile. It waited for the compile: one gap as long as the request (a
    ratio of the request's own time, not a speed)."""
    schema = {"type": "object", "patternProperties": {
        f"^p{i}[a-z]+$": {"type": "integer"} for i in range(300)}}
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                        "schema": schema}}}
    done: list[int] = []

    def chat() -> None:
        done.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300,
                               headers={"Authorization": f"Bearer {KEY}"}).status_code)

    start = time.monotonic()
    request = threading.Thread(target=chat)
    request.start()
    answers = [start]
    while request.is_alive():
        assert httpx.get(server.url + "/health", timeout=300).status_code == 200
        answers.append(time.monotonic())
    took = time.monotonic() - start
    assert done == [200]
    longest_wait = max(b - a for a, b in zip(answers, answers[1:], strict=False))
    assert longest_wait < took / 2, (longest_wait, took)
