"""The reference consumer: how a forward must use the step buffers (numpy, float32 math).

This is the contract for runner authors, written as code:

1. After ``prepare_step``, write each step token's K and V into the layer's pools at
   ``cells[:width]`` (:func:`write_kv`).
2. For each query row ``i < width``, attend over pool rows ``[0, read_len)`` with the layer's
   mask ``mask_w{window}[0, 0, i, :read_len]`` (:func:`attend`). ``read_len`` is read from its
   buffer, never from Python state, so a captured graph sees each step's value.
3. Rows past ``width`` and columns past ``read_len`` hold stale values: never read them.

Grouped-query attention is allowed: ``n_heads`` is a multiple of the layer's
``n_kv_heads``, query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``.

:func:`dense_attention` is the same computation with no cache at all (one sequence's own
history and window), which the demo and the tests use as the oracle.
"""

from __future__ import annotations

import numpy as np

__all__ = ["attend", "dense_attention", "write_kv"]


def _as_host(array) -> np.ndarray:
    return array.copy_to_host() if hasattr(array, "copy_to_host") else np.asarray(array)


def write_kv(cache, layer: int, k: np.ndarray, v: np.ndarray, width: int) -> None:
    """Writes the step's K and V (``[width, n_kv_heads, head_dim]``) at ``cells[:width]``.

    On the host backend this is numpy fancy assignment into the pools; on the CUDA backend
    the cache's ``write_kv`` runs the ``scatter_rows`` kernel, which reads ``cells`` on the
    device exactly as a forward's own K/V write would.
    """
    k_pool = cache.buffer(f"layer_{layer}_k")
    v_pool = cache.buffer(f"layer_{layer}_v")
    if not isinstance(k_pool, np.ndarray):
        cache.write_kv(layer, k, v, width)
        return
    cells = np.asarray(cache.buffer("cells"))[:width]
    k_pool[cells] = k.astype(k_pool.dtype)
    v_pool[cells] = v.astype(v_pool.dtype)


def attend(cache, layer: int, q: np.ndarray, width: int) -> np.ndarray:
    """Attention of the step's queries (``[width, n_heads, head_dim]``) over the pools.

    Returns ``[width, n_heads, head_dim]`` float32. Softmax in float32, scale 1/sqrt(d).
    """
    cfg = cache.config.layers[layer]
    read_len = int(_as_host(cache.buffer("read_len"))[0])
    mask = _as_host(cache.buffer(f"mask_w{cfg.window}"))[0, 0, :width, :read_len]
    k = _as_host(cache.buffer(f"layer_{layer}_k"))[:read_len].astype(np.float32)
    v = _as_host(cache.buffer(f"layer_{layer}_v"))[:read_len].astype(np.float32)
    return _masked_attention(q.astype(np.float32), k, v, mask.astype(bool))


def _masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    # q [n, H, d]; k, v [m, Hkv, d]; mask [n, m]
    n, n_heads, d = q.shape
    group = n_heads // k.shape[1]
    kh = np.repeat(k, group, axis=1)                       # [m, H, d]
    vh = np.repeat(v, group, axis=1)
    scores = np.einsum("nhd,mhd->hnm", q, kh, dtype=np.float32) / np.float32(np.sqrt(d))
    scores = np.where(mask[None, :, :], scores, np.float32(-np.inf))
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - top, dtype=np.float32)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hnm,mhd->nhd", weights, vh, dtype=np.float32)


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
