#!/usr/bin/env python3
"""One captured CUDA graph serves any mix of sequences.

A cellcache CudaCellCache writes each step into buffers at fixed device addresses, so the
attention forward (cuda/attention.cu: write K/V at cells[:width], attend over
[0, read_len) under each layer's mask) is captured once into a CUDA graph and replayed for
every decode step, whatever sequences the batch holds and in whatever order. The graph is
captured after the first step and re-captured only when Step.grew says the pools moved, so
captures = 1 + growths.

The session: at least 16 sequences arrive over time and prefill in chunks (eager steps, any
width); decode steps take exactly --width decoding sequences, a different random subset in a
different order each step (graph replays); some sequences fork with seq_clone(upto=...),
some rewind, some finish. Each decode step runs the forward eagerly and by graph replay,
both checked, and both timed side by side. Every token's output is checked against a dense
per-sequence numpy computation (its own history, its own window).

--torch runs the same session with the forward in torch over the cache's buffers (DLPack)
and captures it with torch.cuda.graph.

Exit codes: 0 all outputs matched; 1 a mismatch; 3 no CUDA driver or device here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cellcache import attention  # noqa: E402
from cellcache.config import CacheConfig, LayerConfig, storage_dtype  # noqa: E402

NO_GPU_EXIT = 3
TOLERANCE = 2e-3            # float32 math on both sides; bf16 pools rounded identically
LAYERS = (LayerConfig(2, 32, 0), LayerConfig(2, 32, 16), LayerConfig(2, 32, 0))
N_HEADS = 4


def cuda_usable() -> tuple[bool, str]:
    try:
        from cellcache.cuda.driver import device_usable
    except ImportError as e:
        return False, f"cuda-bindings is not installed ({e})"
    return (True, "") if device_usable() else (False, "no CUDA driver or no CUDA device")


class DriverForward:
    """The forward as PTX kernels launched through the driver API, eagerly or as a graph."""

    def __init__(self, cache, stream: int, max_write: int):
        from cellcache.cuda import driver as drv
        from cellcache.cuda.driver import check, cu

        self.cu, self.check, self.cache, self.stream = cu, check, cache, stream
        self.module = drv.load_module("attention")
        name = cache.config.dtype
        self.f_store = drv.function(self.module, f"store_kv_{name}")
        self.f_attend = drv.function(self.module, f"attend_{name}")
        self.inputs = []
        for layer in LAYERS:
            q = self._alloc(max_write * N_HEADS * layer.head_dim * 4)
            k = self._alloc(max_write * layer.row_elems * 4)
            v = self._alloc(max_write * layer.row_elems * 4)
            out = self._alloc(max_write * N_HEADS * layer.head_dim * 4)
            self.inputs.append((q, k, v, out))
        self.graph = self.exec = None
        self.graph_width = None

    def _alloc(self, n: int) -> int:
        return int(self.check(self.cu.cuMemAlloc(n), "cuMemAlloc"))

    def fill(self, qkv: list) -> None:
        for (q, k, v, _), arrays in zip(self.inputs, qkv):
            for ptr, a in zip((q, k, v), arrays):
                a = np.ascontiguousarray(a, dtype=np.float32)
                self.check(self.cu.cuMemcpyHtoDAsync(ptr, a.ctypes.data, a.nbytes, self.stream),
                           "cuMemcpyHtoDAsync")

    def launch(self, width: int) -> None:
        cu, c = self.cu, self.cache
        cells = c.buffer("cells").ptr
        read_len = c.buffer("read_len").ptr
        P, I32, I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        for li, layer in enumerate(LAYERS):
            q, k, v, out = self.inputs[li]
            kp, vp = c.buffer(f"layer_{li}_k").ptr, c.buffer(f"layer_{li}_v").ptr
            mask = c.buffer(f"mask_w{layer.window}").ptr
            self.check(cu.cuLaunchKernel(
                self.f_store, (layer.row_elems + 127) // 128, width, 1, 128, 1, 1, 0, self.stream,
                ((cells, width, k, v, kp, vp, layer.row_elems), (P, I32, P, P, P, P, I32)), 0),
                "cuLaunchKernel(store_kv)")
            self.check(cu.cuLaunchKernel(
                self.f_attend, width, N_HEADS, 1, 128, 1, 1, 0, self.stream,
                ((read_len, q, kp, vp, mask, c.capacity, N_HEADS, layer.n_kv_heads, layer.head_dim, out),
                 (P, P, P, P, P, I64, I32, I32, I32, P)), 0), "cuLaunchKernel(attend)")

    def capture(self, width: int) -> None:
        cu, check = self.cu, self.check
        self.release_graph()
        check(cu.cuStreamBeginCapture(self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")
        try:
            self.launch(width)
        finally:
            self.graph = check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        self.exec = check(cu.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
        self.graph_width = width

    def replay(self) -> None:
        self.check(self.cu.cuGraphLaunch(self.exec, self.stream), "cuGraphLaunch")

    def outputs(self, width: int) -> list[np.ndarray]:
        self.check(self.cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        outs = []
        for li, layer in enumerate(LAYERS):
            a = np.empty((width, N_HEADS, layer.head_dim), np.float32)
            self.check(self.cu.cuMemcpyDtoH(a.ctypes.data, self.inputs[li][3], a.nbytes), "cuMemcpyDtoH")
            outs.append(a)
        return outs

    def sync(self) -> None:
        self.check(self.cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def release_graph(self) -> None:
        if self.exec is not None:
            self.check(self.cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            self.check(self.cu.cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.exec = self.graph = None

    def close(self) -> None:
        self.release_graph()
        for bufs in self.inputs:
            for ptr in bufs:
                self.cu.cuMemFree(ptr)
        self.cu.cuModuleUnload(self.module)


class TorchForward:
    """The same forward in torch over the cache's buffers (DLPack), captured by torch.cuda.graph."""

    def __init__(self, cache, stream, max_write: int):
        import torch

        self.torch, self.cache, self.stream = torch, cache, stream
        dev = torch.device("cuda", cache.config.device)
        self.inputs = [tuple(torch.zeros((max_write, n, layer.head_dim), device=dev)
                             for n in (N_HEADS, layer.n_kv_heads, layer.n_kv_heads, N_HEADS))
                       for layer in LAYERS]
        self.graph = None
        self.graph_width = None
        self._views()

    def _views(self) -> None:
        t, c = self.torch, self.cache
        self.cells = t.from_dlpack(c.buffer("cells"))
        self.read_len = t.from_dlpack(c.buffer("read_len"))
        self.masks = {w: t.from_dlpack(c.buffer(f"mask_w{w}"))[0, 0] for w in c.config.windows}
        self.pools = [(t.from_dlpack(c.buffer(f"layer_{i}_k")), t.from_dlpack(c.buffer(f"layer_{i}_v")))
                      for i in range(len(LAYERS))]
        self.rows = torch_rows = self.pools[0][0].shape[0]
        self.arange = t.arange(torch_rows, device=self.cells.device)

    def fill(self, qkv: list) -> None:
        with self.torch.cuda.stream(self.stream):
            for bufs, arrays in zip(self.inputs, qkv):
                for dst, a in zip(bufs, arrays):
                    dst[: a.shape[0]].copy_(self.torch.from_numpy(np.ascontiguousarray(a)), non_blocking=False)

    def _forward(self, width: int, write: bool = True) -> None:
        t = self.torch
        cells = self.cells[:width]
        valid = self.arange < self.read_len          # device-side: graph replays see the new value
        for li, layer in enumerate(LAYERS):
            q, k, v, out = self.inputs[li]
            kp, vp = self.pools[li]
            if write:
                kp.index_copy_(0, cells, k[:width].to(kp.dtype))
                vp.index_copy_(0, cells, v[:width].to(vp.dtype))
            mask = self.masks[layer.window][:width, : self.rows] & valid
            group = N_HEADS // layer.n_kv_heads
            K = kp.float().repeat_interleave(group, dim=1)
            V = vp.float().repeat_interleave(group, dim=1)
            scores = t.einsum("whd,rhd->hwr", q[:width], K) / (layer.head_dim ** 0.5)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            out[:width] = t.einsum("hwr,rhd->whd", t.softmax(scores, dim=-1), V)

    def launch(self, width: int) -> None:
        with self.torch.cuda.stream(self.stream):
            self._forward(width)

    def capture(self, width: int) -> None:
        t = self.torch
        self._views()                    # the pools may have moved
        # Warm up outside capture (allocator, kernels) without the K/V write: cells[:width]
        # may hold stale entries now, and writing there would clobber live rows.
        with t.cuda.stream(self.stream):
            self._forward(width, write=False)
        self.stream.synchronize()
        self.graph = t.cuda.CUDAGraph()
        with t.cuda.graph(self.graph, stream=self.stream):
            self._forward(width)
        self.graph_width = width

    def replay(self) -> None:
        with self.torch.cuda.stream(self.stream):
            self.graph.replay()

    def outputs(self, width: int) -> list[np.ndarray]:
        self.stream.synchronize()
        return [self.inputs[li][3][:width].cpu().numpy() for li in range(len(LAYERS))]

    def sync(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.graph = None


def run(seqs: int = 16, steps: int = 500, seed: int = 0, width: int = 16, use_torch: bool = False,
        capacity: int = 8192, progress: bool = True) -> dict:
    from cellcache.cuda.backend import CudaCellCache
    from cellcache.cuda.driver import check, cu

    rng = np.random.default_rng(seed)
    max_write = 64
    cfg = CacheConfig(capacity=capacity, layers=LAYERS, max_write=max_write, initial_capacity=128,
                      dtype="bfloat16", max_seqs=max(64, 4 * seqs))
    cache = CudaCellCache(cfg)
    st = storage_dtype(cfg.dtype)
    if use_torch:
        import torch

        stream = torch.cuda.Stream(device=cfg.device)
        handle = stream
    else:
        stream = int(check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate"))
        handle = stream
    fwd = (TorchForward if use_torch else DriverForward)(cache, stream, max_write)
    max_len = 240
    live: dict[int, dict] = {}
    stats = dict(steps=0, tokens=0, graph_steps=0, eager_steps=0, captures=0, forks=0, rewinds=0,
                 finished=0, preempted=0, arrivals=0, mismatches=0)
    max_err = 0.0
    t_eager, t_graph = [], []

    def new(sid, prompt):
        return {"prompt": prompt, "len": 0, "target": int(rng.integers(prompt + 8, max_len)),
                "k": [np.zeros((max_len, la.n_kv_heads, la.head_dim), np.float32) for la in LAYERS],
                "v": [np.zeros((max_len, la.n_kv_heads, la.head_dim), np.float32) for la in LAYERS]}

    def check_outputs(step, qkv, outs):
        nonlocal max_err
        bad = 0
        for li, layer in enumerate(LAYERS):
            q = qkv[li][0]
            for i in range(step.width):
                s = live[int(step.seq_ids[i])]
                p = int(step.positions[i])
                ref = attention.dense_attention(q[i], s["k"][li], s["v"][li], p, layer.window)
                err = float(np.max(np.abs(outs[li][i] - ref)))
                max_err = max(max_err, err)
                bad += not err <= TOLERANCE
        return bad

    for step_no in range(steps):
        # arrivals: the session is topped up to --seqs, and requests keep arriving over time
        arriving = max(0, seqs - len(live)) + int(rng.random() < 0.15 and len(live) < 3 * seqs)
        for _ in range(arriving):
            sid = cache.seq_new()
            if sid is None:
                break
            live[sid] = new(sid, int(rng.integers(8, 96)))
            stats["arrivals"] += 1
        prefilling = [s for s, d in live.items() if d["prompt"] > d["len"]]
        decoding = [s for s, d in live.items() if d["prompt"] <= d["len"]]
        if prefilling and (step_no % 2 == 0 or len(decoding) < width):
            batch = []
            for s in rng.permutation(prefilling)[:3]:
                d = live[int(s)]
                batch += [int(s)] * min(int(rng.integers(8, 33)), d["prompt"] - d["len"])
            batch = batch[:max_write]
            rng.shuffle(batch)
            graph_step = False
        else:
            batch = [int(s) for s in rng.permutation(decoding)[:width]]     # new order each step
            graph_step = len(batch) == width
        if not batch:
            continue
        while not cache.declare_step(batch):
            victim = max(live, key=lambda s: live[s]["len"])
            cache.seq_rm(victim)
            del live[victim]
            stats["preempted"] += 1
            batch = [s for s in batch if s != victim]
            graph_step = False
            if not batch:
                break
        if not batch:
            continue
        step = cache.prepare_step(stream=handle)
        if step.grew:                                    # pools moved: (re)capture
            fwd.capture(width)
            stats["captures"] += 1
        qkv = []
        for layer in LAYERS:
            w = step.width
            qkv.append((rng.standard_normal((w, N_HEADS, layer.head_dim), dtype=np.float32),
                        rng.standard_normal((w, layer.n_kv_heads, layer.head_dim), dtype=np.float32),
                        rng.standard_normal((w, layer.n_kv_heads, layer.head_dim), dtype=np.float32)))
        for li in range(len(LAYERS)):                    # the oracle sees the stored (rounded) K/V
            for i in range(step.width):
                d, p = live[int(step.seq_ids[i])], int(step.positions[i])
                d["k"][li][p] = qkv[li][1][i].astype(st).astype(np.float32)
                d["v"][li][p] = qkv[li][2][i].astype(st).astype(np.float32)
        fwd.fill(qkv)
        fwd.sync()
        t0 = time.perf_counter()
        fwd.launch(step.width)                           # eager
        fwd.sync()
        t1 = time.perf_counter()
        stats["mismatches"] += check_outputs(step, qkv, fwd.outputs(step.width))
        if graph_step:
            t2 = time.perf_counter()
            fwd.replay()                                 # the same forward, by graph replay
            fwd.sync()
            t3 = time.perf_counter()
            stats["mismatches"] += check_outputs(step, qkv, fwd.outputs(step.width))
            t_eager.append((t1 - t0) * 1e6)
            t_graph.append((t3 - t2) * 1e6)
            stats["graph_steps"] += 1
        else:
            stats["eager_steps"] += 1
        cache.commit_step()
        stats["steps"] += 1
        stats["tokens"] += step.width
        for s in set(int(x) for x in step.seq_ids):
            live[s]["len"] += int(np.count_nonzero(step.seq_ids == s))
        for s in list(live):
            d = live[s]
            if d["prompt"] > d["len"]:
                continue
            if d["len"] >= d["target"]:
                cache.seq_rm(s)
                del live[s]
                stats["finished"] += 1
                continue
            r = rng.random()
            if r < 0.02 and d["len"] > 1:
                upto = int(rng.integers(1, d["len"] + 1))
                child = cache.seq_clone(s, upto=upto)
                if child is not None:
                    c = new(child, 0)
                    c["len"] = upto
                    c["k"] = [a.copy() for a in d["k"]]
                    c["v"] = [a.copy() for a in d["v"]]
                    live[child] = c
                    stats["forks"] += 1
            elif r < 0.08 and d["len"] > 1:
                back = int(rng.integers(1, min(4, d["len"]) + 1))
                assert cache.rewind(s, d["len"] - back)
                d["len"] -= back
                stats["rewinds"] += 1
        if progress and (step_no + 1) % max(1, steps // 10) == 0:
            print(f"capture_graph: {step_no + 1}/{steps} steps, {stats['graph_steps']} replays, "
                  f"{stats['mismatches']} mismatches", file=sys.stderr, flush=True)
    m = cache.metrics()
    fwd.close()
    if not use_torch:
        check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
    cache.close()
    return {
        "mode": "torch" if use_torch else "driver", **stats, "growths": m["growth_count"],
        "rows": m["flat_capacity"], "max_error": max_err,
        "eager_forward_us": statistics.median(t_eager) if t_eager else 0.0,
        "graph_forward_us": statistics.median(t_graph) if t_graph else 0.0,
    }


def main(argv: list[str] | None = None, probe=cuda_usable) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=16, help="live sequences to keep (>= 16; default 16)")
    p.add_argument("--steps", type=int, default=500, help="steps to run (default 500)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--width", type=int, default=16, help="decode batch width the graph is captured for")
    p.add_argument("--torch", action="store_true", help="forward in torch over DLPack views, torch.cuda.graph")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.seqs < 16 or args.steps < 1 or not 1 <= args.width <= 64 or args.width > args.seqs:
        p.error("need --seqs >= 16, --steps >= 1 and 1 <= --width <= min(64, --seqs)")
    ok, why = probe()
    if not ok:
        print(f"capture_graph: {why}; this demo needs a GPU (exit {NO_GPU_EXIT})")
        return NO_GPU_EXIT
    s = run(args.seqs, args.steps, args.seed, args.width, args.torch, progress=not args.quiet)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print(f"capture_graph [{s['mode']}]: {s['steps']} steps ({s['graph_steps']} graph replays, "
              f"{s['eager_steps']} eager), {s['tokens']} tokens, {s['arrivals']} arrivals, "
              f"{s['forks']} forks, {s['rewinds']} rewinds, {s['finished']} finished, "
              f"{s['preempted']} preempted")
        print(f"captures {s['captures']} = 1 + growths {s['growths']}: "
              f"{'yes' if s['captures'] == 1 + s['growths'] else 'NO'}; max error {s['max_error']:.2e}; "
              f"{s['mismatches']} mismatches")
        print(f"forward per decode step (width {args.width}, 3 layers): eager {s['eager_forward_us']:.0f} us, "
              f"graph replay {s['graph_forward_us']:.0f} us")
    return 1 if s["mismatches"] or s["captures"] != 1 + s["growths"] else 0


if __name__ == "__main__":
    sys.exit(main())
