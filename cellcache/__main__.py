"""``python -m cellcache COMMAND`` (also the ``cellcache`` console script)."""

from __future__ import annotations

import importlib.util
import sys

from ._cli import run_main
from .errors import CellCacheError

USAGE = """usage: cellcache COMMAND [options]

commands:
  demo       simulated serving session, every token checked (cellcache demo --help)
  generate   serve a Hugging Face model through the cache (cellcache generate --help;
             needs the 'hf' extra: pip install 'cellcache[hf]')
  serve      OpenAI-compatible HTTP server for a local checkpoint (cellcache serve --help;
             needs the 'serve' extra: pip install 'cellcache[serve]')
"""

#: What ``generate`` imports beyond the core: the modules of the ``hf`` extra.
HF_EXTRA = ("torch", "transformers")


def _missing_hf_extra() -> str | None:
    """The first module of the ``hf`` extra that cannot be found, or None."""
    for name in HF_EXTRA:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):           # a parent missing, a module without a spec
            return name
    return None


def _generate(argv: list[str]) -> int:
    """``cellcache generate``, or one line naming the ``hf`` extra and exit code 2 (as every
    other missing piece: ``--backend cuda`` without cuda-bindings) when torch or transformers
    is missing or will not import."""
    missing = _missing_hf_extra()
    if missing is None:
        try:
            from .generate import main as generate_main
        except ModuleNotFoundError as e:          # found, yet a part of it is not there
            if e.name is None or e.name.partition(".")[0] not in HF_EXTRA:
                raise
            missing = e.name
        else:
            return generate_main(argv)
    print(f"cellcache generate: error: needs the 'hf' extra (no module named {missing!r}): "
          "pip install 'cellcache[hf]'", file=sys.stderr)
    return 2


def _serve(argv: list[str]) -> int:
    """``cellcache serve``, or one line naming the extra and exit code 2 when torch or
    transformers (the ``hf`` extra, which ``serve`` includes) is missing; the server's own
    packages are checked by the command after its usage (``--help`` works without them)."""
    missing = _missing_hf_extra()
    if missing is None:
        from .serve import main as serve_main

        return serve_main(argv)
    print(f"cellcache serve: error: needs the 'serve' extra (no module named {missing!r}): "
          "pip install 'cellcache[serve]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in ("demo", "generate", "serve"):
        print(f"cellcache: error: unknown command {command!r} (see --help)", file=sys.stderr)
        return 2

    def run() -> int:
        try:
            if command == "demo":
                from .demo import main as demo_main

                return demo_main(rest)
            if command == "serve":
                return _serve(rest)
            return _generate(rest)
        except CellCacheError as e:
            # whatever a command did not catch itself (--device cuda without a driver, a refused
            # model, a cache that does not fit) is one line and exit code 2, never a traceback
            print(f"cellcache {command}: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2

    # Ctrl-C (while a model loads, or in demo) and `| head` on stdout: one line or none, no traceback
    return run_main(f"cellcache {command}", run)


if __name__ == "__main__":
    sys.exit(main())
