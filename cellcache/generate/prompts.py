"""Text in: the tokenizer a :class:`~cellcache.generate.Generator` is given, prompts given as
text or chat messages turned into token ids, the text options of a request checked, and a
model and its tokenizer loaded from a local Hugging Face directory.

::

    "text"                      --tokenizer.encode-------------------------------> ids
    [{"role", "content"}, ...]  --tokenizer.apply_chat_template(add_generation_prompt)--> ids
    ids                         --token_ids (checked against the model's vocabulary)--> ids

Every refusal is an InvalidArgument; nothing here imports torch until a model is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgument
from .requests import Sampling, token_ids

__all__ = ["TOKENIZER_FILES", "check_text_options", "check_tokenizer", "encode_prompt", "has_tokenizer_files",
           "is_messages", "load_pretrained", "load_tokenizer"]


def check_tokenizer(tokenizer: Any) -> None:
    """None, or something with callable ``encode`` and ``decode`` (a Hugging Face
    tokenizer); InvalidArgument otherwise."""
    if tokenizer is None:
        return
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise InvalidArgument(f"tokenizer of type {type(tokenizer).__name__} has no encode/decode; "
                              "give a transformers tokenizer (AutoTokenizer.from_pretrained) or None")


def is_messages(prompt: Any) -> bool:
    """Whether ``prompt`` is a list (or tuple) of chat messages: mappings, at least one."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)


def _ids_of(out: Any) -> Any:
    """The ids a tokenizer call returned: a list, or a mapping's ``input_ids``."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    return out


def encode_prompt(tokenizer: Any, prompt: Any, vocab: int | None, limit: int | None = None) -> list[int]:
    """``prompt`` (token ids, a ``str``, or chat messages) as checked token ids in
    ``[0, vocab)`` (``Generator.encode`` states the contract); token ids from an iterator
    are read for at most ``limit`` (:func:`token_ids`)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidArgument("prompt is text and the Generator has no tokenizer; give token ids, "
                                  "or build it with tokenizer=... (or Generator.from_pretrained)")
        if not prompt:
            raise InvalidArgument("prompt is an empty str; give at least one character")
        try:
            ids = _ids_of(tokenizer.encode(prompt))
        except Exception as e:                        # the tokenizer's own failure
            raise InvalidArgument(f"the tokenizer could not encode the prompt: {e}") from e
        return token_ids(ids, "the encoded prompt", vocab)
    if is_messages(prompt):
        if tokenizer is None:
            raise InvalidArgument("prompt is chat messages and the Generator has no tokenizer")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("prompt is chat messages and the tokenizer has no chat template; "
                                  "give text or token ids, or set tokenizer.chat_template")
        for m in prompt:
            if not isinstance(m.get("role"), str) or "content" not in m:
                raise InvalidArgument(f"chat message {dict(m)!r} needs a str 'role' and a 'content'")
        try:
            ids = _ids_of(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True,
                                                        tokenize=True))
        except Exception as e:                        # a template that fails on these messages
            raise InvalidArgument(f"the chat template failed on the messages: {e}") from e
        return token_ids(ids, "the chat prompt", vocab)
    return token_ids(prompt, "prompt", vocab, limit=limit)


def check_text_options(tokenizer: Any, sampling: Sampling, on_text: Any, vocab: int,
                       sharded: bool) -> None:
    """What a request's text and sampling need of its generator: a tokenizer for
    ``on_text`` and ``stop_strings``, ``logit_bias`` and ``stop`` ids in the vocabulary, no stop strings
    under tensor parallelism (a text match on rank 0 would end a continuation there
    alone). InvalidArgument otherwise."""
    if tokenizer is None and (on_text is not None or sampling.stop_strings):
        what = "on_text" if on_text is not None else "stop_strings"
        raise InvalidArgument(f"{what} needs text and the Generator has no tokenizer; build it with "
                              "tokenizer=... (or Generator.from_pretrained)")
    if sharded and sampling.stop_strings:
        raise InvalidArgument("stop_strings under tensor parallelism are not supported; use stop "
                              "token ids")
    for what, ids in (("logit_bias", sampling.logit_bias), ("stop", sampling.stop)):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidArgument(f"{what} holds token id {bad[0]}, outside the model's vocabulary "
                                  f"[0, {vocab})")


#: The files one of which every tokenizer transformers loads from a directory has.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def has_tokenizer_files(path: Any) -> bool:
    """Whether ``path`` may hold a tokenizer: True unless it is a local directory without
    any of :data:`TOKENIZER_FILES` (or a ``*.tiktoken`` file). transformers 5 answers such a
    directory with an empty tokenizer (one token, every id decoded to nothing) instead of an
    error; a checkpoint saved without its tokenizer is served as token ids instead."""
    if not os.path.isdir(path):
        return True                        # a hub name: transformers resolves it
    names = set(os.listdir(path))
    return any(f in names for f in TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names)


def load_pretrained(path: Any, tokenizer: Any, dtype: Any, device: Any) -> tuple[Any, Any]:
    """(model, tokenizer) from a local Hugging Face directory or a hub name the local cache
    already holds (never downloaded: ``local_files_only``): ``AutoModelForCausalLM`` in
    ``dtype`` (``"auto"``: the checkpoint's) on ``device`` (None: ``"cuda"`` when torch sees
    one, else ``"cpu"``), in eval mode, and ``AutoTokenizer`` from ``path`` unless
    ``tokenizer`` is given (a tokenizer, or a path or name to load one from); None for a
    directory without tokenizer files (:func:`has_tokenizer_files`).
    InvalidArgument when something cannot be loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise InvalidArgument(f"path of type {type(path).__name__} is not a directory path or model name")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(f"device {device!r} is not a torch device: {e}") from e
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise InvalidArgument(f"dtype {dtype!r} is not a torch dtype name or 'auto'")
        dtype = resolved
    elif not (dtype == "auto" or isinstance(dtype, torch.dtype)):
        raise InvalidArgument(f"dtype of type {type(dtype).__name__} is not a torch dtype or 'auto'")
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    elif isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
        tokenizer = load_tokenizer(tokenizer, required=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgument(f"could not load {path!r} from local files: {e}") from e
    return model.to(device).eval(), tokenizer


def load_tokenizer(path: Any, required: bool = False) -> Any:
    """``AutoTokenizer`` from a local directory or a cached hub name (``local_files_only``),
    checked; None for a directory without tokenizer files (:func:`has_tokenizer_files`)
    unless ``required``. InvalidArgument when it cannot be loaded."""
    from transformers import AutoTokenizer

    if not required and not has_tokenizer_files(path):
        return None               # a checkpoint alone: token ids only (see has_tokenizer_files)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgument(f"could not load {path!r} from local files: {e}") from e
    check_tokenizer(tokenizer)
    return tokenizer


