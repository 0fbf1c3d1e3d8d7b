"""Text out of token ids, one token at a time: incremental detokenization and stop strings.

::

    token --Detokenizer.push--> newly final text  (decode(window + token) minus decode(window);
                                                   "" while it ends in U+FFFD: half a character)
          --TextStream.push---> text released     (the stop-string matcher holds back a tail
                                                   that may still begin a stop string; a match
                                                   cuts the text before it and stops)
    end   --TextStream.close--> what was held back (the detokenizer's pending bytes, decoded
                                                   as they are, and the held tail)

The detokenizer is the prefix-window method vLLM and TGI use: it keeps two offsets into the
ids, ``prefix`` (where the window decoded as context starts) and ``read`` (the ids already
turned into released text). A token's text is ``decode(ids[prefix:])`` minus
``decode(ids[prefix:read])``: decoding with a few ids of context in front keeps what
SentencePiece-style decoders do at the start of a text (strip the ``▁`` space) out of the
middle of a stream, and a byte-level or byte-fallback token that ends part way through a
UTF-8 character decodes to U+FFFD, so nothing is released until the character is whole.
The window starts with the last :data:`CONTEXT` prompt ids, so the first token's leading
space is kept (a continuation of the prompt, as vLLM streams it). Special tokens are
skipped (``skip_special_tokens=True``; the detokenizer does not even keep their ids, so a
run of them costs nothing) and spaces are not cleaned up.

Nothing here imports torch; a tokenizer is anything with ``decode(ids,
skip_special_tokens=..., clean_up_tokenization_spaces=...)`` (Hugging Face's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CONTEXT", "Detokenizer", "TextStream", "decode", "decoder", "special_ids", "token_bytes"]

#: Prompt ids kept in front of a continuation's first token as decoding context.
CONTEXT = 5
_BAD = "\ufffd"


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """``ids`` as text: special tokens skipped, spaces left as the tokens have them."""
    if not ids:
        return ""
    return decoder(tokenizer)(list(ids))


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """The fastest way to decode ``tokenizer``'s ids as :func:`decode` does: a Hugging Face
    fast tokenizer's own Rust tokenizer (``backend_tokenizer``: the same decoder without
    the Python layer around it, which never cleans up spaces), else its ``decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "decode", None)):
        def fast(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=True)
        return fast

    def slow(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return slow


def _byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character that stands for each
    byte in a token's string, inverted."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    chars: dict[str, int] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_chars()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types of a fast tokenizer's decoders (``ByteLevel``, ``ByteFallback``, ``Replace``,
    ...; a ``Sequence``'s members); empty for other tokenizers."""
    # (the decoder's own state, not the whole tokenizer's JSON: a large vocabulary's is MBs)
    try:
        spec = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    kinds: set[str] = set()
    todo = [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            kinds.add(str(d.get("type")))
            todo.extend(d.get("decoders") or ())
    return kinds


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """A function giving a token's own bytes, which may be part of a character (the
    ``bytes`` of OpenAI's chat log-probabilities: a client joins them to rebuild a character
    split over tokens): a byte-level BPE's token string mapped back through its alphabet
    (GPT-2, Llama 3, Qwen), a byte-fallback token ``<0xXX>`` as that byte and ``▁`` as a
    space (SentencePiece: Llama 2, Mistral, Gemma); otherwise, and for a token whose string
    those rules do not cover (an added token), the UTF-8 of the token decoded alone."""
    kinds = _decoder_kinds(tokenizer)
    to_piece = getattr(tokenizer, "convert_ids_to_tokens", None)

    def alone(token: int) -> bytes:
        return str(tokenizer.decode([token])).encode("utf-8")

    if to_piece is None or not ({"ByteLevel", "ByteFallback"} & kinds):
        return alone

    def own(token: int) -> bytes:
        piece = to_piece(token)
        if not isinstance(piece, str) or not piece:
            return alone(token)
        if "ByteLevel" in kinds:
            if all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            return alone(token)
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")
    return own


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a decode with ``skip_special_tokens=True`` drops: a Hugging Face tokenizer's
    ``all_special_ids`` and its added tokens marked special (empty for other objects)."""
    ids: set[int] = set()
    try:
        ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids.update(int(i) for i, t in added.items() if getattr(t, "special", False))
    except (TypeError, ValueError):           # not a Hugging Face tokenizer's shapes
        return frozenset()
    return frozenset(ids)


class Detokenizer:
    """Incremental detokenization of one continuation (module docstring).

    Example
    -------
    >>> d = Detokenizer(tok, prompt)                     # doctest: +SKIP
    >>> "".join(d.push(t) for t in outputs) + d.flush()  # doctest: +SKIP
    """

    __slots__ = ("decode", "special", "ids", "prefix", "read", "before")

    def __init__(self, tokenizer: Any, prompt: Sequence[int] = ()):
        self.decode = decoder(tokenizer)
        #: ids decoding skips (special tokens), never kept: they change no text, and a run of
        #: them (end-of-sequence under ``ignore_eos``) would grow what each push decodes
        self.special = special_ids(tokenizer)
        self.ids: list[int] = list(prompt[-CONTEXT:]) if CONTEXT else []
        self.prefix = 0                       # ids[prefix:read] decode to context, not emitted
        self.read = len(self.ids)             # ids[read:] are not turned into text yet
        self.before: str | None = None        # the context's text (decoded once per release)

    def push(self, token: int) -> str:
        """Appends ``token``; returns the text that became final with it ("" while the
        pending ids end part way through a character)."""
        if token in self.special:
            return ""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text of the pending ids as it decodes now (at the end of a continuation: an
        incomplete character at the very end decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        ids, prefix, read = self.ids, self.prefix, self.read
        if read == len(ids):
            return ""
        before = self.before
        if before is None:
            before = self.before = self.decode(ids[prefix:read]) if read > prefix else ""
        after = self.decode(ids[prefix:])
        if len(after) <= len(before) or (after.endswith(_BAD) and not final):
            return ""                         # nothing yet, or half a character at the end
        if not after.startswith(before):      # a decoder that rewrote the context: the
            before = before[:_common(before, after)]   # text from where they part
        # the context moves up to the ids just released, and the ids before it are dropped
        del ids[:read]
        self.prefix, self.read = 0, len(ids)
        self.before = None
        return after[len(before):]


def _first_stop(text: str, stops: Sequence[str]) -> int:
    """Where ``text`` is cut for the first stop string it holds, -1 for none: the start of
    the match that ends first (of those, the longest), which is where the text would stop
    were it fed a character at a time, so the cut never depends on how it was tokenized."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return -1 if best is None else best[1]


def _common(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TextStream:
    """One continuation's text: a :class:`Detokenizer` and the stop-string matcher.

    ``text`` is the text released so far (every :meth:`push` and :meth:`close` result,
    concatenated); ``fed`` counts the tokens pushed; ``stopped`` says a stop string
    matched (the text ends just before it, later pushes release nothing); ``closed``: no
    more text comes (:meth:`close` ran).

    A stop string is matched on the detokenized text, across token boundaries: text that
    could still be the start of a stop string is held back until it cannot, so the text
    released never holds a stop string or anything after the first one. Of stop strings
    that overlap, the one that ends first (the longest of those) cuts, as if the text came
    a character at a time: the cut does not depend on the tokens.

    Example
    -------
    >>> s = TextStream(tok, prompt, stops=("\\n\\n",))     # doctest: +SKIP
    >>> for t in tokens: delta = s.push(t)                 # doctest: +SKIP
    """

    __slots__ = ("detok", "stops", "longest", "held", "text", "fed", "stopped", "closed", "min_tokens")

    def __init__(self, tokenizer: Any, prompt: Sequence[int] = (), stops: Sequence[str] = (),
                 min_tokens: int = 0):
        self.detok = Detokenizer(tokenizer, prompt)
        self.stops = tuple(stops)
        #: stop strings end nothing before this many tokens were pushed (``min_new_tokens``)
        self.min_tokens = min_tokens
        self.longest = max((len(s) for s in self.stops), default=0)
        self.held = ""
        self.text = ""
        self.fed = 0
        self.stopped = False
        self.closed = False

    def push(self, token: int) -> str:
        """Feeds one token; returns the text it releases (maybe ""). After a stop string
        matched, or once closed, nothing is released."""
        self.fed += 1
        if self.stopped or self.closed:
            return ""
        return self._release(self.detok.push(token), final=False)

    def close(self) -> str:
        """Ends the stream: returns what was held back (the detokenizer's pending ids and a
        tail that might have begun a stop string), cut before a stop string that it holds.
        Later calls return ""."""
        if self.closed:
            return ""
        out = "" if self.stopped else self._release(self.detok.flush(), final=True)
        self.closed = True
        return out

    def _release(self, piece: str, final: bool) -> str:
        if not self.stops:
            self.text += piece
            return piece
        buf = self.held + piece
        if not buf:
            return ""
        cut = -1
        if self.fed >= self.min_tokens:       # (before: a stop string ends nothing)
            cut = _first_stop(buf, self.stops)
        if cut >= 0:                          # the first stop string: the text ends before it
            out = buf[:cut]
            self.held = ""
            self.stopped = True
        elif final:
            out, self.held = buf, ""
        else:                                 # hold the longest tail that begins a stop string
            keep = 0
            for n in range(min(len(buf), self.longest - 1), 0, -1):
                tail = buf[-n:]
                if any(s.startswith(tail) for s in self.stops):
                    keep = n
                    break
            out, self.held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out
