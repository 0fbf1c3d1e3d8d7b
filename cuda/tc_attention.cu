// Paged attention on tensor cores (FlashAttention-2 style) over the page-size-1 CSR view.
// No host code and no CUDA headers (NVRTC builds it); PTX ISA 8.0 / sm_80 instructions only
// (mma.sync m16n8k16, ldmatrix, cp.async).
//
//   tc_plan             the work list, on the device: one block prefix-sums the step's runs
//                       (qo_indptr, kv_indptr, width) into work items {run, q tile, kv split,
//                       splits} in a fixed-capacity list, picks a kv split size when the
//                       step has fewer units than the host's target, orders the list (run by
//                       run, or heaviest first over the step) and resets the work counters;
//                       with cascade, groups decode runs that share leading cells (tc_share
//                       finds the shares once a step) into the shared pass's list.
//   tc_attend_T_dD_V    persistent CTAs: each takes the next unit (item x kv head) from the
//                       counter until the list is exhausted, reading the next unit's set-up
//                       while the current one's first tiles land. A unit is QROWS packed rows of
//                       one run, row p = (query p / G, head p % G) of the kv head's group, so
//                       a group shares every K/V tile. Variant V = m<MQ>w<WKV>k<KT>s<ST>: 4
//                       warps of 16 x MQ rows, either along the rows (w1: QROWS = 64 MQ) or
//                       along the kv tile (w4: QROWS = 16, each warp its own KT / 4 keys of
//                       every tile, the four (m, l, O) merged in shared memory at the end: the
//                       decode shape). K/V tiles of KT entries are gathered with cp.async
//                       (zero-fill past the end) into a ring of ST buffers, the kv_indices of
//                       a tile loaded one iteration before its copies are issued (through
//                       shared memory: no index registers). m2 variants: one barrier a tile,
//                       tile j + ST - 1 issued right after it into tile j - 1's buffer (K and
//                       V one commit group); the others: K and V in separate groups, ST tiles
//                       ahead, issued after a second barrier at the end of the iteration.
//                       m2 variants with k64 score 32-key sub-tiles (..x<KS> variants: KS keys
//                       at once); ..b<B> variants are compiled for B CTAs an SM. S = Q K^T and
//                       O += P V with mma.m16n8k16 (f32 accumulate), operands from ldmatrix
//                       (.trans for V, every address a per-lane register plus an immediate),
//                       online softmax in exp2 with scale * log2(e) folded in (the row sums on
//                       the tensor cores at d128 m2); masks only on edge tiles.
//                       Its CTA with the launch's last take from the counter puts it back
//                       (so a plan serves the step's later layers too); the runs' own launch
//                       then writes zeros into the padding rows.
//   tc_merge_T          the splits of each split row and the own and shared parts of each
//                       grouped row merged (the host leaves it out where it can tell that
//                       nothing is split or grouped).
//
// Masks mirror attention.cu: query i of a run of qo_len queries over a list of L entries sees
// entries (hi - window, hi], hi = L - qo_len + i (window 0: [0, hi]).
//
// Shared memory rows are 16-byte chunks; with D / 8 a multiple of 8 (d64, d128, d256) chunk c
// of row r lives at r * CH + (c ^ (r & 7)) (XOR swizzle), otherwise (d80, d96) rows are padded
// by one chunk to an odd stride. Either way the 8 row addresses of one ldmatrix phase (same
// chunk column, 8 consecutive rows) and the chunks of a cp.async row fall in distinct banks.
#include "abi.h"

#define TC_THREADS 128             // 4 warps
#define TC_PLAN_THREADS 1024
#define TC_HDR 16                  // int32 words of the plan header
#define TC_NEG_INF __int_as_float(0xff800000)

// plan header words
#define TC_N_UNITS 0
#define TC_CHUNK 1                 // kv split size (0: no split)
#define TC_COUNTER 2               // next unit (atomic)
#define TC_SPLIT 3                 // 1 when some run is split (the merge has work)
#define TC_GUNITS 4                // units of the shared (cascade) pass: group items x kv heads
#define TC_GCOUNTER 5              // next unit of the shared pass (atomic)
#define TC_CASCADE 6               // 1 when some rows are grouped (the merge has work)

#define TC_NSH 4                   // most kv splits of a group's shared keys
#define TC_CASCADE_ALIGN 128       // a group's shared keys and their splits: multiples of this

struct f16 { unsigned short x; };
struct bf16 { unsigned short x; };

// Everything the three kernels take, passed by value. Every field is 8 bytes, so the host
// packs it with one struct format (cellcache/cuda/tc.py, _ARGS).
typedef struct {
    const cc_i32* qo_indptr;       // [rows + 1]
    const cc_i32* kv_indptr;       // [rows + 1]
    const cc_i32* kv_indices;
    const cc_i64* width;           // real rows; rows past it are padding
    const void* q;                 // [rows, n_heads, D] at (q_s_tok, q_s_head, 1)
    const void* k_pool;            // [cells, n_kv_heads, D]
    const void* v_pool;
    void* out;                     // [rows, n_heads, D] at (o_s_tok, o_s_head, 1)
    cc_i64 q_s_tok, q_s_head, o_s_tok, o_s_head;
    cc_i64 rows, n_heads, n_kv_heads, group, window;
    cc_i32* plan;                  // header, items (int4 x list_cap), run_base, run_ns
    float* part;                   // split partials: [slot][n_kv_heads][QROWS][D + 2]
    cc_i64 list_cap;               // items the list holds
    cc_i64 split_cap;              // most units (items x kv heads) a split plan may make
    cc_i64 target_units;           // split when the step has fewer units than this (host: split x CTAs)
    double sl2;                    // softmax scale * log2(e)
    const float* kv_scale;         // 8-bit K/V: the layer's scales, K [n_kv_heads] then V [n_kv_heads]
    cc_i64 mode;                   // tc_attend: 0 the runs' own units, 1 the groups' shared units
    cc_i64 gcap;                   // group items the list holds (0: no cascade)
    float* cpart;                  // grouped rows' partials: [row][n_heads][1 + TC_NSH][D + 2]
    const cc_i32* share;           // [rows]: leading kv entries run r shares with run r - 1
} TcArgs;

// -- instructions ------------------------------------------------------------------------------

