"""Prefill/decode disaggregation through the server: two `python -m mini_vllm serve` processes (a
kv_producer and a kv_consumer of chapter 06's pool) and `python -m mini_vllm disagg-proxy` before
them, asked with the official `openai` client — vLLM's `examples/online_serving/disaggregated_serving`.

The truth kept: the answer through the proxy is the decode server's own answer to the same request
(greedy, a tiny random model: equal tokens mean equal computations), and the decode server computed
almost none of the prompt — it loaded it (`usage.prompt_tokens_details.cached_tokens`, every full
block but the one holding the last prompt token). Every engine's blocks are free at the end (each
server's /metrics: no request running, KV cache usage 0)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

openai = pytest.importorskip("openai")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `python -m mini_vllm ...` server process, up when /health answers 200; stopped with SIGINT."""

    def __init__(self, args: list[str], timeout_s: float = 240):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "mini_vllm", *args, "--port", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited: {self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{args[0]} did not come up in {timeout_s} s"
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("vllm:") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tiny_engine_models):
    from global_prefix_cache.metadata import MetadataServerProcess

    model = str(tiny_engine_models["llama"][0])
    metadata = MetadataServerProcess()
    started = []
    try:
        def kv(role):
            return json.dumps({"kv_connector": "GlobalKVPoolConnector", "kv_role": role,
                               "kv_connector_extra_config": {"metadata_server": metadata.address}})
        common = ["--max-model-len", "256", "--num-gpu-blocks-override", "64", "--cpu-kernels", "off",
                  "--served-model-name", "tiny", "--disable-log-stats"]
        prefill = Served(["serve", model, *common, "--kv-transfer-config", kv("kv_producer")])
        started.append(prefill)
        decode = Served(["serve", model, *common, "--kv-transfer-config", kv("kv_consumer")])
        started.append(decode)
        proxy = Served(["disagg-proxy", "--prefill", prefill.url, "--decode", decode.url])
        started.append(proxy)
        yield prefill, decode, proxy
    finally:
        for served in reversed(started):
            served.stop()
        metadata.stop()


PROMPT = ("Prefill and decode run on different servers: the prefill server computes the prompt's K/V "
          "once and the decode server loads it instead of computing it again, then generates.")


def test_completions_through_the_proxy_are_the_decode_servers_own(cluster):
    prefill, decode, proxy = cluster
    via_proxy = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=decode.url + "/v1", api_key="none", max_retries=0, timeout=120)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    got = via_proxy.completions.create(**kw)
    num_prompt = got.usage.prompt_tokens
    assert got.usage.prompt_tokens_details.cached_tokens >= (num_prompt - 1) // 16 * 16 >= 32, got.usage
    expect = direct.completions.create(**kw)              # the decode server computing everything itself
    assert got.choices[0].text == expect.choices[0].text and got.usage.completion_tokens == 12
    # Streamed chat through the proxy: the same text as the decode server's own, in order.
    messages = [{"role": "user", "content": PROMPT}]
    stream = via_proxy.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                               stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == direct.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                                      temperature=0).choices[0].message.content
    for server in (prefill, decode):
        deadline = time.monotonic() + 10
        while (m := server.metrics())["vllm:num_requests_running"] or m["vllm:kv_cache_usage_perc"]:
            assert time.monotonic() < deadline, f"{server.url} still holds requests or blocks: {m}"
            time.sleep(0.2)


def test_a_bad_request_is_the_prefill_servers_400_and_reaches_no_decode_server(cluster):
    _, decode, proxy = cluster
    before = decode.metrics().get("vllm:request_success_total", 0.0)
    r = httpx.post(proxy.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "temperature": -1},
                   timeout=60)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    assert decode.metrics().get("vllm:request_success_total", 0.0) == before
