"""`mlxspec serve` end to end: a real server process on 127.0.0.1, driven by the official
`openai` client (and raw HTTP for malformed requests), with the default SmolLM2 target and
the shipped DSpark drafter. Outputs are checked against `mlxspec generate` run as a command.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")

KEY = "test-key-123"
PROMPT = "Write a Python function that reverses a string."
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7)
N_REF = 10  # greedy reference length


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_generate(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlxspec.cli", "generate", "--verbose", "False", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def _reference_procs(smollm2_path):
    """Start `mlxspec generate` (same defaults as the server: shipped DSpark drafter), greedy and
    sampled, before the server, so they load while it does."""
    return {"greedy": _cli_generate("--prompt", PROMPT, "--max-tokens", str(N_REF)),
            "sampled": _cli_generate("--prompt", PROMPT, "--max-tokens", "8", "--temp", "0.8", "--top-p", "0.9",
                                     "--seed", "7")}


@pytest.fixture(scope="module")
def server(_reference_procs, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxspec.cli", "serve", "--port", str(port), "--api-key", KEY,
         "--max-queue", "4", "--max-body-bytes", "64K", "--max-tokens-limit", "1024"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        model_id = _wait_healthy(proc, port, 180, log_path.read_text)["model"]
        yield {"port": port, "proc": proc, "model": model_id, "log": log_path}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


@pytest.fixture(scope="module")
def reference(_reference_procs):
    out = {}
    for name, p in _reference_procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        assert stdout.endswith("\n")
        out[name] = stdout[:-1]
    return out


def _wait_healthy(proc, port: int, limit: float, output) -> dict:
    """Poll GET /health until it answers 200 -> its JSON; fail with the server's output
    (`output()`) if it exits first, or when it is not up within `limit` seconds."""
    deadline = time.time() + limit
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}: {output()[-2000:]}")
        try:
            st, _, body = _raw(port, "GET", "/health")
            if st == 200:
                return json.loads(body)
        except OSError:
            pass
        if time.time() > deadline:
            pytest.fail(f"server did not come up within {limit:g} s")
        time.sleep(0.3)


def _client(server, key=KEY):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=key, max_retries=0, timeout=120)


def _raw(port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    h.update(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    return r.status, dict(r.getheaders()), data


def _chat(client, model, prompt=PROMPT, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], **kw)


def _stream_text(stream):
    text, finish, usage, chunks = "", None, None, 0
    for ch in stream:
        chunks += 1
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            text += piece or ""
            finish = c.finish_reason or finish
    return text, finish, usage, chunks


def _assert_error(status, body, want_status, want_code=None):
    assert status == want_status, body
    assert "Traceback" not in body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if want_code:
        assert err["code"] == want_code, err


# ----------------------------------------------------------------------------- outputs

def test_chat_greedy_equals_generate(server, reference):
    c = _client(server)
    r = _chat(c, server["model"], max_tokens=N_REF, temperature=0)
    assert r.choices[0].message.content == reference["greedy"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.object == "chat.completion"
    u = r.usage
    assert u.completion_tokens == N_REF and u.total_tokens == u.prompt_tokens + N_REF and u.prompt_tokens > 20
    ext = u.model_extra["mlxspec"]
    assert ext["speculative"].startswith("eagle3") and ext["target_forwards"] >= 1  # the default drafter (registry)
    assert 0 <= ext["acceptance_rate"] <= 1 and ext["tau"] >= 1 and ext["verify_time_s"] > 0
    # streaming: the same text, in several chunks, with usage at the end
    text, finish, usage, chunks = _stream_text(
        _chat(c, server["model"], max_tokens=N_REF, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert text == reference["greedy"] and finish == "length" and chunks > 3
    assert (usage.prompt_tokens, usage.completion_tokens) == (u.prompt_tokens, N_REF)
    # a request may turn speculation off: greedy output is the same
    r2 = _chat(c, server["model"], max_tokens=N_REF, temperature=0, extra_body={"speculative": False, "cache_prompt": False})
    assert r2.choices[0].message.content == reference["greedy"]
    assert r2.usage.model_extra["mlxspec"]["speculative"] == "autoregressive"


def test_sampled_with_seed_equals_generate(server, reference):
    c = _client(server)
    r = _chat(c, server["model"], max_tokens=8, **SAMPLED)
    assert r.choices[0].message.content == reference["sampled"]


def test_stop_strings(server, reference):
    c = _client(server)
    full = reference["greedy"]
    stop = "reverse_"
    assert stop in full, full
    want = full[: full.index(stop)]
    r = _chat(c, server["model"], max_tokens=N_REF, temperature=0, stop=[stop, "never-there"])
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    text, finish, _, _ = _stream_text(_chat(c, server["model"], max_tokens=N_REF, temperature=0, stop=stop, stream=True))
    assert text == want and finish == "stop"  # no partial "rev..." leaked into the stream


def test_completions(server):
    c = _client(server)
    prompt = "def fibonacci(n):\n    "
    r = c.completions.create(model=server["model"], prompt=prompt, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.choices[0].text
    s = c.completions.create(model=server["model"], prompt=prompt, max_tokens=6, temperature=0, stream=True,
                             stream_options={"include_usage": True})
    text, finish, usage, _ = _stream_text(s)
    assert text == r.choices[0].text and finish == "length"
    assert usage.prompt_tokens == r.usage.prompt_tokens
    m = c.models.list()
    assert [x.id for x in m.data] == [server["model"]]


def test_prefix_cache_multi_turn(server):
    c = _client(server)
    m = server["model"]
    msgs = [{"role": "user", "content": "Name three colours."}]
    t1 = c.chat.completions.create(model=m, messages=msgs, max_tokens=6, temperature=0)
    msgs2 = msgs + [{"role": "assistant", "content": t1.choices[0].message.content},
                    {"role": "user", "content": "And three animals?"}]
    cold = c.chat.completions.create(model=m, messages=msgs2, max_tokens=6, temperature=0,
                                     extra_body={"cache_prompt": False})
    warm = c.chat.completions.create(model=m, messages=msgs2, max_tokens=6, temperature=0)
    again = c.chat.completions.create(model=m, messages=msgs2, max_tokens=6, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    n_warm = warm.usage.prompt_tokens_details.cached_tokens
    assert n_warm >= t1.usage.prompt_tokens  # at least turn 1's prompt was reused
    assert again.usage.prompt_tokens_details.cached_tokens == cold.usage.prompt_tokens - 1
    # the cache changes nothing in the output, and a reused entry was not mutated
    assert warm.choices[0].message.content == cold.choices[0].message.content == again.choices[0].message.content


def test_concurrent_clients(server):
    m = server["model"]
    prompts = ["Name a fruit.", "What is 2 + 2?", "Say hello in French."]
    c = _client(server)
    want = [_chat(c, m, p, max_tokens=5, temperature=0, extra_body={"cache_prompt": False}).choices[0].message.content
            for p in prompts]
    got, errors = [None] * 3, []

    def run(i):
        try:
            cl = _client(server)
            if i % 2:
                got[i] = _chat(cl, m, prompts[i], max_tokens=5, temperature=0).choices[0].message.content
            else:
                got[i] = _stream_text(_chat(cl, m, prompts[i], max_tokens=5, temperature=0, stream=True))[0]
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors and got == want


def test_cancel_mid_stream_frees_server(server):
    c = _client(server)
    m = server["model"]
    stream = _chat(c, m, "Write a long story about a dragon.", max_tokens=800, temperature=0, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()  # the client goes away mid-generation
    t0 = time.time()
    r = _chat(c, m, "Name a fruit.", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert time.time() - t0 < 20  # 800 tokens would take over a minute here
    st, _, body = _raw(server["port"], "GET", "/metrics")
    assert re.search(r"^mlxspec_cancelled_total [1-9]", body, re.M), body


def test_queue_full_answers_429(server):
    c = _client(server)
    m = server["model"]
    streams = [_chat(c, m, "Write a long story about a dragon.", max_tokens=800, stream=True) for _ in range(4)]
    try:
        with pytest.raises(openai.RateLimitError) as ei:
            _chat(c, m, max_tokens=4)
        assert ei.value.status_code == 429
        assert ei.value.response.headers.get("retry-after") == "1"
        assert ei.value.body["code"] == "queue_full"
        # continuous batching: the four run together, in one batch
        t0 = time.time()
        while not re.search(r"^mlxspec_batch_size 4$", _raw(server["port"], "GET", "/metrics")[2], re.M):
            assert time.time() - t0 < 60, "the four streams never ran in one batch"
            time.sleep(0.3)
    finally:
        for s in streams:
            s.close()
    # the queue drains (cancelled jobs are skipped) and the server answers again
    t0 = time.time()
    while True:
        try:
            _chat(c, m, "Name a fruit.", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.time() - t0 < 20
            time.sleep(0.5)


# ----------------------------------------------------------------------------- bad input

def test_bad_input(server):
    port, m = server["port"], server["model"]
    msgs = [{"role": "user", "content": "hi"}]
    ok = {"model": m, "messages": msgs, "max_tokens": 2}
    P = "/v1/chat/completions"
    cases = [
        (P, "{not json", 400, "invalid_json"),
        (P, "[1, 2]", 400, "invalid_json"),
        (P, b"\xff\xfe", 400, "invalid_json"),
        (P, {**ok, "model": "gpt-9"}, 404, "model_not_found"),
        (P, {"messages": msgs}, 400, "missing_required_parameter"),
        (P, {**ok, "messages": []}, 400, "invalid_value"),
        (P, {**ok, "messages": "hi"}, 400, "invalid_type"),
        (P, {**ok, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value"),
        (P, {**ok, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_type"),
        (P, {**ok, "temperature": "hot"}, 400, "invalid_type"),
        (P, {**ok, "temperature": 7}, 400, "invalid_value"),
        (P, {**ok, "top_p": 0}, 400, "invalid_value"),
        (P, {**ok, "top_k": -1}, 400, "invalid_value"),
        (P, {**ok, "max_tokens": "5"}, 400, "invalid_type"),
        (P, {**ok, "max_tokens": True}, 400, "invalid_type"),
        (P, {**ok, "max_tokens": 0}, 400, "invalid_value"),
        (P, {**ok, "max_tokens": 5000}, 400, "invalid_value"),
        (P, {**ok, "n": 2}, 400, "invalid_value"),
        (P, {**ok, "stop": 3}, 400, "invalid_type"),
        (P, {**ok, "stream": "yes"}, 400, "invalid_type"),
        (P, {**ok, "seed": 1.5}, 400, "invalid_type"),
        (P, {**ok, "seed": -1}, 400, "invalid_value"),
        (P, '{"model": ' + "[" * 50_000 + "]" * 50_000 + "}", 413, "body_too_large"),
        (P, "[" * 20_000 + "]" * 20_000, 400, "invalid_json"),
        (P, json.dumps(ok)[:-1] + ', "temperature": NaN}', 400, "invalid_type"),
        (P, {**ok, "logprobs": True}, 400, "unsupported_parameter"),
        (P, "x" * 70_000, 413, "body_too_large"),
        ("/v1/completions", {"model": m, "prompt": ""}, 400, "invalid_value"),
        ("/v1/completions", {"model": m, "prompt": {"a": 1}}, 400, "invalid_type"),
        ("/v1/completions", {"model": m, "prompt": [1, 2, 10**9]}, 400, "invalid_value"),
        ("/v1/completions", {"model": m, "prompt": [1] * 9000}, 400, "context_length_exceeded"),
        ("/v1/nothing", ok, 404, "not_found"),
    ]
    for path, body, status, code in cases:
        st, _, text = _raw(port, "POST", path, body)
        _assert_error(st, text, status, code)
    st, _, text = _raw(port, "GET", P)
    _assert_error(st, text, 405)
    # through the official client too
    c = _client(server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=msgs)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=m, messages=[])
    assert ei.value.body["param"] == "messages"
    # and the server is alive and well; `tools` go to the chat template (SmolLM2's defines no tool calls)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = _chat(c, m, "Name a fruit.", max_tokens=2, tools=tools)
    assert r.usage.completion_tokens == 2 and r.choices[0].message.tool_calls is None


def test_api_key(server):
    port, m = server["port"], server["model"]
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        st, _, text = _raw(port, "GET", "/v1/models", headers=headers)
        _assert_error(st, text, 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="nope").chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}])
    st, _, _ = _raw(port, "GET", "/health", headers={"Authorization": ""})
    assert st == 200  # health needs no key


def test_metrics(server):
    _chat(_client(server), server["model"], "Name a fruit.", max_tokens=2)
    st, h, body = _raw(server["port"], "GET", "/metrics")
    assert st == 200 and h["content-type"].startswith("text/plain")
    for name in ("mlxspec_requests_total", "mlxspec_completion_tokens_total", "mlxspec_acceptance_rate",
                 "mlxspec_tau", "mlxspec_queue_depth", "mlxspec_time_to_first_token_seconds_bucket",
                 "mlxspec_prompt_cache_bytes", "mlxspec_batch_size"):
        assert re.search(rf"^{name}\b", body, re.M), name
    assert re.search(r"^mlxspec_max_batch 8$", body, re.M)  # the default on this machine's 2+ cores
    assert int(re.search(r"^mlxspec_batch_steps_total (\d+)", body, re.M).group(1)) >= 1
    assert re.search(r"^mlxspec_batch_steps_started_ahead_total \d+$", body, re.M)
    assert float(re.search(r"^mlxspec_generation_tokens_per_second (\S+)", body, re.M).group(1)) > 0
    count = int(re.search(r"^mlxspec_time_to_first_token_seconds_count (\d+)", body, re.M).group(1))
    assert count >= 1
    assert int(re.search(r"^mlxspec_blas_threads (\d+)", body, re.M).group(1)) >= 1  # OpenBLAS, governed


def _counter(port, name) -> int:
    return int(re.search(rf"^{name} (\d+)", _raw(port, "GET", "/metrics")[2], re.M).group(1))


def test_a_burst_of_requests_shares_one_prefill(server):
    """Requests arriving together are prefilled in ONE batched forward (the worker waits a few ms
    while requests are still arriving), not one by one."""
    port, m = server["port"], server["model"]
    before = [_counter(port, n) for n in ("mlxspec_prefills_total", "mlxspec_prefilled_prompts_total")]
    go, out = threading.Barrier(4), [None] * 4
    clients = [_client(server) for _ in range(4)]  # made before the barrier: the four arrive together

    def one(i):
        go.wait()
        out[i] = _chat(clients[i], m, f"Name a colour, please ({i}).", max_tokens=3)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None and r.usage.completion_tokens >= 1 for r in out)
    after = [_counter(port, n) for n in ("mlxspec_prefills_total", "mlxspec_prefilled_prompts_total")]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4)


# ----------------------------------------------------------------------------- Anthropic Messages, OpenAI Responses

anthropic = None
YES_NO = "Reply with one word: yes or no?"  # SmolLM2 answers "Yes." and stops (EOS) greedily
SYSTEM = "You are a helpful coding assistant."
GREEDY = {"temperature": 0}  # anthropic>=2 has no `temperature` argument: it goes in the body


def _anthropic(server, key=KEY):
    global anthropic
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server['port']}", api_key=key, max_retries=0, timeout=120)


def _sse_events(text):
    """Raw SSE -> [(event, data)]: the wire format, which the clients partly hide (ping)."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def _chat_ref(server, msgs, **kw):
    r = _client(server).chat.completions.create(model=server["model"], messages=msgs, temperature=0, **kw)
    return r.choices[0].message.content, r.usage


