"""Tokenizers built locally for the text tests (no download): a byte-level BPE (GPT-2
style: every byte a symbol, so a character of several UTF-8 bytes may be split over tokens)
and a SentencePiece-style BPE (Metaspace ``▁`` for spaces, byte fallback ``<0xXX>`` tokens
for characters outside its vocabulary, a ``<s>`` added in front as Llama's), both wrapped
as :class:`transformers.PreTrainedTokenizerFast` with a chat template, ids ``<unk>`` 0,
``<s>`` 1, ``</s>`` 2 (the tiny random Llama's bos/eos), every id below 512 (the tiny random
models' vocabulary).

:func:`save_model_and_tokenizer` writes a tiny random model and one of them into a directory
that ``Generator.from_pretrained`` (and ``AutoModelForCausalLM`` / ``AutoTokenizer``) load
from.

>>> tok = make_tokenizer("bytelevel")                                     # doctest: +SKIP
>>> save_model_and_tokenizer(tmp_path, "sentencepiece")                   # doctest: +SKIP
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "CORPUS", "KINDS", "MULTIBYTE", "make_tokenizer",
           "save_model_and_tokenizer"]

#: The two kinds :func:`make_tokenizer` builds.
KINDS = ("bytelevel", "sentencepiece")

#: A chat template: ``<|role|>content`` lines, then ``<|assistant|>`` when a generation
#: prompt is asked for.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

#: Text the tokenizers are trained on (ASCII and a few accented letters; no CJK, no emoji,
#: so those go through bytes).
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there, general kenobi",
    "a stop string may span several tokens: STOP here, or END there",
    "café crème brûlée à la carte, déjà vu",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "<|user|> what is the answer? <|assistant|> the answer is 42.",
] * 20

#: Text with characters of 2, 3 and 4 UTF-8 bytes the tokenizers split over several tokens.
MULTIBYTE = "naïve 中文 🙂 ok"

SPECIALS = ["<unk>", "<s>", "</s>"]


def _bytelevel() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _sentencepiece() -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    # train the merges on the corpus, then rebuild the model with the 256 byte tokens
    # <0x00>..<0xFF> in its vocabulary (byte fallback needs them as ordinary tokens)
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=220, special_tokens=SPECIALS, show_progress=False)
    base.train_from_iterator(CORPUS, trainer)
    model = json.loads(base.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(SPECIALS)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


@cache
def _built(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind {kind!r}; give one of {KINDS}")
    tok = _bytelevel() if kind == "bytelevel" else _sentencepiece()
    assert tok.get_vocab_size() <= 512
    return tok.to_str()


def make_tokenizer(kind: str = "bytelevel") -> Any:
    """A fresh :class:`transformers.PreTrainedTokenizerFast` of ``kind`` (:data:`KINDS`) with
    :data:`CHAT_TEMPLATE`, bos ``<s>`` (1), eos ``</s>`` (2), unk ``<unk>`` (0)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_built(kind)),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_model_and_tokenizer(path: str | Path, kind: str = "bytelevel", *,
                             model: Any = None, seed: int = 3) -> Path:
    """Writes a model (``model``, default the tiny random Llama ``random_model("llama-tiny",
    seed=seed)``, float32) and a tokenizer of ``kind`` into directory ``path`` (made if
    needed), as ``save_pretrained`` does; the model's generation config gets the
    tokenizer's bos/eos (1, 2). Returns the path."""
    from cellcache.generate import random_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = random_model("llama-tiny", seed=seed)
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    make_tokenizer(kind).save_pretrained(path)
    return path
