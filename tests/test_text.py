"""Text in the generator (issue 40 §1) on the CPU, with tokenizers built locally
(tests/helpers_text.py: byte-level BPE, SentencePiece-style with byte fallback): prompts as
text and chat messages, incremental detokenization (never half a character mid-stream, the
deltas concatenating to the text), stop strings matched across token boundaries and cut
exactly, waiting (``result``, blocking iterators driven by a stepping thread), loading from
a directory, and every refusal with nothing queued."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from cellcache import InvalidArgument  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402
from cellcache.generate.text import CONTEXT, Detokenizer, TextStream, decode, decoder, token_bytes  # noqa: E402

from .helpers import run_watched  # noqa: E402
from .helpers_text import KINDS, MULTIBYTE, make_tokenizer, save_model_and_tokenizer  # noqa: E402

WAIT = 60          # seconds: a fail-safe on joins and waits only, never a timing assertion


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


@pytest.fixture(scope="module", params=KINDS)
def tok(request):
    return make_tokenizer(request.param)


def make(model, tok, **kw):
    opts = dict(capacity=512, max_batch_tokens=32, max_seqs=8, prefill_chunk=16, eos=[], tokenizer=tok)
    opts.update(kw)
    return Generator(model, **opts)


def hf_decode(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def expected_text(tok, prompt, out):
    """The continuation's text decoded whole by the tokenizer's own ``decode``."""
    ctx = list(prompt[-CONTEXT:])
    return hf_decode(tok, ctx + list(out))[len(hf_decode(tok, ctx)):]


def clean(tok):
    """A logit_bias that keeps a random model's output valid text: no token that decodes
    alone to part of a character, no id past the tokenizer's vocabulary (a random model
    draws invalid UTF-8 otherwise, whose U+FFFD replacements differ between a text decoded
    in pieces and whole)."""
    return {i: -100.0 for i in range(512) if i >= len(tok) or "\ufffd" in tok.decode([i])}


def SP(tok, **kw):
    """Sampling with :func:`clean`'s bias."""
    return Sampling(logit_bias=clean(tok), **kw)


# -- the detokenizer and the stop-string matcher alone ------------------------------------------------
def test_the_fast_decoder_decodes_as_the_tokenizer(tok):
    ids = tok.encode("hello " + MULTIBYTE + " END", add_special_tokens=True)
    for i in range(len(ids)):
        for j in range(i, len(ids) + 1):
            assert decoder(tok)(ids[i:j]) == hf_decode(tok, ids[i:j]) == decode(tok, ids[i:j])

    class Slow:                                       # no backend: its own decode
        def decode(self, ids, **kw):
            return hf_decode(tok, ids)
    assert decoder(Slow())(ids) == hf_decode(tok, ids)


def test_multibyte_characters_split_over_tokens_never_stream_half(tok):
    prompt = tok.encode("hello there")
    out = tok.encode(" " + MULTIBYTE + " and more", add_special_tokens=False)
    pieces = [tok.decode([t]) for t in out]
    assert any("\ufffd" in p for p in pieces)          # the text really splits characters
    d = Detokenizer(tok, prompt)
    deltas = [d.push(t) for t in out]
    assert not any("\ufffd" in x for x in deltas)
    assert "".join(deltas) + d.flush() == expected_text(tok, prompt, out)
    assert MULTIBYTE in "".join(deltas)


def test_a_truncated_character_is_flushed_at_the_end(tok):
    out = tok.encode(" 中", add_special_tokens=False)
    d = Detokenizer(tok, tok.encode("a"))
    deltas = [d.push(t) for t in out[:-1]]
    assert "".join(deltas).strip() == ""              # nothing of the half character
    assert d.flush().endswith("\ufffd")               # the end: as it decodes


def test_special_tokens_cost_nothing_and_keep_the_context(tok):
    """Special tokens decode to nothing (skipped): a run of them (end-of-sequence drawn over
    and over under ``ignore_eos``) never grows the ids decoded at each token, and the text
    after them keeps its leading space."""
    prompt = tok.encode("hello")
    d = Detokenizer(tok, prompt)
    decoded = []
    real = d.decode
    d.decode = lambda ids: (decoded.append(len(ids)), real(ids))[1]
    first = tok.encode(" world", add_special_tokens=False)
    text = "".join(d.push(t) for t in first)
    for _ in range(300):
        text += d.push(tok.eos_token_id)
    text += "".join(d.push(t) for t in first) + d.flush()
    out = first + [tok.eos_token_id] * 300 + first
    assert text == expected_text(tok, prompt, out) and text.count("world") == 2
    assert max(decoded) <= CONTEXT + 2 * len(first)


