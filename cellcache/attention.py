"""The reference consumer: how a forward must use the step buffers (numpy, float32 math).

This is the contract for runner authors, written as code:

1. After ``prepare_step``, write each step row's K and V into the layer's pools at
   ``cells[:pad_to]`` (:func:`write_kv`); padding rows' cells name the sink row, which no
   real query ever sees.
2. For each real query row ``i < width``, attend either over pool rows ``[0, read_len)``
   under the layer's mask row ``i`` (:func:`attend_masked`), or over the row's request in
   the paged view (:func:`attend_paged`): its kv list ``kv_indices[kv_indptr[r]:
   kv_indptr[r + 1]]`` in position order, causal and aligned to the list's end, with
   ``window_left = window - 1``. ``read_len`` and ``width`` are read from their buffers,
   never from Python state, so a captured graph sees each step's values.
3. Rows past ``width`` are padding (discard their outputs); rows past ``pad_to`` and columns
   past ``read_len`` hold stale values: never read them.

Grouped-query attention is allowed: ``n_heads`` is a multiple of the layer's
``n_kv_heads``, query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``.
:func:`dense_attention` is the same computation with no cache at all (one sequence's own
history and window): the oracle of the demo and the tests.
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgument

__all__ = ["attend", "attend_masked", "attend_paged", "dense_attention", "reference_forward",
           "write_kv"]


def _as_host(array) -> np.ndarray:
    return array.copy_to_host() if hasattr(array, "copy_to_host") else np.asarray(array)


def write_kv(cache, layer: int, k: np.ndarray, v: np.ndarray, width: int,
             pad_to: int | None = None) -> None:
    """Writes the step's K and V (``[width, n_kv_heads, head_dim]``) at ``cells[:width]`` and
    NaN rows for the padding rows ``[width, pad_to)`` (at the sink): a padding row's K/V is
    garbage, and a cache that let a real query see it would turn its output into NaN.

    On a CUDA cache the rows go up and the ``store_kv`` kernel writes them, reading
    ``cells`` on the device as a forward does.
    """
    if cache.config.kv8:
        raise InvalidArgument(f"the reference K/V write does not take 8-bit pools ({cache.config.kv_dtype}): "
                              "write through cellcache.torch.attention, which scales them")
    pad_to = width if pad_to is None else pad_to
    if cache.backend == "cuda":
        from .cuda.kernels import write_rows

        write_rows(cache, layer, k, v, width, pad_to)
        return
    lay = cache.layer(layer)
    cells = np.asarray(cache.buffer("cells"))[:pad_to]
    k_rows = np.full((pad_to,) + k.shape[1:], np.nan, np.float32)
    v_rows = np.full((pad_to,) + v.shape[1:], np.nan, np.float32)
    k_rows[:width], v_rows[:width] = k[:width], v[:width]
    lay.k[cells] = k_rows.astype(lay.k.dtype)
    lay.v[cells] = v_rows.astype(lay.v.dtype)


def attend(cache, layer: int, q: np.ndarray, width: int) -> np.ndarray:
    """Attention of the step's real queries (``[width, n_heads, head_dim]``): through the
    layer's mask when the cache has masks, else through the paged view."""
    if cache.config.mask_format != "none":
        return attend_masked(cache, layer, q, width)
    return attend_paged(cache, layer, q, width)


def _mask_rows(cache, window: int, width: int, read_len: int) -> np.ndarray:
    mask = _as_host(cache.buffer(f"mask_w{window}"))
    if cache.config.mask_format == "bits":
        bits = np.unpackbits(mask[:width], axis=1, bitorder="little")
        return bits[:, :read_len].astype(bool)
    return mask[0, 0, :width, :read_len].astype(bool)


