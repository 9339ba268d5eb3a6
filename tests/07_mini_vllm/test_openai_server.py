"""The OpenAI-compatible server, through the official `openai` client (and raw HTTP where the
client hides what is tested), on loopback.

One server per module (a tiny random Llama with SmolLM2's tokenizer, an API key), run by
uvicorn in a thread of this process on a socket bound to a free port — so a test can also ask
the engine core itself (over its utility channel) whether every KV block is free. Random
weights make every generated token a coin toss: equal texts mean equal computations.

CI scale: the issue's 64 concurrent streaming clients run here as 64, each asking few tokens
(the 2-core CI runs the module in well under a minute).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx2 as httpx   # the HTTP client the openai package ships with
import jsonschema
import pytest

from openai_server_thread import API_KEY, NAME, ServerThread

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tiny_llama(tiny_engine_models):
    return tiny_engine_models["llama"][0]


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = ServerThread(tiny_llama)
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def every_block_free_after_test(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama, make_llm):
    """The offline LLM on the same checkpoint (the oracle for greedy/seeded outputs)."""
    return make_llm(tiny_llama, max_model_len=256)


def sse_events(lines) -> list:
    """SSE lines -> JSON events, checking the framing: 'data: ' lines, '[DONE]' last and once."""
    events, done = [], 0
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        assert not done, "an event after [DONE]"
        if payload == "[DONE]":
            done += 1
            continue
        events.append(json.loads(payload))
    assert done == 1, "the stream did not end with [DONE]"
    return events


# ============================================================================ happy paths
def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


def test_completions_greedy_equal_offline_llm(client, offline):
    """Several prompts in one request, greedy: each choice's text and token count are
    LLM.generate's (same checkpoint, in-process engine)."""
    from mini_vllm import SamplingParams

    prompts = ["Hello there", "The capital of France is", "def fibonacci(n):"]
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    # A token prompt is the same request as its text.
    ids = ref[1].prompt_token_ids
    r2 = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == ref[1].outputs[0].text


def test_streamed_equals_non_streamed_for_a_seed(client):
    kwargs = dict(model=NAME, prompt="Once upon a time", max_tokens=24, temperature=0.9, top_p=0.95, seed=1234,
                  extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    assert len([c for c in chunks if c.choices]) > 2, "streamed in one piece, not token by token"


def test_chat_sync_async_streaming(client, server, offline):
    """Chat: the model's chat template (LLM.chat gives the same text), sync, async and streamed."""
    from mini_vllm import SamplingParams

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paging?"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    r = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.outputs[0].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)

    async def async_chat():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        try:
            whole = await aclient.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                                          temperature=0, extra_body={"ignore_eos": True})
            stream = await aclient.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True},
                                                           extra_body={"ignore_eos": True})
            chunks = [c async for c in stream]
        finally:
            await aclient.close()
        return whole, chunks

    whole, chunks = asyncio.run(async_chat())
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-2].choices[0].finish_reason == "length"


