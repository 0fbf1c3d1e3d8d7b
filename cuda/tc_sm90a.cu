// Prefill attention for Hopper (sm_90a): wgmma on paged K/V, warp-specialized as
// FlashAttention-3 is. Built by tools/build_ptx.py for compute_90a (PTX ISA 8.0, NVRTC 12.0),
// beside the sm_80 kernels. cellcache/cuda/tc.py loads it on compute capability 9.0 and runs
// a windowless bf16 prefill launch at d64 / d128 through tc90_plan + tc90_qpre_bf16_d<D>;
// tools/bench.py --section attention also times the bench's entries (tools/_sm90a.py: a
// host-made list in other orders, one CTA a unit); tests/gpu/test_sm90a_gpu.py checks both
// (docs/design/attention.md, "An sm_90a path").
//
//   tc90_plan                           one block: the step's units, run by run, kv head by kv
//       head, each pair's 128-row blocks last (heaviest) first, {run, kv head, first row, 0},
//       from qo_indptr / kv_indptr cut at width (padding runs make none); plan[0].x the count.
//   tc90_pipe_bf16_d<D>                 persistent: one CTA an SM takes units blockIdx.x,
//       + gridDim.x, ...; zeros in the padding rows. q / out at (token, head) strides. Each
//       unit's first tile is peeled off the loop, so ptxas keeps the wgmmas in flight (see
//       TC90_ATTEND); the consumers copy a unit's Q.
//   tc90_qpre_bf16_d<D>                 (chosen) pipe, and the producer copies each unit's Q
//       (cp.async, Q full / Q empty mbarriers) once both consumers are past the unit before's
//       last S, so the copy hides behind that tile's softmax, P V and stores
//       (docs/design/attention.md: 0.93x pipe's time on the long case, 0.79x on the
//       512-token d128 one).
//   tc90_early_bf16_d<D>                qpre with the unit's first K/V tile copied before its
//       Q (FlashAttention-3's order), so that tile too lands while the consumers finish the
//       unit before; kept beside qpre until timed.
//   tc90_<overlap|pingpong>_bf16_d<D>   (the bench's) one CTA a unit of a host-made list.
//   All run one body. A unit is 128 packed rows (row p = query p / G, head p % G of the kv
//   head's group of G); 384 threads. Warpgroup 0 produces (setmaxnreg 56): it gathers 128-key
//   K/V tiles through kv_indices with cp.async into ST stages (4 at d64, 3 at d128), each
//   guarded by a full and an empty mbarrier; lane l of producer warp w holds the cell of the
//   tile's row 32 w + l, read one tile ahead, and hands it to the lanes copying that row by
//   shuffle (each lane copies one 16-byte chunk of every row of its warp's 32). Warpgroups 1
//   and 2 consume (setmaxnreg 224), 64 rows each: S = Q K^T by SS wgmma m64n128k16 (Q and K in
//   128-byte-swizzled shared memory), online softmax in registers (exp2, scale * log2 e folded
//   in), O += P V by RS wgmma with P from the S registers; each tile's P V is issued behind the
//   next tile's S, so the softmax of one overlaps the other. pingpong (the runner's too): the
//   two consumers also take turns at the tensor cores (named barriers 3 and 4). The stage ring
//   and the turns run on across a CTA's units. Causal behind each run's history: query i of a
//   run of n over L keys sees keys [0, L - n + i]; masks only on tiles reaching a row's limit.
//   A unit without a row (row0 >= n x G, as of an empty run) is skipped by every warpgroup.
// The units are best listed run by run (neighbouring CTAs then share K/V in L2: heaviest
// first over the step made a long-prompt case DRAM-bound, 1.4x slower).
typedef unsigned short u16;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16)
       | ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// byte offset of 16-byte chunk c (8 bf16) of row r in an R-row tile: 64-column panels of R x 128 B
__device__ __forceinline__ uint32_t sw128_off(int r, int c, int R) {
  return (uint32_t)(((c >> 3) * R + r) * 128 + (((c & 7) ^ (r & 7)) << 4));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t out;   // cvt.rn.bf16x2.f32 d, a, b puts a in the upper half
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}
__device__ __forceinline__ void commit_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

