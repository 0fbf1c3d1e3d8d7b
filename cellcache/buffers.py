"""The step buffers, described once.

Every buffer a forward reads or writes is a :class:`BufferSpec` derived from the
:class:`~cellcache.config.CacheConfig`: its name, dtype, shape, role and initial value, and
what ``prepare_step`` writes into it. Both backends allocate from these specs,
:class:`cellcache.torch.TorchView` maps them by role, ``metrics()`` counts their bytes, and
a test renders the README's buffer table from them. A new buffer is one entry here.

>>> from cellcache.config import CacheConfig, LayerConfig
>>> cfg = CacheConfig(capacity=64, layers=[LayerConfig(1, 8)], max_write=4)
>>> [(s.name, s.shape) for s in step_buffers(cfg)]
[('cells', (4,)), ('positions', (4,)), ('read_len', (1,)), ('width', (1,)), ('mask_w0', (1, 1, 4, 64))]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import CacheConfig

__all__ = ["PAGED_ROLES", "BufferSpec", "buffer_names", "mask_row_bytes", "pool_spec",
           "readme_table", "step_buffer_bytes", "step_buffers"]

#: The roles of the paged view's buffers (FlashInfer's page-size-1 CSR layout).
PAGED_ROLES = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")


@dataclass(frozen=True)
class BufferSpec:
    """One buffer: ``name`` as ``cache.buffer(name)`` knows it, ``dtype``, ``shape`` for
    this config, ``role`` (what a consumer uses it for: ``"cells"``, ``"positions"``,
    ``"read_len"``, ``"width"``, ``"mask"``, ``"qo_indptr"``, ``"kv_indptr"``,
    ``"kv_indices"``, ``"kv_last_page_len"``, ``"k"``, ``"v"``), ``window`` (masks) or
    ``layer`` (pools), ``fill`` (the value it starts with), and for the docs its shape in
    config terms, when it exists and what ``prepare_step(pad_to=B)`` writes."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    role: str
    fill: int = 0
    window: int | None = None
    layer: int | None = None
    shape_doc: str = ""
    when: str = ""
    written: str = ""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the first axis (a pool: one cell row)."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize


def mask_row_bytes(config: CacheConfig) -> int:
    """Bytes of one mask row: ``capacity`` bools, ``ceil(capacity / 8)`` packed bits, or 0
    without masks. The one place the mask width is computed."""
    if config.mask_format == "none":
        return 0
    return config.capacity if config.mask_format == "bool" else (config.capacity + 7) // 8


def step_buffers(config: CacheConfig) -> list[BufferSpec]:
    """The step buffers of ``config`` in ``buffer_names`` order (pools excluded: they grow,
    see :func:`pool_spec`). All are allocated once, zeroed (``fill`` aside), and never move."""
    mw = config.max_write
    i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
    out = [
        BufferSpec("cells", i64, (mw,), "cells", shape_doc="[max_write]",
                   written="`[0, B)`: the real rows' cells, then the sink row for padding rows"),
        BufferSpec("positions", i64, (mw,), "positions", shape_doc="[max_write]",
                   written="`[0, B)`: padding rows repeat row 0's position"),
        BufferSpec("read_len", i64, (1,), "read_len", shape_doc="[1]",
                   written="`used_end` after placement"),
        BufferSpec("width", i64, (1,), "width", shape_doc="[1]",
                   written="the real width (rows `[width, B)` are padding)"),
    ]
    if config.mask_format == "bool":
        out += [BufferSpec(f"mask_w{w}", np.dtype(np.bool_), (1, 1, mw, config.capacity), "mask",
                           window=w, shape_doc="[1, 1, max_write, capacity]",
                           when='`mask_format="bool"`',
                           written="rows `[0, B)` × cols `[0, read_len)`; padding rows repeat row 0")
                for w in config.windows]
    elif config.mask_format == "bits":
        out += [BufferSpec(f"mask_w{w}", np.dtype(np.uint8), (mw, mask_row_bytes(config)), "mask",
                           window=w, shape_doc="[max_write, ceil(capacity/8)]",
                           when='`mask_format="bits"`',
                           written="the same, bit j of a row = column j, little-endian")
                for w in config.windows]
    if config.paged:
        out += [
            BufferSpec("qo_indptr", i32, (mw + 1,), "qo_indptr", shape_doc="[max_write + 1]",
                       when="`paged=True`", written="entries `[0, B]`"),
            BufferSpec("kv_indptr", i32, (mw + 1,), "kv_indptr", shape_doc="[max_write + 1]",
                       when="`paged=True`", written="entries `[0, B]`"),
            BufferSpec("kv_indices", i32, (config.max_kv + mw,), "kv_indices",
                       shape_doc="[max_kv + max_write]", when="`paged=True`",
                       written="each request's cells in position order"),
            BufferSpec("kv_last_page_len", i32, (mw,), "kv_last_page_len", fill=1,
                       shape_doc="[max_write]", when="`paged=True`", written="all ones (page size 1)"),
        ]
    return out


