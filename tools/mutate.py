#!/usr/bin/env python3
"""Mutation check of the cell table: do the CPU tests catch small bugs in pyx/_table.pyx and
its views, pyx/_views.pyx?

Each mutant is one hand-written edit of one of those sources (an off-by-one in the free-cell
search, a summary scan that stops after the first word, ...). First the unmutated tree is
copied, built and tested: it must pass, or a failing test would prove nothing. Then for each
mutant the tree (tracked files and untracked ones git does not ignore) is copied, the edit
applied, the extensions rebuilt and the table's tests run; the mutant is caught when they fail
(or crash). Prints a table and writes JSON (by default benchmarks/results/mutate.json, the
benchmark's canonical file, when every mutant ran; with --only, only where --json says); exit
code 1 if any mutant survives, 2 on bad usage, a mutant whose text is not in its source, or a
failing baseline. Takes a few minutes (one build per mutant); not part of CI.

  python3 tools/mutate.py [--examples 300] [--only NAME ...] [--json PATH]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, ROOT, run_record

from cellcache._cli import Parser, in_range, output_file, run_main

TESTS = ["tests/test_table_machine.py", "tests/test_rules.py", "tests/test_refusals.py",
         "tests/test_cache_machine.py", "tests/test_host_growth.py", "tests/test_step_protocol.py",
         "tests/test_host_buffers.py"]

TABLE = "pyx/_table.pyx"
VIEWS = "pyx/_views.pyx"

# name: (what it breaks, source file, text in it, replacement)
MUTANTS = {
    "free-search-off-by-one": ("the free-cell search skips the cell it starts at",
                               TABLE,
                               "m = self.free_bits[w] & bits_from(c)\n",
                               "m = self.free_bits[w] & bits_from(c + 1)\n"),
    "summary-scan-first-word": ("the summary scan stops after its first word",
                                TABLE,
                                "            if sw >= self.n_sum_words:\n                return -1\n"
                                "            m = self.sum_free[sw]",
                                "            if True:\n                return -1\n"
                                "            m = self.sum_free[sw]"),
    "last-used-skips-a-word": ("the backward search skips the word before the start's",
                               TABLE,
                               "m = self.sum_used[sw] & bits_upto(ww)\n",
                               "m = self.sum_used[sw] & bits_below(ww)\n"),
    "free-while-owned": ("a cell is freed while one owner is left",
                         TABLE,
                         "            if left == 0:\n                cell_pos[c] = POS_FREE",
                         "            if left <= 1:\n                cell_pos[c] = POS_FREE"),
    "clone-one-short": ("seq_clone(upto) shares one position too few",
                        TABLE,
                        "        if 0 <= limit < n:\n            n = limit\n",
                        "        if 0 <= limit < n:\n            n = limit - 1 if limit else 0\n"),
    "positions-ignore-step": ("a sequence's second token in a step repeats its first position",
                              TABLE,
                              "positions[i] = self.seq_pos_[s] + self.scratch[s]",
                              "positions[i] = self.seq_pos_[s]"),
    "window-one-wide": ("the mask window lets one more position in",
                        VIEWS,
                        "q0 = 0 if window == 0 or p < window else p - window + 1",
                        "q0 = 0 if window == 0 or p < window else p - window"),
    "used-summary-counts-padding": ("bits past capacity count as used in the last word",
                                    TABLE,
                                    "        if (~word) & self._valid(w):",
                                    "        if (~word):"),
    "paged-list-one-short": ("a run's kv list leaves out its last entry",
                             VIEWS,
                             "            kv += positions[i] + 1\n",
                             "            kv += positions[i]\n"),
    "undo-unlogged": ("undo_place does not log the cells it frees",
                      TABLE,
                      "            self._set_free(c)\n            self._mark(c)\n",
                      "            self._set_free(c)\n"),
    "rewind-to-end-refused": ("rewind(seq, pos(seq)) is refused",
                              TABLE,
                              "if not self._is_live(s) or not 0 <= p <= self.seq_pos_[s]:",
                              "if not self._is_live(s) or not 0 <= p < self.seq_pos_[s]:"),
    "shrink-stops-at-one": ("used_end stays 1 when the last occupied cell is freed",
                            TABLE,
                            "if self.used_end_ > 0 and self.cell_pos[self.used_end_ - 1] == POS_FREE:",
                            "if self.used_end_ > 1 and self.cell_pos[self.used_end_ - 1] == POS_FREE:"),
}


def copy_tree(dst: Path) -> None:
    # the working tree as git sees it: tracked files and new ones it does not ignore (a new
    # source must travel too, or every mutant fails to build and counts as caught)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if not (ROOT / f).is_file():          # tracked but deleted in the working tree
            continue
        target = dst / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)


def build_and_test(tree: Path, examples: int) -> subprocess.CompletedProcess | None:
    """Builds the extensions in tree and runs TESTS there; None when the build fails."""
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=tree, capture_output=True, text=True)
    if build.returncode != 0:
        return None
    env = dict(os.environ, CELLCACHE_MACHINE_EXAMPLES=str(examples))
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           *TESTS], cwd=tree, capture_output=True, text=True, env=env)


def baseline(examples: int) -> str:
    """Why the unmutated tree fails (its build or its tests), or "" when it passes."""
    with tempfile.TemporaryDirectory() as tmp:
        copy_tree(Path(tmp))
        r = build_and_test(Path(tmp), examples)
    if r is None:
        return "the unmutated tree does not build"
    if r.returncode != 0:
        failed = [line for line in r.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return f"the unmutated tree fails its tests ({failed[0] if failed else r.stdout[-300:]})"
    return ""


def run_mutant(name: str, examples: int) -> dict:
    what, path, old, new = MUTANTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        src = tree / path
        text = src.read_text()
        if text.count(old) != 1:
            return {"mutant": name, "what": what, "status": f"not applied ({path} changed?)"}
        src.write_text(text.replace(old, new))
        t0 = time.perf_counter()
        r = build_and_test(tree, examples)
        if r is None:
            return {"mutant": name, "what": what, "status": "caught (does not build)"}
        failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED")]
        status = "caught" if r.returncode != 0 else "SURVIVED"
        if r.returncode < 0:
            status = f"caught (crash, signal {-r.returncode})"
        return {"mutant": name, "what": what, "status": status,
                "first_failure": failed[0][7:] if failed else "", "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = Parser(prog="mutate", description=__doc__,
               formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=in_range(10, 100000), default=300,
                   help="state machine examples per run (default 300)")
    p.add_argument("--only", nargs="*", choices=sorted(MUTANTS), help="run only these mutants")
    p.add_argument("--json", type=output_file, default=None,
                   help="where to write the JSON (default: benchmarks/results/mutate.json when every "
                        "mutant runs; none with --only)")
    args = p.parse_args(argv)
    names = args.only or list(MUTANTS)
    words = ["python3", "tools/mutate.py", *(argv if argv is not None else sys.argv[1:])]
    record = run_record("mutate", words, "cpu")
    path = args.json or (None if args.only else RESULTS / "mutate.json")
    stale = [f"{name} ({MUTANTS[name][1]})" for name in names
             if (ROOT / MUTANTS[name][1]).read_text().count(MUTANTS[name][2]) != 1]
    if stale:
        print(f"mutate: text not found exactly once for: {', '.join(stale)}", file=sys.stderr)
        return 2
    print("mutate: baseline (the unmutated tree) ...", file=sys.stderr, flush=True)
    broken = baseline(args.examples)
    if broken:
        print(f"mutate: {broken}; no mutant can be judged", file=sys.stderr)
        return 2
    rows = []
    for k, name in enumerate(names, 1):
        print(f"mutate: [{k}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_mutant(name, args.examples))
        print(f"mutate:   {rows[-1]['status']} {rows[-1].get('first_failure', '')}",
              file=sys.stderr, flush=True)
    caught = sum(r["status"].startswith("caught") for r in rows)
    print()
    print(f"{'mutant':<28} {'status':<24} first failing test")
    for r in rows:
        print(f"{r['mutant']:<28} {r['status']:<24} {r.get('first_failure', '')[:70]}")
    print(f"caught {caught} of {len(rows)} mutants")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**record, "caught": caught, "total": len(rows), "mutants": rows},
                                   indent=2) + "\n")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(run_main("mutate", main))
