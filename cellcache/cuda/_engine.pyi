from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from .._table import CellTable

MAX_WINDOWS: int
STEP_THREADS: int
MASK_COLS: int
MASK_MAX_ROWS: int
PARAMS_BYTES: int
ATTN_THREADS: int
PREFILL_K: int
PREFILL_PAIRS: int
PROFILED: bool
MASK_FORMATS: dict[str, int]
ENTRY_POINTS: tuple[str, ...]
KDL_CUDA: int

def set_entry_points(pointers: dict[str, int]) -> None: ...
def entry_points_set() -> bool: ...
def staging_words(max_write: int, owner_words: int, records: int) -> int: ...
def fill_params(f: dict[str, Any]) -> bytes: ...
def paged_args(
    qo_indptr: int, kv_indptr: int, kv_indices: int, width: int, q_s_tok: int, q_s_head: int,
    o_s_tok: int, o_s_head: int, n_rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
    window: int, scale: float,
) -> bytes: ...
def launch(
    fn: int, grid: tuple[int, int, int], block: int, smem: int, stream: int, args: bytes,
    offsets: tuple[int, ...],
) -> None: ...
def dlpack_capsule(
    owner: object, ptr: int, shape: tuple[int, ...], code: int, bits: int, device_id: int
) -> Any: ...
@disjoint_base
class StepEngine:
    @property
    def records_sent(self) -> int: ...
    @property
    def launches(self) -> int: ...
    def __init__(
        self,
        table: CellTable,
        ctx: int,
        fn_apply: int,
        fn_build: int,
        params: int,
        slot_words: int,
        host_slots: tuple[int, ...],
        dev_slots: tuple[int, ...],
        slot_events: tuple[int, ...],
        commit_event: int,
        sm_count: int,
        paged: bool,
        masks: bool,
        seq_ids: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        cells: npt.NDArray[np.int64],
    ) -> None: ...
    def is_capturing(self, stream: int) -> int: ...
    def order_after_commit(self, stream: int) -> int: ...
    def order_after_step(self, stream: int) -> int: ...
    def commit(self, stream: int) -> int: ...
    def synchronize(self) -> int: ...
    def write_step(
        self, width: int, pad_to: int, read_len: int, sink: int, stream: int
    ) -> tuple[int, npt.NDArray[np.int32] | None, npt.NDArray[np.int32] | None]: ...
    def phase_ns(self, reset: bool = True) -> dict[str, int]: ...
