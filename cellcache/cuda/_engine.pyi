from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from .._table import CellTable

MAX_WINDOWS: int
STEP_THREADS: int
MASK_COLS: int
MASK_MAX_ROWS: int
PARAMS_BYTES: int
PROFILED: bool
MASK_FORMATS: dict[str, int]

def staging_words(max_write: int, owner_words: int, records: int) -> int: ...
def step_params(
    *,
    capacity: int,
    owner_words: int,
    bit_words: int,
    max_write: int,
    n_windows: int,
    paged: int,
    mask_format: int,
    mask_row_bytes: int,
    pos: int,
    owners: int,
    seqbits: int,
    cells: int,
    positions: int,
    read_len: int,
    width: int,
    seq_ids: int,
    windows: Sequence[int],
    masks: Sequence[int],
    qo_indptr: int = 0,
    kv_indptr: int = 0,
    kv_indices: int = 0,
    run_seq: int = 0,
    run_last: int = 0,
    run_kv: int = 0,
) -> bytes: ...
@disjoint_base
class EngineResources:
    @property
    def ctx(self) -> int: ...
    @property
    def fn_apply(self) -> int: ...
    @property
    def fn_build(self) -> int: ...
    @property
    def params(self) -> int: ...
    @property
    def slot_words(self) -> int: ...
    @property
    def host_slots(self) -> tuple[int, int]: ...
    @property
    def dev_slots(self) -> tuple[int, int]: ...
    @property
    def slot_events(self) -> tuple[int, int]: ...
    @property
    def commit_event(self) -> int: ...
    @property
    def sm_count(self) -> int: ...
    @property
    def paged(self) -> bool: ...
    @property
    def masks(self) -> bool: ...
    def __init__(
        self,
        *,
        ctx: int,
        fn_apply: int,
        fn_build: int,
        params: int,
        slot_words: int,
        host_slots: Sequence[int],
        dev_slots: Sequence[int],
        slot_events: Sequence[int],
        commit_event: int,
        sm_count: int,
        paged: bool,
        masks: bool,
    ) -> None: ...
@disjoint_base
class StepEngine:
    @property
    def target_blocks(self) -> int: ...
    @target_blocks.setter
    def target_blocks(self, value: int) -> None: ...
    @property
    def records_sent(self) -> int: ...
    @property
    def launches(self) -> int: ...
    def __init__(
        self,
        table: CellTable,
        resources: EngineResources,
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
