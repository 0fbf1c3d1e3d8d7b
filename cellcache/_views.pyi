from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._table import CellTable

def fill_masks(
    table: CellTable,
    seq_ids: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    read_len: int,
    windows: Sequence[int],
    outs: Sequence[npt.NDArray[Any]],
    pad_to: int | None = None,
    bits: bool = False,
) -> None: ...
def fill_paged(
    table: CellTable,
    seq_ids: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    pad_to: int,
    sink: int,
    qo_indptr: npt.NDArray[np.int32],
    kv_indptr: npt.NDArray[np.int32],
    kv_indices: npt.NDArray[np.int32],
) -> tuple[int, int]: ...

# Cython's table of the C declarations in cellcache/_views.pxd (cimported by cuda/_engine)
__pyx_capi__: dict[str, Any]