__device__ __forceinline__ cc_u32 smem_addr(const void* p)
{
    cc_u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros and reads nothing
__device__ __forceinline__ void cp_async16(cc_u32 dst, const void* src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 16 bytes global -> shared, zeros when cell < 0 (the ignore-src predicate, PTX ISA 7.5: one
// compare a copy instead of a computed source size; src must still be a valid address)
__device__ __forceinline__ void cp_async16_cell(cc_u32 dst, const void* src, int cell)
{
    asm volatile("{\n\t.reg .pred z;\n\tsetp.lt.s32 z, %2, 0;\n\t"
                 "cp.async.cg.shared.global [%0], [%1], 16, z;\n\t}"
                 :: "r"(dst), "l"(src), "r"(cell) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(cc_u32 addr, cc_u32 (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(cc_u32 addr, cc_u32 (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 8-bit K/V (float8 e4m3, "fn": no infinities): four bytes of w (element 0 the lowest) as
// two f16x2 words, each value exactly x * 2^-8 (subnormals included): the byte's sign goes
// to bit 15 and its 7 magnitude bits to bits 7-13, so e4m3's exponent (bias 7) reads as
// f16's (bias 15). The 2^8 is folded into the scales.
__device__ __forceinline__ void e4m3x4_to_f16(cc_u32 w, cc_u32& lo, cc_u32& hi)
{
    const cc_u32 x0 = __byte_perm(w, 0, 0x1404), x1 = __byte_perm(w, 0, 0x3424);   // bytes 1 and 3
    lo = (x0 & 0x80008000u) | ((x0 >> 1) & 0x3F803F80u);
    hi = (x1 & 0x80008000u) | ((x1 >> 1) & 0x3F803F80u);
}

// bytes 0 and 2 (even) or 1 and 3 (odd) of w as one f16x2 word, x 2^-8 as above
__device__ __forceinline__ cc_u32 e4m3_even_to_f16(cc_u32 w)
{
    const cc_u32 x = __byte_perm(w, 0, 0x2404);
    return (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
}
__device__ __forceinline__ cc_u32 e4m3_odd_to_f16(cc_u32 w)
{
    const cc_u32 x = __byte_perm(w, 0, 0x3414);
    return (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
}

template <bool C, typename A, typename B> struct Sel { typedef A type; };
template <typename A, typename B> struct Sel<false, A, B> { typedef B type; };

// D (16x8, f32) += A (16x16, row) * B (16x8, col); A in a[0..3], B in b0, b1 (PTX ISA
// "Matrix Fragments for mma.m16n8k16 with floating point type": with g = lane / 4,
// t = lane % 4, a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..][g]; d0,d1 = D[g][2t..], d2,d3 = D[g+8][2t..]).
template <typename T> struct Mma;
template <> struct Mma<f16> {
    static __device__ __forceinline__ void run(float (&d)[4], const cc_u32 (&a)[4], cc_u32 b0, cc_u32 b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // lo in the low half (the lower column), hi in the high half
    static __device__ __forceinline__ cc_u32 pack(float lo, float hi)
    {
        cc_u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static constexpr cc_u32 ONES = 0x3c003c00u;        // (1, 1)
    static __device__ __forceinline__ void unpack(cc_u32 w, float& lo, float& hi)
    {
        asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(w & 0xFFFFu)));
        asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(w >> 16)));
    }
};
template <> struct Mma<bf16> {
    static __device__ __forceinline__ void run(float (&d)[4], const cc_u32 (&a)[4], cc_u32 b0, cc_u32 b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ cc_u32 pack(float lo, float hi)
    {
        cc_u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static constexpr cc_u32 ONES = 0x3f803f80u;        // (1, 1)
    static __device__ __forceinline__ void unpack(cc_u32 w, float& lo, float& hi)
    {
        lo = __uint_as_float(w << 16);
        hi = __uint_as_float(w & 0xFFFF0000u);
    }
};

// -- variants ----------------------------------------------------------------------------------

// One kernel variant: D head_dim, MQ 16-row blocks a warp (1 or 2), WKV warps along the kv
// tile (1: the 4 warps split the unit's rows; 4: the 4 warps share one 16*MQ-row block and
// each takes its own KT/4 keys of every tile, merged through shared memory at the end), KT kv
// entries a tile (the CTA's), ST ring stages. Shared memory: Q (QROWS rows) + 2 x ST tiles of
// KT rows; the end-of-unit merge of WKV > 1 reuses it.
template <int D, int MQ, int WKV, int KT, int ST, int KS = 0> struct Tile {
    static constexpr int CH = D / 8;                        // 16-byte chunks of a row
    static constexpr bool SWZ = CH % 8 == 0;
    static constexpr int RS = SWZ ? CH : CH + 1;            // row stride in chunks
    static constexpr int WQ = 4 / WKV;                      // warps along the rows
    static constexpr int WROWS = 16 * MQ;                   // rows a warp
    static constexpr int QROWS = WROWS * WQ;                // packed rows a unit
    static constexpr int KW = KT / WKV;                     // keys a warp computes of a tile
    // keys a warp scores at once: two 16-row blocks a warp with more than 32 keys of a tile
    // score them in 32-key sub-tiles (S of 64 keys next to O would spill at d128), each with
    // its own online-softmax step; then K and V of a tile are waited for together
    // (KS > 0: the variant's own sub-tile, ..x<KS> variants)
    static constexpr int KSUB = KS > 0 ? KS : MQ == 2 && KW > 32 ? 32 : KW;
    static constexpr int Q_CH = QROWS * RS, KV_CH = KT * RS;
    static constexpr int RING = 16 * (Q_CH + 2 * ST * KV_CH);
    static constexpr int OS = D + 8;                        // merge: floats a row (+8: banks)
    static constexpr int MERGE = WKV > 1 ? 4 * 4 * WROWS * (OS + 2) : 0;
    static constexpr int SMEM = RING > MERGE ? RING : MERGE;
    // 8-bit K/V: a ring of ST stages of KT K then KT V rows of D bytes (unswizzled), and one
    // f16 K and V tile (the layout above) that each tile is widened into before it is read
    static constexpr int F8_RING = 2 * ST * KT * D;
    // R8 (8-bit, warps along the kv tile, D a multiple of 32): no f16 tile; each warp's ring
    // rows are D + 16 bytes apart (ldmatrix rows of 8 keys then fall in distinct banks)
    static constexpr bool R8 = WKV > 1 && D % 32 == 0;
    static constexpr int P8 = R8 ? D + 16 : D;
    static constexpr int RING8 = R8 ? 16 * Q_CH + 2 * ST * KT * P8 : 16 * (Q_CH + 2 * KV_CH) + F8_RING;
    static constexpr int SMEM8 = RING8 > MERGE ? RING8 : MERGE;
    static constexpr int NP = (KT * CH + TC_THREADS - 1) / TC_THREADS;  // load passes a tile
    static_assert(4 % WKV == 0 && KW % 16 == 0 && KW % KSUB == 0 && KSUB % 16 == 0 && (MQ == 1 || MQ == 2) &&
                  ST >= 1 && KT <= TC_THREADS, "tile");
    static __device__ __forceinline__ int at(int row, int c) { return row * RS + (SWZ ? (c ^ (row & 7)) : c); }
    // Bytes to chunk 2k + b of a row (16 at(row, 2k + b)) for ldmatrix, split into per-lane
    // registers and constants: a lane's row is a base row with low bits lx = row & 7 plus a
    // multiple of 8 (a constant, ROWB bytes a row), and chunk 2k + b of it is at one of NOFF
    // per-lane offsets loff(row, b, koff_sel(k)) (SWZ: the XOR of 2 (k & 3) with b ^ lx; else
    // one) plus the constant koff(k). So every ldmatrix of the unrolled loops is a register
    // plus an immediate: no per-load address arithmetic (which cost ~2 instructions a load).
    static constexpr int NOFF = SWZ ? 4 : 1;
    static constexpr int ROWB = 16 * RS;                     // bytes a row
    static __device__ __forceinline__ cc_u32 loff(int row, int b, int i)
    {
        return 16 * (row * RS + (SWZ ? ((2 * i) ^ (b ^ (row & 7))) : b));
    }
    static __device__ __forceinline__ constexpr int koff_sel(int k) { return SWZ ? (k & 3) : 0; }
    static __device__ __forceinline__ constexpr int koff(int k) { return SWZ ? 128 * (k >> 2) : 32 * k; }
};

// -- one unit --------------------------------------------------------------------------------

__device__ __forceinline__ const int4* plan_items(const TcArgs& a)
{
    return reinterpret_cast<const int4*>(a.plan + TC_HDR);
}
__device__ __forceinline__ cc_i32* plan_run_base(const TcArgs& a) { return a.plan + TC_HDR + 4 * a.list_cap; }
__device__ __forceinline__ cc_i32* plan_run_ns(const TcArgs& a) { return plan_run_base(a) + a.rows; }
// cascade: a grouped run's own keys start at run_start (its group's shared keys); run_crow is
// its row in cpart (-1: not grouped); run_cs its partials there (1 + the shared splits)
__device__ __forceinline__ cc_i32* plan_run_start(const TcArgs& a) { return plan_run_base(a) + 2 * a.rows; }
__device__ __forceinline__ cc_i32* plan_run_crow(const TcArgs& a) { return plan_run_base(a) + 3 * a.rows; }
__device__ __forceinline__ cc_i32* plan_run_cs(const TcArgs& a) { return plan_run_base(a) + 4 * a.rows; }
// by row: 8 x its row in cpart + its partials there (-1: not grouped), for the merge
__device__ __forceinline__ cc_i32* plan_row_cr(const TcArgs& a) { return plan_run_base(a) + 5 * a.rows; }
// groups {first run, runs, shared keys, first cpart row (-1: not run)}: rows / 2 + 1 of them,
// then the shared pass's items {group, q tile, split, split size}: gcap of them
__device__ __forceinline__ int4* plan_groups(const TcArgs& a)
{
    return reinterpret_cast<int4*>(a.plan + TC_HDR + 4 * a.list_cap + ((6 * a.rows + 3) & ~3LL));
}
__device__ __forceinline__ int4* plan_gitems(const TcArgs& a) { return plan_groups(a) + a.rows / 2 + 1; }

// Real queries of run r: its rows below width (padding runs and runs past the last have none).
__device__ __forceinline__ int run_qlen(const TcArgs& a, int r, cc_i64 width)
{
    const cc_i64 q0 = a.qo_indptr[r], q1 = min((cc_i64)a.qo_indptr[r + 1], width);
    return q1 > q0 ? (int)(q1 - q0) : 0;
}

// The kv range [r0, r1] of q tile qt (packed rows [p0, p1)) of a run: the first query's lo
// to the last query's hi, cut to split s of size chunk when the run is split (ns > 1).
// shift = L - qo_len (hi(q) = shift + q). Empty when r1 < r0.
__device__ __forceinline__ void unit_keys(int shift, int p0, int p1, int G, int W, int s, int ns,
                                          int chunk, int& r0, int& r1)
{
    const int qa = p0 / G, qb = (p1 - 1) / G;
    r0 = W > 0 ? max(0, shift + qa - W + 1) : 0;
    r1 = shift + qb;
    if (ns > 1) {
        r0 = max(r0, s * chunk);
        r1 = min(r1, s * chunk + chunk - 1);
    }
}

// A unit's set-up, read by one thread into shared memory (TC_DESC words): the unit, its
// plan item and its run's offsets. tc_attend has the next unit's read while the current
// unit's first tiles are in flight, so a unit starts from shared memory instead of a chain
// of dependent global loads (counter, item, offsets: ncu put half the decode kernel's stall
// samples in a unit's set-up at 256 x 640 d64). desc[0] >= the unit count: no unit.
#define TC_DESC 16
enum { D_UNIT, D_IT, D_Q0 = 5, D_QLEN, D_K0, D_L, D_SHIFT, D_CROW, D_START, D_CHUNK, D_BASE };
__device__ __forceinline__ void unit_desc(const TcArgs& a, int u, int n_units, int* desc)
{
    desc[D_UNIT] = u;
    if (u >= n_units) return;
    const int n_kvh = (int)a.n_kv_heads, item = u / n_kvh;
    const int4 it = a.mode ? plan_gitems(a)[item] : plan_items(a)[item];
    int run, q0, qlen, k0, L, shift, crow, start = 0, chunk = 0, base = 0;
    if (a.mode) {
        const int4 gd = plan_groups(a)[it.x];
        run = gd.x; qlen = gd.y; L = gd.z; crow = gd.w;
        q0 = a.qo_indptr[run];
        k0 = a.kv_indptr[run];
        shift = L;
    } else {
        // every load below depends on the item only: they go out together
        run = it.x;
        const cc_i64 width = *a.width;
        q0 = a.qo_indptr[run];
        const int q1 = a.qo_indptr[run + 1];
        k0 = a.kv_indptr[run];
        L = a.kv_indptr[run + 1] - k0;
        crow = a.gcap > 0 ? plan_run_crow(a)[run] : -1;
        start = a.gcap > 0 ? plan_run_start(a)[run] : 0;   // read when crow >= 0 only
        chunk = a.plan[TC_CHUNK];
        base = plan_run_base(a)[run];
        const cc_i64 qe = min((cc_i64)q1, width);      // run_qlen, its q1 read once for shift too
        qlen = qe > q0 ? (int)(qe - q0) : 0;
        shift = L - (q1 - q0);                          // hi(q) = shift + q
    }
    desc[D_IT] = it.x; desc[D_IT + 1] = it.y; desc[D_IT + 2] = it.z; desc[D_IT + 3] = it.w;
    desc[D_Q0] = q0; desc[D_QLEN] = qlen; desc[D_K0] = k0; desc[D_L] = L; desc[D_SHIFT] = shift;
    desc[D_CROW] = crow; desc[D_START] = start; desc[D_CHUNK] = chunk; desc[D_BASE] = base;
}

// KV8: the pools hold float8 e4m3 (scaled per kv head, a.kv_scale), widened to f16 x 2^-8:
// in registers straight from the 8-bit ring (R8: warps along the kv tile, D % 32 == 0) or
// through an f16 tile in shared memory (the others). Q is converted to f16 once a unit, so S
// and P V run on f16 tensor cores for either T; K's scale x 2^8 joins the scores' scale
// (sl2) and V's x 2^8 scales O when written.
// One unit from its set-up (desc, shared memory); pre() runs once every thread has issued the
// unit's first copies (every thread calls it, with no barrier after it).
template <typename T, bool KV8, int D, int MQ, int WKV, int KT, int ST, int KS, typename Pre>
__device__ void tc_unit(const TcArgs& a, const int* desc, uint4* smem, Pre&& pre)
{
    using C = Tile<D, MQ, WKV, KT, ST, KS>;
    using M = typename Sel<KV8, Mma<f16>, Mma<T>>::type;   // the operands' type on the tensor cores
    constexpr int CH = C::CH, NP = C::NP, QROWS = C::QROWS, KW = C::KW, WROWS = C::WROWS;
    constexpr int KSUB = C::KSUB, NSUB = KW / KSUB;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wq = warp / WKV, wk = warp - wq * WKV;    // the warp's row block and key slice
    const int g = lane >> 2, tg = lane & 3;
    const int n_kvh = (int)a.n_kv_heads, G = (int)a.group, W = (int)a.window;
    const int u = desc[D_UNIT], kvh = u - (u / n_kvh) * n_kvh;
    // mode 1 (cascade): a group's shared keys [0, S) for all its rows (consecutive decode
    // runs, one row each: the group's rows are q0, q0 + 1, ...), split s of size it.w; every
    // key precedes every query (shift S). Mode 0: a run's own tile; a grouped run's keys
    // start past its group's shared ones.
    const bool grp = a.mode != 0;
    const int qt = desc[D_IT + 1], split = desc[D_IT + 2], ns = grp ? 1 : desc[D_IT + 3];
    const int q0 = desc[D_Q0], qlen = desc[D_QLEN], k0 = desc[D_K0], L = desc[D_L];
    const int shift = desc[D_SHIFT], crow = desc[D_CROW];
    int r0, r1;
    if (grp) {
        r0 = split * desc[D_IT + 3];
        r1 = min(L, r0 + desc[D_IT + 3]) - 1;
    }
    const int P = qlen * G;
    const int p0 = qt * QROWS, p1 = min(P, p0 + QROWS);
    const int qa = p0 / G, qb = (p1 - 1) / G;           // the unit's first and last query
    if (!grp) {
        unit_keys(shift, p0, p1, G, W, split, ns, desc[D_CHUNK], r0, r1);
        if (crow >= 0) r0 = max(r0, desc[D_START]);    // a multiple of TC_CASCADE_ALIGN
    }
    // a windowed unit's tiles start at a multiple of KT of the run's list (the keys below its
    // first query's window land in the first tile, an edge tile, which masks them), so a
    // row's tiles are the same whichever unit holds it and whichever rows share it: a token
    // read in a prompt chunk and in a decode step sums its keys alike (batch-invariant
    // serving). A split's start is a multiple of KT already, so it stays within its split.
    if (r1 >= r0) r0 -= r0 % KT;
    // keys in [full_lo, full_hi] are visible to every row of the unit
    const int full_hi = min(shift + qa, r1);
    const int full_lo = W > 0 ? shift + qb - W + 1 : 0;
    const int n_tiles = r1 >= r0 ? (r1 - r0) / KT + 1 : 0;

    const T* __restrict__ q = static_cast<const T*>(a.q);
    const T* __restrict__ kp = static_cast<const T*>(a.k_pool);
    const T* __restrict__ vp = static_cast<const T*>(a.v_pool);
    const cc_i32* __restrict__ kv_idx = a.kv_indices + k0;
    uint4* s_q = smem;
    uint4* s_k = smem + C::Q_CH;
    uint4* s_v = s_k + (KV8 ? 1 : ST) * C::KV_CH;
    // R8: the widened tiles stay in registers, the 8-bit ring follows Q
    constexpr bool R8 = KV8 && C::R8;
    static_assert(!R8 || (MQ == 1 && KSUB == 16 && NSUB == 1), "the register path fills s[0], pa[0], o[0] only");
    constexpr int P8 = C::P8;
    unsigned char* s_f8 = R8 ? reinterpret_cast<unsigned char*>(s_k)
                             : reinterpret_cast<unsigned char*>(s_v + (KV8 ? 1 : ST) * C::KV_CH);
    const cc_u32 a_q = smem_addr(s_q), a_k = smem_addr(s_k), a_v = smem_addr(s_v);

    // Q: the unit's packed rows, zeros past the last real one
    for (int c = tid; c < QROWS * CH; c += TC_THREADS) {
        const int row = c / CH, col = c - row * CH, p = p0 + row;
        const T* src = q;
        int bytes = 0;
        if (p < p1) {
            const int qi = p / G, hl = p - qi * G;
            src = q + (cc_i64)(q0 + qi) * a.q_s_tok + (cc_i64)(kvh * G + hl) * a.q_s_head + col * 8;
            bytes = 16;
        }
        cp_async16(a_q + 16 * C::at(row, col), src, bytes);
    }
    cp_async_commit();

    // The cells of a tile: thread t < KT reads the cell of row t of tile j + ST + 1 while tile
    // j is computed and stores it at the end of the iteration into s_cells[(j + ST + 1) & 1],
    // one iteration before the copies that read it there are issued, so the index latency
    // never stalls the issue and the copies hold no index registers (-1: past the range).
    __shared__ __align__(16) int s_cells[2][KT];
    auto cell_of = [&](int j, int row) { const int key = r0 + j * KT + row; return j < n_tiles && key <= r1 ? kv_idx[key] : -1; };
    // a cell's row of kv heads is n_kvh * D elements (bytes < 2^32): one 32 x 32 -> 64-bit
    // multiply-add a copy; a zero-filled copy (cell -1) points at cell 0 and reads nothing.
    // When CH divides the 128 threads (d64, d128, d256) a thread copies the same column every
    // pass, of rows RPP apart: the source column and (RPP % 8 == 0) the swizzled chunk are
    // per-thread constants, so a copy is one multiply-add and a constant shared offset.
    const cc_u32 cbytes = (cc_u32)(n_kvh * D * (int)sizeof(T));
    constexpr bool COLFIX = TC_THREADS % CH == 0;
    constexpr int RPP = COLFIX ? TC_THREADS / CH : 1;  // rows a pass
    const int crow0 = COLFIX ? tid / CH : 0, ccol = COLFIX ? tid - crow0 * CH : 0;
    const int cx = C::SWZ ? (ccol ^ (crow0 & 7)) : ccol;   // the swizzled chunk (RPP % 8 == 0)
    // A thread's NP cells of a tile are read before any of its copies is issued: the copies
    // are volatile asm with a memory clobber, so a read between two of them cannot move up,
    // and a read-then-copy loop paid a shared (or, for the first tiles, global) latency a copy
    // (measured on the H100, 256 x 4K d64: the index reads' waits were ~40% of the kernel's
    // stall samples). With COLFIX and NP rows a thread filling the tile exactly (TRANS), row r's
    // cell is kept at slot (r % RPP) NP + r / RPP, so a thread's NP cells are contiguous and
    // come in NP / 4 16-byte reads.
    constexpr bool TRANS = COLFIX && RPP * NP == KT && NP % 4 == 0 && !KV8;
    auto cell_slot = [](int row) { return TRANS ? (row % RPP) * NP + row / RPP : row; };
    auto cells_of = [&](int j, bool from_smem, int (&cl)[NP]) {
        if (TRANS && from_smem) {
            const int4* v = reinterpret_cast<const int4*>(s_cells[j & 1] + crow0 * NP);
#pragma unroll
            for (int i = 0; i < NP / 4; ++i) {
                const int4 x = v[i];
                cl[4 * i] = x.x; cl[4 * i + 1] = x.y; cl[4 * i + 2] = x.z; cl[4 * i + 3] = x.w;
            }
        } else {
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                const int row = COLFIX ? crow0 + p * RPP : (tid + p * TC_THREADS) / CH;
                const bool in = COLFIX ? RPP * NP <= KT || row < KT : tid + p * TC_THREADS < KT * CH;
                cl[p] = !in ? -1 : from_smem ? s_cells[j & 1][row] : cell_of(j, row);
            }
        }
    };
    // tile j's copies into its stage of the ring at base, from the thread's cells cl
    auto issue_cells = [&](const T* __restrict__ pool, cc_u32 base, int j, const int (&cl)[NP]) {
        const cc_u32 buf = base + 16 * (j % ST) * C::KV_CH;
        if constexpr (COLFIX) {
            const char* colp = reinterpret_cast<const char*>(pool + kvh * D + ccol * 8);
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                const int row = crow0 + p * RPP;
                if (RPP * NP <= KT || row < KT) {
                    const char* src = colp + (cc_u64)(cc_u32)max(cl[p], 0) * cbytes;
                    const int chunk = RPP % 8 == 0 ? row * C::RS + cx : C::at(row, ccol);
                    cp_async16_cell(buf + 16 * chunk, src, cl[p]);
                }
            }
        } else {
            const T* __restrict__ head = pool + kvh * D;
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                const int c = tid + p * TC_THREADS;
                if (c < KT * CH) {
                    const int row = c / CH, col = c - row * CH;
                    const T* src = head + (cc_u64)(cc_u32)max(cl[p], 0) * (cbytes / sizeof(T)) + col * 8;
                    // (the COLFIX forms cost registers here: 164 instead of 128 at d80)
                    cp_async16(buf + 16 * C::at(row, col), src, cl[p] >= 0 ? 16 : 0);
                }
            }
        }
    };
    // tile j from the cells in s_cells[j & 1] (from_smem) or straight from kv_indices
    auto issue = [&](const T* __restrict__ pool, cc_u32 base, int j, bool from_smem) {
        if (j >= n_tiles) return;                      // an empty group keeps the count uniform
        int cl[NP];
        cells_of(j, from_smem, cl);
        issue_cells(pool, base, j, cl);
    };
    // ONEBAR (the m2 variants, compute-bound prefill shapes): one barrier a tile. After the
    // barrier of iteration j every warp is done with tile j - 1, so tile j + ST - 1 goes into
    // its buffer right there (K and V in one commit group, ST - 1 tiles ahead, as FlashInfer's
    // fa2 does with one tile); the cells of tile j + ST are read at the start of iteration j
    // and stored at its end. Other variants (decode shapes, bound by the bytes in flight):
    // ST tiles ahead, issued after a second barrier at the end of the iteration.
    constexpr bool ONEBAR = MQ == 2 && !KV8;
    static_assert(!ONEBAR || ST >= 2, "one barrier a tile needs two stages");
    static_assert(!KV8 || ST >= 2, "8-bit K/V: a tile lands while the last one is widened");
    // KV8: tile j's K and V rows (D bytes each, 16-byte copies) into stage j % ST of the
    // 8-bit ring, one commit group a tile, ST - 1 tiles ahead (issued after the barrier that
    // ends the widening of tile j - 1, which held that stage)
    constexpr int F8_CH = D / 16;
    const cc_u32 a_f8 = smem_addr(s_f8);
    const unsigned char* __restrict__ kp8 = static_cast<const unsigned char*>(a.k_pool) + kvh * D;
    const unsigned char* __restrict__ vp8 = static_cast<const unsigned char*>(a.v_pool) + kvh * D;
    const cc_u32 rbytes8 = (cc_u32)(n_kvh * D);
    // (a thread's cells first, then its copies: as for the 16-bit tiles above)
    constexpr int NI8 = (KT * F8_CH + TC_THREADS - 1) / TC_THREADS;
    auto issue8 = [&](int j, bool from_smem) {
        if (j >= n_tiles) return;
        const cc_u32 buf = a_f8 + (j % ST) * 2 * KT * D;
        const int* cells = s_cells[j & 1];
        if constexpr (NI8 == 1) {                      // one read a tile: nothing to hoist
            for (int c = tid; c < KT * F8_CH; c += TC_THREADS) {
                const int row = c / F8_CH, col = c - row * F8_CH;
                const int cell = from_smem ? cells[row] : cell_of(j, row);
                const cc_u64 off = (cc_u64)(cc_u32)max(cell, 0) * rbytes8 + 16 * col;
                cp_async16_cell(buf + row * D + 16 * col, kp8 + off, cell);
                cp_async16_cell(buf + (KT + row) * D + 16 * col, vp8 + off, cell);
            }
            return;
        }
        int cl[NI8];
#pragma unroll
        for (int i = 0; i < NI8; ++i) {
            const int c = tid + i * TC_THREADS, row = c / F8_CH;
            cl[i] = c >= KT * F8_CH ? -1 : from_smem ? cells[row] : cell_of(j, row);
        }
#pragma unroll
        for (int i = 0; i < NI8; ++i) {
            const int c = tid + i * TC_THREADS;
            if (c < KT * F8_CH) {
                const int row = c / F8_CH, col = c - row * F8_CH;
                const cc_u64 off = (cc_u64)(cc_u32)max(cl[i], 0) * rbytes8 + 16 * col;
                cp_async16_cell(buf + row * D + 16 * col, kp8 + off, cl[i]);
                cp_async16_cell(buf + (KT + row) * D + 16 * col, vp8 + off, cl[i]);
            }
        }
    };
    // Q: T -> f16 in place (KV8; every thread its own chunks); its scale goes into sl2 (f32):
    // scaled here, a large |q| times K's scale could pass f16's range
    auto widen_q = [&]() {
        const float qs = 1.f;
        if constexpr (R8) {
            // and each 16-dim block permuted: f16 pairs (p0 .. p7) as (p0 p2 p4 p6)(p1 p3 p5 p7),
            // so that an A fragment's dims (2t, 2t + 1 | 2t + 8, 2t + 9) are physical 4t .. 4t + 3,
            // the four bytes one lane gets of a K row from ldmatrix over the 8-bit rows
            for (int c = tid; c < QROWS * CH / 2; c += TC_THREADS) {
                const int row = c / (CH / 2), col = 2 * (c - row * (CH / 2));
                uint4* p0 = s_q + C::at(row, col);
                uint4* p1 = s_q + C::at(row, col + 1);
                const uint4 wa = *p0, wb = *p1;
                cc_u32 f[8];
                const cc_u32 in[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float x0, x1;
                    Mma<T>::unpack(in[i], x0, x1);
                    f[i] = Mma<f16>::pack(x0 * qs, x1 * qs);
                }
                *p0 = make_uint4(f[0], f[2], f[4], f[6]);
                *p1 = make_uint4(f[1], f[3], f[5], f[7]);
            }
            return;
        }
        for (int c = tid; c < QROWS * CH; c += TC_THREADS) {
            const int row = c / CH, col = c - row * CH;
            uint4* p = s_q + C::at(row, col);
            uint4 w = *p;
            float x0, x1;
            Mma<T>::unpack(w.x, x0, x1); w.x = Mma<f16>::pack(x0 * qs, x1 * qs);
            Mma<T>::unpack(w.y, x0, x1); w.y = Mma<f16>::pack(x0 * qs, x1 * qs);
            Mma<T>::unpack(w.z, x0, x1); w.z = Mma<f16>::pack(x0 * qs, x1 * qs);
            Mma<T>::unpack(w.w, x0, x1); w.w = Mma<f16>::pack(x0 * qs, x1 * qs);
            *p = w;
        }
    };
    // rows [r0, r1) of an 8-bit stage (K rows, then `rows` V rows from `src`) widened into rows
    // d0 + ... of the f16 K and V tiles, 16 bytes -> two chunks, by threads c0, c0 + step, ...
    auto widen = [&](const unsigned char* src, int rows, int d0, int c0, int step) {
        for (int c = c0; c < 2 * rows * F8_CH; c += step) {
            const int rr = c / F8_CH, col = c - rr * F8_CH;   // rr: K rows, then V rows
            const uint4 w = *reinterpret_cast<const uint4*>(src + rr * D + 16 * col);
            const int row = d0 + (rr < rows ? rr : rr - rows);
            uint4* dst = rr < rows ? s_k : s_v;
            uint4 lo, hi;
            e4m3x4_to_f16(w.x, lo.x, lo.y);
            e4m3x4_to_f16(w.y, lo.z, lo.w);
            e4m3x4_to_f16(w.z, hi.x, hi.y);
            e4m3x4_to_f16(w.w, hi.z, hi.w);
            dst[C::at(row, 2 * col)] = lo;
            dst[C::at(row, 2 * col + 1)] = hi;
        }
    };
    // W8 (KV8 with the warps along the kv tile, the decode shape): every warp reads only its
    // own KW keys of a tile, so each warp copies, widens and reads them through a ring of its
    // own (ST stages of KW K then KW V rows) with no block barrier in the loop: the copies
    // of tile j + ST - 1 go out right after tile j has landed, their cells (lanes < KW, one
    // tile ahead in a register) handed out by shuffles
    constexpr bool W8 = KV8 && WKV > 1;
    const int wkey0 = wk * KW;
    constexpr int PW = R8 ? P8 : D;                    // bytes between a warp's ring rows
    const cc_u32 a_w8 = a_f8 + warp * ST * 2 * KW * PW;
    auto issue_w8 = [&](int j, int cell_reg) {
        if (j >= n_tiles) return;
        const cc_u32 buf = a_w8 + (j % ST) * 2 * KW * PW;
        for (int c0 = 0; c0 < KW * F8_CH; c0 += 32) {   // uniform trip count: the shuffles see every lane
            const int c = c0 + lane, row = min(c / F8_CH, KW - 1), col = c - row * F8_CH;
            const int cell = __shfl_sync(0xffffffffu, cell_reg, row);
            if (c < KW * F8_CH) {
                const cc_u64 off = (cc_u64)(cc_u32)max(cell, 0) * rbytes8 + 16 * col;
                cp_async16_cell(buf + row * PW + 16 * col, kp8 + off, cell);
                cp_async16_cell(buf + (KW + row) * PW + 16 * col, vp8 + off, cell);
            }
        }
    };
    int wcell = -1;                                     // W8: the cell of key wkey0 + lane of the next tile to issue
    // R8: a lane's ldmatrix row in its warp's ring: matrix lane / 8 = (keys 0-7 | 8-15) x
    // (bytes 0-15 | 16-31) of a 32-byte column
    const cc_u32 r8_lane = ((lane & 7) + 8 * ((lane >> 3) & 1)) * PW + 16 * (lane >> 4);
    if constexpr (W8) {
        cp_async_wait<0>();                            // Q has landed (every thread's copies)
        __syncthreads();
        widen_q();
        __syncthreads();
#pragma unroll
        for (int s = 0; s < ST - 1; ++s) {
            issue_w8(s, lane < KW ? cell_of(s, wkey0 + lane) : -1);
            cp_async_commit();
        }
        wcell = lane < KW ? cell_of(ST - 1, wkey0 + lane) : -1;
    } else if constexpr (KV8) {
#pragma unroll
        for (int s = 0; s < ST - 1; ++s) {
            issue8(s, false);
            cp_async_commit();
        }
        if (tid < KT) s_cells[(ST - 1) & 1][tid] = cell_of(ST - 1, tid);   // read after the first barrier
    } else {
        // the first tiles' cells straight from kv_indices, every read issued before any copy
        // (and the next tile's, kept in s_cells, first of all), K and V of a tile from one read
        constexpr int PRE = ONEBAR ? ST - 1 : ST;       // tiles issued here
        const int next = tid < KT ? cell_of(PRE, tid) : -1;
        int cl[PRE][NP];
#pragma unroll
        for (int s = 0; s < PRE; ++s) cells_of(s, false, cl[s]);
#pragma unroll
        for (int s = 0; s < PRE; ++s) {
            if (s < n_tiles) issue_cells(kp, a_k, s, cl[s]);
            if (!ONEBAR) cp_async_commit();
            if (s < n_tiles) issue_cells(vp, a_v, s, cl[s]);
            cp_async_commit();
        }
        if (tid < KT) s_cells[PRE & 1][cell_slot(tid)] = next;   // read after the (loop's) first barrier
    }
    pre();                                              // the next unit's set-up, while these land

    // this thread's rows: g and g + 8 of each of the warp's MQ 16-row blocks
    const int wp0 = p0 + wq * WROWS;
    const bool active = wp0 < p1;                       // the warp has real rows
    // KV8: the stored K stands for K / (k_scale * 2^8): the scores' scale takes both
    const float sl2 = KV8 ? (float)a.sl2 * a.kv_scale[kvh] * 256.f : (float)a.sl2;
    const int kw0 = wk * KW;                            // the warp's first key of a tile
    // the lane's ldmatrix rows and chunk bits (every row base below is a multiple of 8, so a
    // row's low 3 bits are lx): rows lx + 8 ((lane / 8) % 2), chunk bit lane / 16, for Q, V
    // (.trans) and K alike (K's four 8 x 8 matrices are then keys 0-7 / 8-15 of dims 0-7,
    // then of dims 8-15: b[0], b[2] are the first n8 block's b0, b1 and b[1], b[3] the
    // second's), so K and V share one set of per-lane offsets
    const int lx = lane & 7, b8 = (lane >> 3) & 1, b16 = lane >> 4;
    const int qv_row = lx + 8 * b8, k_row = lx + 8 * b16;
    // per-lane ldmatrix addresses (Tile::loff): Q's absolute, K's and V's relative to a tile
    constexpr int NOFF = C::NOFF, ROWB = C::ROWB;
    cc_u32 q_la[NOFF], k_lo[NOFF], v_lo[NOFF];
#pragma unroll
    for (int i = 0; i < NOFF; ++i) {
        q_la[i] = a_q + C::loff(wq * WROWS + qv_row, b16, i);
        k_lo[i] = C::loff(k_row, b8, i);
        v_lo[i] = C::loff(qv_row, b16, i);
    }

    float o[MQ][D / 8][4];
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
        for (int n = 0; n < D / 8; ++n) o[mq][n][0] = o[mq][n][1] = o[mq][n][2] = o[mq][n][3] = 0.f;
    // m: the rows' running maxima. l: the row sums of P, per thread (its keys; summed over
    // the row's four lanes at the end), or with LQ (m2 variants of d128 and up, where the
    // adds cost the most; at d64 the 6 more registers would cost the third CTA an SM) on the
    // tensor cores: P as packed for P V times a 16 x 8 block of ones, lq[mq] an
    // mma accumulator whose elements 0 and 2 are the full sums of rows g and g + 8 (every
    // column of the product is the row sum over all 16 keys, all four lanes), of the same
    // rounded P that O accumulates: one mma per 16 keys instead of an add a score
    constexpr bool LQ = MQ == 2 && D >= 128;
    float m[2 * MQ], l[2 * MQ], lq[MQ][4];
#pragma unroll
    for (int i = 0; i < 2 * MQ; ++i) { m[i] = TC_NEG_INF; l[i] = 0.f; }
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq) lq[mq][0] = lq[mq][1] = lq[mq][2] = lq[mq][3] = 0.f;

    for (int j = 0; j < n_tiles; ++j) {
        if constexpr (W8) {
            cp_async_wait<ST - 2>();                   // this lane's copies of tile j have landed
            __syncwarp();                              // ... every lane's; the warp is done with tile j - 1
            issue_w8(j + ST - 1, wcell);               // into tile j - 1's stage
            cp_async_commit();
            wcell = lane < KW ? cell_of(j + ST, wkey0 + lane) : -1;
            if constexpr (!R8) {
                widen(s_f8 + (warp * ST + j % ST) * 2 * KW * D, KW, wkey0, lane, 32);
                __syncwarp();
            }
        }
        const int ncell = !W8 && tid < KT ? cell_of(j + ST + (ONEBAR || KV8 ? 0 : 1), tid) : -1;   // in flight while we compute
        if (W8) {}
        else if (ONEBAR || KV8) cp_async_wait<ONEBAR || KV8 ? ST - 2 : 0>();   // Q and tile j have landed
        else if (NSUB > 1) cp_async_wait<2 * ST - 2>();     // Q, K(j) and V(j) have landed
        else cp_async_wait<2 * ST - 1>();              // Q and K(j) have landed
        if (!W8) __syncthreads();
        if constexpr (W8) {
        } else if constexpr (KV8) {
            // every warp is done with the f16 tile (j - 1) and tile j - 1's 8-bit stage
            issue8(j + ST - 1, true);
            cp_async_commit();
            if (j == 0) widen_q();
            widen(s_f8 + (j % ST) * 2 * KT * D, KT, 0, tid, TC_THREADS);   // tile j into the f16 tile
            __syncthreads();
        } else if constexpr (ONEBAR) {                        // into tile j - 1's buffer: every warp is done with it
            if (j + ST - 1 < n_tiles) {                 // K and V from one read of the cells
                int cl[NP];
                cells_of(j + ST - 1, true, cl);
                issue_cells(kp, a_k, j + ST - 1, cl);
                issue_cells(vp, a_v, j + ST - 1, cl);
            }
            cp_async_commit();
        }
        const int st = KV8 ? 0 : j % ST, t0 = r0 + j * KT;
        const cc_u32 kb = a_k + 16 * st * C::KV_CH, vb = a_v + 16 * st * C::KV_CH;
        const bool edge = !(t0 >= full_lo && t0 + KT - 1 <= full_hi);
#pragma unroll 1
        for (int h = 0; h < NSUB; ++h) {               // not unrolled: one S live at a time
            const int kh = kw0 + h * KSUB;             // the sub-tile's first key in the tile
            float s[MQ][KSUB / 8][4];
            cc_u32 k_la[NOFF], v_la[NOFF];             // this sub-tile's K and V lane addresses
#pragma unroll
            for (int i = 0; i < NOFF; ++i) {
                k_la[i] = kb + kh * ROWB + k_lo[i];
                v_la[i] = vb + kh * ROWB + v_lo[i];
            }
            {
#pragma unroll
                for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
                    for (int n = 0; n < KSUB / 8; ++n) s[mq][n][0] = s[mq][n][1] = s[mq][n][2] = s[mq][n][3] = 0.f;
                if constexpr (R8) {
                    // K straight from the warp's 8-bit rows: ldmatrix of 8 keys x 16 bytes gives
                    // a lane four bytes (dims 4t .. 4t + 3) of key g, widened to the two B
                    // registers of Q's permuted dims; one x4 covers 16 keys x 32 dims
                    const cc_u32 kb8 = a_w8 + (j % ST) * 2 * KW * PW + r8_lane;
#pragma unroll
                    for (int kp = 0; kp < D / 32; ++kp) {
                        cc_u32 aq0[4], aq1[4], r[4], b[8];
                        ldsm_x4(q_la[C::koff_sel(2 * kp)] + C::koff(2 * kp), aq0);
                        ldsm_x4(q_la[C::koff_sel(2 * kp + 1)] + C::koff(2 * kp + 1), aq1);
                        ldsm_x4(kb8 + 32 * kp, r);
#pragma unroll
                        for (int i = 0; i < 4; ++i) e4m3x4_to_f16(r[i], b[2 * i], b[2 * i + 1]);
                        M::run(s[0][0], aq0, b[0], b[1]);         // keys 0-7, dims 32 kp + 0-15
                        M::run(s[0][1], aq0, b[2], b[3]);         // keys 8-15
                        M::run(s[0][0], aq1, b[4], b[5]);         // keys 0-7, dims 32 kp + 16-31
                        M::run(s[0][1], aq1, b[6], b[7]);
                    }
                } else {
#pragma unroll
                for (int ks = 0; ks < D / 16; ++ks) {
                    cc_u32 aq[MQ][4];
#pragma unroll
                    for (int mq = 0; mq < MQ; ++mq)
                        ldsm_x4(q_la[C::koff_sel(ks)] + ROWB * 16 * mq + C::koff(ks), aq[mq]);
#pragma unroll
                    for (int jj = 0; jj < KSUB / 16; ++jj) {
                        cc_u32 b[4];
                        ldsm_x4(k_la[C::koff_sel(ks)] + ROWB * 16 * jj + C::koff(ks), b);
#pragma unroll
                        for (int mq = 0; mq < MQ; ++mq) {
                            M::run(s[mq][2 * jj], aq[mq], b[0], b[1]);
                            M::run(s[mq][2 * jj + 1], aq[mq], b[2], b[3]);
                        }
                    }
                }
                }
                if (edge) {                            // raw scores of hidden keys -> -inf
                    int hi[2 * MQ];                    // the rows' last visible key
#pragma unroll
                    for (int i = 0; i < 2 * MQ; ++i) hi[i] = shift + (wp0 + 16 * (i >> 1) + g + 8 * (i & 1)) / G;
#pragma unroll
                    for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
                        for (int n = 0; n < KSUB / 8; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int key = t0 + kh + 8 * n + 2 * tg + (e & 1);
                                const int h1 = hi[2 * mq + (e >> 1)];
                                if (key > r1 || key > h1 || (W > 0 && key <= h1 - W)) s[mq][n][e] = TC_NEG_INF;
                            }
                }
                // online softmax, 2 MQ rows a thread, m in scaled log2 units: p = 2^(s sl2 - m)
                // (one fma + ex2 a score); O and the row sums lq are rescaled only when some
                // row of the warp has a new maximum
                float corr[2 * MQ];
                bool grew = false;
#pragma unroll
                for (int i = 0; i < 2 * MQ; ++i) {
                    const int mq = i >> 1, r = i & 1;
                    float mx = fmaxf(s[mq][0][2 * r], s[mq][0][2 * r + 1]);
#pragma unroll
                    for (int n = 1; n < KSUB / 8; ++n) mx = fmaxf(mx, fmaxf(s[mq][n][2 * r], s[mq][n][2 * r + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    mx = fmaxf(m[i], mx * sl2);
                    const float base = mx == TC_NEG_INF ? 0.f : mx;     // nothing seen yet: all 0
                    corr[i] = ex2(m[i] - base);
                    grew |= corr[i] != 1.f;
                    m[i] = mx;
#pragma unroll
                    for (int n = 0; n < KSUB / 8; ++n) {
                        s[mq][n][2 * r] = ex2(fmaf(s[mq][n][2 * r], sl2, -base));
                        s[mq][n][2 * r + 1] = ex2(fmaf(s[mq][n][2 * r + 1], sl2, -base));
                    }
                    if (!LQ) {
                        float sum = s[mq][0][2 * r] + s[mq][0][2 * r + 1];
#pragma unroll
                        for (int n = 1; n < KSUB / 8; ++n) sum += s[mq][n][2 * r] + s[mq][n][2 * r + 1];
                        l[i] = l[i] * corr[i] + sum;
                    }
                }
                if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
                    for (int i = 0; i < 2 * MQ; ++i) {
                        if (LQ) lq[i >> 1][2 * (i & 1)] *= corr[i];    // (1 and 3 are not read)
#pragma unroll
                        for (int n = 0; n < D / 8; ++n) {
                            o[i >> 1][n][2 * (i & 1)] *= corr[i];
                            o[i >> 1][n][2 * (i & 1) + 1] *= corr[i];
                        }
                    }
                }
            }
            if (NSUB == 1 && !ONEBAR && !KV8) {
                cp_async_wait<2 * ST - 2>();           // V(j) has landed
                __syncthreads();                       // ... and every warp is done with K(j)
                issue(kp, a_k, j + ST, true);
                cp_async_commit();
            }
            {
#pragma unroll
                for (int t = 0; t < KSUB / 16; ++t) {
                    cc_u32 pa[MQ][4];
#pragma unroll
                    for (int mq = 0; mq < MQ; ++mq) {
                        pa[mq][0] = M::pack(s[mq][2 * t][0], s[mq][2 * t][1]);
                        pa[mq][1] = M::pack(s[mq][2 * t][2], s[mq][2 * t][3]);
                        pa[mq][2] = M::pack(s[mq][2 * t + 1][0], s[mq][2 * t + 1][1]);
                        pa[mq][3] = M::pack(s[mq][2 * t + 1][2], s[mq][2 * t + 1][3]);
                        if (LQ) M::run(lq[mq], pa[mq], M::ONES, M::ONES);   // row sums
                    }
                    if constexpr (R8) {
                        // V straight from the warp's 8-bit rows: ldmatrix.trans of 8 keys x 8
                        // byte pairs gives a lane keys (2t, 2t + 1) x dims (2g, 2g + 1); the even
                        // bytes feed an n8 block of even dims, the odd ones one of odd dims
                        // (o[2 db] and o[2 db + 1] for dims 16 db ..: see the write below)
                        const cc_u32 vb8 = a_w8 + (j % ST) * 2 * KW * PW + KW * PW + r8_lane;
#pragma unroll
                        for (int dp = 0; dp < D / 32; ++dp) {
                            cc_u32 r[4];
                            ldsm_x4_t(vb8 + 32 * dp, r);
                            M::run(o[0][4 * dp], pa[0], e4m3_even_to_f16(r[0]), e4m3_even_to_f16(r[1]));
                            M::run(o[0][4 * dp + 1], pa[0], e4m3_odd_to_f16(r[0]), e4m3_odd_to_f16(r[1]));
                            M::run(o[0][4 * dp + 2], pa[0], e4m3_even_to_f16(r[2]), e4m3_even_to_f16(r[3]));
                            M::run(o[0][4 * dp + 3], pa[0], e4m3_odd_to_f16(r[2]), e4m3_odd_to_f16(r[3]));
                        }
                    } else {
#pragma unroll
                    for (int dp = 0; dp < D / 16; ++dp) {
                        cc_u32 b[4];
                        ldsm_x4_t(v_la[C::koff_sel(dp)] + ROWB * 16 * t + C::koff(dp), b);
#pragma unroll
                        for (int mq = 0; mq < MQ; ++mq) {
                            M::run(o[mq][2 * dp], pa[mq], b[0], b[1]);
                            M::run(o[mq][2 * dp + 1], pa[mq], b[2], b[3]);
                        }
                    }
                    }
                }
            }
        }
        if constexpr (W8) {
        } else if constexpr (ONEBAR || KV8) {
            // the other slot: its cells (tile j + ST - 2) were read before this iteration's
            // barrier (iteration j - 1's issue); these are read after the next one
            if (tid < KT) s_cells[(j + ST) & 1][cell_slot(tid)] = ncell;
        } else {
            __syncthreads();                           // every warp is done with V(j) (and K(j))
            if (NSUB > 1) {
                issue(kp, a_k, j + ST, true);
                cp_async_commit();
            }
            issue(vp, a_v, j + ST, true);
            cp_async_commit();
            // the other slot: its cells (tile j + ST - 1) were last read before this iteration's
            // first barrier; these are read after the next one
            if (tid < KT) s_cells[(j + ST + 1) & 1][cell_slot(tid)] = ncell;
        }
    }
    cp_async_wait<0>();                                // nothing in flight into the buffers
    if (WKV > 1) __syncthreads();                      // ... from any thread (the merge reuses them)
    if (!active) return;
#pragma unroll
    for (int i = 0; i < 2 * MQ; ++i) {
        if (LQ) {
            l[i] = lq[i >> 1][2 * (i & 1)];            // full row sums already
        } else {
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        }
    }
    if (WKV > 1) {
        // the key slices of a row block: warps wk > 0 leave (m, l, o) in shared memory (the
        // ring is free: every warp passed the loop's last barrier, no copy is in flight),
        // warp wk = 0 folds them into its own and writes the result
        float* s_ml = reinterpret_cast<float*>(smem);             // [warp][WROWS][2]
        float* s_o = s_ml + 4 * WROWS * 2;                        // [warp][WROWS][OS]
        if (wk > 0) {
#pragma unroll
            for (int i = 0; i < 2 * MQ; ++i) {
                const int row = 16 * (i >> 1) + g + 8 * (i & 1);
                if (tg == 0) {
                    s_ml[(warp * WROWS + row) * 2] = m[i];
                    s_ml[(warp * WROWS + row) * 2 + 1] = l[i];
                }
#pragma unroll
                for (int n = 0; n < D / 8; ++n)
                    *reinterpret_cast<float2*>(s_o + (warp * WROWS + row) * C::OS + 8 * n + 2 * tg) =
                        make_float2(o[i >> 1][n][2 * (i & 1)], o[i >> 1][n][2 * (i & 1) + 1]);
            }
        }
        // only the warps of this unit's row blocks take part; all of them are active together
        asm volatile("bar.sync 1, %0;" :: "r"(WKV * 32 * ((p1 - p0 + WROWS - 1) / WROWS)) : "memory");
        if (wk > 0) return;
#pragma unroll
        for (int i = 0; i < 2 * MQ; ++i) {
            const int row = 16 * (i >> 1) + g + 8 * (i & 1);
            float mx = m[i];
#pragma unroll
            for (int w = 1; w < WKV; ++w) mx = fmaxf(mx, s_ml[((warp + w) * WROWS + row) * 2]);
            const float base = mx == TC_NEG_INF ? 0.f : mx;
            const float f0 = ex2(m[i] - base);
            float lsum = l[i] * f0;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) { o[i >> 1][n][2 * (i & 1)] *= f0; o[i >> 1][n][2 * (i & 1) + 1] *= f0; }
#pragma unroll
            for (int w = 1; w < WKV; ++w) {
                const float* ml = s_ml + ((warp + w) * WROWS + row) * 2;
                const float f = ex2(ml[0] - base);
                lsum += ml[1] * f;
                const float* ow = s_o + ((warp + w) * WROWS + row) * C::OS + 2 * tg;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    const float2 v = *reinterpret_cast<const float2*>(ow + 8 * n);
                    o[i >> 1][n][2 * (i & 1)] += f * v.x;
                    o[i >> 1][n][2 * (i & 1) + 1] += f * v.y;
                }
            }
            m[i] = mx;
            l[i] = lsum;
        }
    }
    // grouped rows (crow >= 0) leave (m, l, O) in cpart: slot 0 the own keys, 1 + s split s
    // of the shared ones; split runs in part at their slot; others write out
    const int slot = desc[D_BASE] + ((P + QROWS - 1) / QROWS - 1 - qt) * ns + split;
    const int cslot = grp ? 1 + split : 0;
    const float vs = KV8 ? a.kv_scale[n_kvh + kvh] * 256.f : 1.f;   // 8-bit V's scale (2^8: the widening)
#pragma unroll
    for (int i = 0; i < 2 * MQ; ++i) {
        const int p = wp0 + 16 * (i >> 1) + g + 8 * (i & 1), mq = i >> 1, r = i & 1;
        if (p >= p1) continue;
        const int qi = p / G, hl = p - qi * G;
        if (ns == 1 && crow < 0) {
            T* dst = static_cast<T*>(a.out) + (cc_i64)(q0 + qi) * a.o_s_tok + (cc_i64)(kvh * G + hl) * a.o_s_head;
            const float inv = (l[i] > 0.f ? 1.f / l[i] : 0.f) * vs;
            if constexpr (R8) {                        // o[2 db] / o[2 db + 1]: even / odd dims of 16 db ..
#pragma unroll
                for (int db = 0; db < D / 16; ++db) {
                    const float* e = o[mq][2 * db];
                    const float* od = o[mq][2 * db + 1];
                    *reinterpret_cast<uint2*>(dst + 16 * db + 4 * tg) =
                        make_uint2(Mma<T>::pack(e[2 * r] * inv, od[2 * r] * inv),
                                   Mma<T>::pack(e[2 * r + 1] * inv, od[2 * r + 1] * inv));
                }
            } else {
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<cc_u32*>(dst + 8 * n + 2 * tg) =
                    Mma<T>::pack(o[mq][n][2 * r] * inv, o[mq][n][2 * r + 1] * inv);
            }
        } else {
            float* dst = crow >= 0
                ? a.cpart + (((cc_i64)(crow + qi) * a.n_heads + kvh * G + hl) * (1 + TC_NSH) + cslot) * (D + 2)
                : a.part + (((cc_i64)slot * n_kvh + kvh) * QROWS + (p - p0)) * (D + 2);
            if (tg == 0) { dst[0] = m[i]; dst[1] = l[i]; }
            if constexpr (R8) {
#pragma unroll
                for (int db = 0; db < D / 16; ++db) {
                    const float* e = o[mq][2 * db];
                    const float* od = o[mq][2 * db + 1];
                    *reinterpret_cast<float2*>(dst + 2 + 16 * db + 4 * tg) = make_float2(e[2 * r] * vs, od[2 * r] * vs);
                    *reinterpret_cast<float2*>(dst + 4 + 16 * db + 4 * tg) =
                        make_float2(e[2 * r + 1] * vs, od[2 * r + 1] * vs);
                }
            } else {
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<float2*>(dst + 2 + 8 * n + 2 * tg) = make_float2(o[mq][n][2 * r] * vs, o[mq][n][2 * r + 1] * vs);
            }
        }
    }
}

// Padding rows [width, rows) of out: 16-byte zeros (2-byte elements, head_dim % 8 == 0), over
// the whole grid.
__device__ __forceinline__ void zero_padding(const TcArgs& a, int head_dim)
{
    const int width = (int)*a.width, H = (int)a.n_heads, chunks = head_dim / 8;
    const int n = ((int)a.rows - width) * H * chunks;  // (rows x heads x 16-byte chunks: int)
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        const int i = width + e / (H * chunks), h = e / chunks % H, c = e % chunks;
        unsigned short* dst = static_cast<unsigned short*>(a.out) + i * a.o_s_tok + h * a.o_s_head + 8 * c;
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
}

// Persistent: each CTA takes units from the counter the plan reset until the list is done.
// Thread 0 takes the next unit from the counter as a unit starts and reads its set-up into
// the other descriptor once the unit's first copies are out (unit_desc), so the chain of
// dependent loads of a unit's start overlaps the previous unit's tiles. A CTA stops at its
// first take past the list, so the takes past it are n_units .. n_units + CTAs - 1, one a
// CTA, and the CTA that took the last one knows that no take is left in flight: it puts the
// counter back for the next launch that runs this plan (the step's next layer, when the plan
// is kept), and no merge launch is needed for that. The runs' own launch (mode 0) zeroes the
// padding rows for the same reason.
template <typename T, bool KV8, int D, int MQ, int WKV, int KT, int ST, int KS = 0>
__device__ void tc_attend(const TcArgs& a)
{
    extern __shared__ uint4 smem[];
    __shared__ int s_desc[2][TC_DESC];
    const int n_units = a.plan[a.mode ? TC_GUNITS : TC_N_UNITS];
    if (n_units > 0) {                                 // (0: a shared pass with no group)
        cc_i32* counter = a.plan + (a.mode ? TC_GCOUNTER : TC_COUNTER);
        if (threadIdx.x == 0) unit_desc(a, atomicAdd(counter, 1), n_units, s_desc[0]);
        __syncthreads();
        int b = 0;
        for (; s_desc[b][D_UNIT] < n_units; b ^= 1) {
            int next = 0;
            if (threadIdx.x == 0) next = atomicAdd(counter, 1);   // in flight while the unit starts
            int* nd = s_desc[b ^ 1];                    // the previous unit's, free since its barrier
            tc_unit<T, KV8, D, MQ, WKV, KT, ST, KS>(a, s_desc[b], smem, [&]() {
                if (threadIdx.x == 0) unit_desc(a, next, n_units, nd);
            });
            __syncthreads();                           // the next set-up visible; the buffers free
        }
        if (threadIdx.x == 0 && s_desc[b][D_UNIT] == n_units + (int)gridDim.x - 1) *counter = 0;
    }
    if (a.mode == 0) zero_padding(a, D);
}

// -- the plan ----------------------------------------------------------------------------------

template <typename V>
__device__ __forceinline__ V block_sum(V x, V* scratch)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    V t = 0;
    for (int w = 0; w < nw; ++w) t += scratch[w];
    return t;
}

__device__ __forceinline__ int block_max(int x, int* scratch)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, off));
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    int t = scratch[0];
    for (int w = 1; w < nw; ++w) t = max(t, scratch[w]);
    return t;
}

// Inclusive scan over the block; *total gets the block's sum.
__device__ __forceinline__ int block_scan(int x, int* scratch, int* total)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    int before = 0, t = 0;
    for (int w = 0; w < nw; ++w) {
        if (w < warp) before += scratch[w];
        t += scratch[w];
    }
    *total = t;
    return x + before;
}

// Block 0: the work list. Every (run, q tile, kv split) has a slot, run by run, a run's q
// tiles last first, splits innermost: slot run_base[r] + (nt - 1 - qt) * ns + s (the split
// partials live at their slot, so the merge finds them without the list). The list holds
// the items in the order CTAs take them: order 0 by slot (a run's tiles that see the most
// keys first, run after run: neighbouring units share K/V in L2); order 1 heaviest first
// over the whole step (TC_BUCKETS buckets of kv entries, longest first, so the persistent
// grid ends on the lightest units and has no tail). One block (tc_attend zeroes the padding
// rows). qrows: packed rows a unit; min_chunk: the smallest kv split (a multiple of the tile).
#define TC_BUCKETS 256
// Cascade (cmin > 0, a.gcap > 0): before the runs' own items, runs are grouped. Run r joins
// run r - 1's group when both are decode runs sharing at least cmin leading kv entries
// (a.share, from tc_share); a group of two or more runs reads its shared keys [0, S) once for
// all its rows (S: the members' least share, down to a multiple of TC_CASCADE_ALIGN) in the
// shared pass (items {group, q tile, split, split size} for tc_attend in mode 1: gqrows packed
// rows a unit, split into at most TC_NSH so that the units come near gtarget), and each member
// its own keys [S, L) in its own item, unsplit; the merge folds them. A step with a group
// splits no run's own keys.
// Whether run r joins run r - 1's group: a.share[r] >= cmin, and checked against this step
// (so a share left from another step can only cost sharing, never results): both are decode
// runs with more history than the share and their entries at share - 1 are the same cell
// (sharing is a prefix: then so are all before it).
__device__ __forceinline__ bool tc_linked(const TcArgs& a, int r, int cmin, cc_i64 width)
{
    if (r <= 0 || r >= (int)a.rows) return false;
    const int sh = a.share[r];
    if (sh < cmin) return false;
    if (run_qlen(a, r, width) != 1 || run_qlen(a, r - 1, width) != 1 ||
        a.qo_indptr[r + 1] - a.qo_indptr[r] != 1 || a.qo_indptr[r] - a.qo_indptr[r - 1] != 1)
        return false;
    const int kp = a.kv_indptr[r - 1], kr = a.kv_indptr[r], ke = a.kv_indptr[r + 1];
    if (sh > kr - kp - 1 || sh > ke - kr - 1) return false;
    return a.kv_indices[kp + sh - 1] == a.kv_indices[kr + sh - 1];
}

__device__ int tc_groups(const TcArgs& a, int cmin, int gqrows, int gtarget, long long* s_ll, int* s_i)
{
    const cc_i64 width = *a.width;
    const int rows = (int)a.rows, G = (int)a.group, nkv = (int)a.n_kv_heads;
    cc_i32* run_start = plan_run_start(a);
    cc_i32* run_crow = plan_run_crow(a);
    cc_i32* run_cs = plan_run_cs(a);
    int4* groups = plan_groups(a);
    int4* gitems = plan_gitems(a);
    // each run's link decided once (run_cs holds it until the groups are made): a run
    // starts a group when the next one links to it and it links to none
    for (int r = threadIdx.x; r < rows; r += blockDim.x) run_cs[r] = tc_linked(a, r, cmin, width);
    __syncthreads();
    int ng = 0;
    for (int b = 0; b < rows; b += blockDim.x) {
        const int r = b + threadIdx.x;
        const bool lnk = r < rows && run_cs[r] != 0;
        const bool st = r < rows && !lnk && r + 1 < rows && run_cs[r + 1] != 0;
        int total;
        const int gi = ng + block_scan(st ? 1 : 0, s_i, &total) - 1;
        if (r < rows) {
            run_crow[r] = st || lnk ? gi : -1;         // the run's group, for now
            run_start[r] = 0;
            plan_row_cr(a)[r] = -1;
            if (st) groups[gi] = make_int4(r, 0, 0x7fffffff, -1);
        }
        ng += total;
    }
    if (ng == 0) return 0;
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const int g = run_crow[r];
        run_cs[r] = 0;
        if (g < 0) continue;
        atomicAdd(&groups[g].y, 1);
        if (groups[g].x != r) atomicMin(&groups[g].z, a.share[r]);   // a linked member
    }
    __syncthreads();
    long long tiles = 0;
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
        int S = groups[g].z / TC_CASCADE_ALIGN * TC_CASCADE_ALIGN;
        if (S < cmin || groups[g].y < 2) S = 0;        // (every group has two runs and a share)
        groups[g].z = S;
        if (S > 0) tiles += (groups[g].y * G + gqrows - 1) / gqrows;
    }
    tiles = block_sum(tiles, s_ll);
    const int nsh = tiles > 0 ? (int)max(1LL, min((long long)TC_NSH, gtarget / (tiles * nkv))) : 1;
    int crows = 0, items = 0;
    for (int b = 0; b < ng; b += blockDim.x) {
        const int g = b + threadIdx.x;
        int n = 0, nt = 0, nsg = 0, chunk = 0, S = 0;
        if (g < ng) {
            S = groups[g].z;
            if (S > 0) {
                n = groups[g].y;
                nt = (n * G + gqrows - 1) / gqrows;
                chunk = ((S + nsh - 1) / nsh + TC_CASCADE_ALIGN - 1) / TC_CASCADE_ALIGN * TC_CASCADE_ALIGN;
                nsg = (S + chunk - 1) / chunk;
            }
        }
        int tr, ti;
        const int cb = crows + block_scan(n, s_i, &tr) - n;
        const int ib = items + block_scan(nt * nsg, s_i, &ti) - nt * nsg;
        if (S > 0) {
            groups[g].w = cb;
            for (int t = 0; t < nt; ++t)
                for (int s = 0; s < nsg; ++s)
                    if (ib + t * nsg + s < a.gcap) gitems[ib + t * nsg + s] = make_int4(g, t, s, chunk);
        }
        crows += tr;
        items += ti;
    }
    __syncthreads();
    const bool fits = items <= a.gcap;                  // (the host sizes gcap so that it does)
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const int g = run_crow[r];
        if (g < 0) continue;
        const int4 d = groups[g];
        if (d.z == 0 || !fits) {
            run_crow[r] = -1;
            continue;
        }
        const int chunk = ((d.z + nsh - 1) / nsh + TC_CASCADE_ALIGN - 1) / TC_CASCADE_ALIGN * TC_CASCADE_ALIGN;
        run_crow[r] = d.w + (r - d.x);
        run_start[r] = d.z;
        run_cs[r] = 1 + (d.z + chunk - 1) / chunk;
        plan_row_cr(a)[a.qo_indptr[r]] = 8 * run_crow[r] + run_cs[r];   // a decode run: one row
    }
    return fits ? items : 0;
}

