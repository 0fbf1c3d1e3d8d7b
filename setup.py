"""Build of the Cython extensions and, when nvcc is present, the shipped PTX.

Metadata lives in pyproject.toml. Cython directives are set once, here:
``CELLCACHE_CYTHON_DEBUG=1`` turns bounds checks and wraparound back on (CI runs the
suite once that way).
"""

import os
import shutil
import subprocess
import sys

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
    for name in ("table", "driver")
]

# The PTX in cellcache/ptx/ is package data built from cuda/*.cu. Rebuild it only when a
# source changed and nvcc is here; without nvcc the shipped PTX is used as it is.
if shutil.which("nvcc") and os.path.exists("tools/build_ptx.py"):
    subprocess.run([sys.executable, "tools/build_ptx.py", "--if-stale"], check=True)

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        include_path=["."],
        build_dir="build/cython-debug" if DEBUG else "build/cython",
    ),
)
