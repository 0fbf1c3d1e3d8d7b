#!/usr/bin/env python3
"""cellcache benchmarks: print a table of side-by-side measurements and write JSON.

Sections:
  table      the Cython CellTable against the pure-Python reference (placement of a decode
             step; seq_clone / rewind / seq_rm of a 32,768-token sequence at two pool sizes).
  soak       10**6 random calls from 8 threads on one host cache: calls/s, peak RSS, RSS
             drift, invariants after.
  gpu        prepare_step of the CUDA backend against a host-built-mask baseline (GPU).
  growth     growing a 1 GiB pool by mapping against by copy (GPU).
  attention  the paged kernels against SDPA over the dense mask and FlashInfer (GPU).
  serve      the continuous-batching generator against Hugging Face's own (GPU;
             tools/bench_serve.py).
  prefix     PrefixCache lookups on the host: match / peek of an 8K-token prompt against a
             tree of 100K cached tokens (target: match <= 20 us).

Targets are checked by ratios measured in the same run, printed with the table; the exit
code is 0 whether or not a target is met (the numbers go into the docs and closing notes),
and non-zero only when a measurement itself fails (e.g. the two tables disagree).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import RESULTS, log, require_gpu, run_record

from cellcache._cli import output_file, run_main


def median_ns(fn, reps: int, setup=None) -> float:
    """Median wall time of ``fn()`` in ns over ``reps`` runs; ``setup()`` runs untimed before each."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times)


def reference_copy(table):
    """A ReferenceTable holding the same cells as ``table`` (built directly, not replayed)."""
    from cellcache import ReferenceTable

    ref = ReferenceTable(table.capacity, table.max_seqs, table.max_write)
    ref.cell_pos = table.positions_array().tolist()
    words = table.owner_words_array()
    owners = [set() for _ in range(table.capacity)]
    for w in range(words.shape[0]):
        col = words[w]
        for bit in range(64):
            seq = 64 * w + bit
            if seq >= table.max_seqs:
                break
            for c in np.nonzero((col >> np.uint64(bit)) & np.uint64(1))[0].tolist():
                owners[c].add(seq)
    ref.cell_owners = owners
    ref.live = set(table.live_seqs())
    return ref


def fill_pool(table, n_seqs: int, tokens_each: int, chunk: int, rng) -> list[int]:
    """Prefill ``n_seqs`` sequences in interleaved chunks; returns their ids."""
    seqs = [table.seq_new() for _ in range(n_seqs)]
    remaining = {s: tokens_each for s in seqs}
    while remaining:
        for s in list(remaining):
            n = min(chunk, remaining[s], table.max_write)
            assert table.declare_step([s] * n)
            table.place()
            remaining[s] -= n
            if remaining[s] == 0:
                del remaining[s]
    return seqs


def bench_decode(args, rng) -> dict:
    from cellcache import CellTable

    cap, n_live, width = 1 << 20, 256, 64
    log(f"[table] decode placement: capacity {cap}, {n_live} live sequences, width {width}")
    t = CellTable(cap, max_seqs=n_live, max_write=4096)
    seqs = fill_pool(t, n_live, 2048, 512, rng)
    # churn: finish a quarter of the sequences and start new ones, leaving holes behind
    for s in seqs[::4]:
        t.seq_rm(s)
    for _ in seqs[::4]:
        s = t.seq_new()
        assert t.declare_step([s] * 100)
        t.place()
    live = np.array(t.live_seqs(), dtype=np.int64)
    steps = [rng.permutation(live)[:width].astype(np.int64) for _ in range(args.reps)]
    cells = np.empty(width, np.int64)
    positions = np.empty(width, np.int64)
    it = iter(steps)

    def one():
        t.declare_step(next(it))
        t.place_into(cells, positions)

    fast = median_ns(one, args.reps)
    t.check_invariants()
    log("[table]   reference copy of the pool (slow by design)...")
    ref = reference_copy(t)
    ids = [int(x) for x in steps[0]]
    t0 = time.perf_counter_ns()
    ref.declare_step(ids)
    rcells, rpos, rlen = ref.place()
    slow = time.perf_counter_ns() - t0
    assert t.declare_step(ids)
    c2, p2, l2 = t.place()
    if rcells != c2.tolist() or rpos != p2.tolist() or rlen != l2:
        raise SystemExit("bench: CellTable and the reference placed the decode step differently")
    return {
        "case": "decode placement (64 tokens, 256 live, cap 1M)",
        "cython_us": fast / 1e3, "reference_us": slow / 1e3, "speedup": slow / fast,
        "used_cells": t.capacity - t.free_cells,
    }