__device__ void tc_plan_impl(const TcArgs& a, int qrows, int min_chunk, int head_dim, int order,
                             int cmin, int gqrows, int gtarget)
{
    const cc_i64 width = *a.width;
    const int rows = (int)a.rows, G = (int)a.group, nkv = (int)a.n_kv_heads, W = (int)a.window;
    __shared__ long long s_ll[32];
    __shared__ int s_i[32];
    __shared__ int s_bucket[TC_BUCKETS];
    const int gitems = cmin > 0 && a.gcap > 0 && W == 0 ? tc_groups(a, cmin, gqrows, gtarget, s_ll, s_i) : 0;
    if (a.gcap > 0 && gitems == 0)
        for (int r = threadIdx.x; r < rows; r += blockDim.x) plan_run_crow(a)[r] = plan_row_cr(a)[r] = -1;
    __syncthreads();
    const cc_i32* run_crow = plan_run_crow(a);
    long long nt_sum = 0;
    int max_len = 0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const int ql = run_qlen(a, r, width);
        if (ql > 0) {
            nt_sum += (ql * G + qrows - 1) / qrows;
            max_len = max(max_len, a.kv_indptr[r + 1] - a.kv_indptr[r]);
        }
    }
    nt_sum = block_sum(nt_sum, s_ll);
    max_len = block_max(max_len, s_i);
    int chunk = 0;
    if (gitems == 0 && nt_sum * nkv < a.target_units) {
        // the smallest split (most units) that stays within split_cap units
        for (long long c = min_chunk; c < max_len; c *= 2) {
            long long items = 0;
            for (int r = threadIdx.x; r < rows; r += blockDim.x) {
                const int ql = run_qlen(a, r, width);
                if (ql > 0) {
                    const long long len = a.kv_indptr[r + 1] - a.kv_indptr[r];
                    items += (long long)((ql * G + qrows - 1) / qrows) * ((len + c - 1) / c);
                }
            }
            items = block_sum(items, s_ll);
            if (items * nkv <= a.split_cap && items <= a.list_cap) { chunk = (int)c; break; }
        }
    }
    int4* items = reinterpret_cast<int4*>(a.plan + TC_HDR);
    cc_i32* run_base = plan_run_base(a);
    cc_i32* run_ns = plan_run_ns(a);
    const int cap = (int)a.list_cap;
    int carry = 0;
    for (int b = 0; b < rows; b += blockDim.x) {
        const int r = b + threadIdx.x;
        int nt = 0, ns = 1;
        if (r < rows) {
            const int ql = run_qlen(a, r, width);
            if (ql > 0) {
                nt = (ql * G + qrows - 1) / qrows;
                if (chunk) ns = max(1, (a.kv_indptr[r + 1] - a.kv_indptr[r] + chunk - 1) / chunk);
            }
        }
        const int v = nt * ns;
        int total;
        const int ex = carry + block_scan(v, s_i, &total) - v;
        if (r < rows) {
            run_base[r] = ex;
            run_ns[r] = ns;
            if (order == 0)
                for (int t = 0; t < nt; ++t)
                    for (int s = 0; s < ns; ++s) {
                        const int k = ex + t * ns + s;
                        if (k < cap) items[k] = make_int4(r, nt - 1 - t, s, ns);
                    }
        }
        carry += total;
    }
    if (order != 0) {
        // counting sort by kv entries, longest first: a histogram, its exclusive scan, then
        // every item takes the next place of its bucket (any order within a bucket)
        for (int i = threadIdx.x; i < TC_BUCKETS; i += blockDim.x) s_bucket[i] = 0;
        __syncthreads();
        for (int pass = 0; pass < 2; ++pass) {
            for (int r = threadIdx.x; r < rows; r += blockDim.x) {
                const int ql = run_qlen(a, r, width);
                if (ql == 0) continue;
                const int P = ql * G, nt = (P + qrows - 1) / qrows, ns = run_ns[r];
                const int L = a.kv_indptr[r + 1] - a.kv_indptr[r];
                const int shift = L - (a.qo_indptr[r + 1] - a.qo_indptr[r]);
                const int start = gitems > 0 && run_crow[r] >= 0 ? plan_run_start(a)[r] : 0;
                for (int qt = nt - 1; qt >= 0; --qt)
                    for (int s = 0; s < ns; ++s) {
                        int r0, r1;
                        unit_keys(shift, qt * qrows, min(P, qt * qrows + qrows), G, W, s, ns, chunk, r0, r1);
                        r0 = max(r0, start);
                        const long long len = r1 >= r0 ? r1 - r0 + 1 : 0;
                        const int bk = TC_BUCKETS - 1 - (int)(len * TC_BUCKETS / (max_len + 1));
                        const int k = atomicAdd(s_bucket + bk, 1);
                        if (pass == 1 && k < cap) items[k] = make_int4(r, qt, s, ns);
                    }
            }
            if (pass == 0) {
                __syncthreads();
                const int x = threadIdx.x < TC_BUCKETS ? s_bucket[threadIdx.x] : 0;
                int total;
                const int ex = block_scan(x, s_i, &total) - x;
                __syncthreads();
                if (threadIdx.x < TC_BUCKETS) s_bucket[threadIdx.x] = ex;
                __syncthreads();
            }
        }
    }
    if (threadIdx.x == 0) {
        a.plan[TC_N_UNITS] = min(carry, cap) * nkv;
        a.plan[TC_CHUNK] = chunk;
        a.plan[TC_COUNTER] = 0;
        a.plan[TC_SPLIT] = chunk != 0;
        a.plan[TC_GUNITS] = gitems * nkv;
        a.plan[TC_GCOUNTER] = 0;
        a.plan[TC_CASCADE] = gitems > 0;
    }
}

