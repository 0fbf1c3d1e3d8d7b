"""Batched sampling on the model's device: one call per step for every row that samples.

::

    logits [R, V] (device, any float dtype) --rows--> x [S, V]   one slot per token to draw
        server knobs:  (only slots in spec.extras) float32 copy; + logit_bias; -inf for the
                       min_new_tokens ids; repetition, frequency, presence penalties
                       (a step launched ahead counts each row's fed id on the device)
        greedy slots:  argmax(x)                  (ties: the lowest id, as torch.argmax)
        random slots:  float32(x) / T -> min_p mask -> top-k mask -> softmax -> top-p mask -> CDF
                       (T, top_k, top_p clamped on the host first: see below)
                       token = first id whose CDF exceeds u * CDF[-1]
                       u = hash(seed, continuation, output index)  (host, per slot)
        verify runs:   accepted = leading slots whose token equals the draft they check
        logprobs:      log_softmax(float32 logits) of the rows asked for (the model's own
                       distribution, before any knob): the drawn / given id's, top-k ids
                       (largest first, ties by the lowest id)
    ids [S] (+ accepted [G]) (+ logprobs as float64 bits)
        --one device-to-host copy (readback.Readback)--> numpy

Seeds are counter-based: the uniform of continuation k's output token t is a SplitMix64
hash of ``(seed, k, t)``, computed on the host for the step's slots (a few vectorized
numpy operations) and uploaded with the other per-slot parameters; the vocabulary-wide work
(softmax, cumulative sum, search) runs on the device for every slot at once. So a token
depends only on its logits and its key: not on the batch around it, not on how many times
a step was rolled back or a sequence recomputed after preemption, not on whether it was
reached through a verify run of drafts. Greedy slots use no randomness at all.

Every value :class:`~cellcache.generate.Sampling` accepts draws as the formula's limit
where float32 arithmetic cannot compute the formula itself; the host clamps the step's
parameters (a few numpy operations over the random slots) and the device work is unchanged:

- ``temperature < TEMPERATURE_MIN`` (2**-64) draws as ``T -> 0+``: the largest logit, ties
  sharing the draw evenly (seeded), i.e. top-k 1 at temperature 1. The formula's ``x / T``
  overflows float32 for a logit of magnitude ``FLT_MAX * T`` (T under 2**-126 is even
  subnormal or 0 in float32), and softmax turns ``inf - inf`` into NaN. From 2**-64 up,
  ``x / T`` stays finite for every logit under 2**63 in magnitude (real logits: a few
  hundred); at 2**-64 a logit more than 2**-57 below the largest already gets probability
  0 (``exp(-128)`` underflows float32), so the formula there draws the limit too and the
  two sides of the threshold draw alike.
- ``temperature > TEMPERATURE_MAX`` (2**64) draws at 2**64, which is ``T -> inf``: uniform
  over the kept set. Above FLT_MAX, T would be inf (``x / inf`` is 0, erasing top-k's order,
  and NaN for a -inf logit). Dividing by a power of two keeps the logits' order exactly
  (down to magnitudes of 2**-62), and ``exp(-d / 2**64)`` rounds to exactly 1 for logits
  spanning less than 2**39, so the kept tokens are equally likely, -inf ones never drawn.
  With top-p the head is then ``ceil(top_p * kept)`` of those equally likely tokens, in
  the sort's order.
- ``top_p < TOP_P_MIN`` (2**-64) keeps the largest logit alone (top-k 1, ties kept), as
  every top-p below the largest probability (>= 1/vocab) does: cast to float32 a smaller
  top-p is subnormal or 0, and 0 keeps nothing (a row with nothing kept has no token: the
  search ends past the last id). Taken as top-k 1, it is so at any temperature, also one
  so high that every probability rounds to the same value.

Ordinary values (``TEMPERATURE_MIN <= T <= TEMPERATURE_MAX``, ``top_p >= TOP_P_MIN``) pass
through untouched: their draws are bit for bit those of the unclamped formula.

:class:`Sampler` needs no cache and no model: logits and a :class:`SampleSpec` in, a
:class:`SamplerOutput` of host arrays out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgument
from .plan import SamplerOutput, SampleSpec
from .readback import Pending, Readback

__all__ = ["FUSED_DRAW", "LOGPROB_BLOCK", "TEMPERATURE_MAX", "TEMPERATURE_MIN", "TOP_P_MIN", "Draw",
           "SampleSpec", "Sampler", "SamplerOutput", "uniforms"]

#: On CUDA, a slot that samples at a temperature alone (no top-k, top-p or min-p of its own)
#: draws in one fused launch with the step's others like it (:meth:`Sampler._fused_draw`);
#: False: through torch's ops.
FUSED_DRAW = True
#: Temperatures below this draw as their limit T -> 0+: top-k 1 at temperature 1 (module
#: docstring: below it float32's ``x / T`` overflows for ever smaller logits, while the
#: formula there already draws the limit).
TEMPERATURE_MIN = 2.0 ** -64
#: Temperatures above this draw at it, which is already their limit T -> inf: uniform over
#: the kept tokens (a power of two: dividing by it keeps the logits' order exactly).
TEMPERATURE_MAX = 2.0 ** 64
#: top-p values below this keep the most probable token alone, as this one does (a normal
#: float32, below 1/vocab for every vocabulary).
TOP_P_MIN = 2.0 ** -64
#: Rows whose log-softmax is computed at once for log-probabilities: a long prompt's rows
#: (``prompt_logprobs``) go a block at a time, bounding the float32 copies of the logits.
LOGPROB_BLOCK = 256

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _C1
    x = (x ^ (x >> np.uint64(27))) * _C2
    return x ^ (x >> np.uint64(31))


def uniforms(seed: Any, index: Any, position: Any) -> np.ndarray:
    """Uniforms in [0, 1) (float64, 53 random bits) for keys ``(seed, index, position)``:
    seeds in [0, 2**63), continuation indexes and output positions >= 0 (arrays or ints,
    broadcast). The same key always gives the same number; different keys independent ones."""
    with np.errstate(over="ignore"):
        s = np.asarray(seed, dtype=np.uint64)
        k = np.asarray(index, dtype=np.uint64)
        t = np.asarray(position, dtype=np.uint64)
        h = _mix(_key(s, k) ^ t)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _key(seed: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The part of :func:`uniforms`' hash that does not depend on the position (uint64
    arrays in, wrapping arithmetic): a slot's is the same at every step of its sequence."""
    return _mix(_mix(seed) ^ index)