def test_anthropic_messages_equal_chat(server):
    a, m = _anthropic(server), server["model"]
    user = [{"role": "user", "content": PROMPT}]
    want, u = _chat_ref(server, [{"role": "system", "content": SYSTEM}] + user, max_tokens=N_REF)
    r = a.messages.create(model=m, system=SYSTEM, messages=user, max_tokens=N_REF, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == m and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    # Anthropic counts: input_tokens is what was not read from the prompt cache, which the chat
    # request just filled with this very prompt (all but the last token is reused)
    assert r.usage.output_tokens == N_REF
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == u.prompt_tokens
    assert r.usage.cache_read_input_tokens == u.prompt_tokens - 1
    ext = r.usage.model_extra["mlxspec"]
    assert ext["speculative"].startswith("eagle3") and ext["target_forwards"] >= 1 and ext["tau"] >= 1  # the default drafter (registry)
    assert a.messages.count_tokens(model=m, system=SYSTEM, messages=user).input_tokens == u.prompt_tokens
    # the system prompt as text blocks, content as text blocks: the same conversation
    blocks = [{"role": "user", "content": [{"type": "text", "text": PROMPT[:10]}, {"type": "text", "text": PROMPT[10:]}]}]
    with a.messages.stream(model=m, system=[{"type": "text", "text": SYSTEM}], messages=blocks, max_tokens=N_REF,
                           extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == want and final.content[0].text == want and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == N_REF
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == u.prompt_tokens
    # the wire: exactly Anthropic's event sequence, ping included, deltas summing to the text
    st, h, body = _raw(server["port"], "POST", "/v1/messages",
                       {"model": m, "system": SYSTEM, "messages": user, "max_tokens": N_REF, "stream": True,
                        "temperature": 0}, headers={"Authorization": "", "x-api-key": KEY})
    assert st == 200 and h["content-type"].startswith("text/event-stream")
    evs = _sse_events(body)
    names = [e for e, _ in evs]
    assert all(d["type"] == e for e, d in evs)
    n_delta = names.count("content_block_delta")
    assert n_delta >= 2 and names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * n_delta \
        + ["content_block_stop", "message_delta", "message_stop"]
    assert evs[0][1]["message"]["content"] == [] and evs[0][1]["message"]["usage"]["input_tokens"] == u.prompt_tokens
    assert evs[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for e, d in evs if e == "content_block_delta") == want
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for e, d in evs if e == "content_block_delta")
    md = evs[-2][1]
    assert md["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert md["usage"]["output_tokens"] == N_REF and md["usage"]["mlxspec"]["target_forwards"] >= 1


def test_anthropic_stop_sequences_and_end_turn(server):
    a, m = _anthropic(server), server["model"]
    user = [{"role": "user", "content": PROMPT}]
    full, _ = _chat_ref(server, user, max_tokens=N_REF)
    stop = "reverse_"
    assert stop in full, full
    r = a.messages.create(model=m, messages=user, max_tokens=N_REF, stop_sequences=["never-there", stop],
                          extra_body=GREEDY)
    assert r.content[0].text == full[: full.index(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    # the model's own end of turn (EOS) is end_turn, with no stop sequence
    yes, _ = _chat_ref(server, [{"role": "user", "content": YES_NO}], max_tokens=8)
    with a.messages.stream(model=m, messages=[{"role": "user", "content": YES_NO}], max_tokens=8,
                           stop_sequences=["never-there"], extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == yes and final.stop_reason == "end_turn" and final.stop_sequence is None


def test_anthropic_tools_and_errors(server):
    a, m, port = _anthropic(server), server["model"], server["port"]
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    conv = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]}]
    # SmolLM2's template defines no tool calls: tools are accepted, the answer is text, and a header says so
    raw = a.messages.with_raw_response.create(model=m, messages=conv, tools=tools, max_tokens=2)
    r = raw.parse()
    assert [b.type for b in r.content] == ["text"] and r.stop_reason == "max_tokens"
    assert "no <tool_call> markup" in raw.headers["x-mlxspec-warning"]
    ok = {"model": m, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    bad_msgs = [
        ({"model": m, "messages": ok["messages"]}, 400),  # max_tokens is required, as Anthropic's
        ({**ok, "messages": []}, 400),
        ({**ok, "messages": [{"role": "system", "content": "x"}]}, 400),
        ({**ok, "messages": [{"role": "user", "content": 5}]}, 400),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "y"}]}]}, 400),
        ({**ok, "system": 3}, 400),
        ({**ok, "temperature": 1.5}, 400),
        ({**ok, "top_k": -1}, 400),
        ({**ok, "max_tokens": 0}, 400),
        ({**ok, "max_tokens": 5000}, 400),
        ({**ok, "stop_sequences": "x"}, 400),
        ({**ok, "tools": tools, "tool_choice": {"type": "any"}}, 400),  # a forced call this model cannot make
        ({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400),
        ({**ok, "model": "claude-sonnet-4"}, 404),
        ("{not json", 400),
        ("x" * 70_000, 413),
    ]
    for body, status in bad_msgs:
        st, _, text = _raw(port, "POST", "/v1/messages", body)
        assert st == status and "Traceback" not in text, (body, text)
        err = json.loads(text)
        assert set(err) == {"type", "error"} and err["type"] == "error" and set(err["error"]) == {"type", "message"}
        want = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}[status]
        assert err["error"]["type"] == want and err["error"]["message"], err
    st, _, text = _raw(port, "GET", "/v1/messages")
    assert st == 405 and json.loads(text)["error"]["type"] == "invalid_request_error"
    # through the official client: its exception classes, the message from the server
    with pytest.raises(anthropic.BadRequestError) as ei:
        a.messages.create(model=m, messages=[], max_tokens=2)
    assert ei.value.status_code == 400 and ei.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        a.messages.create(model="claude-sonnet-4", messages=ok["messages"], max_tokens=2)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        _anthropic(server, key="nope").messages.create(model=m, messages=ok["messages"], max_tokens=2)
    assert ei.value.body["error"]["type"] == "authentication_error"


