"""End-to-end agreement: does a served configuration compute the model it serves?

A :class:`~cellcache.generate.Generator` may serve in bf16 or fp16 through cellcache's
tensor-core kernels, CUDA graphs, ``torch.compile``, asynchronous steps or FlashInfer; each
piece is checked on its own elsewhere, this checks the whole. It is a teacher-forced check:

1. :class:`LogitsTap` records, through ``Generator.on_logits``, the float32 logits every
   sampled row of the served path was drawn from, with the token history (context) the row
   conditions on: prompt chunks, decode steps, forks, drafts (rejected ones too), recomputes
   after preemption, prefix-cache hits and padded buckets all yield rows, whatever the run
   exercised.
2. :func:`compare` runs Hugging Face's own forward of the same weights over the same
   contexts twice: in float32 (the **reference**) and in the served dtype (the **noise
   floor**: what HF itself gets in that precision), and compares per row.

It passes when the served path's error against the reference is within ``factor`` (1.5) times
the noise floor's, for the largest ``|Δlogit|`` over every row and for the mean ``|Δlogit|``,
and the served argmax equals the reference's wherever the reference's top-2 margin exceeds
twice the noise floor's error on that row (a margin the precision cannot flip). Because the
reference is fed the served path's own tokens, near-ties that send the two greedy
continuations apart do not count against it, and a wrong kernel cannot hide behind them.

A configuration with 8-bit K/V (``kv_dtype``) rounds every K and V to e4m3 on top of the
served dtype: its noise floor is HF's forward in the served dtype with the same rounding at
the same per-(layer, kv head) scales (:func:`kv8_floor`), so the check still asks whether
the kernels compute what such a model computes.

A float32 served configuration has no noise floor (HF's float32 forward is the reference):
``atol`` times the reference logits' scale (their root mean square) bounds its error instead
(a random-weight model's logits are small: an absolute bound would hide a wrong model).

>>> ref, floor = reference_models(model)                # before the Generator attaches # doctest: +SKIP
>>> gen = Generator(model, ...)                                              # doctest: +SKIP
>>> with LogitsTap(gen) as tap:                                              # doctest: +SKIP
...     reqs = [gen.add(p, Sampling(max_new_tokens=32)) for p in prompts]
...     gen.run()
>>> report = compare(tap.rows(), ref, floor)                                 # doctest: +SKIP
>>> report.passed, report.summary()                                          # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidArgument
from .requests import Request

__all__ = ["Agreement", "LogitsTap", "Row", "compare", "kv8_floor", "reference_models"]

#: The served path's error may be this many times the noise floor's.
FACTOR = 1.5
#: The error bound without a noise floor (a float32 served configuration), relative to the
#: reference logits' root mean square.
ATOL = 1e-3


@dataclasses.dataclass(frozen=True)
class Row:
    """One sampled row of the served path: continuation ``k`` of ``request``, the ``context``
    (token ids) whose next-token logits it holds, those logits (float32, on the device they
    were computed on), and its kind: ``"prompt"`` (the row read the prompt's last token),
    ``"output"`` (a decode or verify row whose context is prompt + outputs), ``"draft"`` (a
    context holding a draft token the continuation did not keep)."""

    request: Request
    k: int
    context: tuple[int, ...]
    logits: torch.Tensor
    kind: str


class LogitsTap:
    """Records the logits a Generator samples from (``gen.on_logits``) while entered.

    ``keep(request)`` chooses the requests recorded (default: all); ``max_rows`` bounds the
    rows kept per continuation (the first ones; None: all). Kept rows stay on the model's
    device (copied: the runner reuses its buffers) until :meth:`rows`. Entering installs the
    tap (another ``on_logits`` is kept and restored on exit); a Generator without
    ``on_logits`` is refused (InvalidArgument).
    """

    def __init__(self, gen: Any, keep: Callable[[Request], bool] | None = None,
                 max_rows: int | None = None):
        if not hasattr(gen, "on_logits"):
            raise InvalidArgument(f"{type(gen).__name__} has no on_logits to tap")
        if keep is not None and not callable(keep):
            raise InvalidArgument(f"keep of type {type(keep).__name__} is not callable or None")
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int)
                                     or max_rows < 1):
            raise InvalidArgument(f"max_rows={max_rows!r} is not an int >= 1 or None")
        self.gen, self.keep, self.max_rows = gen, keep, max_rows
        self._before: Any = None
        self._kept: list[tuple[list[tuple[Request, int, Any]], torch.Tensor]] = []
        self._count: dict[tuple[int, int], int] = {}

    def __enter__(self) -> LogitsTap:
        self._before = self.gen.on_logits
        self.gen.on_logits = self._record
        return self

    def __exit__(self, *exc: object) -> None:
        self.gen.on_logits = self._before

    def _record(self, rows: Sequence[tuple[Request, int, Any]], logits: torch.Tensor) -> None:
        take, meta = [], []
        for i, (req, k, ctx) in enumerate(rows):
            if self.keep is not None and not self.keep(req):
                continue
            key = (req.id, k)
            n = self._count.get(key, 0)
            if self.max_rows is not None and n >= self.max_rows:
                continue
            self._count[key] = n + 1
            take.append(i)
            meta.append((req, k, ctx if isinstance(ctx, int) else tuple(ctx)))
        if take:
            index = torch.tensor(take, device=logits.device)
            self._kept.append((meta, logits.index_select(0, index).float()))

    def rows(self) -> list[Row]:
        """The recorded rows, contexts resolved: a row recorded with a position (its last
        token was still on the device) reads its continuation's tokens now, so call this
        after the requests ran. A continuation that never got that far (cancelled with the
        token in flight) drops the row."""
        out = []
        for meta, logits in self._kept:
            for j, (req, k, ctx) in enumerate(meta):
                full = list(req.prompt) + list(req.outputs[k])
                if isinstance(ctx, int):
                    if ctx > len(full):
                        continue
                    ctx = tuple(full[:ctx])
                n = len(ctx)
                if n <= len(req.prompt):
                    kind = "prompt"
                elif tuple(full[:n]) == ctx:
                    kind = "output"
                else:
                    kind = "draft"
                out.append(Row(req, k, ctx, logits[j], kind))
        return out


def reference_models(model: Any, dtype: torch.dtype | None = None,
                     device: str | torch.device | None = None) -> tuple[Any, Any | None]:
    """Two copies of ``model`` for :func:`compare`, made before a Generator attaches to it
    (which switches its attention): the reference in float32 and the noise floor in
    ``dtype`` (default the model's own; None when that is float32), both with HF's SDPA
    attention and in eval mode, on ``device`` (default the model's). ``device="cpu"``
    keeps them out of the GPU's memory until the comparison (an 8B model's two copies
    take 48 GB): move them to the rows' device for :func:`compare`."""
    dtype = dtype or next(model.parameters()).dtype
    elsewhere = device is not None and torch.device(device) != next(model.parameters()).device

    def copy_in(to: torch.dtype) -> Any:
        m = copy.deepcopy(model)
        if elsewhere:
            m = m.to(device)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()       # the copy's blocks, freed on the GPU: to the driver
        m = m.to(to).eval()
        m.set_attn_implementation("sdpa")
        return m

    ref = copy_in(torch.float32)
    floor = copy_in(dtype) if dtype != torch.float32 else None
    return ref, floor


#: The attention implementation :func:`kv8_floor` registers with transformers.
KV8_ATTENTION = "cellcache_kv8_reference"


def kv8_floor(floor: Any, view: Any) -> None:
    """Makes ``floor`` (:func:`reference_models`' noise-floor model) read K/V as a served
    configuration with 8-bit K/V stores them: each layer's keys and values divided by
    ``view``'s scales for that layer (``view.kv_scales``, read at each forward: the served
    run's first writes set them), saturated at ±448, rounded to e4m3, multiplied back, then
    HF's own SDPA attention. Call it once the served run has written every layer."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..torch import FP8_MAX

    def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        s = scale.to(x.device)[None, :, None, None]                     # x: [B, kv heads, T, D]
        q8 = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (q8.float() * s).to(x.dtype)

    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kwargs: Any) -> Any:
        scales = view.kv_scales(module.layer_idx)
        return sdpa_attention_forward(module, query, rounded(key, scales[0]), rounded(value, scales[1]),
                                      attention_mask, **kwargs)

    AttentionInterface.register(KV8_ATTENTION, attend)
    floor.set_attn_implementation(KV8_ATTENTION)


@dataclasses.dataclass
class Agreement:
    """:func:`compare`'s verdict. ``error_max``/``error_mean``: the served rows' largest and
    mean ``|Δlogit|`` against the float32 reference; ``noise_max``/``noise_mean``: the same
    for HF's own forward in the served dtype (0 without one); ``argmax_checked``: rows whose
    reference margin exceeds twice the row's noise (or ``atol``), ``argmax_mismatches`` those
    of them whose served argmax differs; ``scale``: the reference logits' root mean square
    (``atol`` is relative to it); ``by_kind``: the same errors by row kind (:class:`Row`);
    ``worst``: the rows with the largest error."""

    rows: int
    error_max: float
    error_mean: float
    noise_max: float
    noise_mean: float
    argmax_checked: int
    argmax_mismatches: int
    factor: float
    atol: float
    scale: float
    by_kind: dict[str, dict[str, float]]
    worst: list[dict[str, Any]]

    @property
    def passed(self) -> bool:
        """Within ``factor`` x the noise floor (plus ``atol`` x ``scale``) for the largest and
        the mean error, no argmax flipped where the margin is clear, and at least one row
        compared."""
        slack = self.atol * self.scale
        return (self.rows > 0 and self.argmax_mismatches == 0
                and self.error_max <= self.factor * self.noise_max + slack
                and self.error_mean <= self.factor * self.noise_mean + slack)

    def summary(self) -> str:
        """One line: the verdict and the figures it rests on."""
        ratio = (f"{self.error_max / self.noise_max:.2f}x / {self.error_mean / self.noise_mean:.2f}x "
                 "the noise floor" if self.noise_max > 0 and self.noise_mean > 0 else "no noise floor")
        return (f"{'PASS' if self.passed else 'FAIL'}: {self.rows} rows, max |dlogit| "
                f"{self.error_max:.4g} (noise {self.noise_max:.4g}), mean {self.error_mean:.4g} "
                f"(noise {self.noise_mean:.4g}), {ratio}; argmax "
                f"{self.argmax_checked - self.argmax_mismatches}/{self.argmax_checked} "
                "where the margin is clear")

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed, "summary": self.summary()}


def _sequences(rows: Sequence[Row]) -> list[tuple[tuple[int, ...], list[int]]]:
    """The forwards that cover ``rows``: each row's context is a prefix of one sequence, the
    row reading that sequence's position ``len(context) - 1``. Rows of one continuation share
    its longest context; other contexts (drafts) get their own."""
    longest: dict[tuple[int, int], tuple[int, ...]] = {}
    for r in rows:
        key = (r.request.id, r.k)
        if r.kind != "draft" and len(r.context) > len(longest.get(key, ())):
            longest[key] = r.context
    seqs: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        full = longest.get((r.request.id, r.k))
        seq = full if r.kind != "draft" and full is not None else r.context
        seqs.setdefault(seq, []).append(i)
    return list(seqs.items())


@torch.no_grad()
def _logits_at(model: Any, seq: tuple[int, ...], positions: list[int]) -> torch.Tensor:
    """float32 logits of ``model``'s forward over ``seq`` at ``positions``."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(seq)], device=device)
    keep = torch.tensor(positions, device=device)
    try:
        out = model(ids, logits_to_keep=keep).logits[0]
    except TypeError:                     # a model without logits_to_keep
        out = model(ids).logits[0, keep]
    return out.float()


@torch.no_grad()
def compare(rows: Sequence[Row], reference: Any, noise: Any | None = None, *,
            factor: float = FACTOR, atol: float = ATOL, worst: int = 5) -> Agreement:
    """Compares the served ``rows`` (:meth:`LogitsTap.rows`) with ``reference`` (the model in
    float32) and ``noise`` (the model in the served dtype; None: no noise floor, ``atol``
    alone bounds the error): one forward of each model per sequence the rows read
    (:func:`_sequences`). Returns the :class:`Agreement`."""
    if not math.isfinite(factor) or factor <= 0 or not math.isfinite(atol) or atol < 0:
        raise InvalidArgument(f"factor={factor} must be > 0 and atol={atol} >= 0 (finite)")
    err_max, err_mean, nz_max, nz_mean = [], [], [], []
    checked = mismatched = 0
    square_sum, count = 0.0, 0
    kinds: list[str] = []
    where: list[tuple[float, int, int, str, int]] = []
    for seq, members in _sequences(rows):
        positions = [len(rows[i].context) - 1 for i in members]
        ref = _logits_at(reference, seq, positions)
        floor = _logits_at(noise, seq, positions) if noise is not None else None
        served = torch.stack([rows[i].logits.to(ref.device) for i in members])
        if served.shape != ref.shape:
            raise InvalidArgument(f"served logits {list(served.shape)} and the reference's "
                                  f"{list(ref.shape)} differ: is it the same model?")
        square_sum += float(ref.square().sum())
        count += ref.numel()
        d = (served - ref).abs()
        e_max, e_mean = d.amax(-1), d.mean(-1)
        if floor is not None:
            dn = (floor - ref).abs()
            n_max, n_mean = dn.amax(-1), dn.mean(-1)
        else:
            n_max = n_mean = torch.zeros_like(e_max)
        top2 = ref.topk(2, dim=-1)
        margin = top2.values[:, 0] - top2.values[:, 1]
        clear = margin > 2 * n_max + atol * ref.square().mean().sqrt()
        flipped = clear & (served.argmax(-1) != top2.indices[:, 0])
        checked += int(clear.sum())
        mismatched += int(flipped.sum())
        for j, i in enumerate(members):
            r = rows[i]
            err_max.append(float(e_max[j]))
            err_mean.append(float(e_mean[j]))
            nz_max.append(float(n_max[j]))
            nz_mean.append(float(n_mean[j]))
            kinds.append(r.kind)
            where.append((float(e_max[j]), r.request.id, r.k, r.kind, len(r.context)))
    by_kind: dict[str, dict[str, float]] = {}
    for kind in sorted(set(kinds)):
        ix = [i for i, k in enumerate(kinds) if k == kind]
        by_kind[kind] = {"rows": len(ix), "error_max": max(err_max[i] for i in ix),
                         "error_mean": sum(err_mean[i] for i in ix) / len(ix),
                         "noise_max": max(nz_max[i] for i in ix),
                         "noise_mean": sum(nz_mean[i] for i in ix) / len(ix)}
    where.sort(reverse=True)
    n = len(err_max)
    return Agreement(
        rows=n, error_max=max(err_max, default=0.0), error_mean=sum(err_mean) / n if n else 0.0,
        noise_max=max(nz_max, default=0.0), noise_mean=sum(nz_mean) / n if n else 0.0,
        argmax_checked=checked, argmax_mismatches=mismatched, factor=factor, atol=atol,
        scale=math.sqrt(square_sum / count) if count else 0.0, by_kind=by_kind,
        worst=[{"error_max": e, "request": rid, "k": k, "kind": kind, "context_len": n_ctx}
               for e, rid, k, kind, n_ctx in where[:worst]])