__device__ __forceinline__ float ex2f(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void bar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, int parity) {
  asm volatile("{\n.reg .pred P;\nWAIT_%=:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
               "@!P bra WAIT_%=;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// arrives where c is non-zero, without a branch (a predicated instruction)
__device__ __forceinline__ void bar_arrive_if(uint32_t bar, int c) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n"
               :: "r"(bar), "r"(c) : "memory");
}
__device__ __forceinline__ void bar_arrive_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void wg_ss_n128(float* d, uint64_t da, uint64_t db, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
    "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
    : "l"(da), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void wg_rs_n64(float* d, const uint32_t* a, uint64_t db, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void wg_rs_n128(float* d, const uint32_t* a, uint64_t db, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
    "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

template <int N>
__device__ __forceinline__ void wg_rs(float* d, const uint32_t* a, uint64_t db, int scale_d) {
  if constexpr (N == 64) wg_rs_n64(d, a, db, scale_d);
  else wg_rs_n128(d, a, db, scale_d);
}

// What the runner's launches take (cellcache/cuda/tc.py, _ARGS90: every field 8 bytes).
typedef struct {
  const int* qo_indptr;            // [rows + 1]
  const int* kv_indptr;            // [rows + 1]
  const int* kv_indices;
  const long long* width;          // real rows; rows past it are padding (null: none)
  const u16* q;                    // [rows, H, D] at (q_s_tok, q_s_head, 1)
  const u16* k_pool;               // [cells, Hkv, D]
  const u16* v_pool;
  u16* out;                        // [rows, H, D] at (o_s_tok, o_s_head, 1)
  long long q_s_tok, q_s_head, o_s_tok, o_s_head;
  long long rows, n_heads, n_kv_heads;
  int4* plan;                      // plan[0].x: units; the units from plan[1]
  long long cap;                   // units the list holds
  double sl2;                      // softmax scale * log2(e)
} Tc90Args;

// Real queries of run r: its rows below width (padding runs and runs past the last have none).
__device__ __forceinline__ int run_qlen(const Tc90Args& a, int r) {
  const long long q0 = a.qo_indptr[r], q1 = a.qo_indptr[r + 1];
  const long long e = a.width ? min(q1, *a.width) : q1;
  return e > q0 ? (int)(e - q0) : 0;
}

// D: head_dim; ST: K/V stages; PP: the consumers take turns at the tensor cores; PIPE: each
// unit's first tile peeled off the loop; QP: 0, the consumers copy each unit's Q after the
// unit before; 1, the producer does (cp.async, while the consumers finish the unit before),
// then the unit's K/V; 2, the producer copies the unit's first K/V tile, then Q. The CTA
// takes units first, first + step, ... below n_units (one CTA a unit: first = blockIdx.x,
// step = gridDim.x = n_units); the stage ring and the consumers' turns run on across units.
template <int D, int ST, bool PP, bool PIPE, int QP>
__device__ __forceinline__ void tc90_prefill(const Tc90Args& p, const int4* units, int n_units) {
  extern __shared__ unsigned char dyn[];
  unsigned char* base = (unsigned char*)(((unsigned long long)dyn + 1023) & ~1023ull);
  const int QT = 64 * D * 2, KT = 128 * D * 2;
#define SK(st) (base + 2 * QT + (st) * 2 * KT)
#define SV(st) (base + 2 * QT + (st) * 2 * KT + KT)
  // full[ST], empty[ST], then (QP) Q full and Q empty
  const uint32_t bars = smem_u32(base + 2 * QT + ST * 2 * KT);
#define FULL(st) (bars + 8 * (st))
#define EMPTY(st) (bars + 8 * (ST + (st)))
#define QFULL (bars + 16 * ST)
#define QEMPTY (bars + 16 * ST + 8)
  const int H = (int)p.n_heads, Hkv = (int)p.n_kv_heads, G = H / Hkv;
  const float scale_log2 = (float)p.sl2;
  const u16 *Q = p.q, *Kp = p.k_pool, *Vp = p.v_pool;
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  if (p.width) {                                     // zeros in the padding rows
    const long long w0 = *p.width;
    const long long n = (p.rows - w0) * H * (D / 8);
    for (long long i = blockIdx.x * 384ll + threadIdx.x; i < n; i += gridDim.x * 384ll) {
      const long long row = w0 + i / (H * (D / 8)), h = i / (D / 8) % H, c = i % (D / 8);
      *reinterpret_cast<uint4*>(p.out + row * p.o_s_tok + h * p.o_s_head + c * 8) = make_uint4(0, 0, 0, 0);
    }
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < ST; ++s) { bar_init(FULL(s), 128); bar_init(EMPTY(s), 256); }
    if constexpr (QP != 0) { bar_init(QFULL, 128); bar_init(QEMPTY, 256); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // a unit (run, kv head, first packed row): its queries' place and its keys
  struct Unit { int kvh, row0, q0, k0, hist, nrows, n_keys, n_tiles; };
  auto unit_at = [&](int i, Unit& v) {
    const int4 u = units[i];
    const int run = u.x;
    v.kvh = u.y; v.row0 = u.z;
    v.q0 = p.qo_indptr[run];
    const int n = p.qo_indptr[run + 1] - v.q0;
    v.k0 = p.kv_indptr[run];
    v.hist = p.kv_indptr[run + 1] - v.k0 - n;
    v.nrows = run_qlen(p, run) * G;
    if (v.row0 >= v.nrows) return false;             // no row (an empty run): nothing to read
    v.n_keys = v.hist + min(v.row0 + 127, v.nrows - 1) / G + 1;
    v.n_tiles = (v.n_keys + 127) / 128;
    return v.n_keys > 0;                             // (fewer keys than queries: not a step)
  };
  if (wg == 0) {                                     // the producer: K/V tiles, stage by stage
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int lane = tid & 31, pw = tid >> 5;       // warp pw copies rows 32 pw .. 32 pw + 31
    constexpr int CPR = D / 8, RPJ = 32 / CPR;     // 16-byte chunks a row; rows a copy of the warp
    const int c = lane % CPR, rsub = lane / CPR;    // this lane's chunk of every row it copies
    int t = 0;                                       // tiles of this CTA so far (its stage ring)
    int u = 0;                                       // (QP) units of this CTA so far
    for (int i = blockIdx.x; i < n_units; i += gridDim.x) {
      Unit v;
      if (!unit_at(i, v)) continue;
      // both consumers' Q (QP): 128 rows, zeros past nrows, once both are past the unit
      // before's last S
      auto copy_q = [&]() {
        bar_wait(QEMPTY, (u & 1) ^ 1);
        const uint32_t sq0 = smem_u32(base);
#pragma unroll 1
        for (int k = 0; k < CPR; ++k) {                // (not unrolled: the producer's 56 registers)
          const int idx = k * 128 + tid, r = idx / CPR, qc = idx % CPR, row = v.row0 + r;
          const bool in = row < v.nrows;
          const u16* src = in ? Q + (v.q0 + row / G) * p.q_s_tok + (v.kvh * G + row % G) * p.q_s_head + qc * 8 : Q;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                       :: "r"(sq0 + (r >> 6) * QT + sw128_off(r & 63, qc, 64)), "l"(src), "r"(in ? 16 : 0));
        }
        bar_arrive_cp_async(QFULL);
        ++u;
      };
      if constexpr (QP == 1) copy_q();
      const char* kb = (const char*)(Kp + (size_t)v.kvh * D + c * 8);
      const char* vb = (const char*)(Vp + (size_t)v.kvh * D + c * 8);
      // the cell of row 32 pw + lane of tile j (clamped: a row past the keys copies zeros)
      auto cell_of = [&](int j) { return p.kv_indices[v.k0 + min(j * 128 + 32 * pw + lane, v.n_keys - 1)]; };
      int nxt = cell_of(0);
      for (int j = 0; j < v.n_tiles; ++j, ++t) {
        const int s = t % ST;
        const long long off = (long long)nxt * (Hkv * D * 2);   // this lane's row, in bytes
        if (j + 1 < v.n_tiles) nxt = cell_of(j + 1);   // in flight while this tile is copied
        const int left = v.n_keys - j * 128 - 32 * pw;  // rows of this warp's 32 that are keys
        const uint32_t sk = smem_u32(SK(s)), sv = smem_u32(SV(s));
        bar_wait(EMPTY(s), ((t / ST) & 1) ^ 1);
#pragma unroll
        for (int k = 0; k < CPR; ++k) {                // D/8 copies of K and of V a lane
          const int rl = RPJ * k + rsub, r = 32 * pw + rl;
          const long long o = __shfl_sync(0xffffffff, off, rl);
          const uint32_t so = sw128_off(r, c, 128), nb = rl < left ? 16 : 0;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(sk + so), "l"(kb + o), "r"(nb));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(sv + so), "l"(vb + o), "r"(nb));
        }
        bar_arrive_cp_async(FULL(s));
        // QP 2: Q behind the unit's first tile (its stage held tile t - ST, of an earlier
        // unit, freed by that tile's P V: no Q of this unit needed), so that tile lands
        // while the consumers finish
        if constexpr (QP == 2) if (j == 0) copy_q();
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  const int cw = wg - 1;                              // consumer warpgroup 0 or 1: 64 rows each
  unsigned char* sq = base + cw * QT;
  const int q4 = threadIdx.x & 3, w = tid >> 5, g = (threadIdx.x & 31) >> 2;
  if constexpr (PP) if (cw == 1) asm volatile("bar.arrive 3, 256;\n" ::: "memory");   // the first consumer goes first
  int t = 0;                                          // tiles of this CTA so far (the stage ring)
  int u = 0;                                          // (QP) units of this CTA so far
  for (int ui = blockIdx.x; ui < n_units; ui += gridDim.x) {
    Unit v;
    if (!unit_at(ui, v)) continue;
    if constexpr (QP != 0) {                          // the producer's copy of this unit's Q
      bar_wait(QFULL, u & 1);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      ++u;
    } else {
      // every warp of this warpgroup is past its wgmmas of the unit before, which read sq
      // (a warp's wait covers its own): only then is the next Q written over it
      asm volatile("bar.sync %0, 128;\n" :: "r"(1 + cw) : "memory");
      for (int idx = tid; idx < 64 * (D / 8); idx += 128) {
        int i = idx / (D / 8), c = idx % (D / 8), r = v.row0 + cw * 64 + i;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (r < v.nrows) {
          int tok = r / G, h = v.kvh * G + r % G;
          x = *reinterpret_cast<const uint4*>(Q + (v.q0 + tok) * p.q_s_tok + h * p.q_s_head + c * 8);
        }
        *reinterpret_cast<uint4*>(sq + sw128_off(i, c, 64)) = x;
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("bar.sync %0, 128;\n" :: "r"(1 + cw) : "memory");   // this warpgroup's Q is in
    }
    int lim[2];
    for (int hh = 0; hh < 2; ++hh) {
      int r = v.row0 + cw * 64 + 16 * w + g + 8 * hh;
      lim[hh] = r < v.nrows ? v.hist + r / G : -1;
    }
    const int lim_lo = min(lim[0], lim[1]);
    float o[D / 2], s[64], m[2] = {-1e30f, -1e30f}, lsum[2] = {0.f, 0.f};
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    uint32_t a[8][4];                                  // P of the tile before, for its P V
    int prev = 0;                                      // that tile's stage
    // one tile: S = Q K^T; from the second on, the tile before's P V issued behind it; the
    // softmax; P of this tile into a. PIPE calls it with a constant FIRST (inlined, the
    // branch folds away): no branch between a wgmma.fence and the wgmmas after it, which
    // ptxas would otherwise serialize. (A lambda, not a template: NVRTC takes no generic
    // device lambda; tests/test_cuda_host_side.py checks ptxas's verdict on the result.)
    auto one_tile = [&](const bool FIRST, int tile) {
      const int st = t % ST;
      bar_wait(FULL(st), (t / ST) & 1);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      if constexpr (PP) asm volatile("bar.sync %0, 256;\n" :: "r"(3 + cw) : "memory");   // my turn at the tensor cores
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t oq = (kk >> 2) * (64 * 128) + (kk & 3) * 32, ok = (kk >> 2) * (128 * 128) + (kk & 3) * 32;
        wg_ss_n128(s, desc_sw128(smem_u32(sq) + oq, 16, 1024), desc_sw128(smem_u32(SK(st)) + ok, 16, 1024), kk > 0);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      if (!FIRST) {                           // the tile before's P V, behind this S
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
          wg_rs<D>(o, a[kk], desc_sw128(smem_u32(SV(prev)) + kk * 2048, 128 * 128, 1024), 1);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");   // S is in
      } else {
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      }
      if constexpr (QP != 0) bar_arrive_if(QEMPTY, tile == v.n_tiles - 1);   // the unit's last S: Q is free
      if constexpr (PP) asm volatile("bar.arrive %0, 256;\n" :: "r"(4 - cw) : "memory");   // the other's turn
      float mx[2] = {m[0], m[1]};
      const int kb = tile * 128;
      if (kb + 127 > lim_lo) {
        for (int i = 0; i < 64; ++i) {
          int key = kb + 8 * (i / 4) + 2 * q4 + (i & 1);
          s[i] = key <= lim[(i & 3) >> 1] ? s[i] * scale_log2 : -1e30f;
          mx[(i & 3) >> 1] = fmaxf(mx[(i & 3) >> 1], s[i]);
        }
      } else {
        for (int i = 0; i < 64; ++i) {
          s[i] *= scale_log2;
          mx[(i & 3) >> 1] = fmaxf(mx[(i & 3) >> 1], s[i]);
        }
      }
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
      }
      float alpha[2] = {ex2f(m[0] - mx[0]), ex2f(m[1] - mx[1])}, rs[2] = {0.f, 0.f};
      m[0] = mx[0]; m[1] = mx[1];
      for (int i = 0; i < 64; ++i) { s[i] = ex2f(s[i] - mx[(i & 3) >> 1]); rs[(i & 3) >> 1] += s[i]; }
      for (int h = 0; h < 2; ++h) {
        rs[h] += __shfl_xor_sync(0xffffffff, rs[h], 1);
        rs[h] += __shfl_xor_sync(0xffffffff, rs[h], 2);
        lsum[h] = lsum[h] * alpha[h] + rs[h];
      }
      if (!FIRST) {
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");   // the P V before: O is whole
        bar_arrive(EMPTY(prev));                         // and its stage free
      }
      for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i & 3) >> 1];
      for (int kk = 0; kk < 8; ++kk)
        for (int r = 0; r < 4; ++r) a[kk][r] = pack_bf16(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
      prev = st;
      ++t;
    };
    if constexpr (PIPE) {
      one_tile(true, 0);
      for (int tile = 1; tile < v.n_tiles; ++tile) one_tile(false, tile);
    } else {
      for (int tile = 0; tile < v.n_tiles; ++tile) one_tile(tile == 0, tile);
    }
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");          // the last tile's P V
    for (int kk = 0; kk < 8; ++kk)
      wg_rs<D>(o, a[kk], desc_sw128(smem_u32(SV(prev)) + kk * 2048, 128 * 128, 1024), 1);
    commit_wait();
    bar_arrive(EMPTY(prev));                           // the last tile's stage free too
    for (int hh = 0; hh < 2; ++hh) {
      if (lim[hh] < 0) continue;
      int r = v.row0 + cw * 64 + 16 * w + g + 8 * hh, tok = r / G, h = v.kvh * G + r % G;
      u16* dst = p.out + (v.q0 + tok) * p.o_s_tok + h * p.o_s_head;
      float inv = 1.f / lsum[hh];
      for (int j = 0; j < D / 8; ++j) {
        int i = 4 * j + 2 * hh;
        *reinterpret_cast<uint32_t*>(dst + 8 * j + 2 * q4) = pack_bf16(o[i] * inv, o[i + 1] * inv);
      }
    }
  }
  if constexpr (PP) if (cw == 0) asm volatile("bar.sync 3, 256;\n" ::: "memory");   // the second's last turn given
#undef SK
#undef SV
#undef FULL
#undef EMPTY
#undef QFULL
#undef QEMPTY
}

// The bench's entries: one CTA a unit of a host-made list (tools/_sm90a.py), q and out
// contiguous [T, H, D], no padding rows.
#define TC90(NAME, D, ST, PP)                                                                    \
  extern "C" __global__ void __launch_bounds__(384, 1)                                          \
  NAME(const u16* Q, const u16* Kp, const u16* Vp, const int* qo_indptr, const int* kv_indptr,   \
       const int* kv_indices, const int4* units, int H, int Hkv, float scale_log2, u16* O) {     \
    const Tc90Args p = {qo_indptr, kv_indptr, kv_indices, nullptr, Q, Kp, Vp, O,                \
                        (long long)H * D, D, (long long)H * D, D, 0, H, Hkv, nullptr, 0,        \
                        scale_log2};                                                             \
    tc90_prefill<D, ST, PP, false, 0>(p, units, gridDim.x);                                                \
  }
// (name, head_dim, stages, ping-pong): tools/_sm90a.py sizes shared memory for these stages
TC90(tc90_overlap_bf16_d64, 64, 4, false)
TC90(tc90_overlap_bf16_d128, 128, 3, false)
TC90(tc90_pingpong_bf16_d64, 64, 4, true)
TC90(tc90_pingpong_bf16_d128, 128, 3, true)

// The runner's entries (cellcache/cuda/tc.py): tc90_plan lists the step's units on the device
// (one block), tc90_<entry>_bf16_d<D> runs them on persistent CTAs (one an SM: grid = SMs),
// each taking every gridDim.x-th unit, and writes zeros into the padding rows.
#define TC90_PLAN_THREADS 1024
extern "C" __global__ void __launch_bounds__(TC90_PLAN_THREADS) tc90_plan(const Tc90Args a) {
  // units run by run, kv head by kv head, each (run, kv head)'s 128-row blocks heaviest
  // (last) first: neighbouring CTAs read the same K/V, which L2 then serves
  __shared__ int s_warp[TC90_PLAN_THREADS / 32];
  __shared__ int s_carry;
  const int rows = (int)a.rows, Hkv = (int)a.n_kv_heads, G = (int)(a.n_heads / a.n_kv_heads);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  if (threadIdx.x == 0) s_carry = 0;
  __syncthreads();
  for (int b = 0; b < rows; b += TC90_PLAN_THREADS) {
    const int r = b + threadIdx.x;
    const int nt = r < rows ? (run_qlen(a, r) * G + 127) / 128 : 0;
    int x = nt;                                      // inclusive scan: warps, then their sums
    for (int d = 1; d < 32; d <<= 1) { const int y = __shfl_up_sync(0xffffffff, x, d); if (lane >= d) x += y; }
    if (lane == 31) s_warp[wid] = x;
    __syncthreads();
    if (wid == 0) {
      int y = s_warp[lane];
      for (int d = 1; d < 32; d <<= 1) { const int z = __shfl_up_sync(0xffffffff, y, d); if (lane >= d) y += z; }
      s_warp[lane] = y;
    }
    __syncthreads();
    const int ex = s_carry + (wid > 0 ? s_warp[wid - 1] : 0) + x - nt;
    for (int h = 0; h < Hkv; ++h)
      for (int j = 0; j < nt; ++j) {
        const long long k = (long long)ex * Hkv + (long long)h * nt + j;
        if (k < a.cap) a.plan[1 + k] = make_int4(r, h, (nt - 1 - j) * 128, 0);
      }
    __syncthreads();
    if (threadIdx.x == 0) s_carry += s_warp[31];
    __syncthreads();
  }
  if (threadIdx.x == 0) a.plan[0] = make_int4((int)min((long long)s_carry * Hkv, a.cap), 0, 0, 0);
}

// Each peels the first tile of a unit off the loop, so no branch sits between a wgmma.fence
// and the wgmmas after it (with the branch, ptxas serializes every wgmma: C7513, a
// WARPGROUP.DEPBAR after each HGMMA); QP says who copies Q and when (tc90_prefill).
#define TC90_ATTEND(NAME, D, ST, PIPE, QP)                                                       \
  extern "C" __global__ void __launch_bounds__(384, 1) NAME(const Tc90Args a) {                 \
    tc90_prefill<D, ST, true, PIPE, QP>(a, a.plan + 1, a.plan[0].x);                             \
  }
TC90_ATTEND(tc90_pipe_bf16_d64, 64, 4, true, 0)
TC90_ATTEND(tc90_pipe_bf16_d128, 128, 3, true, 0)
TC90_ATTEND(tc90_qpre_bf16_d64, 64, 4, true, 1)
TC90_ATTEND(tc90_qpre_bf16_d128, 128, 3, true, 1)
TC90_ATTEND(tc90_early_bf16_d64, 64, 4, true, 2)
TC90_ATTEND(tc90_early_bf16_d128, 128, 3, true, 2)
