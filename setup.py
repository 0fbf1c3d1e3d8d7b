"""Build of the Cython extensions (metadata lives in pyproject.toml).

Each ``pyx/<path>.pyx`` becomes the private module ``cellcache.<path>``; its declarations
(``.pxd``) and stub (``.pyi``) sit in the package beside the built module. Cython directives
are set once, here. ``CELLCACHE_CYTHON_DEBUG=1`` turns bounds checks and the table's
assumption checks on (CI runs the suite once that way); ``CELLCACHE_PROFILE=1`` makes the
step engine time its host phases. The PTX kernels are package data built by
``tools/build_ptx.py`` and checked in; installing needs no CUDA compiler, header or GPU.
"""

import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup


def flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


DEBUG = flag("CELLCACHE_CYTHON_DEBUG")
PROFILE = flag("CELLCACHE_PROFILE")

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
    "auto_pickle": False,       # raw pointers: nothing here is picklable
    "autotestdict": False,
}
macros = [("CELLCACHE_DEBUG", "1")] if DEBUG else []
if PROFILE:
    macros.append(("CELLCACHE_PROFILE", "1"))

# the debug checks' messages are unused strings in a release build
WARNINGS = [] if sys.platform == "win32" else ["-Wno-unused-const-variable"]

# module -> source: pyx/<path>.pyx builds cellcache.<path>
MODULES = {
    "cellcache._table": "pyx/_table.pyx",
    "cellcache._views": "pyx/_views.pyx",
    "cellcache.cuda._launch": "pyx/cuda/_launch.pyx",
    "cellcache.cuda._dlpack": "pyx/cuda/_dlpack.pyx",
    "cellcache.cuda._engine": "pyx/cuda/_engine.pyx",
}
# headers and declarations a module may include or cimport
DEPENDS = ["cuda/abi.h", "cellcache/_table.pxd", "cellcache/_views.pxd", "cellcache/_bitset.pxd",
           "cellcache/cuda/_launch.pxd"]

extensions = [
    Extension(
        name,
        [source],
        include_dirs=["."],
        define_macros=macros,
        extra_compile_args=(["-O0", "-g"] if DEBUG else ["-O2"]) + WARNINGS,
        depends=DEPENDS,
    )
    for name, source in MODULES.items()
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        include_path=["."],
        build_dir="build/cython-debug" if DEBUG else "build/cython",
    ),
)
