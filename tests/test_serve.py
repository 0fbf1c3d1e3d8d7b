"""``cellcache serve`` driven by real clients: one server subprocess (a tiny random Llama and a
locally trained tokenizer with a chat template, float32 on the CPU, the prefix cache on) for
the module, the real ``openai`` client, ``curl`` and httpx. Greedy outputs equal the
in-process Generator's and Hugging Face ``generate``'s token for token; streams concatenate
to the whole text; ``n``, seeds, stop strings, log-probabilities, usage with cached prompt
tokens; every refusal is an OpenAI error body and queues nothing."""

from __future__ import annotations

import json
import shutil
import subprocess

import openai
import pytest
import torch

from tests.helpers_serve import ServerProcess, wait_until
from tests.helpers_text import save_model_and_tokenizer

CURL = shutil.which("curl") or "curl"           # (present here and in CI)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_and_tokenizer(tmp_path_factory.mktemp("serve") / "tiny-chat", "bytelevel")


@pytest.fixture(scope="module", params=["engine-process", "no-engine-process"])
def server(model_dir, request):
    """The server both ways: its generator in an engine process (the default), and on the
    engine thread beside the HTTP loop."""
    srv = ServerProcess(model_dir, "--device", "cpu", "--dtype", "float32", "--capacity", "4096",
                        "--log-level", "warning", "--served-model-name", "tiny", f"--{request.param}")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(model_dir):
    """The same checkpoint in this process: the Generator, and HF's model."""
    from transformers import AutoModelForCausalLM

    from cellcache.generate import Generator

    gen = Generator.from_pretrained(str(model_dir), dtype="float32", device="cpu", capacity=4096)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return gen, hf


def run_local(gen, prompt, **sampling):
    from cellcache.generate import Sampling

    req = gen.add(prompt, Sampling(**sampling))
    gen.run()
    return req