@pytest.mark.parametrize("stop", ["END", "the END", "ND o", "\u4e2d", "t"])
def test_stop_strings_across_tokens_cut_exactly(tok, stop):
    prompt = tok.encode("x")
    out = tok.encode(" " + MULTIBYTE + " and the END of it", add_special_tokens=False)
    full = expected_text(tok, prompt, out)
    s = TextStream(tok, prompt, (stop, "never there"))
    deltas = [s.push(t) for t in out]
    final = s.close()
    assert s.stopped and "".join(deltas) + final == s.text == full[:full.index(stop)]
    for i in range(len(deltas)):                      # never a stop string, at any point
        assert stop not in "".join(deltas[:i + 1])


class PieceTokenizer:
    """A tokenizer whose id i decodes to ``pieces[i]`` (no special tokens, no context rules):
    the same text fed in pieces of any size."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("stops", [("quick", "ui"), ("ui", "quick"), ("brown", "row", "ro"),
                                   ("k brown", "quick b")])
def test_overlapping_stop_strings_cut_alike_however_the_text_is_tokenized(stops):
    """Stop strings overlapping in one token's text: the cut is where the text first holds
    a stop string (the one that ends first; of those, the longest), as when the same text
    comes a character at a time, not wherever the earliest-starting one begins."""
    text = "the quick brown fox"
    chunked = ["the", " quick", " brown", " fox"]
    cuts = []
    for pieces in (chunked, list(text), [text]):
        s = TextStream(PieceTokenizer(pieces), (), stops)
        released = "".join(s.push(i) for i in range(len(pieces))) + s.close()
        assert s.stopped and released == s.text
        cuts.append(s.text)
    end = min(text.find(x) + len(x) for x in stops)
    want = text[:min(text.find(x) for x in stops if text.find(x) + len(x) == end)]
    assert cuts == [want] * 3


def test_held_text_is_released_when_it_cannot_start_a_stop_string(tok):
    prompt = tok.encode("x")
    out = tok.encode(" the END", add_special_tokens=False)
    s = TextStream(tok, prompt, ("the ENDING",))
    text = "".join(s.push(t) for t in out)
    full = expected_text(tok, prompt, out)            # (SentencePiece: its own extra space)
    assert full.endswith(" the END")
    assert text == full[:-7] and s.held == "the END"  # "the END" may begin "the ENDING"
    assert s.close() == "the END" and s.text == full and not s.stopped


# -- the generator --------------------------------------------------------------------------------------
def test_text_prompts_messages_and_streamed_deltas(model, tok):
    gen = make(model, tok)
    ids = gen.encode("hello world")
    assert ids == tok.encode("hello world")
    msgs = [{"role": "user", "content": "what is the answer?"}]
    chat = gen.encode(msgs)
    assert chat == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
    calls = []

    def on_text(req, k, delta):
        calls.append(((req.id, k), delta, req.finish_reasons[k]))

    a = gen.add("hello world", SP(tok, max_new_tokens=12), on_text=on_text)
    b = gen.add(msgs, SP(tok, max_new_tokens=10, n=2, temperature=1.0, seed=5), on_text=on_text)
    c = gen.add(ids, SP(tok, max_new_tokens=12))                # no stream: decoded when read
    gen.run()
    assert a.prompt == ids and b.prompt == chat
    assert a.outputs == c.outputs and a.text == c.text
    for req in (a, b, c):
        for k in range(req.sampling.n):
            assert req.texts[k] == expected_text(tok, req.prompt, req.outputs[k])
    for req in (a, b):
        for k in range(req.sampling.n):
            mine = [(d, r) for key, d, r in calls if key == (req.id, k)]
            assert "".join(d for d, _ in mine) == req.texts[k]
            assert mine[-1][1] == "length"            # the last call: the reason is set


def test_each_continuation_streams_its_own_text_and_ends_with_one_flush(model, tok):
    gen = make(model, tok)
    got: dict[tuple[int, int], list] = {}

    def on_text(req, k, delta):
        got.setdefault((req.id, k), []).append((delta, req.finish_reasons[k]))

    reqs = [gen.add("hello", SP(tok, max_new_tokens=9, n=3, temperature=1.0, seed=2), on_text=on_text),
            gen.add("the quick", SP(tok, max_new_tokens=7), on_text=on_text)]
    gen.run()
    for req in reqs:
        for k in range(req.sampling.n):
            calls = got[(req.id, k)]
            assert "".join(d for d, _ in calls) == req.texts[k]
            assert [r for _, r in calls[:-1]] == [None] * (len(calls) - 1)
            assert calls[-1][1] == "length"
            assert all(d for d, _ in calls[:-1])      # only the flush may be empty
            # streamed as one decode of the whole output (U+FFFD only where its bytes are
            # invalid in the whole text too: random tokens may be)
            assert req.texts[k] == expected_text(tok, req.prompt, req.outputs[k])


def pick_stop(text):
    """A stop string from the middle of ``text`` (two characters, not at its start)."""
    i = len(text) // 2
    while i < len(text) - 2 and not text[i:i + 2].strip():
        i += 1
    return text[i:i + 2]


@pytest.mark.parametrize("async_steps", [False, True])
def test_stop_strings_end_the_continuation_and_cut_its_text(model, tok, async_steps):
    # async: plain sampling, so that the decode steps run ahead (the server knobs, here the
    # clean-text bias, take the synchronous path); the stop is then matched in delivery
    sp = (lambda **kw: Sampling(**kw)) if async_steps else (lambda **kw: SP(tok, **kw))
    ref = make(model, tok, async_steps=async_steps)
    base = ref.add("hello world", sp(max_new_tokens=24))
    ref.run()
    full = base.text
    stop = pick_stop(full)
    assert len(stop) == 2
    gen = make(model, tok, async_steps=async_steps)
    ahead = []
    real = gen.runner.forward

    def forward(step, tokens=None, logit_rows=None, decode=False, *, device_tokens=None, logits=True):
        ahead.append(device_tokens is not None)
        return real(step, tokens, logit_rows, decode, device_tokens=device_tokens, logits=logits)

    gen.runner.forward = forward
    calls = []
    req = gen.add("hello world", sp(max_new_tokens=24, stop_strings=[stop, "\x00never"]),
                  on_text=lambda r, k, d: calls.append((d, r.finish_reasons[k])))
    other = gen.add("the quick", sp(max_new_tokens=24))
    gen.run()
    assert any(ahead) == async_steps
    assert req.finish_reasons == ["stop"] and req.text == full[:full.index(stop)]
    assert "".join(d for d, _ in calls) == req.text and calls[-1][1] == "stop"
    assert req.outputs[0] == base.outputs[0][:len(req.outputs[0])]
    assert len(req.outputs[0]) < 24 and other.finish_reasons == ["length"]
    if not async_steps:                     # its tokens up to the one that completed the stop
        n = len(req.outputs[0])
        assert stop in expected_text(tok, req.prompt, base.outputs[0][:n])
        assert stop not in expected_text(tok, req.prompt, base.outputs[0][:n - 1])


def test_a_stop_string_in_one_continuation_leaves_the_others(model, tok):
    ref = make(model, tok)
    base = ref.add("hello", SP(tok, max_new_tokens=16, n=2, temperature=1.0, seed=9))
    ref.run()
    stop = pick_stop(base.texts[0])
    if stop in base.texts[1]:
        pytest.skip("both continuations hold the stop string")  # pragma: no cover - seed fixed
    gen = make(model, tok)
    req = gen.add("hello", SP(tok, max_new_tokens=16, n=2, temperature=1.0, seed=9, stop_strings=[stop]),
                  on_text=lambda *a: None)
    gen.run()
    assert req.finish_reasons == ["stop", "length"]
    assert req.texts == [base.texts[0][:base.texts[0].index(stop)], base.texts[1]]
    assert req.outputs[1] == base.outputs[1]


def test_result_and_iterators_with_a_stepping_thread(model, tok):
    gen = make(model, tok)
    req = gen.add("hello", Sampling(max_new_tokens=16))
    other = gen.add("the quick", Sampling(max_new_tokens=12, stop_strings=["zz"]), on_text=lambda *a: None)
    with pytest.raises(TimeoutError):
        req.result(timeout=0)
    deltas, tokens = [], []
    readers = [threading.Thread(target=lambda: deltas.extend(req.iter_text(timeout=WAIT))),
               threading.Thread(target=lambda: tokens.extend(other.iter_tokens(timeout=WAIT)))]
    for t in readers:
        t.start()
    stepper = threading.Thread(target=gen.run)
    stepper.start()
    assert req.result(timeout=WAIT) is req and other.result(WAIT) is other
    stepper.join(WAIT)
    for t in readers:
        t.join(WAIT)
        assert not t.is_alive()
    assert "".join(deltas) == req.text and all(deltas)
    assert tokens == other.outputs[0] and len(tokens) == 12
    with pytest.raises(InvalidArgument, match="timeout"):
        req.result(timeout=-1)
    # refused at the call, before any iteration; the request is as it was
    before = (list(req.outputs[0]), req.text, req.finish_reasons[:])
    with pytest.raises(InvalidArgument, match="continuation"):
        req.iter_tokens(1)
    with pytest.raises(InvalidArgument, match="continuation"):
        req.iter_text(-1)
    for bad in (-1, float("nan"), "1"):
        with pytest.raises(InvalidArgument, match="timeout"):
            req.iter_text(timeout=bad)
        with pytest.raises(InvalidArgument, match="timeout"):
            req.iter_tokens(timeout=bad)
    assert (req.outputs[0], req.text, req.finish_reasons) == before
    assert list(req.iter_tokens(timeout=0)) == req.outputs[0]


def test_token_bytes_are_a_token_s_own_bytes(tok):
    """Each token's own bytes (a byte-level token through its alphabet, a byte-fallback
    ``<0xXX>`` as that byte, ``▁`` as a space), so that a text's tokens joined give its UTF-8
    back even where a token holds part of a character; a tokenizer without those decoders
    gives each token's text decoded alone."""
    own = token_bytes(tok)
    for text in (MULTIBYTE, "café crème brûlée", "plain words"):
        ids = tok.encode(text, add_special_tokens=False)
        joined = b"".join(own(t) for t in ids)
        assert joined.lstrip(b" ") == text.encode("utf-8"), (text, ids)
    parts = [t for t in tok.encode(MULTIBYTE, add_special_tokens=False) if "\ufffd" in tok.decode([t])]
    assert parts and all(own(t) != "\ufffd".encode() for t in parts)      # parts of characters

    class Plain:                                        # no fast tokenizer's decoders
        def decode(self, ids):
            return "".join(chr(65 + i) for i in ids)

    assert token_bytes(Plain())(3) == b"D"