def test_responses_equal_chat(server):
    c, m = _client(server), server["model"]
    want, u = _chat_ref(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}],
                        max_tokens=N_REF)
    r = c.responses.create(model=m, instructions=SYSTEM, input=PROMPT, max_output_tokens=N_REF, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == m
    assert r.output_text == want and [o.type for o in r.output] == ["message"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (u.prompt_tokens, N_REF)
    assert r.usage.total_tokens == u.prompt_tokens + N_REF
    assert r.usage.input_tokens_details.cached_tokens == u.prompt_tokens - 1  # the prefix cache is shared
    assert r.usage.model_extra["mlxspec"]["speculative"].startswith("eagle3")
    # input as a message list (a developer message is a system message, as in chat), streamed
    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}]
    evs = list(c.responses.create(model=m, input=items, max_output_tokens=N_REF, temperature=0, stream=True))
    types = [e.type for e in evs]
    n = types.count("response.output_text.delta")
    assert n >= 2 and types == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.content_part.added"] + ["response.output_text.delta"] * n + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == want
    assert evs[-4].text == want and evs[-1].response.output_text == want
    assert evs[-1].response.usage.output_tokens == N_REF and evs[-1].response.usage.input_tokens == u.prompt_tokens
    # a response that ends by itself is "completed"; the client's stream helper assembles it
    yes, _ = _chat_ref(server, [{"role": "user", "content": YES_NO}], max_tokens=8)
    with c.responses.stream(model=m, input=YES_NO, max_output_tokens=8, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == yes == final.output_text and final.status == "completed"
    assert final.incomplete_details is None and final.usage.output_tokens >= 1


def test_responses_errors(server):
    c, m, port = _client(server), server["model"], server["port"]
    ok = {"model": m, "input": "hi", "max_output_tokens": 2}
    cases = [
        ({"model": m}, "missing_required_parameter"),
        ({**ok, "input": 5}, "invalid_type"),
        ({**ok, "input": []}, "invalid_value"),
        ({**ok, "input": [{"role": "wizard", "content": "x"}]}, "invalid_value"),
        ({**ok, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "invalid_value"),
        ({**ok, "input": [{"type": "web_search_call"}]}, "invalid_value"),
        ({**ok, "instructions": 3}, "invalid_type"),
        ({**ok, "max_output_tokens": 0}, "invalid_value"),
        ({**ok, "max_output_tokens": 5000}, "invalid_value"),
        ({**ok, "temperature": "hot"}, "invalid_type"),
        ({**ok, "previous_response_id": "resp_123"}, "unsupported_parameter"),
        ({**ok, "tools": [{"type": "web_search"}]}, "unsupported_parameter"),
        ({**ok, "text": {"format": {"type": "json_object"}}}, "unsupported_parameter"),
        ({**ok, "model": "gpt-9"}, "model_not_found"),
    ]
    for body, code in cases:
        st, _, text = _raw(port, "POST", "/v1/responses", body)
        _assert_error(st, text, 404 if code == "model_not_found" else 400, code)
    with pytest.raises(openai.BadRequestError) as ei:
        c.responses.create(model=m, input=[])
    assert ei.value.body["param"] == "input"


def test_messages_and_responses_queue_full_and_cancel(server):
    a, c, m = _anthropic(server), _client(server), server["model"]
    long = [{"role": "user", "content": "Write a long story about a dragon."}]
    streams = [_chat(c, m, long[0]["content"], max_tokens=800, stream=True) for _ in range(4)]
    try:
        with pytest.raises(anthropic.RateLimitError) as ei:
            a.messages.create(model=m, messages=long, max_tokens=4)
        assert ei.value.body["error"]["type"] == "rate_limit_error"
        assert ei.value.response.headers.get("retry-after") == "1"
        with pytest.raises(openai.RateLimitError) as ei:
            c.responses.create(model=m, input="hi", max_output_tokens=4)
        assert ei.value.body["code"] == "queue_full"
    finally:
        for s in streams:
            s.close()
    t0 = time.time()
    while True:  # the cancelled jobs drain
        try:
            _chat(c, m, "Name a fruit.", max_tokens=1)
            break
        except openai.RateLimitError:
            assert time.time() - t0 < 20
            time.sleep(0.5)
    # a client that leaves mid-stream cancels its generation, on both APIs
    _, _, before = _raw(server["port"], "GET", "/metrics")
    n0 = int(re.search(r"^mlxspec_cancelled_total (\d+)", before, re.M).group(1))
    with a.messages.stream(model=m, messages=long, max_tokens=800) as s:
        it = iter(s.text_stream)
        next(it)
    s2 = c.responses.create(model=m, input=long[0]["content"], max_output_tokens=800, stream=True)
    for e in s2:
        if e.type == "response.output_text.delta":
            break
    s2.close()
    t0 = time.time()
    r = a.messages.create(model=m, messages=[{"role": "user", "content": YES_NO}], max_tokens=2)
    assert r.usage.output_tokens >= 1 and time.time() - t0 < 30
    _, _, after = _raw(server["port"], "GET", "/metrics")
    assert int(re.search(r"^mlxspec_cancelled_total (\d+)", after, re.M).group(1)) >= n0 + 2
    assert re.search(r'^mlxspec_requests_total\{route="messages",status="200"\} [1-9]', after, re.M)


def test_sigterm_mid_stream_exits_0(server):
    """Last: shuts the module's server down."""
    c = _client(server)
    stream = _chat(c, server["model"], "Write a long story about a dragon.", max_tokens=800, stream=True)
    it = iter(stream)
    next(it)
    server["proc"].send_signal(signal.SIGTERM)
    rc = server["proc"].wait(30)
    assert rc == 0, server["log"].read_text()[-3000:]
    with pytest.raises(Exception):  # the stream ends early (cancelled): it never completes normally
        for ch in it:
            assert not (ch.choices and ch.choices[0].finish_reason == "length")


# ----------------------------------------------------------------------------- a hub id, a sliding-window target

def test_hub_id_is_served_under_its_repo_id(tmp_path):
    """`mlxspec serve --model org/name` (a cached hub snapshot, offline; a gemma3 model whose
    4-token window the prompt overflows) lists and answers as "org/name", as mlx_lm.server
    does, not as the snapshot's commit hash; greedy text equals `mlxspec generate`'s."""
    import os

    from tiny_targets import write_hub_repo

    hf = tmp_path / "hf"
    write_hub_repo(hf, "tiny-org/gemma3-tiny", "gemma3", seed=0)
    env = dict(os.environ, HF_HOME=str(hf), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    prompt = "t1 t5 t9 t2 t7 t3 t8"
    ref = subprocess.run([sys.executable, "-m", "mlxspec.cli", "generate", "--model", "tiny-org/gemma3-tiny",
                          "--prompt", prompt, "--max-tokens", "12", "--ignore-chat-template", "--verbose", "False"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert ref.returncode == 0, ref.stderr
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxspec.cli", "serve", "--model", "tiny-org/gemma3-tiny",
                             "--port", str(port), "--api-key", KEY], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_healthy(proc, port, 120, proc.stderr.read)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny-org/gemma3-tiny"]
        r = c.completions.create(model="tiny-org/gemma3-tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert r.model == "tiny-org/gemma3-tiny"
        assert r.choices[0].text == ref.stdout[:-1]
    finally:
        proc.terminate()
        proc.wait(30)
    # sliding-window layers: no batch, one request at a time, said in one line
    err = proc.stderr.read()
    assert ("mlxspec serve: --max-batch 8: model_type 'gemma3_text' has RotatingKVCache layers: batched speculation "
            "needs plain KV caches, so its sequences run one at a time\n") in err, err


def test_max_batch_1_serves_one_at_a_time(reference, smollm2_path):
    """--max-batch 1: the server before batching (one generation at a time, FIFO); same text."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxspec.cli", "serve", "--port", str(port), "--api-key", KEY,
                             "--max-batch", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        srv = {"port": port, "model": _wait_healthy(proc, port, 180, proc.stderr.read)["model"]}
        c = _client(srv)
        got = [None, None]

        def run(i):
            got[i] = _chat(c, srv["model"], max_tokens=N_REF, temperature=0).choices[0].message.content

        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert got == [reference["greedy"]] * 2
        metrics = _raw(port, "GET", "/metrics")[2]
        assert re.search(r"^mlxspec_max_batch 1$", metrics, re.M) and re.search(r"^mlxspec_batch_steps_total 0$",
                                                                               metrics, re.M)
    finally:
        proc.terminate()
        proc.wait(30)
    bad = subprocess.run([sys.executable, "-m", "mlxspec.cli", "serve", "--max-batch", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == \
        "mlxspec: error: --max-batch 0 is out of range: use 1 or more", bad.stderr


# ----------------------------------------------------------------------------- prompt cache (in process)

def _filled(kind, n, seed, wrap=list):
    import mlx.core as mx
    from mlx_lm.models import cache as C

    c = {"kv": C.KVCache, "quantized": lambda: C.QuantizedKVCache(group_size=32, bits=8),
         "rotating": lambda: C.RotatingKVCache(max_size=64)}[kind]()
    mx.random.seed(seed)
    k = mx.random.normal((1, 2, n, 32))
    c.update_and_fetch(k, k + 1)
    out = wrap([c])
    if hasattr(out, "length"):
        out.length = n
    return out


def _state(cache):
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    return [np.array(a[:, :, :40]) for _, a in tree_flatten(cache[0].state) if isinstance(a, mx.array)]


@pytest.mark.parametrize("wrap", ["list", "TargetCache"])
@pytest.mark.parametrize("kind", ["kv", "quantized", "rotating"])
def test_prompt_cache_prefix_copy_and_lru(kind, wrap):
    import mlx.core as mx
    import numpy as np

    from mlxspec.server.prompt_cache import PromptCache

    if wrap == "TargetCache":  # what Target.make_cache() returns (caches + rollback log)
        wrap = pytest.importorskip("mlxspec.targets.rollback").TargetCache
    else:
        wrap = list
    pc = PromptCache(max_bytes=1 << 30)
    toks = list(range(100, 140))
    cache = _filled(kind, 40, 0, wrap)
    before = _state(cache)
    taps = mx.arange(40, dtype=mx.float32).reshape(1, 40, 1)
    assert pc.store(toks, cache, taps)
    # a prompt sharing 30 tokens then diverging: the trimmed copy (trimmable kinds) or nothing
    hit = pc.fetch(toks[:30] + [1, 2, 3], need_taps=True)
    if kind == "rotating" and not cache[0].is_trimmable():
        assert hit is None
    else:
        assert hit is not None and hit.n == 30 and hit.cache[0].offset == 30
        assert hit.taps.shape[1] == 30 and float(hit.taps[0, -1, 0]) == 29.0
        hit.cache[0].update_and_fetch(mx.zeros((1, 2, 5, 32)), mx.zeros((1, 2, 5, 32)))  # the request writes on
    # the whole entry plus more: every kind reuses it all, and the entry was never mutated
    hit = pc.fetch(toks + [7, 8], need_taps=True)
    assert hit is not None and hit.n == 40
    hit.cache[0].update_and_fetch(mx.zeros((1, 2, 2, 32)), mx.zeros((1, 2, 2, 32)))
    for a, b in zip(before, _state(pc.entries[next(iter(pc.entries))].cache)):
        np.testing.assert_array_equal(a, b)
    # at least one token of the prompt is always left to prefill
    assert pc.fetch(toks, need_taps=True).n == 39 or kind == "rotating"
    # an entry without taps does not serve a drafter that needs them
    pc2 = PromptCache(1 << 30)
    pc2.store(toks, _filled(kind, 40, 0, wrap), None)
    assert pc2.fetch(toks + [1], need_taps=True) is None and pc2.fetch(toks + [1], need_taps=False).n == 40


def test_prompt_cache_byte_bound_is_lru():
    from mlxspec.server.prompt_cache import PromptCache, cache_nbytes, compact

    c0 = _filled("kv", 40, 0)
    compact(c0)
    one = cache_nbytes(c0)
    pc = PromptCache(max_bytes=int(2.5 * one))
    for i in range(3):
        assert pc.store([i] * 40, _filled("kv", 40, i), None)
    assert len(pc) == 2 and pc.nbytes <= pc.max_bytes
    assert pc.fetch([0] * 41, need_taps=False) is None  # the oldest went first
    assert pc.fetch([1] * 41, need_taps=False).n == 40
    pc.store([3] * 40, _filled("kv", 40, 3), None)  # 1 was used last, so 2 goes
    assert pc.fetch([2] * 41, need_taps=False) is None and pc.fetch([1] * 41, need_taps=False) is not None
    assert not PromptCache(max_bytes=one // 2).store([0] * 40, _filled("kv", 40, 0), None)  # too big to keep


def test_tool_call_parsing():
    from mlxspec.server.app import ToolStream, parse_tool_calls

    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"})]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    # streamed in small pieces: text before the call passes, the call itself is held back
    ts, out = ToolStream(), ""
    for i in range(0, len(text), 3):
        out += ts.feed(text[i:i + 3])
    assert out == "Let me look.\n"
    rest, calls = ts.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_weather"
    ts = ToolStream()
    assert ts.feed("a <tool") == "a " and ts.feed("s are fun") == "<tools are fun" and ts.finish() == ("", [])


def test_messages_and_responses_tool_use_mapping():
    """In process: tool_use / tool_result blocks and function_call items become the chat
    messages a tool template renders, and a generated <tool_call> comes back as an Anthropic
    tool_use block / a Responses function_call item, streamed as those APIs stream them."""
    import asyncio
    from types import SimpleNamespace

    from mlxspec.server import compat

    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "Sunny"}]},
                                         {"type": "text", "text": "Thanks"}]}]
    assert compat.anthropic_to_chat({"system": [{"type": "text", "text": "S"}], "messages": conv}) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny", "name": "get_weather"},
        {"role": "user", "content": "Thanks"}]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert compat.anthropic_tools({"tools": [{"name": "get_weather", "description": "d", "input_schema": schema}],
                                   "tool_choice": {"type": "any"}}) == (
        [{"type": "function", "function": {"name": "get_weather", "parameters": schema, "description": "d"}}], True)
    assert compat.anthropic_tools({"tools": [{"name": "x"}], "tool_choice": {"type": "none"}}) == (None, False)
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "toolu_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"}]
    assert compat.responses_to_chat({"instructions": "S", "input": items}) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny", "name": "get_weather"}]

    gen = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "prompt_tokens_details": {"cached_tokens": 2}, "mlxspec": {"tau": 1.0}}

    async def run(make):
        job = SimpleNamespace(events=asyncio.Queue(), stop_sequence=None, cancel=lambda: None)
        for i in range(0, len(gen), 7):
            job.events.put_nowait(("text", gen[i:i + 7]))
        job.events.put_nowait(("done", "stop", usage))
        return "".join([x async for x in make(job, SimpleNamespace(cancel=lambda: None))])

    evs = _sse_events(asyncio.run(run(lambda j, w: compat._anthropic_sse(SimpleNamespace(model_id="m"), j, w,
                                                                         "msg_1", 5, True))))
    names = [e for e, _ in evs]
    n = names.count("content_block_delta") - 1
    assert names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * n + [
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert "".join(d["delta"]["text"] for e, d in evs if e == "content_block_delta" and d["index"] == 0) == "Let me look.\n"
    tool = [d for e, d in evs if d.get("index") == 1]
    assert tool[0]["content_block"]["type"] == "tool_use" and tool[0]["content_block"]["name"] == "get_weather"
    assert json.loads("".join(d["delta"]["partial_json"] for d in tool if d["type"] == "content_block_delta")) == {
        "city": "Paris"}
    md = evs[-2][1]
    assert md["delta"]["stop_reason"] == "tool_use"
    assert (md["usage"]["input_tokens"], md["usage"]["cache_read_input_tokens"]) == (3, 2)

    def response(status, output, usage=None, finish=None, error=None):
        return {"status": status, "output": output, "usage": usage}

    evs = _sse_events(asyncio.run(run(lambda j, w: compat._responses_sse(j, w, response, True))))
    final = evs[-1][1]["response"]
    assert evs[-1][0] == "response.completed" and [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me look.\n"
    fc = final["output"][1]
    assert fc["name"] == "get_weather" and json.loads(fc["arguments"]) == {"city": "Paris"}
    assert "response.function_call_arguments.done" in [e for e, _ in evs]
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["input_tokens_details"]["cached_tokens"] == 2
    # non-streaming: the same blocks
    from mlxspec.server.app import parse_tool_calls

    content, calls = parse_tool_calls(gen)
    blocks = compat.anthropic_blocks(content, calls)
    assert [b["type"] for b in blocks] == ["text", "tool_use"] and blocks[1]["input"] == {"city": "Paris"}
    assert compat.anthropic_stop("stop", None, calls) == ("tool_use", None)
