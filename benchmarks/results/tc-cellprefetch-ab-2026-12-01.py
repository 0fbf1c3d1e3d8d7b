"""In-process A/B of the tensor-core decode (the script that wrote
tc-cellprefetch-ab-2026-12-01.json, run from the repository root on the H200 as
`python3 <this file> old_tc.ptx out.json`): the package's PTX ("new": that call's tree was
52f6b78 with tc-cellprefetch-trial-2026-12-01.patch applied and the PTX rebuilt) against
another tc_attention.ptx given as argv[1] ("old": 52f6b78's), alternating in one process,
FlashInfer off (that comparison is bench.py's)."""
import json
import sys
import time

import numpy as np

from cellcache.cuda import driver as drv

sys.path.insert(0, "tools")
import bench_gpu as B  # noqa: E402

orig = drv.load_module


def loader(path):
    def load(name):
        if name != "tc_attention" or path is None:
            return orig(name)
        with open(path, "rb") as f:
            image = np.frombuffer(f.read() + b"\0", dtype=np.uint8)
        load.keep = image
        return drv.check(drv.cu.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
    return load


B._flashinfer = lambda: None
old = sys.argv[1]
res = []
for rnd in range(2):
    for tag, path in (("old", old), ("new", None)):
        drv.load_module = loader(path)
        for c in B.ATTENTION_CASES[2:]:
            t = time.time()
            r = B._attention_case(*c, reps=30, rng=np.random.default_rng(0))
            row = {"round": rnd, "ptx": tag, "case": c[0], "table_ms": r["tensor_core_ms"],
                   "best": r.get("best_choice"), "best_ms": r.get("tensor_core_best_ms"),
                   "variants": [{k: v[k] for k in ("variant", "split", "ms", "diff_table") if k in v}
                                for v in r["variants"]]}
            res.append(row)
            print(f"{tag} {c[0]}: table {row['table_ms']:.4f} ms, best {row['best']} {row['best_ms']:.4f} ms "
                  f"({time.time() - t:.0f} s)", flush=True)
drv.load_module = orig
with open(sys.argv[2], "w") as f:
    json.dump(res, f, indent=1)