def test_a_stop_string_the_last_flush_completes_ends_with_stop():
    """A stop string ending in U+FFFD matches only when the continuation's last, unfinished
    character is flushed as U+FFFD: the text is cut before it and the continuation's reason
    is "stop" (it said "length" though its text was cut)."""
    from cellcache.generate.requests import Request

    tok = make_tokenizer("bytelevel")
    own = token_bytes(tok)
    lead = next(t for t in range(len(tok)) if own(t) == b"\xc3")          # a character's first byte
    ab = tok.encode("ab", add_special_tokens=False)
    for stops, reason, text in ((["b\ufffd"], "stop", "a"), (["zz"], "length", "ab\ufffd")):
        req = Request(0, [5], Sampling(max_new_tokens=8, stop_strings=stops), None, None, 0, outputs=[[]],
                      arrived=0.0, finish_reasons=[None], token_times=[[]], on_text=lambda *a: None,
                      tokenizer=tok)
        released = "".join(req.push_text(0, t)[0] for t in [*ab, lead])
        assert not req.text_stopped(0)
        req.finish_reasons[0] = "length"              # max_new_tokens ran out
        released += req.close_text(0)
        assert (released, req.texts[0], req.finish_reasons) == (text, text, [reason])


def test_a_timeout_past_the_platform_s_longest_wait_is_no_limit():
    """A wait longer than ``threading.TIMEOUT_MAX`` (~292 years) is taken as no limit: the
    locks refuse such a timeout with OverflowError, which a result() or iterator of a
    pending request raised for ``timeout=1e10``."""
    import threading

    from cellcache.generate.requests import _timeout

    with pytest.raises(OverflowError):
        threading.Event().wait(threading.TIMEOUT_MAX * 2)
    assert _timeout(threading.TIMEOUT_MAX * 2) is None and _timeout(1e10) is None and _timeout(2**80) is None
    assert _timeout(0) == 0 and _timeout(2.5) == 2.5 and _timeout(None) is None
    for bad in (-1, float("inf"), float("nan"), True, "1"):
        with pytest.raises(InvalidArgument, match="timeout"):
            _timeout(bad)


