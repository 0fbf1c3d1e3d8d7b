"""Build of the Cython extensions and, when nvcc is present, the shipped PTX.

Metadata lives in pyproject.toml. Cython directives are set once, here:
``CELLCACHE_CYTHON_DEBUG=1`` turns bounds checks and wraparound back on (CI runs the
suite once that way).
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("CELLCACHE_CYTHON_DEBUG", "") not in ("", "0")

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
    "auto_pickle": False,       # raw pointers: a table is not picklable
    "autotestdict": False,
}

extensions = [
    Extension(
        f"cellcache._{name}",
        [f"pyx/_{name}.pyx"],
        extra_compile_args=["-O2"] if not DEBUG else ["-O0", "-g"],
    )
    for name in ("table",)
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        include_path=["."],
        build_dir="build/cython-debug" if DEBUG else "build/cython",
    ),
)