def hf_greedy(hf, ids, max_new_tokens):
    """HF ``generate``'s greedy tokens after ``ids``, up to and with its first eos."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                      pad_token_id=2)[0, len(ids):].tolist()
    return out[:out.index(2) + 1] if 2 in out else out


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert server.get("/health")[0] == 200
    status, body, _ = server.get("/v1/models/other")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_completion_greedy_equals_the_library_and_hf(client, local):
    gen, hf = local
    prompt = "the quick brown fox"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    mine = run_local(gen, prompt, max_new_tokens=12)
    ids = gen.encode(prompt)
    assert choice.token_ids == mine.outputs[0] == hf_greedy(hf, ids, 12)
    assert choice.text == mine.texts[0]
    assert choice.finish_reason == {"stop": "stop", "length": "length"}[mine.finish_reasons[0]]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(mine.outputs[0])
    assert r.prompt_token_ids == ids


def test_chat_greedy_equals_the_library_and_reuses_the_prefix(client, local):
    gen, hf = local
    messages = [{"role": "system", "content": "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000"},
                {"role": "user", "content": "hello world, general kenobi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True})
    mine = run_local(gen, messages, max_new_tokens=10)
    ids = gen.encode(messages)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == mine.texts[0]
    assert r.choices[0].token_ids == mine.outputs[0] == hf_greedy(hf, ids, 10)
    assert r.usage.prompt_tokens == len(ids)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0                 # the prefix cache


def test_a_stream_concatenates_to_the_whole_text(client):
    messages = [{"role": "user", "content": "café crème brûlée"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    plain = client.completions.create(model="tiny", prompt="hello there", max_tokens=12, temperature=0)
    streamed = list(client.completions.create(model="tiny", prompt="hello there", max_tokens=12,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert streamed[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_n_and_seeds(client):
    kw = dict(model="tiny", prompt="general kenobi", max_tokens=8, temperature=1.0, n=3, seed=11)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]        # seeded: repeatable
    with_ids = client.completions.create(**kw, extra_body={"return_token_ids": True})
    assert a.usage.completion_tokens == sum(len(c.token_ids) for c in with_ids.choices)
    batch = client.completions.create(model="tiny", prompt=["the lazy dog", "déjà vu"], max_tokens=6,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    one = client.completions.create(model="tiny", prompt="déjà vu", max_tokens=6, temperature=0)
    assert batch.choices[2].text == batch.choices[3].text == one.choices[0].text


def test_stop_strings_cut_the_text(client):
    base = client.completions.create(model="tiny", prompt="a stop string may span", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    i = next((i for i in range(2, len(text) - 2)
              if text[i:i + 2].strip() and text[i:i + 2] not in text[:i + 1]), None)
    assert i is not None, f"no stop string to pick in {text!r}"
    stop = text[i:i + 2]
    cut = client.completions.create(model="tiny", prompt="a stop string may span", max_tokens=24,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:i] and cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt="a stop string may span", max_tokens=24,
                                              temperature=0, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == text[:i]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, local):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the answer"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token   # (part of a character)
        # greedy: the sampled token is the most probable one
        assert abs(entry.logprob - max(t.logprob for t in entry.top_logprobs)) < 1e-4
    # tokens holding part of a character: their own bytes (not U+FFFD's), which joined give
    # the message back (the byte-level tokenizer decodes bytes with errors replaced)
    words = [{"role": "user", "content": "café crème brûlée"}]
    r = client.chat.completions.create(model="tiny", messages=words, max_tokens=12, temperature=1, seed=0,
                                       logprobs=True, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    partial = [e for e in content if "\ufffd" in e.token]
    assert partial and all(e.bytes != list("\ufffd".encode()) for e in partial)
    joined = bytes(b for e in content for b in e.bytes)
    assert joined.decode("utf-8", "replace") == r.choices[0].message.content
    c = client.completions.create(model="tiny", prompt="hello world", max_tokens=4, temperature=0, logprobs=2,
                                  echo=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    lp = c.choices[0].logprobs
    n_prompt = c.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 4
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert all(len(t) >= 2 for t in lp.top_logprobs[n_prompt:])
    assert c.choices[0].text.startswith("hello world")


def test_max_tokens_zero_with_echo_scores_the_prompt(client, local):
    """The openai client's loglikelihood request (``max_tokens=0, echo=True, logprobs=1``):
    the prompt back with the library's prompt log-probabilities (HF's forward's too), the
    first None, no token, finish "length", no completion tokens; streamed alike, the usage
    chunk included; without echo a 400."""
    gen, hf = local
    prompt = "the lazy dog sat on the mat"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    ids = gen.encode(prompt)
    assert choice.text == prompt and choice.finish_reason == "length" and choice.token_ids == []
    assert r.usage.prompt_tokens == len(ids) == r.usage.total_tokens and r.usage.completion_tokens == 0
    assert r.prompt_token_ids == ids
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    mine = run_local(gen, prompt, max_new_tokens=0, prompt_logprobs=1)
    assert mine.outputs == [[]] and mine.finish_reasons == ["length"]
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in mine.prompt_logprobs[1:]], abs=1e-5)
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    assert lp.token_logprobs[1:] == pytest.approx([float(lsm[i - 1, ids[i]]) for i in range(1, len(ids))],
                                                  abs=1e-4)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == prompt
    assert [p.finish_reason for p in parts if p.finish_reason] == ["length"]
    streamed = [v for p in parts if p.logprobs for v in p.logprobs.token_logprobs]
    # (read again into other cells, the first copy held by the prefix cache: sums over a
    # longer masked row, ulps)
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0, logprobs=1)
    assert e.value.param == "max_tokens"


def test_refusals_are_openai_errors_and_queue_nothing(server, client):
    before = server.metrics()
    bad = [
        (b"{not json", 400, None),
        ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),       # (echo only)
        ({"model": "tiny", "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"100000": 1}}, 400, None),
        ({"model": "tiny", "prompt": [1, 100000]}, 400, None),
        ({"model": "other", "prompt": "x"}, 404, "model"),
    ]
    for body, status, param in bad:
        got, answer, _ = server.post("/v1/completions", body)
        assert got == status, (body, answer)
        err = answer["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param, (body, err)
    got, answer, _ = server.post("/v1/nowhere", {})
    assert got == 404 and "error" in answer
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=0)
    assert e.value.param == "max_tokens"
    after = server.metrics()
    for key in ("cellcache_prompt_tokens_total", "cellcache_requests_live", "cellcache_kv_cells_free"):
        assert after[key] == before[key], key
    assert after['cellcache_http_errors_total{status="400"}'] >= before.get(
        'cellcache_http_errors_total{status="400"}', 0) + 9


def test_curl_streams_server_sent_events(server):
    body = json.dumps({"model": "tiny", "prompt": "the quick", "max_tokens": 5, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    out = subprocess.run([CURL, "-sN", "-H", "Content-Type: application/json", "-d", body,
                          server.url + "/v1/completions"], capture_output=True, text=True, timeout=60).stdout
    events = [line.removeprefix("data: ") for line in out.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    err = subprocess.run([CURL, "-s", "-w", "\n%{http_code}", "-H", "Content-Type: application/json",
                          "-d", "{", server.url + "/v1/chat/completions"], capture_output=True, text=True,
                         timeout=60).stdout
    text, code = err.rsplit("\n", 1)
    assert code == "400" and json.loads(text)["error"]["type"] == "invalid_request_error"


def test_metrics_after_requests(server):
    wait_until(lambda: server.metrics()["cellcache_requests_live"] == 0, what="every request done")
    m = server.metrics()
    assert m["cellcache_time_to_first_token_seconds_count"] > 0
    # the front end's TTFT of the streamed ones (handler to first chunk): at least the engine's
    n = m["cellcache_http_time_to_first_token_seconds_count"]
    assert 0 < n <= m["cellcache_time_to_first_token_seconds_count"]
    assert m["cellcache_http_time_to_first_token_seconds_sum"] / n > 0
    assert m["cellcache_inter_token_latency_seconds_count"] > 0
    assert m["cellcache_e2e_request_latency_seconds_count"] > 0
    assert m["cellcache_event_loop_lag_seconds_count"] > 0      # probed since start-up
    assert m["cellcache_generation_tokens_total"] > 0
    assert 0 < m["cellcache_prefix_hit_rate"] <= 1
    assert m["cellcache_kv_cells_capacity"] == 4096
    assert m["cellcache_requests_running"] == 0 and m["cellcache_requests_waiting"] == 0


def test_streams_of_batches_n_chat_and_echo(client):
    kw = dict(model="tiny", prompt=["the lazy dog", "hello there"], max_tokens=6, temperature=0, n=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    parts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert parts == {c.index: c.text for c in whole.choices}
    assert finishes == dict.fromkeys(range(4), "length")

    messages = [{"role": "user", "content": "the answer is"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0.8,
                                          seed=3, n=2)
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                                temperature=0.8, seed=3, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in chat.choices}

    echo = dict(model="tiny", prompt="hello world", max_tokens=4, temperature=0, echo=True, logprobs=1,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**echo)
    chunks = list(client.completions.create(**echo, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert plain.choices[0].text.startswith("hello world")
    n_tokens = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs)
    assert n_tokens == plain.usage.prompt_tokens + 4 == len(plain.choices[0].logprobs.tokens)


def test_sampling_knobs_reach_the_sampler(client):
    biased = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                       logit_bias={"300": 100},
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert biased.choices[0].token_ids == [300, 300, 300]
    banned = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                       logit_bias={"300": -100},
                                       extra_body={"return_token_ids": True, "ignore_eos": True,
                                                   "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.3})
    assert 300 not in banned.choices[0].token_ids and len(banned.choices[0].token_ids) == 3
    # presence/frequency penalties and min_tokens: accepted, the answer the right size
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, presence_penalty=1.5, frequency_penalty=-0.5,
                                       temperature=0.7, seed=1, extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