def test_cancel_flushes_the_text_and_wakes_the_waiters(model, tok):
    gen = make(model, tok)
    calls = []
    req = gen.add("hello", Sampling(max_new_tokens=30), on_text=lambda r, k, d: calls.append(
        (d, r.finish_reasons[k])))
    for _ in range(4):
        gen.step()
    assert gen.cancel(req)
    assert req.result(timeout=0) is req and req.finish_reasons == ["cancelled"]
    assert calls[-1][1] == "cancelled" and "".join(d for d, _ in calls) == req.text


def test_from_pretrained_loads_model_and_tokenizer(tmp_path, model):
    path = save_model_and_tokenizer(tmp_path / "m", "sentencepiece")
    gen = Generator.from_pretrained(path, dtype="float32", device="cpu", capacity=256, eos=[])
    assert gen.tokenizer is not None and gen.runner.vocab == 512
    req = gen.add("hello world", Sampling(max_new_tokens=5))
    gen.run()
    ref = make(model, make_tokenizer("sentencepiece"))
    same = ref.add("hello world", Sampling(max_new_tokens=5))
    ref.run()
    assert req.outputs == same.outputs and req.text == same.text
    with pytest.raises(InvalidArgument, match="could not load"):
        Generator.from_pretrained(tmp_path / "missing", device="cpu")
    with pytest.raises(InvalidArgument, match="dtype"):
        Generator.from_pretrained(path, dtype="float77", device="cpu")