def _uniforms_at(key: np.ndarray, position: np.ndarray) -> np.ndarray:
    """:func:`uniforms` from :func:`_key`'s value and the positions (bit for bit)."""
    with np.errstate(over="ignore"):
        h = _mix(key ^ np.asarray(position, dtype=np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class _Params:
    """What a spec's random slots draw with, apart from their positions: built from its
    lists once and kept while the next spec's lists hold the same values (a steady decode's
    plans share them: only the positions move on), so a step converts one list, not six.

    ``rand``: the slots with temperature > 0; ``key``: their :func:`_key`; ``base``: their
    clamped temperature and top_p rows (module docstring); ``top_k``, ``has_k``, ``has_p``:
    theirs after the clamps."""

    __slots__ = ("lists", "vocab", "rand", "key", "base", "top_k", "has_k", "has_p")

    def __init__(self, spec: SampleSpec, V: int):
        self.lists = (list(spec.temperature), list(spec.top_k), list(spec.top_p), list(spec.seed),
                      list(spec.index))
        self.vocab = V
        temps = np.asarray(spec.temperature, dtype=np.float64)
        rand = self.rand = np.flatnonzero(temps > 0)
        top_k = np.asarray(spec.top_k, dtype=np.int64)[rand]
        with np.errstate(over="ignore"):
            self.key = _key(np.asarray(spec.seed, dtype=np.uint64)[rand],
                            np.asarray(spec.index, dtype=np.uint64)[rand])
        base = np.stack([temps[rand], np.asarray(spec.top_p, dtype=np.float64)[rand]])
        if base[0].min(initial=np.inf) < TEMPERATURE_MIN:   # T -> 0+: the top logit, ties kept
            cold = base[0] < TEMPERATURE_MIN
            base[0, cold] = 1.0
            top_k = np.where(cold, 1, top_k)
        if base[1].min(initial=1.0) < TOP_P_MIN:      # the top logit alone, at any temperature
            top_k = np.where(base[1] < TOP_P_MIN, 1, top_k)
        np.minimum(base[0], TEMPERATURE_MAX, out=base[0])
        np.maximum(base[1], TOP_P_MIN, out=base[1])
        self.base, self.top_k = base, top_k
        self.has_k = (top_k > 0) & (top_k < V)
        self.has_p = base[1] < 1.0

    def holds(self, spec: SampleSpec, V: int) -> bool:
        """Whether ``spec``'s lists hold the values these were built from, for logits of
        ``V`` ids (list equality: a few microseconds for the same objects, which a steady
        decode's plans share; a list changed in place compares unequal)."""
        if V != self.vocab:
            return False
        for now, then in zip((spec.temperature, spec.top_k, spec.top_p, spec.seed, spec.index),
                             self.lists):
            if type(now) is not list or now != then:
                return False
        return True


class Sampler:
    """Draws a step's tokens on ``device`` in one call: :meth:`__call__` (module docstring).

    Every per-slot parameter goes up in at most one host-to-device copy per dtype, and the
    results come back in exactly one device-to-host copy (``copies`` counts them), which
    :attr:`readback` queues into a pinned buffer on CUDA. No ``.item()``, no per-row Python
    over the vocabulary.

    Example
    -------
    >>> spec = SampleSpec()
    >>> _ = spec.add(row=0, temperature=0.0, top_k=0, top_p=1.0, seed=0, index=0, position=0)
    >>> Sampler("cpu")(torch.tensor([[0.1, 2.0, 2.0]]), spec).ids.tolist()
    [1]
    """

    def __init__(self, device: Any = "cpu", stream: Any = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        #: The step's device-to-host copy of the ids (pinned buffers, events, the driver).
        self.readback = Readback(self.device, stream)
        # the last launch that copied a graph's own greedy ids for a spec that says it is
        # dense and not random (slot i row i: the scheduler's lean plans): (spec, logits,
        # greedy ids, slots, the ids' device address); the same three objects again (a
        # steady decode step), the spec still saying so, skip the checks for the copy
        self._fast: tuple[SampleSpec, torch.Tensor, torch.Tensor, int, int] | None = None
        self._params: _Params | None = None           # the last spec's, kept while they hold

    @property
    def stream(self) -> Any:
        """The torch stream the draws are queued on (CUDA), whose event marks the host copy
        done; None: the device's current stream at each call."""
        return self.readback.stream

    @stream.setter
    def stream(self, stream: Any) -> None:
        self.readback.stream = stream

    @property
    def copies(self) -> int:
        """Device-to-host copies so far: one per launched step that draws anything."""
        return self.readback.copies

    def _up(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(values), dtype=dtype)
        if self.cuda:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def __call__(self, logits: torch.Tensor, spec: SampleSpec) -> SamplerOutput:
        """Draws every slot of ``spec`` from ``logits`` (``[rows, vocab]``, on this sampler's
        device). Returns host arrays; the only host sync is their copy."""
        return self.launch(logits, spec).result()

    def launch(self, logits: torch.Tensor, spec: SampleSpec, greedy: torch.Tensor | None = None) -> Draw:
        """Queues every draw of ``spec`` and the one device-to-host copy of the ids, without
        waiting for them: :meth:`Draw.result` waits (asynchronous scheduling feeds
        ``Draw.device_ids`` to the next step before that).

        ``greedy``: the argmax of each row of ``logits``, already on the device (a replayed
        graph computes it: :attr:`cellcache.runner.ModelRunner.greedy`), used instead of an
        argmax launch when slot i draws from row i."""
        fast = self._fast
        if fast is not None and greedy is fast[2] and spec is fast[0] and logits is fast[1] \
                and spec.dense == fast[3] == len(spec.rows) and spec.random is False \
                and not spec.groups and not spec.extras:
            n = fast[3]
            pending = self.readback.copy_again(n, fast[4])
            return Draw(None, pending if pending is not None else self.readback.copy(greedy), n,
                        greedy)
        n = len(spec)
        extras = spec.extras
        if n == 0 and not spec.prompt_rows:
            return Draw(SamplerOutput(np.zeros(0, np.int64), np.zeros(0, np.int64)))
        x = logits
        if not spec.identity(logits.shape[0]):
            x = logits.index_select(0, self._up(spec.rows, torch.int64))
            greedy = None
        min_p = None
        if extras:                                    # the server knobs: their slots' logits
            x = self._process(x, spec)
            greedy = None
            if any(e.sampling.min_p > 0 for e in extras):
                min_p = np.zeros(n)
                for e in extras:
                    min_p[e.slot] = e.sampling.min_p
        if greedy is not None and (greedy.shape != logits.shape[:1] or greedy.dtype != torch.int64
                                   or greedy.device != logits.device):
            raise InvalidArgument(f"greedy ids of shape {tuple(greedy.shape)} {greedy.dtype} on "
                                  f"{greedy.device} for logits {tuple(logits.shape)} on {logits.device}")
        if spec.any_random():
            params = self._params
            if params is None or not params.holds(spec, x.shape[-1]):
                params = self._params = _Params(spec, x.shape[-1])
            rand = params.rand
            tok = self._draw(x, spec, params, None if min_p is None else min_p[rand])
            if rand.size == n:                        # (no greedy slot: no argmax)
                ids = tok
            else:
                ids = greedy if greedy is not None else torch.argmax(x, dim=-1)
                ids = ids.index_copy(0, self._up(rand, torch.int64), tok)
        else:
            ids = greedy if greedy is not None else torch.argmax(x, dim=-1)
        out = ids
        if spec.groups:
            out = torch.cat([ids, self._accept(ids, spec)])
        elif ids is greedy and self.cuda and spec.dense == n and spec.random is False \
                and ids.is_contiguous():
            self._fast = (spec, logits, greedy, n, ids.data_ptr())
        layout = None
        if extras or spec.prompt_rows:
            lp = self._logprobs(logits, spec, ids)
            if lp is not None:
                packed, layout = lp
                out = torch.cat([out, packed])
        return Draw(None, self.readback.copy(out), n, ids, layout)

    def _process(self, x: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """The logits of the step's slots (``x``, slot i in row i) with the server knobs
        of :attr:`SampleSpec.extras` applied, as float32 (a copy): ``logit_bias`` added, the
        ``min_new_tokens`` ids masked (-inf), ``repetition_penalty`` (HF's: the logit of a
        token of the prompt or output divided by it when positive, else multiplied), then
        ``frequency_penalty * count + presence_penalty`` taken off each output token's
        logit. Bias and mask are scatters over the slot's own ids; the penalties' counts
        and seen-sets are built per penalized slot on the device from the host's tokens
        (numpy) and, in a step launched ahead, the token each row was fed on the device
        (:attr:`SampleSpec.fed`, counted there: no host sync). Everything goes up in one
        copy per dtype, and nothing depends on the other slots."""
        x = x.float().clone() if x.dtype == torch.float32 else x.float()
        V = x.shape[-1]
        bias_s, bias_i, bias_v, ban_s, ban_i = [], [], [], [], []
        pen: list[Any] = []                           # the extras with penalties
        seen_j, seen_i, cnt_j, cnt_i, cnt_v = [], [], [], [], []
        for e in spec.extras:
            sp = e.sampling
            if sp.logit_bias:
                n = len(sp.logit_bias)
                bias_s.append(np.full(n, e.slot))
                bias_i.append(np.fromiter(sp.logit_bias.keys(), np.int64, n))
                bias_v.append(np.fromiter(sp.logit_bias.values(), np.float64, n))
            # (an id past the logits' ids is never drawn, so there is nothing to mask: an
            # end-of-sequence id the model's logits do not reach, say)
            banned = [t for t in e.banned if 0 <= t < V]
            if banned:
                ban_s.append(np.full(len(banned), e.slot))
                ban_i.append(np.asarray(banned, dtype=np.int64))
            if e.tokens is not None:
                j = len(pen)
                pen.append(e)
                ids = np.unique(e.tokens)
                seen_j.append(np.full(ids.size, j))
                seen_i.append(ids)
                out, n_out = np.unique(e.tokens[e.n_prompt:], return_counts=True)
                cnt_j.append(np.full(out.size, j))
                cnt_i.append(out)
                cnt_v.append(n_out.astype(np.float64))
        P = len(pen)
        ints = [bias_s, bias_i, ban_s, ban_i, seen_j, seen_i, cnt_j, cnt_i,
                [np.array([e.slot for e in pen], dtype=np.int64)]]
        floats = [bias_v, cnt_v, [np.array([[e.sampling.repetition_penalty, e.sampling.frequency_penalty,
                                             e.sampling.presence_penalty] for e in pen]).reshape(-1)]]
        cat_i = [np.concatenate(g).astype(np.int64) if g else np.zeros(0, np.int64) for g in ints]
        cat_f = [np.concatenate(g).astype(np.float64) if g else np.zeros(0) for g in floats]
        up_i = self._up(np.concatenate(cat_i), torch.int64)
        up_f = self._up(np.concatenate(cat_f), torch.float64).float()
        at_i = np.cumsum([0] + [a.size for a in cat_i]).tolist()
        at_f = np.cumsum([0] + [a.size for a in cat_f]).tolist()

        def ints_of(k: int) -> torch.Tensor:
            return up_i[at_i[k]:at_i[k + 1]]

        def floats_of(k: int) -> torch.Tensor:
            return up_f[at_f[k]:at_f[k + 1]]

        if at_i[2] > at_i[0]:
            x.index_put_((ints_of(0), ints_of(1)), floats_of(0), accumulate=True)
        if at_i[4] > at_i[2]:
            x.index_put_((ints_of(2), ints_of(3)), torch.full((at_i[3] - at_i[2],), -torch.inf,
                                                              device=x.device))
        if P:
            slots = ints_of(8)
            seen = torch.zeros((P, V), dtype=torch.bool, device=x.device)
            seen.index_put_((ints_of(4), ints_of(5)), torch.ones((), dtype=torch.bool, device=x.device))
            counts = torch.zeros((P, V), dtype=torch.float32, device=x.device)
            counts.index_put_((ints_of(6), ints_of(7)), floats_of(1), accumulate=True)
            if spec.fed is not None:                  # each row's token in flight: an output
                fed = spec.fed.index_select(0, slots).to(torch.int64)
                row = torch.arange(P, device=x.device)
                seen[row, fed] = True
                counts.index_put_((row, fed), torch.ones(P, device=x.device), accumulate=True)
            r, freq, pres = floats_of(2).view(P, 3).unbind(1)
            xs = x.index_select(0, slots)
            rep = torch.where(xs > 0, xs / r[:, None], xs * r[:, None])
            xs = torch.where(seen, rep, xs)
            xs = xs - freq[:, None] * counts - pres[:, None] * (counts > 0)
            x.index_copy_(0, slots, xs)
        return x

    def _logprobs(self, logits: torch.Tensor, spec: SampleSpec, ids: torch.Tensor
                  ) -> tuple[torch.Tensor, tuple[int, int, int]] | None:
        """Log-probabilities of the model's own distribution (``log_softmax`` of the float32
        logits, before any knob) for the extras' slots that ask for them (of the token each
        drew) and the spec's prompt rows (of the token given), with the top alternatives:
        packed as int64 for the step's one copy (float64 bits), and the layout (groups,
        entries, top). None when nothing asks."""
        slots = [e.slot for e in spec.extras if e.sampling.logprobs is not None]
        tops = [e.sampling.logprobs for e in spec.extras if e.sampling.logprobs is not None]
        prompt = spec.prompt_rows
        if not slots and not prompt:
            return None
        rows = [spec.rows[s] for s in slots] + [r for r, _, _ in prompt]
        top = max([t for t in tops if t is not None] + [k for _, _, k in prompt], default=0)
        up = self._up(np.array(rows + slots + [t for _, t, _ in prompt], dtype=np.int64), torch.int64)
        L, m = len(rows), len(slots)
        k = min(top, logits.shape[-1])
        tok = torch.cat([ids.index_select(0, up[L:L + m]), up[L + m:]])
        chosen, tops_i, tops_v = [], [], []
        for a in range(0, L, LOGPROB_BLOCK):          # (a prompt's rows: a block at a time)
            b = min(L, a + LOGPROB_BLOCK)
            lsm = torch.log_softmax(logits.index_select(0, up[a:b]).float(), dim=-1)
            chosen.append(lsm.gather(1, tok[a:b, None])[:, 0])
            if k:
                tv, ti = _top(lsm, k)
                tops_i.append(ti.reshape(-1))
                tops_v.append(tv.reshape(-1))
        parts = [torch.cat(chosen).double().view(torch.int64)]
        if k:
            parts += [torch.cat(tops_i), torch.cat(tops_v).double().view(torch.int64)]
        return torch.cat(parts), (len(spec.groups), L, k)

    def _draw(self, x: torch.Tensor, spec: SampleSpec, params: _Params,
              min_p: np.ndarray | None = None) -> torch.Tensor:
        """Tokens of the random slots ``params.rand`` (host indexes into the spec), with the
        parameters :class:`_Params` clamped to what float32 computes as the limit (module
        docstring); ``min_p`` (of the ``rand`` slots, None: none) masks, after temperature,
        every token whose probability is below min_p times the largest."""
        rand, top_k, has_k, has_p = params.rand, params.top_k, params.has_k, params.has_p
        # every float parameter, uploaded at once: temperature, top_p, u
        host = np.empty((3, rand.size))
        host[:2] = params.base
        host[2] = _uniforms_at(params.key, np.asarray(spec.position)[rand])
        # a slot at a temperature alone draws through the fused launch wherever it runs,
        # whatever the other slots ask: a slot's way never depends on the batch
        plain = ~has_k & ~has_p if min_p is None else ~has_k & ~has_p & ~(min_p > 0)
        kern = self._fused_kernels(x) if plain.any() else None
        if kern is None:
            return self._torch_draw(x, rand, host, top_k, has_k, has_p, min_p)
        if plain.all():
            return self._fused_draw(kern, x, rand, self._up(host, torch.float64))
        a, b = np.flatnonzero(plain), np.flatnonzero(~plain)
        drawn = torch.cat([         # (host[:, a] is column-major: the kernel reads rows of it)
            self._fused_draw(kern, x, rand[a], self._up(np.ascontiguousarray(host[:, a]), torch.float64)),
            self._torch_draw(x, rand[b], host[:, b], top_k[b], has_k[b], has_p[b],
                             None if min_p is None else min_p[b])])
        return torch.empty_like(drawn).index_copy_(0, self._up(np.concatenate([a, b]), torch.int64), drawn)

    def _torch_draw(self, x: torch.Tensor, rand: np.ndarray, host: np.ndarray, top_k: np.ndarray,
                    has_k: np.ndarray, has_p: np.ndarray, min_p: np.ndarray | None) -> torch.Tensor:
        """:meth:`_draw`'s formula through torch's ops for slots ``rand`` (``host``: their
        clamped temperature, top_p and u rows; ``top_k``, ``has_k``, ``has_p``, ``min_p``
        theirs)."""
        V = x.shape[-1]
        params = self._up(host, torch.float64)
        xr = x if rand.size == x.shape[0] else x.index_select(0, self._up(rand, torch.int64))
        xr = xr.float() / params[0].float()[:, None]
        if min_p is not None and min_p.max(initial=0.0) > 0:
            with np.errstate(divide="ignore"):
                floor = self._up(np.log(min_p), torch.float64).float()   # (log 0: -inf, none masked)
            xr = xr.masked_fill(xr < xr.max(dim=-1, keepdim=True).values + floor[:, None], -torch.inf)
        if has_k.any():                               # the k-th largest value: ties kept, as before
            kmax = int(top_k[has_k].max())
            kk = np.where(has_k, top_k, kmax)
            vals = torch.topk(xr, kmax, dim=-1).values
            kth = vals.gather(1, self._up(kk - 1, torch.int64)[:, None])
            kth = kth.masked_fill(~self._up(has_k, torch.bool)[:, None], -torch.inf)
            xr = xr.masked_fill(xr < kth, -torch.inf)
        probs = torch.softmax(xr, dim=-1)
        if has_p.any():                               # the smallest head whose mass reaches top_p
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < params[1].float()[:, None]
            keep |= ~self._up(has_p, torch.bool)[:, None]
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
        cdf = torch.cumsum(probs.double(), dim=-1)
        target = params[2] * cdf[:, -1]
        tok = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
        return tok.clamp_(max=V - 1)

    def _fused_kernels(self, x: torch.Tensor) -> Any:
        """The fused kernels that draw from ``x`` (:meth:`_fused_draw`), or None where they do
        not: on the host, for logits other than float32 rows of contiguous ids, past their
        largest vocabulary, with :data:`FUSED_DRAW` off, or where the kernels do not load.
        Nothing of it depends on the step's other slots."""
        if not (FUSED_DRAW and self.cuda and x.dtype == torch.float32 and x.ndim == 2
                and x.stride(1) == 1):
            return None
        from ..cuda.driver import CudaError
        from ..cuda.fused import SAMPLE_MAX_VOCAB, fused_kernels

        if x.shape[1] > SAMPLE_MAX_VOCAB:
            return None
        try:
            return fused_kernels(x.device.index if x.device.index is not None else 0)
        except CudaError:
            return None

    def _fused_draw(self, k: Any, x: torch.Tensor, rand: np.ndarray, params: torch.Tensor) -> torch.Tensor:
        """The draws of slots ``rand`` at a temperature alone (``params``: temperature, top_p,
        u a row, float64 on the device) in one launch of ``sample_rows`` (cuda/fused.cu):
        the formula of :meth:`_torch_draw` without its softmax, float64 cumulative sum and
        search over the vocabulary as separate passes (each of them reads or writes ``rows x
        vocab`` floats). Its sums run in another order (over the unnormalized ``exp``, where
        torch sums the probabilities rounded to float32), so its draw and torch's differ where
        ``u`` times the sum lands within rounding of a boundary between two ids (a few in
        100,000 draws at 152K ids, mostly in the tail); which of the two a slot takes depends
        only on the slot and the device (:meth:`_fused_kernels`, which gives ``k``)."""
        params = params.contiguous()                  # (the kernel reads its rows as arrays)
        n = rand.size
        rows = None if n == x.shape[0] and np.array_equal(rand, np.arange(n)) \
            else self._up(rand, torch.int64)
        tok = torch.empty(n, dtype=torch.int64, device=x.device)
        with torch.cuda.device(x.device):
            k.sample_rows(x.data_ptr(), x.stride(0), x.shape[1], n, 0 if rows is None else rows.data_ptr(),
                          params[0].data_ptr(), params[2].data_ptr(), tok.data_ptr(),
                          torch.cuda.current_stream(x.device).cuda_stream)
        return tok

    def _accept(self, ids: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Accepted drafts per verify group: the leading slots whose token is their draft."""
        first = np.array([f for f, _ in spec.groups], dtype=np.int64)
        drafts = np.array([d for _, d in spec.groups], dtype=np.int64)
        slots = np.concatenate([np.arange(f, f + d + 1) for f, d in spec.groups])
        group = np.repeat(np.arange(len(first)), drafts + 1)
        pos = slots - first[group]
        want = np.asarray(spec.draft, dtype=np.int64)[slots]
        up = self._up(np.stack([slots, group, pos, want]), torch.int64)
        miss = ids.index_select(0, up[0]) != up[3]    # the last slot's draft is -1: always a miss
        at = torch.where(miss, up[2], torch.full_like(up[2], 1 << 40))
        acc = self._up(drafts, torch.int64)
        return acc.scatter_reduce(0, up[1], at, reduce="amin", include_self=True)


def _top(lsm: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``lsm`` (float32) and their ids, largest
    first, ties by the lowest id: topk over one int64 key per entry (the float's bits made
    order-preserving, then the id reversed), so which tied ids make the top k, and their
    order, never depend on the topk kernel (bf16 logits tie often)."""
    bits = lsm.contiguous().view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64) << 32
    V = lsm.shape[-1]
    key |= torch.arange(V - 1, -1, -1, device=lsm.device, dtype=torch.int64)
    ti = torch.topk(key, k, dim=-1).indices
    return lsm.gather(1, ti), ti


class Draw:
    """A launched :meth:`Sampler.launch`: ``device_ids`` (the drawn ids, on the device, at
    once) and :meth:`result` (the host copy: waits for it the first time)."""

    __slots__ = ("_out", "_pending", "_n", "_layout", "device_ids")

    def __init__(self, out: SamplerOutput | None, pending: Pending | None = None, n: int = 0,
                 device_ids: torch.Tensor | None = None, layout: tuple[int, int, int] | None = None):
        self._out, self._pending, self._n, self._layout = out, pending, n, layout
        self.device_ids = out.device_ids if out is not None else device_ids

    def result(self) -> SamplerOutput:
        if self._out is None:
            assert self._pending is not None
            host = self._pending.wait()
            n, layout = self._n, self._layout
            if layout is None:
                self._out = SamplerOutput(host[:n], host[n:], self.device_ids)
            else:                                 # ids, accepted, then the log-probabilities
                g, L, k = layout
                at = n + g
                chosen = host[at:at + L].view(np.float64)
                ti = host[at + L:at + L + L * k].reshape(L, k)
                tv = host[at + L + L * k:at + L + 2 * L * k].view(np.float64).reshape(L, k)
                self._out = SamplerOutput(host[:n], host[n:at], self.device_ids, (chosen, ti, tv))
            self._pending = None
        return self._out
