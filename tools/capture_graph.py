#!/usr/bin/env python3
"""One captured CUDA graph per width bucket serves every step of a serving session.

A CudaCellCache writes each step into buffers at fixed device addresses, and its pools
reserve their addresses up front, so the attention forward (write K/V at cells[:B], attend
every row over the paged view, or over the masks with --attention dense) is captured once
per width bucket B and replayed for every step: each step is padded to the smallest bucket
that holds it (padding rows write the sink row and are discarded), whatever sequences it
holds, in whatever order, however the pools have grown. No step runs eagerly; every 10th
step also runs the forward eagerly to time it against the replay.

The session (cellcache.session): arrivals over time, chunked prefill mixed with decode in
every step, forks, rewinds, finishes and several pool growths. Every real token's output is
checked against attention over its own sequence's history with no cache; padding rows get
NaN K/V, which any leak into a real row would turn into a mismatch.

--torch runs the forward in torch (cellcache.torch.attention over DLPack views) and captures
it with torch.cuda.graph.

Exit codes: 0 all outputs matched and captures == buckets used; 1 otherwise; 2 bad usage;
3 no CUDA here.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
from _common import NO_GPU_EXIT, cuda_usable, require_gpu

from cellcache._cli import Parser, in_range, run_main
from cellcache.buckets import check_buckets, default_buckets
from cellcache.config import CacheConfig, LayerConfig, storage_dtype
from cellcache.session import Session, SessionConfig

__all__ = ["NO_GPU_EXIT", "main", "run"]
TOLERANCE = 2e-2            # outputs are stored in bfloat16 (paged) / float32 (dense)
LAYERS = (LayerConfig(2, 32, 0), LayerConfig(2, 32, 16), LayerConfig(2, 32, 0))
N_HEADS = 4
MAX_WRITE = 64
EAGER_EVERY = 10


class DriverForward:
    """The forward as cellcache's kernels launched through the driver, one graph per bucket."""

    def __init__(self, cache, stream: int, attention: str):
        from cellcache.cuda.driver import check, cu

        self.cu, self.check, self.cache, self.stream = cu, check, cache, stream
        self.attention = attention
        self.kern = cache.attention_kernels()
        self.dtype = storage_dtype(cache.config.dtype)
        self.bufs = []
        q_item = 4 if attention == "dense" else self.dtype.itemsize
        for layer in LAYERS:
            q = self._alloc(MAX_WRITE * N_HEADS * layer.head_dim * q_item)
            kv = self._alloc(2 * MAX_WRITE * layer.row_elems * self.dtype.itemsize)
            out = self._alloc(MAX_WRITE * N_HEADS * layer.head_dim * q_item)
            self.bufs.append((q, kv, out))
        self.graphs: dict[int, tuple] = {}
        self.last = 0               # the bucket of the last replay (its outputs are read)
        names = ("qo_indptr", "kv_indptr", "kv_indices", "width") if cache.config.paged else ("width",)
        self.view = {n: cache.buffer(n).ptr for n in names}

    def _alloc(self, n: int) -> int:
        """Device memory freed when the cache closes (its context is current then)."""
        ptr = int(self.check(self.cu.cuMemAlloc(n), "cuMemAlloc"))
        self.cache.on_close(lambda: self.check(self.cu.cuMemFree(ptr), "cuMemFree"))
        return ptr

    def upload(self, step, qkv) -> None:
        rows = step.pad_to
        for (q_ptr, kv_ptr, _), (q, k, v), layer in zip(self.bufs, qkv, LAYERS):
            qd = np.zeros((rows, N_HEADS, layer.head_dim), np.float32)
            qd[:step.width] = q
            kvd = np.full((2, rows, layer.n_kv_heads, layer.head_dim), np.nan, np.float32)
            kvd[0, :step.width], kvd[1, :step.width] = k, v
            qd = qd if self.attention == "dense" else qd.astype(self.dtype)
            kvd = np.ascontiguousarray(kvd.astype(self.dtype))
            self.check(self.cu.cuMemcpyHtoD(q_ptr, qd.ctypes.data, qd.nbytes), "cuMemcpyHtoD")
            self.check(self.cu.cuMemcpyHtoD(kv_ptr, kvd.ctypes.data, kvd.nbytes // 2), "cuMemcpyHtoD")
            self.check(self.cu.cuMemcpyHtoD(kv_ptr + MAX_WRITE * layer.row_elems * self.dtype.itemsize,
                                            kvd.ctypes.data + kvd.nbytes // 2, kvd.nbytes // 2),
                       "cuMemcpyHtoD")

    def launch(self, rows: int) -> None:
        c = self.cache
        for li, layer in enumerate(LAYERS):
            q, kv, out = self.bufs[li]
            lay = c.layer(li)
            v_in = kv + MAX_WRITE * layer.row_elems * self.dtype.itemsize
            self.kern.store_kv(c.buffer("cells").ptr, rows, kv, v_in, layer.row_elems,
                               layer.head_dim, lay.k.ptr, lay.v.ptr, layer.n_kv_heads,
                               layer.head_dim, self.stream)
            if self.attention == "dense":
                self.kern.attend_dense(c.buffer("read_len").ptr, q, lay.k.ptr, lay.v.ptr,
                                       lay.mask.ptr, c.capacity, rows, N_HEADS, layer.n_kv_heads,
                                       layer.head_dim, out, self.stream)
            else:
                self.kern.paged(self.view, rows, q, (N_HEADS * layer.head_dim, layer.head_dim),
                                lay.k.ptr, lay.v.ptr, out, (N_HEADS * layer.head_dim, layer.head_dim),
                                N_HEADS, layer.n_kv_heads, layer.head_dim, layer.window, self.stream)

    def capture(self, rows: int) -> None:
        cu, check = self.cu, self.check
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        try:
            self.launch(rows)
        finally:
            graph = check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        self.graphs[rows] = (graph, check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))

    def replay(self, rows: int) -> None:
        self.check(self.cu.cuGraphLaunch(self.graphs[rows][1], self.stream), "cuGraphLaunch")

    def sync(self) -> None:
        self.check(self.cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def outputs(self, width: int) -> list[np.ndarray]:
        self.sync()
        outs = []
        for (_, _, out_ptr), layer in zip(self.bufs, LAYERS):
            dt = np.float32 if self.attention == "dense" else self.dtype
            a = np.empty((width, N_HEADS, layer.head_dim), dt)
            self.check(self.cu.cuMemcpyDtoH(a.ctypes.data, out_ptr, a.nbytes), "cuMemcpyDtoH")
            outs.append(a.astype(np.float32))
        return outs

    def close(self) -> None:
        for graph, exe in self.graphs.values():
            self.check(self.cu.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
            self.check(self.cu.cuGraphDestroy(graph), "cuGraphDestroy")
        self.graphs = {}


class TorchForward:
    """The same forward through cellcache.torch.attention, captured with torch.cuda.graph."""

    def __init__(self, cache, stream, attention: str):
        import torch

        import cellcache.torch as cct

        self.torch, self.cct, self.cache, self.stream = torch, cct, cache, stream
        self.attention = "paged" if attention == "paged" else "sdpa"
        self.view = cct.TorchView(cache)
        dev = self.view.device
        dt = cct.torch_dtype(cache.config.dtype)
        self.inputs = [(torch.zeros((MAX_WRITE, N_HEADS, la.head_dim), dtype=dt, device=dev),
                        torch.zeros((MAX_WRITE, la.n_kv_heads, la.head_dim), dtype=dt, device=dev),
                        torch.zeros((MAX_WRITE, la.n_kv_heads, la.head_dim), dtype=dt, device=dev))
                       for la in LAYERS]
        self.graph_outs: dict[int, list] = {}      # each graph's output tensors
        self.graphs: dict[int, object] = {}
        self.last = 0               # the bucket of the last replay (its outputs are read)

    def upload(self, step, qkv) -> None:
        t = self.torch
        with t.cuda.stream(self.stream):
            for (qb, kb, vb), (q, k, v) in zip(self.inputs, qkv):
                qb.zero_()
                kb.fill_(float("nan"))
                vb.fill_(float("nan"))
                qb[:step.width].copy_(t.from_numpy(q))
                kb[:step.width].copy_(t.from_numpy(k))
                vb[:step.width].copy_(t.from_numpy(v))

    def _forward(self, rows: int) -> list:
        return [self.cct.attention(self.view, li, q[:rows], k[:rows], v[:rows], backend=self.attention)
                for li, (q, k, v) in enumerate(self.inputs)]

    def launch(self, rows: int) -> None:
        with self.torch.cuda.stream(self.stream):
            self._forward(rows)

    def capture(self, rows: int) -> None:
        t = self.torch
        g = t.cuda.CUDAGraph()
        with t.cuda.graph(g, stream=self.stream):
            self.graph_outs[rows] = self._forward(rows)
        self.graphs[rows] = g

    def replay(self, rows: int) -> None:
        with self.torch.cuda.stream(self.stream):
            self.graphs[rows].replay()

    def sync(self) -> None:
        self.stream.synchronize()

    def outputs(self, width: int) -> list[np.ndarray]:
        self.sync()
        return [o[:width].float().cpu().numpy() for o in self.graph_outs[self.last]]

    def close(self) -> None:
        self.graphs = {}


class GraphForward:
    """The session's forward: upload, capture a bucket on its first use, replay (and every
    EAGER_EVERY-th step also run eagerly, timed, and checked the same way)."""

    def __init__(self, impl):
        self.impl = impl
        self.captures = 0
        self.replays: dict[int, int] = {}
        self.t_eager: list[float] = []
        self.t_graph: list[float] = []
        self.n = 0
        self.eager_mismatch = 0

    def __call__(self, cache, step, qkv):
        impl, rows = self.impl, step.pad_to
        impl.upload(step, qkv)
        impl.sync()
        self.n += 1
        if rows not in impl.graphs:
            impl.launch(rows)          # warm-up: allocations and first loads happen outside capture
            impl.sync()
            impl.capture(rows)
            self.captures += 1
        elif self.n % EAGER_EVERY == 0:
            t0 = time.perf_counter()
            impl.launch(rows)
            impl.sync()
            self.t_eager.append((time.perf_counter() - t0) * 1e6)
        impl.last = rows
        t0 = time.perf_counter()
        impl.replay(rows)
        impl.sync()
        self.t_graph.append((time.perf_counter() - t0) * 1e6)
        self.replays[rows] = self.replays.get(rows, 0) + 1
        return impl.outputs(step.width)


def run(seqs: int = 24, steps: int = 1000, seed: int = 0, use_torch: bool = False,
        attention: str = "paged", buckets: list[int] | None = None, capacity: int = 4096,
        progress: bool = True) -> dict:
    from cellcache.cuda.backend import CudaCellCache
    from cellcache.cuda.driver import check, cu

    buckets = check_buckets(buckets, MAX_WRITE) if buckets else default_buckets(MAX_WRITE)
    cfg = CacheConfig(capacity=capacity, layers=LAYERS, max_write=MAX_WRITE, initial_capacity=128,
                      dtype="bfloat16", max_seqs=max(64, 4 * seqs), paged=attention == "paged",
                      mask_format="none" if attention == "paged" else "bool")
    cache = CudaCellCache(cfg)
    if use_torch:
        import torch

        stream = torch.cuda.Stream(device=cfg.device)
        impl = TorchForward(cache, stream, attention)
    else:
        flags = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        stream = int(check(cu.cuStreamCreate(flags), "cuStreamCreate"))
        impl = DriverForward(cache, stream, attention)
    fwd = GraphForward(impl)
    session = Session(cache, fwd, SessionConfig(
        n_heads=N_HEADS, max_len=240, prompt=(8, 96), chunk=(8, 33), arrivals=(0, 3),
        max_live=seqs, p_fork=0.02, p_rewind=0.06, buckets=buckets, tolerance=TOLERANCE,
        decode_only_every=3, q_dtype="bfloat16" if attention == "paged" else None),
        seed=seed, stream=stream)
    summary = session.run(steps, progress, label="capture_graph")
    impl.close()
    m = cache.metrics()
    if not use_torch:         # the stream lives in the context the cache retains: first
        check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
    cache.close()
    return {
        "mode": "torch" if use_torch else "driver", "attention": attention, **summary,
        "captures": fwd.captures, "buckets_used": len(summary["per_bucket"]),
        "replays_per_bucket": dict(sorted(fwd.replays.items())),
        "graph_steps": sum(fwd.replays.values()), "eager_only_steps": 0,
        "mapped_bytes": m.get("mapped_bytes", 0),
        "eager_forward_us": statistics.median(fwd.t_eager) if fwd.t_eager else 0.0,
        "graph_forward_us": statistics.median(fwd.t_graph) if fwd.t_graph else 0.0,
    }


def main(argv: list[str] | None = None, probe=cuda_usable) -> int:
    p = Parser(prog="capture_graph", description=__doc__,
               formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=in_range(1, 256), default=24, help="most live sequences (default 24)")
    p.add_argument("--steps", type=in_range(1, 1_000_000), default=1000, help="steps (default 1000)")
    p.add_argument("--seed", type=in_range(0, 2**63 - 1), default=0, help="random seed (default 0)")
    p.add_argument("--capacity", type=in_range(MAX_WRITE, 1 << 24), default=4096,
                   help="cells in the pool (default 4096)")
    p.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help=f"comma-separated widths to capture (default powers of two to {MAX_WRITE})")
    p.add_argument("--attention", choices=["paged", "dense"], default="paged",
                   help="paged view with the paged kernels (default), or dense masks")
    p.add_argument("--torch", action="store_true", help="forward in torch, torch.cuda.graph")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.buckets is not None and (not args.buckets or min(args.buckets) < 1
                                     or max(args.buckets) != MAX_WRITE):
        p.error(f"--buckets must be positive widths whose largest is {MAX_WRITE}")
    if (code := require_gpu("capture_graph", probe)) is not None:
        return code
    s = run(args.seqs, args.steps, args.seed, args.torch, args.attention, args.buckets,
            args.capacity, progress=not args.quiet)
    good = s["mismatches"] == 0 and s["captures"] == s["buckets_used"]
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print(f"capture_graph [{s['mode']}, {s['attention']}]: {s['steps']} steps, all by graph "
              f"replay, {s['tokens']} tokens, {s['arrivals']} arrivals, {s['forks']} forks, "
              f"{s['rewinds']} rewinds, {s['finished']} finished, {s['preempted']} preempted, "
              f"{s['growths']} growths")
        print("replays per bucket: " + ", ".join(f"{b}: {n}" for b, n in s["replays_per_bucket"].items()))
        print(f"captures {s['captures']} == buckets used {s['buckets_used']} (growths cause none): "
              f"{'yes' if s['captures'] == s['buckets_used'] else 'NO'}; max error "
              f"{s['max_error']:.2e}; {s['mismatches']} mismatches")
        print(f"forward per step (3 layers, median): eager {s['eager_forward_us']:.0f} us, "
              f"graph replay {s['graph_forward_us']:.0f} us")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(run_main("capture_graph", main))