def test_from_pretrained_without_tokenizer_files_serves_token_ids(tmp_path):
    """A checkpoint saved without its tokenizer: no tokenizer (transformers would hand back an
    empty one that decodes every token to nothing), text refused, token ids served."""
    path = tmp_path / "bare"
    random_model("tiny").save_pretrained(path)
    gen = Generator.from_pretrained(path, dtype="float32", device="cpu", capacity=256, eos=[])
    assert gen.tokenizer is None
    with pytest.raises(InvalidArgument, match="no tokenizer"):
        gen.add("hello")
    got: list[int] = []
    req = gen.add([5, 6, 7], Sampling(max_new_tokens=4), on_token=lambda r, k, t: got.append(t))
    gen.run()
    assert got == req.outputs[0] and len(got) == 4 and req.text == ""
    save_tokenizer = make_tokenizer("bytelevel")
    save_tokenizer.save_pretrained(path)             # its files beside: loaded
    assert Generator.from_pretrained(path, dtype="float32", device="cpu", capacity=256).tokenizer is not None


def test_refusals_queue_nothing(model, tok):
    bare = make(model, None)
    assert bare.tokenizer is None
    for prompt in ("hello", [{"role": "user", "content": "hi"}]):
        with pytest.raises(InvalidArgument, match="no tokenizer"):
            bare.add(prompt)
        with pytest.raises(InvalidArgument, match="no tokenizer"):
            bare.encode(prompt)
    with pytest.raises(InvalidArgument, match="no tokenizer"):
        bare.add([1, 2], Sampling(stop_strings=["a"]))
    with pytest.raises(InvalidArgument, match="no tokenizer"):
        bare.add([1, 2], on_text=lambda *a: None)
    req = bare.add([1, 2], Sampling(max_new_tokens=2))
    bare.run()
    assert req.texts == [""] and req.text == ""
    gen = make(model, tok)
    plain = make_tokenizer("bytelevel")
    plain.chat_template = None
    no_chat = make(model, plain)
    for g, prompt, match in ((gen, "", "empty"),
                             (no_chat, [{"role": "user", "content": "x"}], "chat template"),
                             (gen, [{"content": "x"}], "role"), (gen, [1, 2], "on_text")):
        before = (len(g.requests), len(g.waiting))
        with pytest.raises(InvalidArgument, match=match):
            if match == "on_text":
                g.add(prompt, on_text=3)
            else:
                g.add(prompt)
        assert (len(g.requests), len(g.waiting)) == before
    with pytest.raises(InvalidArgument, match="tokenizer"):
        make(model, object())