def test_n_logprobs_and_stop(client, offline):
    from mini_vllm import SamplingParams

    r = client.completions.create(model=NAME, prompt="Hello", n=3, max_tokens=8, temperature=1.0, seed=7,
                                  logprobs=2, extra_body={"ignore_eos": True})
    ref = offline.generate("Hello", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, logprobs=2,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert [c.text for c in r.choices] == [c.text for c in ref.outputs]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert "".join(lp.tokens) == c.text
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    rc = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = rc.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == rc.choices[0].message.content
    # A stop string taken from the greedy text: the output ends right before it, finish_reason "stop".
    full = client.completions.create(model=NAME, prompt="Hello", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.completions.create(model=NAME, prompt="Hello", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[:full.index(stop)]


def _streamed_choices(chunks, text_of) -> tuple[dict, dict]:
    """Streamed chunks -> ({choice index: joined text}, {choice index: [finish reasons]})."""
    texts, finishes = {}, {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (text_of(choice) or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes


def test_n_streamed_equals_non_streamed_for_a_seed(client):
    """n = 3 seeded samples, streamed: each choice's pieces join to that choice's non-streamed
    text, each choice ends once with a finish reason, and include_usage counts every choice's
    tokens. Several prompts with n = 2 as well: choice i * n + j is completion j of prompt i."""
    kwargs = dict(model=NAME, prompt="Once upon a time", n=3, max_tokens=10, temperature=1.0, seed=99,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert len({c.text for c in whole.choices}) > 1, "the seeded samples should differ (else the test is weak)"
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, finishes = _streamed_choices(chunks, lambda choice: choice.text)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30 == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    prompts = ["Hello there", "def f(x):"]
    kw2 = dict(model=NAME, prompt=prompts, n=2, max_tokens=6, temperature=0.8, seed=5, extra_body={"ignore_eos": True})
    whole2 = client.completions.create(**kw2)
    chunks2 = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw2))
    texts2, finishes2 = _streamed_choices(chunks2, lambda choice: choice.text)
    assert texts2 == {c.index: c.text for c in whole2.choices} and sorted(texts2) == [0, 1, 2, 3]
    assert all(f == ["length"] for f in finishes2.values()) and len(finishes2) == 4
    assert chunks2[-1].usage.completion_tokens == 24 == whole2.usage.completion_tokens


def test_chat_n_streamed_equals_non_streamed_for_a_seed(client):
    """Chat with n = 2, seeded: per choice one role chunk first, the streamed content equals the
    non-streamed message, one finish reason, usage over both choices."""
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "Tell me a story."}], n=2, max_tokens=8,
                  temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert len(whole.choices) == 2 and whole.choices[0].message.content != whole.choices[1].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, finishes = _streamed_choices(chunks, lambda choice: choice.delta.content)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {0: ["length"], 1: ["length"]}
    roles = [(ch.index, ch.delta.role) for c in chunks for ch in c.choices if ch.delta.role is not None]
    assert roles == [(0, "assistant"), (1, "assistant")]
    for i in (0, 1):
        first = next(ch for c in chunks for ch in c.choices if ch.index == i)
        assert first.delta.role == "assistant", "a choice's first chunk carries the role"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16 == whole.usage.completion_tokens


def test_64_concurrent_streaming_clients(server):
    """64 streams at once (chat and completions): no errors, every stream well formed and
    complete, its text equal to the same request made alone and not streamed."""
    n_clients = 64

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(i):
            kw = dict(model=NAME, max_tokens=6, temperature=0.8, seed=i, extra_body={"ignore_eos": True})
            if i % 2:
                stream = await aclient.completions.create(prompt=f"Request {i}:", stream=True,
                                                          stream_options={"include_usage": True}, **kw)
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                alone = (await aclient.completions.create(prompt=f"Request {i}:", **kw)).choices[0].text
            else:
                messages = [{"role": "user", "content": f"Request {i}"}]
                stream = await aclient.chat.completions.create(messages=messages, stream=True,
                                                               stream_options={"include_usage": True}, **kw)
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                alone = (await aclient.chat.completions.create(messages=messages, **kw)).choices[0].message.content
            assert chunks[-1].usage.completion_tokens == 6
            return text == alone

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n_clients))), 120)
        finally:
            await aclient.close()

    assert all(asyncio.run(run()))