def attend_masked(cache, layer: int, q: np.ndarray, width: int) -> np.ndarray:
    """Attention over pool rows ``[0, read_len)`` under the layer's mask (bool or bits).

    Returns ``[width, n_heads, head_dim]`` float32. Softmax in float32, scale 1/sqrt(d).
    """
    lay = cache.layer(layer)
    read_len = int(_as_host(cache.buffer("read_len"))[0])
    mask = _mask_rows(cache, lay.window, width, read_len)
    k = _as_host(lay.k)[:read_len].astype(np.float32)
    v = _as_host(lay.v)[:read_len].astype(np.float32)
    return _masked_attention(q[:width].astype(np.float32), k, v, mask)


def attend_paged(cache, layer: int, q: np.ndarray, width: int) -> np.ndarray:
    """Attention of each real query over its request in the paged view (FlashInfer's
    page-size-1 layout: causal, aligned to the end of the list, ``window_left = W - 1``)."""
    lay = cache.layer(layer)
    qo = _as_host(cache.buffer("qo_indptr"))
    kv = _as_host(cache.buffer("kv_indptr"))
    indices = _as_host(cache.buffer("kv_indices"))
    k_pool, v_pool = _as_host(lay.k), _as_host(lay.v)
    out = np.empty(q[:width].shape, np.float32)
    r = 0
    for i in range(width):
        while not qo[r] <= i < qo[r + 1]:
            r += 1
        entries = indices[kv[r]:kv[r + 1]]
        last = len(entries) - (qo[r + 1] - qo[r]) + (i - qo[r])
        lo = 0 if lay.window == 0 else max(0, last - lay.window + 1)
        rows = entries[lo:last + 1]
        k = k_pool[rows].astype(np.float32)
        v = v_pool[rows].astype(np.float32)
        out[i] = _masked_attention(q[i:i + 1].astype(np.float32), k, v,
                                   np.ones((1, len(rows)), bool))[0]
    return out


def reference_forward(cache, step, qkv) -> list[np.ndarray]:
    """A whole forward through the reference consumer: per layer, write K/V (padding rows
    included) then attend; returns each layer's outputs for the real rows."""
    outputs = []
    for li, (q, k, v) in enumerate(qkv):
        write_kv(cache, li, k, v, step.width, step.pad_to)
        outputs.append(attend(cache, li, q, step.width))
    return outputs


def _masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    # q [n, H, d]; k, v [m, Hkv, d]; mask [n, m]. Masked-out K/V never enter the sums, so a
    # row of stale or garbage (even NaN) K/V that no query sees changes nothing.
    n, n_heads, d = q.shape
    out = np.zeros((n, n_heads, d), np.float32)
    if k.shape[0] == 0:
        return out
    group = n_heads // k.shape[1]
    for i in range(n):
        cols = np.flatnonzero(mask[i])
        if cols.size == 0:
            continue
        kh = np.repeat(k[cols], group, axis=1)             # [m, H, d]
        vh = np.repeat(v[cols], group, axis=1)
        scores = np.einsum("hd,mhd->hm", q[i], kh, dtype=np.float32) / np.float32(np.sqrt(d))
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores, dtype=np.float32)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[i] = np.einsum("hm,mhd->hd", weights, vh, dtype=np.float32)
    return out


def dense_attention(q: np.ndarray, k_hist: np.ndarray, v_hist: np.ndarray, p: int,
                    window: int) -> np.ndarray:
    """One query at position ``p`` of one sequence, over its own history with no cache.

    ``k_hist``/``v_hist`` are ``[>= p + 1, n_kv_heads, head_dim]`` (position-indexed, the
    query's own K/V at ``p``); the query sees positions ``(p - window, p]`` (all ``<= p`` when
    window is 0). Returns ``[n_heads, head_dim]`` float32.
    """
    lo = 0 if window == 0 else max(0, p - window + 1)
    k = k_hist[lo:p + 1].astype(np.float32)
    v = v_hist[lo:p + 1].astype(np.float32)
    mask = np.ones((1, p + 1 - lo), dtype=bool)
    return _masked_attention(q[None].astype(np.float32), k, v, mask)[0]