@pytest.mark.parametrize("field,value,match", [
    ("stop_strings", "abc", "sequence of strings"), ("stop_strings", [""], "non-empty"),
    ("stop_strings", [3], "non-empty str"), ("ignore_eos", 1, "bool"),
    ("min_new_tokens", -1, "min_new_tokens"), ("min_new_tokens", 40, "more than"),
    ("min_p", 1.5, "min_p"), ("min_p", float("nan"), "min_p"),
    ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", -3, "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("repetition_penalty", "x", "repetition_penalty"),
    ("repetition_penalty", 1e-300, "outside"), ("repetition_penalty", 2e6, "outside"),
    ("logit_bias", [1, 2], "mapping"), ("logit_bias", {"3": 1.0}, "key"),
    ("logit_bias", {-1: 1.0}, "logit_bias"), ("logit_bias", {3: 101.0}, "logit_bias"),
    ("logit_bias", {True: 1.0}, "logit_bias"), ("logprobs", 21, "logprobs"),
    ("logprobs", True, "logprobs"), ("prompt_logprobs", -1, "prompt_logprobs"),
])
def test_new_sampling_fields_are_checked(field, value, match):
    with pytest.raises(InvalidArgument, match=match):
        Sampling(max_new_tokens=32, **{field: value})
    sp = Sampling()
    setattr(sp, field, value)                         # changed after construction: add() checks


def test_add_checks_the_changed_fields_and_the_vocabulary(model, tok):
    gen = make(model, tok)
    sp = Sampling()
    sp.min_p = 2.0
    with pytest.raises(InvalidArgument, match="min_p"):
        gen.add([1, 2], sp)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        gen.add([1, 2], Sampling(logit_bias={512: 1.0}))
    assert not gen.requests and not gen.waiting


def test_stop_strings_end_nothing_before_min_new_tokens(tok):
    prompt = tok.encode("x")
    out = tok.encode(" END and END again", add_special_tokens=False)
    full = expected_text(tok, prompt, out)
    first = tok.encode(" END", add_special_tokens=False)
    s = TextStream(tok, prompt, ("END",), min_tokens=len(first) + 1)
    text = "".join(s.push(t) for t in out) + s.close()
    assert s.stopped and text == full[:full.index("END", full.index("END") + 1)]


def test_streaming_requests_added_from_a_client_thread_while_stepping(model, tok):
    gen = make(model, tok, max_seqs=16)
    got: dict[int, list[str]] = {}
    added: list = []
    go = threading.Event()

    def client():
        go.wait(WAIT)
        for i in range(12):
            added.append(gen.add("hello" if i % 2 else "the quick",
                                 SP(tok, max_new_tokens=4 + i % 5, stop_strings=["\x00"]),
                                 on_text=lambda r, k, d: got.setdefault(r.id, []).append(d)))

    first = gen.add("hello", SP(tok, max_new_tokens=40), on_text=lambda r, k, d: got.setdefault(
        r.id, []).append(d))
    t = threading.Thread(target=client)
    t.start()
    go.set()
    while t.is_alive() or gen.busy:
        gen.step()
    t.join(WAIT)
    for req in [first, *added]:
        assert req.result(timeout=0).finish_reasons == ["length"]
        assert "".join(got[req.id]) == req.text == expected_text(tok, req.prompt, req.outputs[0])


def test_a_streaming_request_copied_or_pickled_mid_run_keeps_its_text(model, tok):
    import copy
    import pickle

    gen = make(model, tok)
    req = gen.add("hello", SP(tok, max_new_tokens=12, stop_strings=["\x00"], logprobs=1),
                  on_text=None)
    for _ in range(5):
        gen.step()
    text = req.text
    for clone in (copy.deepcopy(req), pickle.loads(pickle.dumps(req))):
        assert clone.text == text and clone.outputs == req.outputs and clone.logprobs == req.logprobs
        assert not clone.streams_text and clone.finished is None
    gen.run()
    assert req.text.startswith(text)


