"""cellcache: the KV cache of a batched LLM runner, as cells shared by many sequences."""

from ._table import CellTable
from .cache import CellCache, Step
from .config import CacheConfig, LayerConfig
from .errors import CellCacheError, CudaError, InvalidArgument, InvalidState, OutOfMemory
from .host import HostCellCache
from .reference import POS_FREE, ReferenceTable
from .registry import build, register_builder

__all__ = [
    "POS_FREE",
    "CacheConfig",
    "CellCache",
    "CellCacheError",
    "CellTable",
    "CudaError",
    "HostCellCache",
    "InvalidArgument",
    "InvalidState",
    "LayerConfig",
    "OutOfMemory",
    "ReferenceTable",
    "Step",
    "build",
    "register_builder",
]

from .registry import _register_defaults  # noqa: E402

_register_defaults()
del _register_defaults