// -- the merge -------------------------------------------------------------------------------

// One warp per (row, head) of a split run: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
template <typename T>
__device__ void tc_merge(const TcArgs& a, int head_dim, int qrows)
{
    const cc_i64 width = *a.width;
    const int H = (int)a.n_heads, G = (int)a.group, nkv = (int)a.n_kv_heads, rows = (int)a.rows;
    const bool split = a.plan[TC_SPLIT] != 0, cascade = a.gcap > 0 && a.plan[TC_CASCADE] != 0;
    if (!split && !cascade) return;
    const int D = head_dim, lane = threadIdx.x & 31;
    const cc_i32* run_base = plan_run_base(a);
    const cc_i32* run_ns = plan_run_ns(a);
    const cc_i64 n_pairs = width * H;
    const cc_i64 stride = (cc_i64)gridDim.x * (blockDim.x >> 5);
    for (cc_i64 pair = (cc_i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); pair < n_pairs;
         pair += stride) {
        const int i = (int)(pair / H), h = (int)(pair % H);
        const int cr = cascade ? plan_row_cr(a)[i] : -1;
        if (cr >= 0) {
            // a grouped row: its own keys' (m, l, O) and its group's splits', the 2 + D floats
            // of each apart; lane s reads split s's m and l
            const int ns = cr & 7;
            const float* pp = a.cpart + ((cc_i64)(cr >> 3) * H + h) * (1 + TC_NSH) * (D + 2);
            const float ms = lane < ns ? pp[lane * (D + 2)] : TC_NEG_INF;
            const float ls = lane < ns ? pp[lane * (D + 2) + 1] : 0.f;
            float mx = ms;
#pragma unroll
            for (int off = 4; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            mx = __shfl_sync(0xffffffffu, mx, 0);
            const float base = mx == TC_NEG_INF ? 0.f : mx;
            const float ws = lane < ns ? ex2(ms - base) : 0.f;
            float den = ws * ls;
#pragma unroll
            for (int off = 4; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffffu, den, off);
            den = __shfl_sync(0xffffffffu, den, 0);
            const float inv = den > 0.f ? 1.f / den : 0.f;
            float w[1 + TC_NSH];                        // every lane: the weights (all lanes shuffle)
#pragma unroll
            for (int s = 0; s < 1 + TC_NSH; ++s) w[s] = __shfl_sync(0xffffffffu, ws, s);
            T* dst = static_cast<T*>(a.out) + (cc_i64)i * a.o_s_tok + (cc_i64)h * a.o_s_head;
            for (int d = 2 * lane; d < D; d += 64) {
                float x0 = 0.f, x1 = 0.f;
#pragma unroll
                for (int s = 0; s < 1 + TC_NSH; ++s) {
                    if (s >= ns) break;
                    const float2 v = *reinterpret_cast<const float2*>(pp + s * (D + 2) + 2 + d);
                    x0 += w[s] * v.x;
                    x1 += w[s] * v.y;
                }
                *reinterpret_cast<cc_u32*>(dst + d) = Mma<T>::pack(x0 * inv, x1 * inv);
            }
            continue;
        }
        if (!split) continue;
        // the run of row i: a 32-way search, every lane probing one point of (lo, hi) at
        // once (two rounds of loads for 1,024 runs where halving takes ten in a row)
        int lo = 0, hi = rows;                          // qo[lo] <= i < qo[hi]
        while (hi - lo > 1) {
            const int span = hi - lo;                   // probes nondecreasing in lane, in [lo + 1, hi - 1]
            const int probe = lo + 1 + (int)((cc_i64)(span - 1) * lane / 32);
            const unsigned below = __ballot_sync(0xffffffffu, a.qo_indptr[probe] <= i);
            const int k = __popc(below);                // qo is nondecreasing: lanes [0, k) hold
            if (k < 32) hi = lo + 1 + (int)((cc_i64)(span - 1) * k / 32);
            if (k > 0) lo = lo + 1 + (int)((cc_i64)(span - 1) * (k - 1) / 32);
        }
        const int run = lo, ns = run_ns[run];
        if (ns <= 1) continue;
        const int q0 = a.qo_indptr[run], ql = run_qlen(a, run, width);
        const int nt = (ql * G + qrows - 1) / qrows;
        const int kvh = h / G, p = (i - q0) * G + (h - kvh * G);
        const int qt = p / qrows, prow = p - qt * qrows;
        const cc_i64 item0 = run_base[run] + (cc_i64)(nt - 1 - qt) * ns;
        const float* pp = a.part + ((item0 * nkv + kvh) * qrows + prow) * (D + 2);
        const cc_i64 sstride = (cc_i64)nkv * qrows * (D + 2);
        float mx = TC_NEG_INF;                          // (a max: the same in any order)
        for (int s = lane; s < ns; s += 32) mx = fmaxf(mx, pp[s * sstride]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float base = mx == TC_NEG_INF ? 0.f : mx;
        float den = 0.f;
        for (int s = 0; s < ns; ++s) den += ex2(pp[s * sstride] - base) * pp[s * sstride + 1];
        const float inv = den > 0.f ? 1.f / den : 0.f;
        T* dst = static_cast<T*>(a.out) + (cc_i64)i * a.o_s_tok + (cc_i64)h * a.o_s_head;
        for (int d = 2 * lane; d < D; d += 64) {
            float x0 = 0.f, x1 = 0.f;
            for (int s = 0; s < ns; ++s) {
                const float w = ex2(pp[s * sstride] - base);
                const float2 v = *reinterpret_cast<const float2*>(pp + s * sstride + 2 + d);
                x0 += w * v.x;
                x1 += w * v.y;
            }
            *reinterpret_cast<cc_u32*>(dst + d) = Mma<T>::pack(x0 * inv, x1 * inv);
        }
    }
}

// -- entry points ----------------------------------------------------------------------------

// The variants, one line each: X(D, MQ, WKV, KT, ST). The host reads this list from the
// module (tc_variants: {D, MQ, WKV, KT, ST, packed rows a unit, dynamic shared bytes, B, KS}
// each, after tc_n_variants), so it is the one source of which kernels exist. Named
// tc_attend_<dtype>_d<D>_m<MQ>w<WKV>k<KT>s<ST>. Rows a warp x warps along the rows: the unit;
// "w4" variants (warps along the kv tile, 16 rows) are for decode-like steps. m2 variants with
// k64 score in 32-key sub-tiles (Tile::KSUB).
#define TC_VARIANTS(X)                                                                          \
    X(64, 1, 1, 64, 3) X(64, 2, 1, 32, 2) X(64, 2, 1, 32, 3) X(64, 1, 4, 64, 2) X(64, 1, 4, 64, 4) \
    X(64, 2, 1, 64, 2) X(64, 1, 4, 64, 3) X(64, 1, 4, 128, 2)                                   \
    X(80, 1, 1, 64, 2) X(80, 2, 1, 32, 2) X(80, 1, 4, 64, 2)                                    \
    X(96, 1, 1, 64, 2) X(96, 2, 1, 32, 2) X(96, 1, 4, 64, 2)                                    \
    X(128, 1, 1, 64, 2) X(128, 2, 1, 32, 2) X(128, 2, 1, 32, 3) X(128, 2, 1, 64, 2)             \
    X(128, 1, 4, 64, 2) X(128, 1, 4, 64, 3) X(128, 1, 4, 128, 2)                                \
    X(256, 1, 1, 16, 3) X(256, 1, 4, 64, 2)
// Variants that ask for B CTAs an SM (__launch_bounds__(128, B): registers capped at
// 65536 / (128 B)), for steps bound by the bytes in flight: Y(D, MQ, WKV, KT, ST, B), named
// tc_attend_<dtype>_d<D>_m<MQ>w<WKV>k<KT>s<ST>b<B>.
#define TC_VARIANTS_B(Y)                                                                        \
    Y(64, 1, 4, 64, 2, 5) Y(64, 2, 1, 32, 2, 3)
// Variants that score KS keys at once (one online-softmax step per KS keys) where the default
// rule would split the tile (m2 with k64: 32): Z(D, MQ, WKV, KT, ST, KS), named
// tc_attend_<dtype>_d<D>_m<MQ>w<WKV>k<KT>s<ST>x<KS>. Fewer instructions a key (one max /
// rescale step a tile), more registers: at d128 S of 64 keys beside O leaves ptxas a few
// spilled words a tile (tools/bench.py --section attention decides).
#define TC_VARIANTS_X(Z)                                                                        \
    Z(64, 2, 1, 64, 2, 64) Z(128, 2, 1, 64, 2, 64)

#define TC_ROW(D, MQ, WKV, KT, ST) D, MQ, WKV, KT, ST, Tile<D, MQ, WKV, KT, ST>::QROWS, Tile<D, MQ, WKV, KT, ST>::SMEM, 0, 0,
#define TC_ROW_B(D, MQ, WKV, KT, ST, B) D, MQ, WKV, KT, ST, Tile<D, MQ, WKV, KT, ST>::QROWS, Tile<D, MQ, WKV, KT, ST>::SMEM, B, 0,
#define TC_ROW_X(D, MQ, WKV, KT, ST, KS) D, MQ, WKV, KT, ST, Tile<D, MQ, WKV, KT, ST, KS>::QROWS, Tile<D, MQ, WKV, KT, ST, KS>::SMEM, 0, KS,
#define TC_ONE(D, MQ, WKV, KT, ST) +1
#define TC_ONE_B(D, MQ, WKV, KT, ST, B) +1
#define TC_ONE_X(D, MQ, WKV, KT, ST, KS) +1
extern "C" __device__ const cc_i32 tc_n_variants = 0 TC_VARIANTS(TC_ONE) TC_VARIANTS_B(TC_ONE_B) TC_VARIANTS_X(TC_ONE_X);
extern "C" __device__ const cc_i32 tc_variants[] = {TC_VARIANTS(TC_ROW) TC_VARIANTS_B(TC_ROW_B) TC_VARIANTS_X(TC_ROW_X)};

extern "C" __global__ void __launch_bounds__(TC_PLAN_THREADS) tc_plan(const TcArgs a, cc_i32 qrows,
                                                                      cc_i32 min_chunk, cc_i32 head_dim,
                                                                      cc_i32 order, cc_i32 cmin,
                                                                      cc_i32 gqrows, cc_i32 gtarget)
{ tc_plan_impl(a, qrows, min_chunk, head_dim, order, cmin, gqrows, gtarget); }

// Cascade: share[r] = how many leading kv entries run r has in common with run r - 1 when
// both are decode runs (one real row each), else 0; one warp a run, from its history (the
// entries before its last, the query's own). Two sequences share cells only as a prefix of
// positions (a clone shares positions below its point, the prefix cache lends a root path,
// and a sequence changes only at its end), so equality is monotone along the lists and a
// 32-way search finds the first difference in a few rounds of one load a lane.
extern "C" __global__ void __launch_bounds__(TC_THREADS) tc_share(const TcArgs a)
{
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (TC_THREADS / 32) + (threadIdx.x >> 5);
    const int rows = (int)a.rows;
    if (r >= rows) return;
    cc_i32* share = const_cast<cc_i32*>(a.share);
    const cc_i64 width = *a.width;
    if (r == 0 || run_qlen(a, r, width) != 1 || run_qlen(a, r - 1, width) != 1 ||
        a.qo_indptr[r + 1] - a.qo_indptr[r] != 1 || a.qo_indptr[r] - a.qo_indptr[r - 1] != 1) {
        if (lane == 0) share[r] = 0;
        return;
    }
    const cc_i32* x = a.kv_indices + a.kv_indptr[r - 1];
    const cc_i32* y = a.kv_indices + a.kv_indptr[r];
    int lo = 0, hi = min(a.kv_indptr[r] - a.kv_indptr[r - 1], a.kv_indptr[r + 1] - a.kv_indptr[r]) - 1;
    // the common length lies in [lo, hi]
    while (lo < hi) {
        const int step = (hi - lo + 31) / 32;
        const int k = lo + (lane + 1) * step - 1;
        const bool valid = k < hi;
        const bool differ = valid && x[k] != y[k];
        const unsigned dm = __ballot_sync(0xffffffffu, differ);
        if (dm) {
            const int f = __ffs(dm) - 1;                // the first probe that differs
            hi = lo + (f + 1) * step - 1;
            lo = lo + f * step;
        } else {
            const unsigned vm = __ballot_sync(0xffffffffu, valid);
            lo = lo + (32 - __clz(vm)) * step;          // past the last probe (all equal)
            lo = min(lo, hi);
        }
    }
    if (lane == 0) share[r] = max(lo, 0);
}

#define TC_ATTEND(SUFFIX, T, D, MQ, WKV, KT, ST)                                                \
extern "C" __global__ void __launch_bounds__(TC_THREADS)                                        \
tc_attend_##SUFFIX##_d##D##_m##MQ##w##WKV##k##KT##s##ST(const TcArgs a)                         \
{ tc_attend<T, false, D, MQ, WKV, KT, ST>(a); }
#define TC_ATTEND_F16(D, MQ, WKV, KT, ST) TC_ATTEND(float16, f16, D, MQ, WKV, KT, ST)
#define TC_ATTEND_BF16(D, MQ, WKV, KT, ST) TC_ATTEND(bfloat16, bf16, D, MQ, WKV, KT, ST)
TC_VARIANTS(TC_ATTEND_F16)
TC_VARIANTS(TC_ATTEND_BF16)

#define TC_ATTEND_B(SUFFIX, T, D, MQ, WKV, KT, ST, B)                                           \
extern "C" __global__ void __launch_bounds__(TC_THREADS, B)                                     \
tc_attend_##SUFFIX##_d##D##_m##MQ##w##WKV##k##KT##s##ST##b##B(const TcArgs a)                  \
{ tc_attend<T, false, D, MQ, WKV, KT, ST>(a); }
#define TC_ATTEND_B_F16(D, MQ, WKV, KT, ST, B) TC_ATTEND_B(float16, f16, D, MQ, WKV, KT, ST, B)
#define TC_ATTEND_B_BF16(D, MQ, WKV, KT, ST, B) TC_ATTEND_B(bfloat16, bf16, D, MQ, WKV, KT, ST, B)
TC_VARIANTS_B(TC_ATTEND_B_F16)
TC_VARIANTS_B(TC_ATTEND_B_BF16)

#define TC_ATTEND_X(SUFFIX, T, D, MQ, WKV, KT, ST, KS)                                          \
extern "C" __global__ void __launch_bounds__(TC_THREADS)                                        \
tc_attend_##SUFFIX##_d##D##_m##MQ##w##WKV##k##KT##s##ST##x##KS(const TcArgs a)                 \
{ tc_attend<T, false, D, MQ, WKV, KT, ST, KS>(a); }
#define TC_ATTEND_X_F16(D, MQ, WKV, KT, ST, KS) TC_ATTEND_X(float16, f16, D, MQ, WKV, KT, ST, KS)
#define TC_ATTEND_X_BF16(D, MQ, WKV, KT, ST, KS) TC_ATTEND_X(bfloat16, bf16, D, MQ, WKV, KT, ST, KS)
TC_VARIANTS_X(TC_ATTEND_X_F16)
TC_VARIANTS_X(TC_ATTEND_X_BF16)

// Variants over 8-bit (float8 e4m3) K/V pools, q and out of T: W(D, MQ, WKV, KT, ST), named
// tc_attend_<dtype>_e4m3_d<D>_m<MQ>w<WKV>k<KT>s<ST>, listed (with their shared memory) in
// tc_variants_e4m3 as tc_variants lists the others.
#define TC_VARIANTS_8(W)                                                                        \
    W(64, 1, 4, 64, 2) W(64, 1, 4, 64, 3) W(64, 1, 4, 64, 4) W(64, 1, 1, 64, 2) W(64, 2, 1, 32, 2) \
    W(80, 1, 4, 64, 2) W(80, 1, 4, 64, 4) W(80, 1, 1, 64, 2) W(80, 2, 1, 32, 2)                 \
    W(96, 1, 4, 64, 2) W(96, 1, 4, 64, 4) W(96, 1, 1, 64, 2) W(96, 2, 1, 32, 2)                 \
    W(128, 1, 4, 64, 2) W(128, 1, 4, 64, 3) W(128, 1, 4, 64, 4) W(128, 1, 1, 64, 2)            \
    W(128, 2, 1, 32, 2)                                                                        \
    W(256, 1, 4, 64, 2) W(256, 1, 4, 64, 4) W(256, 1, 1, 32, 2) W(256, 2, 1, 32, 2)
#define TC_ROW_8(D, MQ, WKV, KT, ST) D, MQ, WKV, KT, ST, Tile<D, MQ, WKV, KT, ST>::QROWS, Tile<D, MQ, WKV, KT, ST>::SMEM8, 0, 0,
extern "C" __device__ const cc_i32 tc_n_variants_e4m3 = 0 TC_VARIANTS_8(TC_ONE);
extern "C" __device__ const cc_i32 tc_variants_e4m3[] = {TC_VARIANTS_8(TC_ROW_8)};
#define TC_ATTEND_8(SUFFIX, T, D, MQ, WKV, KT, ST)                                              \
extern "C" __global__ void __launch_bounds__(TC_THREADS)                                        \
tc_attend_##SUFFIX##_e4m3_d##D##_m##MQ##w##WKV##k##KT##s##ST(const TcArgs a)                    \
{ tc_attend<T, true, D, MQ, WKV, KT, ST>(a); }
#define TC_ATTEND_8_F16(D, MQ, WKV, KT, ST) TC_ATTEND_8(float16, f16, D, MQ, WKV, KT, ST)
#define TC_ATTEND_8_BF16(D, MQ, WKV, KT, ST) TC_ATTEND_8(bfloat16, bf16, D, MQ, WKV, KT, ST)
TC_VARIANTS_8(TC_ATTEND_8_F16)
TC_VARIANTS_8(TC_ATTEND_8_BF16)

#define TC_MERGE(SUFFIX, T)                                                                    \
extern "C" __global__ void __launch_bounds__(TC_THREADS) tc_merge_##SUFFIX(const TcArgs a,     \
                                                                           cc_i32 head_dim,   \
                                                                           cc_i32 qrows)      \
{ tc_merge<T>(a, head_dim, qrows); }
TC_MERGE(float16, f16)
TC_MERGE(bfloat16, bf16)