def test_an_on_text_that_raises_ends_its_request_alone(model, tok):
    gen = make(model, tok)
    calls = []

    def bad(req, k, delta):
        calls.append(delta)
        if len(calls) == 3:
            raise ValueError("client gone")

    failing = gen.add("hello", SP(tok, max_new_tokens=20), on_text=bad)
    other = gen.add("hello", SP(tok, max_new_tokens=20), on_text=lambda *a: None)
    with pytest.raises(ValueError, match="client gone"):
        gen.run()
    gen.run()
    assert failing.finish_reasons == ["error"] and isinstance(failing.error, ValueError)
    assert len(calls) == 3 and failing.result(timeout=0) is failing
    assert other.finish_reasons == ["length"] and len(other.outputs[0]) == 20
    ref = make(model, tok)
    alone = ref.add("hello", SP(tok, max_new_tokens=20))
    ref.run()
    assert other.outputs == alone.outputs and other.text == alone.text


def test_text_options_are_checked_for_sharded_generators_and_paths(tok):
    from cellcache.generate.prompts import check_text_options, load_pretrained

    check_text_options(tok, Sampling(stop_strings=["a"]), None, 512, False)
    with pytest.raises(InvalidArgument, match="tensor parallelism"):
        check_text_options(tok, Sampling(stop_strings=["a"]), None, 512, True)
    with pytest.raises(InvalidArgument, match="path"):
        load_pretrained(3, None, "auto", "cpu")
    with pytest.raises(InvalidArgument, match="device"):
        load_pretrained("x", None, "auto", "nonsense-device")


def test_a_stop_string_in_a_verify_run_keeps_no_token_after_the_one_completing_it(model, tok):
    """A verify run applies several tokens at once: a stop string completed by one of them
    ends the continuation there, as without drafts (outputs, times and log-probabilities
    end with that token; no on_token for the tokens after it)."""
    ref = make(model, tok)
    base = ref.add("hello world", SP(tok, max_new_tokens=24))
    ref.run()
    outs = base.outputs[0]
    stop = pick_stop(base.text)
    stream = TextStream(tok, base.prompt, [stop])
    n = next(i + 1 for i, t in enumerate(outs) if (stream.push(t), stream.stopped)[1])
    P = len(base.prompt)

    def perfect(toks, k):                          # drafts the continuation itself: all accepted
        return outs[len(toks) - P:len(toks) - P + k]

    for draft in (None, perfect):
        gen = make(model, tok)
        seen, calls = [], []
        req = gen.add("hello world", SP(tok, max_new_tokens=24, stop_strings=[stop], logprobs=0),
                      on_token=lambda r, k, t, seen=seen: seen.append(t),
                      on_text=lambda r, k, d, calls=calls: calls.append(d),
                      draft=draft, draft_k=4)
        gen.run()
        assert (gen.stats["accepted"] > 0) == (draft is not None)
        assert req.finish_reasons == ["stop"] and req.text == base.text[:base.text.index(stop)]
        assert req.outputs[0] == outs[:n] and seen == outs[:n], draft
        assert len(req.token_times[0]) == n and [e.token for e in req.logprobs[0]] == outs[:n]
        assert "".join(calls) == req.text


def test_a_stop_token_ends_the_text_before_it(model, tok):
    """A continuation ended by a stop id (or a non-special end-of-sequence id) keeps the token
    in its outputs but not in its text, streamed or read after, as a stop string is cut (and
    as vLLM has it): the text is the text of the tokens before it."""
    word = tok.encode(" hello", add_special_tokens=False)[-1]
    prompt = tok.encode("a b c")
    gen = make(model, tok, eos=[])
    streamed: list[str] = []
    sp = Sampling(max_new_tokens=6, stop=[word], min_new_tokens=2, logit_bias={word: 100.0})
    on = gen.add(prompt, sp, on_text=lambda r, k, d: streamed.append(d))
    read = gen.add(prompt, sp)
    eos_gen = make(model, tok, eos=[word])              # the same id as end-of-sequence
    as_eos = eos_gen.add(prompt, Sampling(max_new_tokens=6, min_new_tokens=2, logit_bias={word: 100.0}))
    seen: list[str] = []
    run_watched(gen, lambda: seen.append(read.texts[0]))     # read while it runs, as a client may
    eos_gen.run()
    for r in (on, read, as_eos):
        out = r.outputs[0]
        assert len(out) == 3 and out[-1] == word and word not in out[:2], out
        assert r.finish_reasons == ["stop"]
        assert r.text == expected_text(tok, prompt, out[:2]) != expected_text(tok, prompt, out), r.text
    assert "".join(streamed) == on.text
    assert seen and all(read.text.startswith(x) for x in seen)     # never past the final text
