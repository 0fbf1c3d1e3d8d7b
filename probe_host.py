import time, statistics, numpy as np, cProfile, pstats, io
from cellcache.cuda.backend import CudaCellCache
from cellcache.cuda.bench import fill_to
from cellcache.cuda.driver import check, cu
from cellcache import CacheConfig, LayerConfig
rng = np.random.default_rng(0)
for read_len in (4096, 1 << 20):
    cap = read_len + 128
    cfg = CacheConfig(capacity=cap, layers=[LayerConfig(1, 8, 0), LayerConfig(1, 8, 4096)], max_write=64, initial_capacity=cap, max_seqs=64)
    c = CudaCellCache(cfg)
    seqs = fill_to(c, read_len - 64, 64, rng)
    stream = int(check(cu.cuStreamCreate(1), "s"))
    e = c._engine
    def T(f, n=200):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter_ns(); f(); ts.append(time.perf_counter_ns() - t0)
        return statistics.median(ts) / 1e3
    print(read_len, "is_capturing", T(lambda: e.is_capturing(stream)))
    ids = [int(x) for x in rng.choice(seqs, 64)]
    def step(sync=True):
        c.declare_step(ids); c.prepare_step(stream=stream); c.commit_step()
        if sync: check(cu.cuStreamSynchronize(stream), "")
        for s in set(ids): c.rewind(s, c.pos(s) - ids.count(s))
    step()
    t = c._table
    cells = np.empty(64, np.int64); pos = np.empty(64, np.int64)
    def place():
        t.declare_step(ids); t.place_into(cells, pos)
        t.undo_place()
    print(read_len, "declare+place+undo", T(place))
    # write_step alone
    ws = []
    for _ in range(100):
        t.declare_step(ids); c._seq_ids[:64] = ids; rl = t.place_into(c._cells, c._positions)
        t0 = time.perf_counter_ns(); e.write_step(64, rl, stream); t1 = time.perf_counter_ns()
        check(cu.cuStreamSynchronize(stream), "")
        ws.append((t1 - t0) / 1e3)
        for s in set(ids): t.rewind(s, t.pos(s) - ids.count(s))
    print(read_len, "write_step", statistics.median(ws), "records", e.records_sent)
    ws = []
    for _ in range(100):
        t0 = time.perf_counter_ns(); c.declare_step(ids); c.prepare_step(stream=stream); t1 = time.perf_counter_ns(); c.commit_step()
        check(cu.cuStreamSynchronize(stream), "")
        ws.append((t1 - t0) / 1e3)
        for s in set(ids): c.rewind(s, c.pos(s) - ids.count(s))
    print(read_len, "declare+prepare", statistics.median(ws))
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): step()
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12); print(s.getvalue()[:3000])
    c.close()
