"""cellcache: the KV cache of a batched LLM runner, as cells shared by many sequences."""

from ._table import CellTable
from .errors import CellCacheError, CudaError, InvalidArgument, InvalidState, OutOfMemory
from .reference import POS_FREE, ReferenceTable

__all__ = [
    "POS_FREE",
    "CellCacheError",
    "CellTable",
    "CudaError",
    "InvalidArgument",
    "InvalidState",
    "OutOfMemory",
    "ReferenceTable",
]