def bench_verbs(args, rng, cap: int) -> list[dict]:
    from cellcache import CellTable

    L = 32768
    log(f"[table] verbs on a {L}-token sequence spread over a pool of capacity {cap}")
    t = CellTable(cap, max_seqs=256, max_write=L)
    # The sequence is prefilled in 512-token chunks interleaved with 63 other sequences'
    # chunks, as continuous batching does, so its cells are spread over the whole pool.
    others = [t.seq_new() for _ in range(63)]
    s = t.seq_new()
    chunk, s_left = 512, L
    other_total = cap - L - 1024
    per_s_chunk = max(1, other_total // (L // chunk))
    while s_left or other_total > 0:
        if s_left:
            assert t.declare_step([s] * chunk)
            t.place()
            s_left -= chunk
        n = min(per_s_chunk, other_total)
        while n > 0:
            m = min(chunk, n)
            assert t.declare_step([others[int(rng.integers(len(others)))]] * m)
            t.place()
            n -= m
            other_total -= m
    cells = t.seq_cells(s)
    spread = (cells[-1] - cells[0] + 1) / cap
    state = {"s": s}

    def place_s():
        assert t.declare_step([state["s"]] * L)
        t.place()

    out = {}
    holder = {}
    out["seq_clone"] = median_ns(lambda: holder.__setitem__("c", t.seq_clone(state["s"])),
                                 args.reps,
                                 setup=lambda: holder.get("c") is not None and t.seq_rm(holder["c"]))
    t.seq_rm(holder["c"])
    out["rewind"] = median_ns(lambda: t.rewind(state["s"], 0), args.reps,
                              setup=lambda: t.pos(state["s"]) == 0 and place_s())
    place_s()

    def rm_setup():
        if state["s"] is None or t.pos(state["s"]) == 0:
            state["s"] = t.seq_new()
            place_s()

    def rm():
        t.seq_rm(state["s"])
        state["s"] = None

    out["seq_rm"] = median_ns(rm, args.reps, setup=rm_setup)
    rm_setup()
    t.check_invariants()

    log(f"[table]   reference at capacity {cap} (slow by design)...")
    ref = reference_copy(t)
    s = state["s"]
    ref_times = {}
    t0 = time.perf_counter_ns()
    c = ref.seq_clone(s)
    ref_times["seq_clone"] = time.perf_counter_ns() - t0
    ref.seq_rm(c)
    t0 = time.perf_counter_ns()
    ref.rewind(s, 0)
    ref_times["rewind"] = time.perf_counter_ns() - t0
    ref2 = reference_copy(t)
    t0 = time.perf_counter_ns()
    ref2.seq_rm(s)
    ref_times["seq_rm"] = time.perf_counter_ns() - t0
    return [
        {"case": f"{verb} of 32K-token seq, cap {cap}", "verb": verb, "capacity": cap,
         "seq_span_fraction_of_pool": spread,
         "cython_us": out[verb] / 1e3, "reference_us": ref_times[verb] / 1e3,
         "speedup": ref_times[verb] / out[verb]}
        for verb in ("seq_clone", "rewind", "seq_rm")
    ]


def section_table(args) -> dict:
    rng = np.random.default_rng(args.seed)
    rows = [bench_decode(args, rng)]
    small = bench_verbs(args, rng, 1 << 16)
    large = bench_verbs(args, rng, 1 << 20)
    rows += small + large
    scaling = {
        r1["verb"]: r2["cython_us"] / r1["cython_us"] for r1, r2 in zip(small, large)
    }
    targets = {
        "decode placement <= 10 us": rows[0]["cython_us"] <= 10.0,
        "verbs at 1M within 1.5x of 64K": all(v <= 1.5 for v in scaling.values()),
        "Cython >= 50x reference on each": all(r["speedup"] >= 50 for r in rows),
    }
    print()
    print(f"{'case':<48} {'cython us':>10} {'ref us':>12} {'speedup':>9}")
    for r in rows:
        print(f"{r['case']:<48} {r['cython_us']:>10.2f} {r['reference_us']:>12.0f} {r['speedup']:>8.0f}x")
    print("verb time at 1M / at 64K: " + ", ".join(f"{k} {v:.2f}x" for k, v in scaling.items()))
    for name, ok in targets.items():
        print(f"target {'met ' if ok else 'MISSED'}: {name}")
    return {"rows": rows, "scaling_1M_over_64K": scaling, "targets": targets}


def section_soak(args) -> dict:
    """Random verbs and steps from 8 threads on one HostCellCache; RSS sampled throughout."""
    import resource
    import threading

    from cellcache import CacheConfig, HostCellCache, InvalidArgument, InvalidState, LayerConfig

    total, n_threads = args.soak_calls, 8
    cfg = CacheConfig(capacity=1 << 14, layers=[LayerConfig(2, 16), LayerConfig(2, 16, 64)],
                      max_write=64, max_seqs=256, dtype="float16", paged=True, mask_format="bits")
    cache = HostCellCache(cfg)
    done = [0] * n_threads
    errors: list = []
    rss = []

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    def work(k: int) -> None:
        rng = np.random.default_rng(args.seed + k)
        mine = [cache.seq_new()]
        try:
            for i in range(total // n_threads):
                r = rng.random()
                mine = [s for s in mine if s is not None]
                try:
                    if r < 0.1 or not mine:
                        mine.append(cache.seq_new())
                    elif r < 0.15:
                        mine.append(cache.seq_clone(mine[int(rng.integers(len(mine)))],
                                                    upto=int(rng.integers(0, 64))))
                    elif r < 0.25:
                        s = mine.pop(int(rng.integers(len(mine))))
                        cache.seq_rm(s)
                    elif r < 0.4:
                        s = mine[int(rng.integers(len(mine)))]
                        cache.rewind(s, max(0, cache.pos(s) - int(rng.integers(0, 8))))
                    elif r < 0.7:
                        picks = rng.integers(0, len(mine), size=int(rng.integers(1, 16)))
                        ids = [mine[int(x)] for x in picks]
                        with cache.lock:               # one thread's step is atomic
                            if cache.declare_step(ids):
                                cache.prepare_step(pad_to=16)
                                cache.commit_step()
                    elif r < 0.72:
                        cache.check_invariants()
                    else:
                        cache.pos(mine[0])
                except (InvalidState, InvalidArgument):
                    pass                               # another thread changed what we named
                if cache.free_cells < 256:
                    for s in mine[: len(mine) // 2]:
                        cache.seq_rm(s)
                    mine = mine[len(mine) // 2:]
                done[k] = i + 1
        except Exception as e:  # noqa: BLE001 - reported after join
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        rss.append((time.perf_counter() - t0, rss_mib()))
        log(f"[soak] {sum(done)}/{total} calls, RSS {rss[-1][1]:.1f} MiB")
        time.sleep(2.0)
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    cache.check_invariants()
    rss.append((elapsed, rss_mib()))
    tail = [m for ts, m in rss if ts >= elapsed / 2]
    res = {"calls": sum(done), "threads": n_threads, "seconds": elapsed,
           "calls_per_s": sum(done) / elapsed, "peak_rss_mib": max(m for _, m in rss),
           "rss_first_half_end_mib": rss[len(rss) // 2][1], "rss_end_mib": rss[-1][1],
           "rss_drift_mib": max(tail) - min(tail), "errors": errors, "invariants_held": not errors}
    print()
    print(f"soak: {res['calls']} calls from {n_threads} threads in {elapsed:.1f} s = "
          f"{res['calls_per_s']:.0f} calls/s; peak RSS {res['peak_rss_mib']:.1f} MiB, drift over "
          f"the second half {res['rss_drift_mib']:.2f} MiB; invariants held: {res['invariants_held']}")
    return res


def section_prefix(args) -> dict:
    """PrefixCache.match of an 8K-token prompt over 100K cached tokens (host backend)."""
    from cellcache import CacheConfig, LayerConfig, PrefixCache, build

    rng = np.random.default_rng(args.seed)
    cfg = CacheConfig(capacity=1 << 17, layers=[LayerConfig(1, 8)], max_write=4096,
                      initial_capacity=1 << 17, dtype="float16", max_seqs=256,
                      mask_format="none")
    cache = build("host", "batched", cfg)
    prefix = PrefixCache(cache, max_seqs=64)

    def toks(n: int) -> np.ndarray:
        return rng.integers(0, 150_000, size=n, dtype=np.int32)

    def fill(seq: int, n: int) -> None:
        while n:
            k = min(n, cfg.max_write)
            assert cache.declare_step([seq] * k)
            cache.prepare_step()
            cache.commit_step()
            n -= k

    # a shared 2K system prompt, 8 documents of 4K under it, 4 conversations of 2K under each:
    # 2048 + 8 * 4096 + 32 * 2048 = 100,352 tokens in 32 leaves; each path is stored as a
    # server would: match, compute the tail, insert
    system = toks(2048)
    docs = [toks(4096) for _ in range(8)]
    convs = [[toks(2048) for _ in range(4)] for _ in range(8)]
    for i, doc in enumerate(docs):
        for conv in convs[i]:
            path = np.concatenate([system, doc, conv])
            seq, n = prefix.match(path, max_len=len(path) - 1)
            if seq is None:
                seq = cache.seq_new()
            fill(seq, len(path) - n)
            prefix.insert(seq, path)
            cache.seq_rm(seq)
    m = prefix.metrics()
    assert m["cached_tokens"] == 2048 + 8 * 4096 + 32 * 2048, m
    full = np.concatenate([system, docs[3], convs[3][2]])               # 8,192 tokens, cached
    partial = np.concatenate([system, docs[3], convs[3][2][:1024], toks(1024)])  # 7,168 cached
    held: list[int] = []

    def release() -> None:
        while held:
            cache.seq_rm(held.pop())

    def timed_match(tokens, **kw):
        def fn():
            held.append(prefix.match(tokens, **kw)[0])
        return fn

    leaf_seq = prefix.prefixes()[0][1]
    # (case, timed call, untimed setup, the prefix length the call must find)
    cases = [
        ("peek, 8K array, 7,168 cached", lambda: prefix.peek(partial), None,
         (partial, None, 7168)),
        ("match, 8K array, 7,168 cached", timed_match(partial), release, (partial, None, 7168)),
        ("match, 8K array, full hit, max_len=8191", timed_match(full, max_len=8191), release,
         (full, 8191, 8191)),
        ("match, 8K list, full hit, max_len=8191", timed_match(full.tolist(), max_len=8191),
         release, (full, 8191, 8191)),
        ("(floor) cache.seq_clone of 8,191 positions",
         lambda: held.append(cache.seq_clone(leaf_seq, 8191)), release, None),
    ]
    rows = []
    for name, fn, setup, check in cases:
        if check is not None:
            query, max_len, want = check
            assert prefix.peek(query, max_len=max_len) == want, name
        us = median_ns(fn, args.reps, setup) / 1e3
        release()
        rows.append({"case": name, "median_us": us})
    target_us = 20.0
    worst = rows[2]["median_us"]
    targets = {f"match (8K prompt, 100K cached) <= {target_us:g} us": worst <= target_us}
    prefix.check_invariants()
    cache.check_invariants()
    print()
    print(f"prefix cache: {m['cached_tokens']} cached tokens in {m['nodes']} nodes, "
          f"{m['leaves']} leaves (host backend, median of {args.reps})")
    print(f"{'case':<48} {'median us':>10} {'/ target':>9}")
    for r in rows:
        print(f"{r['case']:<48} {r['median_us']:>10.2f} {r['median_us'] / target_us:>8.2f}x")
    for name, ok in targets.items():
        print(f"target {'met ' if ok else 'MISSED'}: {name} (measured {worst:.2f} us, "
              f"{worst / target_us:.2f}x the target)")
    return {"rows": rows, "cached_tokens": m["cached_tokens"], "nodes": m["nodes"],
            "leaves": m["leaves"], "target_us": target_us, "match_us": worst,
            "ratio_to_target": worst / target_us, "targets": targets}


SECTIONS = ("table", "soak", "prefix", "gpu", "growth", "attention")
GPU_SECTIONS = ("gpu", "growth", "attention")


def result_name(section: str, case: str = "") -> str:
    """The benchmark a section's run records, the stem of its file in benchmarks/results (a
    run of some attention cases only: ``attention-some``, never the whole sweep's file)."""
    name = {"gpu": "gpu-masks", "all-gpu": "gpu-all"}.get(section, section)
    return f"{name}-some" if case else name


def main(argv=None, probe=None) -> int:
    from cellcache._cli import Parser, in_range

    p = Parser(prog="bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", choices=SECTIONS + ("all-gpu",), default="table")
    p.add_argument("--reps", type=in_range(1, 100_000), default=200,
                   help="timed repetitions per case (median)")
    p.add_argument("--soak-calls", type=in_range(8, 10**9), default=10**6,
                   help="calls of the soak section (default 10**6)")
    p.add_argument("--seed", type=in_range(0, 2**32 - 1), default=0)
    p.add_argument("--case", default="", metavar="TEXT",
                   help="attention section: only the cases whose name contains TEXT (default: every case; "
                        "the record is then attention-some.json)")
    p.add_argument("--baseline-ptx", type=Path, default=None, metavar="FILE",
                   help="attention section: also time the table's choice from this tc_attention.ptx (built "
                        "from other sources, e.g. git show HEAD~1:cellcache/ptx/tc_attention.ptx) on the "
                        "same buffers, and print the ratio")
    p.add_argument("--json", type=output_file, default=None,
                   help="where to write the JSON (default: its canonical file, benchmarks/results/"
                        "<benchmark>.json: the section's name, gpu-masks for gpu, gpu-all for all-gpu)")
    args = p.parse_args(argv)
    if args.case and args.section not in ("attention", "all-gpu"):
        p.error("--case selects cases of the attention section")
    if args.baseline_ptx is not None:
        if args.section not in ("attention", "all-gpu"):
            p.error("--baseline-ptx is for the attention section")
        try:
            args.baseline_ptx = args.baseline_ptx.read_bytes()
        except OSError as e:
            p.error(f"--baseline-ptx: cannot read {args.baseline_ptx}: {e.strerror}")
    sections = GPU_SECTIONS if args.section == "all-gpu" else (args.section,)
    if set(sections) & set(GPU_SECTIONS) and (code := require_gpu("bench", probe)) is not None:
        return code                            # (bench_gpu imports the CUDA backend: a traceback)
    words = ["python3", "tools/bench.py", *(argv if argv is not None else sys.argv[1:])]
    result = run_record(result_name(args.section, args.case), words,
                        "cuda" if set(sections) <= set(GPU_SECTIONS) else "cpu")
    result["machine"] = {"python": platform.python_version(),
                         "cpu": platform.processor() or platform.machine(), "numpy": np.__version__}
    for section in sections:
        if section == "table":
            result["table"] = section_table(args)
        elif section == "soak":
            result["soak"] = section_soak(args)
        elif section == "prefix":
            result["prefix"] = section_prefix(args)
        else:
            import bench_gpu

            result[section] = getattr(bench_gpu, {"gpu": "run"}.get(section, section))(args)
    path = args.json or RESULTS / f"{result['benchmark']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench", main))
