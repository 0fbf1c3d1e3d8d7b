"""cellcache: the KV cache of a batched LLM runner, as cells shared by many sequences."""

from ._table import CellTable
from .cache import CellCache, LayerBuffers, Step
from .config import CacheConfig, LayerConfig
from .errors import (
    CellCacheError,
    CudaError,
    InvalidArgument,
    InvalidState,
    OutOfMemory,
    StepTooLarge,
)
from .host import HostCellCache
from .prefix import PrefixCache
from .reference import POS_FREE, ReferenceTable
from .registry import build, register_builder

try:
    from importlib.metadata import version as _version

    __version__ = _version("cellcache")
except Exception:  # noqa: BLE001 - running from a source tree that was never installed
    __version__ = "0+unknown"

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
    "LayerBuffers",
    "LayerConfig",
    "OutOfMemory",
    "PrefixCache",
    "ReferenceTable",
    "Step",
    "StepTooLarge",
    "__version__",
    "build",
    "register_builder",
]
