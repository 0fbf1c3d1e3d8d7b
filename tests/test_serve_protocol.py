"""The server's wire format without a server: request bodies checked strictly (the 400's
message and ``param``), their mapping onto Sampling's fields, ``max_tokens`` against what the
cache holds, the finish reasons and the usage object."""

from __future__ import annotations

import json

import pytest

from cellcache.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ServeLimits,
    finish_reason,
    from_validation_error,
    max_new_tokens,
    sampling_fields,
    usage,
)


def parse(model, body):
    """``body`` through ``model`` as the server parses it; APIError for a refusal."""
    from pydantic import ValidationError

    try:
        return model.model_validate_json(json.dumps(body) if not isinstance(body, (str, bytes)) else body)
    except ValidationError as e:
        raise from_validation_error(e) from None


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("patch,param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 1.0}, "n"),
    ({"n": 0}, "n"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "0"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
    ({"stop_token_ids": [7] * 1025}, "stop_token_ids"),
])
def test_a_bad_chat_field_is_a_400_naming_it(patch, param):
    with pytest.raises(APIError) as e:
        parse(ChatRequest, {**CHAT, **patch})
    assert e.value.status == 400
    assert e.value.param is not None and e.value.param.startswith(param), (e.value.param, e.value.message)
    body = e.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


def test_invalid_json_and_nan_are_400():
    with pytest.raises(APIError) as e:
        parse(ChatRequest, b"{not json")
    assert e.value.status == 400 and e.value.code == "invalid_json"
    with pytest.raises(APIError) as e:
        parse(ChatRequest, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}')
    assert e.value.status == 400 and e.value.param == "temperature"