def pool_spec(config: CacheConfig, layer: int, kv: str, rows: int) -> BufferSpec:
    """Layer ``layer``'s K (``kv="k"``) or V pool with ``rows`` cell rows plus the sink row."""
    la = config.layers[layer]
    return BufferSpec(f"layer_{layer}_{kv}", config.np_dtype, (rows + 1, la.n_kv_heads, la.head_dim),
                      kv, layer=layer, shape_doc="[sink + 1, n_kv_heads, head_dim]",
                      written="never: the forward writes K/V at `cells`")


def buffer_names(config: CacheConfig) -> list[str]:
    """Every buffer a forward may read or write: the step buffers, then each layer's pools."""
    return [s.name for s in step_buffers(config)] + [
        f"layer_{i}_{kv}" for i in range(len(config.layers)) for kv in "kv"]


def step_buffer_bytes(config: CacheConfig) -> int:
    """Bytes of all step buffers of ``config``."""
    return sum(s.nbytes for s in step_buffers(config))


def readme_table() -> str:
    """The README's buffer table (markdown), rendered from the specs of every format."""
    from .config import LayerConfig

    rows: list[str] = []
    seen: set[tuple[str, ...]] = set()
    def example(fmt: str) -> list[BufferSpec]:
        return step_buffers(CacheConfig(capacity=8, layers=[LayerConfig(1, 1)], max_write=2,
                                        paged=True, mask_format=fmt))

    specs = example("bool")
    after_masks = max(i for i, s in enumerate(specs) if s.role == "mask") + 1
    specs[after_masks:after_masks] = [s for s in example("bits") if s.role == "mask"]
    specs.append(pool_spec(CacheConfig(capacity=8, layers=[LayerConfig(1, 1)], max_write=2), 0, "k", 0))
    groups: list[tuple[list[str], BufferSpec]] = []
    for s in specs:
        name = "mask_w{W}" if s.role == "mask" else "layer_{l}_k" if s.role == "k" else s.name
        key = (name, s.when)
        if key in seen:
            continue
        seen.add(key)
        prev = groups[-1] if groups else None
        if prev and (prev[1].dtype, prev[1].shape_doc, prev[1].when, prev[1].written) == (
                s.dtype, s.shape_doc, s.when, s.written):
            prev[0].append(name)
        else:
            groups.append(([name], s))
    rows.append("| name | dtype | shape | written by `prepare_step(pad_to=B)` |")
    rows.append("|---|---|---|---|")
    for names, s in groups:
        shown = ", ".join(f"`{n}`" for n in names)
        if s.role == "k":
            shown, dtype = "`layer_{l}_k`, `layer_{l}_v`", "config dtype"
        else:
            dtype = s.dtype.name
        if s.when:
            shown += f" ({s.when})"
        rows.append(f"| {shown} | {dtype} | `{s.shape_doc}` | {s.written} |")
    return "\n".join(rows)