# ============================================================================ leaving early
def test_disconnect_mid_stream_and_mid_request_frees_blocks(server):
    """A client that hangs up aborts its request: fewer tokens generated than asked, every block free."""
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 250, "ignore_eos": True}
    generated = _metrics(server)["vllm:generation_tokens_total"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")          # the stream has started; now hang up
    server.wait_idle()
    assert _metrics(server)["vllm:generation_tokens_total"] - generated < 250
    generated = _metrics(server)["vllm:generation_tokens_total"]
    # A non-streaming request whose client gives up (timeout) is aborted as well.
    # (Only the wait for the answer is short: on a loaded machine connecting alone can take 0.2 s.)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(30, read=0.2))
    server.wait_idle()
    assert _metrics(server)["vllm:generation_tokens_total"] - generated < 250


def test_reader_that_never_reads_does_not_stall_others(server):
    """A stream nobody reads: other requests finish meanwhile; when it is finally read, its
    merged deltas are the whole, correct text."""
    kw = {"model": NAME, "prompt": "Slow reader", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    expected = httpx.post(server.url + "/v1/completions", json=kw, headers=headers, timeout=60).json()
    with httpx.Client(timeout=60) as slow:
        with slow.stream("POST", server.url + "/v1/completions", json={**kw, "stream": True}, headers=headers) as r:
            t0 = time.monotonic()
            for i in range(4):
                other = httpx.post(server.url + "/v1/completions", headers=headers, timeout=30,
                                   json={"model": NAME, "prompt": f"other {i}", "max_tokens": 4})
                assert other.status_code == 200
            assert time.monotonic() - t0 < 30
            events = sse_events(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == expected["choices"][0]["text"]


# ============================================================================ bad input
def _long_prompt():
    return "hello " * 300


BAD = [
    # (what, body or raw bytes, expected status)
    ("malformed JSON", b'{"model": "tiny", "prompt": "x", ', 400),
    ("not an object", b'[1, 2, 3]', 400),
    ("unknown model", {"model": "gpt-5", "prompt": "x"}, 404),
    ("max_tokens of the wrong type", {"model": NAME, "prompt": "x", "max_tokens": "ten"}, 400),
    ("temperature of the wrong type", {"model": NAME, "prompt": "x", "temperature": "hot"}, 400),
    ("prompt of the wrong type", {"model": NAME, "prompt": {"a": 1}}, 400),
    ("max_tokens beyond the context", {"model": NAME, "prompt": "x", "max_tokens": 10_000}, 400),
    ("prompt longer than max_model_len", {"model": NAME, "prompt": _long_prompt()}, 400),
    ("out-of-vocabulary token ids", {"model": NAME, "prompt": [1, 2, 10_000_000]}, 400),
    ("negative token id", {"model": NAME, "prompt": [5, -1]}, 400),
    ("empty prompt", {"model": NAME, "prompt": ""}, 400),
    ("n > 1 with greedy", {"model": NAME, "prompt": "x", "n": 2, "temperature": 0}, 400),
    ("top_p out of range", {"model": NAME, "prompt": "x", "top_p": 1.5}, 400),
    ("logprobs too many", {"model": NAME, "prompt": "x", "logprobs": 1000}, 400),
    ("max_tokens zero", {"model": NAME, "prompt": "x", "max_tokens": 0}, 400),
    ("echo (unsupported)", {"model": NAME, "prompt": "x", "echo": True}, 400),
]
BAD_CHAT = [
    ("messages missing", {"model": NAME}, 400),
    ("a schema that is not JSON Schema", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                          "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400),
    ("an unknown response_format", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                    "response_format": {"type": "yaml"}}, 400),
    ("a regex that does not parse", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                     "structured_outputs": {"regex": "a(b"}}, 400),
    ("two constraints at once", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                 "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400),
    ("a message without content type", {"model": NAME, "messages": [{"role": "user", "content": 5}]}, 400),
    ("unknown model", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("top_logprobs without logprobs", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                       "top_logprobs": 2}, 400),
    ("max_completion_tokens beyond the context", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                  "max_completion_tokens": 100_000}, 400),
]


def test_bad_input_gets_its_status_and_never_disturbs_a_neighbour(server):
    """Every bad request -> vLLM's status with OpenAI's error body, while a long stream runs
    beside them; that stream's text is the text it has alone."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    kw = {"model": NAME, "prompt": "Neighbour", "max_tokens": 40, "ignore_eos": True, "temperature": 0.5,
          "seed": 99}
    expected = httpx.post(server.url + "/v1/completions", json=kw, headers=headers, timeout=60).json()
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/completions",
                                                 json={**kw, "stream": True}, headers=headers) as neighbour:
        for path, cases in (("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)):
            for what, body, status in cases:
                if isinstance(body, bytes):
                    r = h.post(server.url + path, content=body, headers={**headers, "Content-Type": "application/json"})
                else:
                    r = h.post(server.url + path, json=body, headers=headers)
                assert r.status_code == status, f"{what}: {r.status_code} {r.text}"
                err = r.json()["error"]
                assert err["code"] == status and err["message"] and err["type"], what
        # streaming requests are validated before the stream starts: a plain error, not an SSE body
        r = h.post(server.url + "/v1/completions", json={**BAD[6][1], "stream": True}, headers=headers)
        assert r.status_code == 400
        # the API key: missing or wrong -> 401 on /v1; /health stays open
        assert h.post(server.url + "/v1/completions", json=kw).status_code == 401
        r = h.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert h.get(server.url + "/health").status_code == 200
        events = sse_events(neighbour.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == expected["choices"][0]["text"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0).completions.create(
            model="gpt-5", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


# ============================================================================ structured output
SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
                "required": ["ok", "n"], "additionalProperties": False}


def test_response_format_and_structured_outputs_constrain_the_answer(client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs body field
    (chapter 08): even the tiny random model's answer is inside the language."""
    messages = [{"role": "user", "content": "Answer in JSON."}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=1.0, seed=3,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "small", "schema": SMALL_SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SMALL_SCHEMA)
    r = client.completions.create(model=NAME, prompt="Pick one:", max_tokens=10, temperature=1.0, seed=5,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:                                            # cut by max_tokens: still the start of an object
        assert text.startswith("{")


# ============================================================================ metrics
def _metrics(server) -> dict:
    """/metrics parsed by prometheus_client's own parser -> {sample name[{finished_reason=...}]: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue                       # histogram buckets: the counts and sums are enough here
            reason, engine = sample.labels.get("finished_reason"), sample.labels.get("engine")
            values[sample.name + (f"{{finished_reason={reason}}}" if reason else "")
                   + (f"{{engine={engine}}}" if engine else "")] = sample.value
    return values


def test_metrics_count_what_was_sent(server, client):
    before = _metrics(server)
    assert before["vllm:num_requests_running"] == 0 and before["vllm:kv_cache_usage_perc"] == 0
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37]]
    max_tokens = [5, 9, 3]
    for p, m in zip(prompts, max_tokens):
        client.completions.create(model=NAME, prompt=p, max_tokens=m, temperature=0, extra_body={"ignore_eos": True})
    list(client.completions.create(model=NAME, prompt=prompts[0], max_tokens=2, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True}))
    server.wait_idle()
    after = _metrics(server)

    def diff(name):
        return after.get(name, 0) - before.get(name, 0)

    assert diff("vllm:prompt_tokens_total") == sum(map(len, prompts)) + len(prompts[0])
    assert diff("vllm:generation_tokens_total") == sum(max_tokens) + 2
    assert diff("vllm:e2e_request_latency_seconds_count") == 4
    assert diff("vllm:time_to_first_token_seconds_count") == 4
    assert diff("vllm:inter_token_latency_seconds_count") == sum(m - 1 for m in max_tokens) + 1
    assert diff("vllm:request_success_total{finished_reason=length}") == 4
    # The prefix cache: the fourth prompt repeats the first (5 tokens: no full 16-token block to hit).
    assert diff("vllm:prefix_cache_queries_total") == sum(map(len, prompts)) + len(prompts[0])
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0


# ============================================================================ data parallelism
def test_data_parallel_server_routes_tenants_by_prefix_and_matches_one_replica(tiny_llama, offline):
    """`serve --data-parallel-size 2`: two engine cores behind the cache-aware router. One request
    with two tenants' prompts interleaved (A1 B1 A2 B2 A3 B3; each tenant a 3-block shared prefix):
    every tenant's prompts go to ONE core, the tenants to different cores (the router's choices, in
    AsyncLLM.route_log and in /metrics per engine); greedy texts are one replica's (the offline LLM);
    the same request again hits the prefix caches. Both core processes are gone after."""
    from mini_vllm import SamplingParams
    from mini_vllm.entrypoints.cli_args import add_serve_args
    import argparse

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["--data-parallel-size", "2"]).data_parallel_size == 2     # vLLM's flag name

    tenants = {"A": " ".join(["Alpha policy text, clause one."] * 12), "B": " ".join(["Bravo manual; rule two!"] * 12)}
    prompts = [tenants[t] + f" Question {i} from {t}?" for i in range(3) for t in "AB"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    assert all(len(o) > 48 for o in (offline.llm_engine.processor.process_inputs(p, params)[1] for p in prompts))
    s = ServerThread(tiny_llama, data_parallel_size=2)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        assert s.engine.data_parallel_size == 2 and len({c.pid for c in s.engine.core_clients}) == 2
        routes, hits = [], []
        for _ in range(2):
            before = _metrics(s)
            r = client.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert [c.text for c in r.choices] == ref
            s.wait_idle()
            after = _metrics(s)
            log = {req_id: engine for req_id, engine, _ in s.engine.route_log}
            routes.append([log[f"{r.id}-{i}"] for i in range(len(prompts))])
            hits.append(after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0))
            assert [after[f"mini_vllm:dp_requests_routed_total{{engine={e}}}"]
                    - before[f"mini_vllm:dp_requests_routed_total{{engine={e}}}"] for e in "01"] == [3, 3]
        for engines in routes:
            a, b = set(engines[0::2]), set(engines[1::2])
            assert len(a) == 1 and len(b) == 1 and a != b, f"tenants not kept together: {engines}"
        assert routes[0] == routes[1]
        assert hits[1] >= 6 * 3 * 16, f"the second round should hit every prompt's prefix blocks: {hits}"
    finally:
        s.stop()


# ============================================================================ a dead engine core
def test_dead_core_gives_503_and_failing_health(tiny_llama):
    """The core process killed under a running stream: the stream ends with an error event,
    new requests get 503 (not a hang, not a 500), /health fails."""
    s = ServerThread(tiny_llama, api_key=None)
    try:
        body = {"model": NAME, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as h, h.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(s.engine.engine_core.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == 503
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert httpx.get(s.url + "/health").status_code == 503
        assert time.monotonic() - t0 < 5
    finally:
        s.stop()


# ============================================================================ the real model
@pytest.mark.model
def test_smollm2_chat_through_the_server_equals_llm_chat(smollm2_dir, make_llm):
    """SmolLM2-135M-Instruct behind our server: a greedy chat completion (the model's own chat
    template, applied by the server) is LLM.chat's text for the same messages, whole and streamed,
    and it is the model answering (the question has one right answer), not a random checkpoint."""
    from mini_vllm import SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = make_llm(smollm2_dir, max_model_len=256).chat(messages, SamplingParams(temperature=0, max_tokens=12),
                                                         use_tqdm=False)[0]
    assert "Paris" in ref.outputs[0].text
    s = ServerThread(smollm2_dir)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == ref.outputs[0].text
        assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
        assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
        s.wait_idle()
    finally:
        s.stop()


def test_the_server_process_freezes_its_start_up_heap(tiny_llama, monkeypatch):
    """`serve` (run_server) freezes the garbage collector's view of its process once the engine and
    the app are built, before uvicorn serves (vLLM's server does the same): the objects of start-up
    are never walked by a collection while requests stream. uvicorn.run is replaced by a probe."""
    import gc

    import uvicorn

    from mini_vllm.cli import build_parser, engine_config
    from mini_vllm.entrypoints.api_server import run_server

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.setdefault("frozen", gc.get_freeze_count()))
    args = build_parser().parse_args(["serve", str(tiny_llama), "--max-model-len", "64", "--kv-cache-memory", "0.01",
                                      "--disable-log-stats"])
    gc.unfreeze()
    try:
        run_server(args, engine_config(args))
    finally:
        gc.unfreeze()            # this is the test process: leave its collector as it was
    assert seen["frozen"] > 50_000