def test_unknown_fields_are_ignored_and_known_unsupported_ones_refused():
    req = parse(ChatRequest, {**CHAT, "parallel_tool_calls": False, "metadata": {"a": 1}})
    assert req.messages[0].as_dict() == {"role": "user", "content": "hi"}
    for patch, param in [({"tools": [{"type": "function"}]}, "tools"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"top_logprobs": 2}, "top_logprobs"),
                         ({"stream_options": {"include_usage": True}}, "stream_options")]:
        with pytest.raises(APIError) as e:
            sampling_fields(parse(ChatRequest, {**CHAT, **patch}))
        assert e.value.status == 400 and e.value.param == param
    for patch, param in [({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of")]:
        with pytest.raises(APIError) as e:
            sampling_fields(parse(CompletionRequest, {"prompt": "x", **patch}))
        assert e.value.param == param


def test_text_parts_are_joined_by_newlines_and_roles_mapped():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b c"}, {"type": "text", "text": ""}]
    req = parse(ChatRequest, {**CHAT, "messages": [{"role": "developer", "content": parts},
                                                  {"role": "user", "content": None},
                                                  {"role": "assistant", "content": [parts[0]]}]})
    assert [m.as_dict() for m in req.messages] == [{"role": "system", "content": "a\nb c\n"},
                                                   {"role": "user", "content": ""},
                                                   {"role": "assistant", "content": "a"}]


def test_null_in_stream_options_is_its_default_too():
    req = parse(ChatRequest, {**CHAT, "stream": True, "stream_options": {"include_usage": None}})
    assert req.stream_options is not None and req.stream_options.include_usage is False
    assert parse(CompletionRequest, {"prompt": "x", "stream": True,
                                     "stream_options": {"include_usage": True}}).stream_options.include_usage
    with pytest.raises(APIError) as e:
        parse(ChatRequest, {**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}})
    assert e.value.param == "stream_options.include_usage"


def test_chat_fields_map_onto_sampling():
    req = parse(ChatRequest, {**CHAT, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 7,
                              "stop": "END", "presence_penalty": 0.5, "frequency_penalty": -0.5,
                              "logit_bias": {"17": -100, "3": 5.5}, "logprobs": True, "top_logprobs": 4,
                              "top_k": 40, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
                              "min_tokens": 3, "stop_token_ids": [9]})
    f = sampling_fields(req)
    assert f == {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "n": 2, "seed": 7, "stop_strings": ("END",),
                 "ignore_eos": True, "min_new_tokens": 3, "min_p": 0.1, "presence_penalty": 0.5,
                 "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {17: -100.0, 3: 5.5},
                 "logprobs": 4, "prompt_logprobs": None, "stop": (9,)}
    assert sampling_fields(parse(ChatRequest, {**CHAT, "logprobs": True}))["logprobs"] == 0
    assert sampling_fields(parse(ChatRequest, CHAT))["logprobs"] is None
    assert sampling_fields(parse(ChatRequest, {**CHAT, "top_k": -1}))["top_k"] == 0


def test_completion_prompts_logprobs_and_echo():
    assert parse(CompletionRequest, {"prompt": "a"}).prompts() == ["a"]
    assert parse(CompletionRequest, {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse(CompletionRequest, {"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert parse(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, {"prompt": []}).prompts()
    assert e.value.param == "prompt"
    with pytest.raises(APIError):
        parse(CompletionRequest, {"prompt": [1, "a"]})
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, {"prompt": "a", "logprobs": 6})
    assert e.value.param == "logprobs"
    f = sampling_fields(parse(CompletionRequest, {"prompt": "a", "logprobs": 2, "echo": True}))
    assert f["logprobs"] == 2 and f["prompt_logprobs"] == 2
    f = sampling_fields(parse(CompletionRequest, {"prompt": "a", "logprobs": 0}))
    assert f["logprobs"] == 0 and f["prompt_logprobs"] is None


def test_max_tokens_zero_scores_a_completions_prompt_only_with_echo():
    """``max_tokens: 0`` with ``echo`` (vLLM's and OpenAI's legacy completions: the prompt
    scored, nothing drawn) maps onto max_new_tokens 0 with the prompt's log-probabilities;
    without echo it stays a 400 naming max_tokens (there would be nothing to return), as
    does a negative count and chat's 0 (``max_tokens`` or ``max_completion_tokens``)."""
    limits = ServeLimits(capacity=100, max_positions=80, default_max_tokens=16)
    req = parse(CompletionRequest, {"prompt": [1, 2, 3], "max_tokens": 0, "echo": True, "logprobs": 2})
    f = sampling_fields(req)
    assert f["prompt_logprobs"] == 2 and f["logprobs"] == 2 and max_new_tokens(req, 3, limits) == 0
    plain = parse(CompletionRequest, {"prompt": "a", "max_tokens": 0, "echo": True})
    assert sampling_fields(plain)["prompt_logprobs"] is None and max_new_tokens(plain, 79, limits) == 0
    with pytest.raises(APIError) as e:                              # (the prompt alone must fit)
        max_new_tokens(plain, 80, limits)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        max_new_tokens(parse(CompletionRequest, {"prompt": "a", "max_tokens": 0, "echo": True,
                                                 "min_tokens": 1}), 3, limits)
    assert e.value.param == "min_tokens"
    for body in ({"prompt": "a", "max_tokens": 0},
                 {"prompt": "a", "max_tokens": 0, "echo": False, "logprobs": 1}):
        with pytest.raises(APIError) as e:
            sampling_fields(parse(CompletionRequest, body))
        assert e.value.status == 400 and e.value.param == "max_tokens" and "echo" in e.value.message
    for model, body in ((CompletionRequest, {"prompt": "a", "max_tokens": -1, "echo": True}),
                        (ChatRequest, {**CHAT, "max_tokens": 0}),
                        (ChatRequest, {**CHAT, "max_completion_tokens": 0})):
        with pytest.raises(APIError) as e:
            parse(model, body)
        assert e.value.status == 400 and e.value.param in ("max_tokens", "max_completion_tokens")


@pytest.mark.parametrize("patch,message", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"stop": [""]}, "empty"),
    ({"logit_bias": {"x1": 1}}, "not a token id"),
    ({"logit_bias": {" 5": 1}}, "not a token id"),
    ({"logit_bias": {"1_0": 1}}, "not a token id"),
    ({"logit_bias": {"\u0665": 1}}, "not a token id"),            # an Arabic-Indic 5
    ({"logit_bias": {"-1": 1}}, "not a token id"),
    ({"logit_bias": {"9" * 20: 1}}, "not a token id"),
    ({"logit_bias": {"9" * 5000: 1}}, "not a token id"),          # int() refuses past 4300 digits
    ({"logit_bias": {"1": 101}}, "outside [-100, 100]"),
])
def test_what_the_wire_allows_and_the_library_cannot_take(patch, message):
    req = parse(CompletionRequest, {"prompt": "a", **patch})
    with pytest.raises(APIError) as e:
        sampling_fields(req)
    assert e.value.status == 400 and message in e.value.message


def test_max_tokens_against_the_cache_and_the_context():
    limits = ServeLimits(capacity=100, max_positions=80, default_max_tokens=16)
    req = parse(CompletionRequest, {"prompt": "a"})
    assert max_new_tokens(req, 10, limits) == 16                  # the cap
    assert max_new_tokens(req, 70, limits) == 10                  # what the context leaves
    assert max_new_tokens(parse(CompletionRequest, {"prompt": "a", "max_tokens": 70}), 10, limits) == 70
    with pytest.raises(APIError) as e:
        max_new_tokens(parse(CompletionRequest, {"prompt": "a", "max_tokens": 71}), 10, limits)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(APIError) as e:
        max_new_tokens(req, 80, limits)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    no_ctx = ServeLimits(capacity=100, default_max_tokens=1000)
    assert max_new_tokens(req, 10, no_ctx) == 91                  # prompt + max - 1 cells
    chat = parse(ChatRequest, {**CHAT, "max_tokens": 5, "max_completion_tokens": 7})
    assert max_new_tokens(chat, 10, no_ctx) == 7
    with pytest.raises(APIError) as e:
        max_new_tokens(parse(ChatRequest, {**CHAT, "max_completion_tokens": 92}), 10, no_ctx)
    assert e.value.param == "max_completion_tokens"
    # min_tokens: named as the request names it; without max_tokens the default cap makes room for it
    with pytest.raises(APIError) as e:
        max_new_tokens(parse(CompletionRequest, {"prompt": "a", "max_tokens": 4, "min_tokens": 5}), 10,
                       limits)
    assert e.value.param == "min_tokens" and "more than max_tokens=4" in e.value.message
    assert max_new_tokens(parse(CompletionRequest, {"prompt": "a", "min_tokens": 40}), 10, limits) == 40
    with pytest.raises(APIError) as e:
        max_new_tokens(parse(CompletionRequest, {"prompt": "a", "min_tokens": 71}), 10, limits)
    assert e.value.param == "min_tokens" and e.value.code == "context_length_exceeded"


def test_finish_reasons_and_usage():
    assert [finish_reason(r) for r in ("stop", "length", "capacity", "cancelled", None)] == \
        ["stop", "length", "length", "abort", None]
    assert usage(10, 5, 4) == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                               "prompt_tokens_details": {"cached_tokens": 4}}
