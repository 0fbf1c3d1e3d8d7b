"""``python -m cellcache COMMAND`` (also the ``cellcache`` console script)."""

from __future__ import annotations

import sys

from .errors import CellCacheError

USAGE = """usage: cellcache COMMAND [options]

commands:
  demo       simulated serving session, every token checked (cellcache demo --help)
  generate   serve a Hugging Face model through the cache (cellcache generate --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in ("demo", "generate"):
        print(f"cellcache: error: unknown command {command!r} (see --help)", file=sys.stderr)
        return 2
    try:
        if command == "demo":
            from .demo import main as demo_main

            return demo_main(rest)
        from .generate import main as generate_main

        return generate_main(rest)
    except CellCacheError as e:
        # whatever a command did not catch itself (--device cuda without a driver, a refused
        # model, a cache that does not fit) is one line and exit code 2, never a traceback
        print(f"cellcache {command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
