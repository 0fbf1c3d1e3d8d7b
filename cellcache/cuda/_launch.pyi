from typing import Any

ATTN_THREADS: int
PREFILL_K: int
PREFILL_PAIRS: int
ENTRY_POINTS: tuple[str, ...]

def set_entry_points(pointers: dict[str, int]) -> None: ...
def entry_points_set() -> bool: ...
def paged_args(
    qo_indptr: int, kv_indptr: int, kv_indices: int, width: int, q_s_tok: int, q_s_head: int,
    o_s_tok: int, o_s_head: int, n_rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
    window: int, scale: float,
) -> bytes: ...
def launch(
    fn: int, grid: tuple[int, int, int], block: int, smem: int, stream: int, args: bytes,
    offsets: tuple[int, ...],
) -> None: ...
def copy_to_host(dst: int, src: int, nbytes: int, stream: int, event: int) -> None: ...

# Cython's table of the C declarations in cellcache/cuda/_launch.pxd (cimported by _engine)
__pyx_capi__: dict[str, Any]
