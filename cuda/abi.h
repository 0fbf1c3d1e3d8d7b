// The contract between the step engine (pyx/cuda/_engine.pyx, which includes this file) and
// the step kernels (cuda/step.cu): limits, launch shapes, the staging layout and the
// parameter block. Plain C: no includes, so NVRTC and the host compiler read it alike.
#ifndef CELLCACHE_ABI_H
#define CELLCACHE_ABI_H

typedef long long cc_i64;
typedef unsigned long long cc_u64;
typedef int cc_i32;
typedef unsigned int cc_u32;
typedef unsigned char cc_u8;

#define CC_MAX_WINDOWS 16          // distinct windows a cache may have on the device
#define CC_MASK_COLS 16            // mask columns one build_step thread owns
#define CC_MASK_MAX_ROWS 64        // most rows one build_step block sweeps
#define CC_STEP_THREADS 128        // threads of a build_step block
#define CC_PAGED_WORDS 16          // seqbits words one thread scans for the paged view
#define CC_APPLY_THREADS 256       // threads of an apply_step block

// mask_format values
#define CC_MASKS_NONE 0
#define CC_MASKS_BOOL 1
#define CC_MASKS_BITS 2

// Staging, in int64 words: a 16-word header, then arrays sized by max_write (mw), then the
// change records {cell, pos, owner words...} from an even word.
#define CC_HDR_WIDTH 0
#define CC_HDR_PAD_TO 1
#define CC_HDR_READ_LEN 2
#define CC_HDR_N_RUNS 3
#define CC_HDR_SINK 4
#define CC_HDR_WORDS 16
#define CC_OFF_SEQ(mw) (CC_HDR_WORDS)
#define CC_OFF_POS(mw) (CC_HDR_WORDS + (mw))
#define CC_OFF_CELLS(mw) (CC_HDR_WORDS + 2 * (mw))
#define CC_OFF_QO(mw) (CC_HDR_WORDS + 3 * (mw))
#define CC_OFF_KV(mw) (CC_HDR_WORDS + 4 * (mw) + 1)
#define CC_OFF_RUN_SEQ(mw) (CC_HDR_WORDS + 5 * (mw) + 2)
#define CC_OFF_RUN_LAST(mw) (CC_HDR_WORDS + 6 * (mw) + 2)
#define CC_OFF_RECORDS(mw) ((CC_HDR_WORDS + 7 * (mw) + 2 + 1) / 2 * 2)

// Everything the kernels need that does not change from step to step, written once to the
// device when the cache is built. Every field is 8 bytes, so host and device agree on the
// layout. Device addresses are cc_u64.
typedef struct {
    cc_i64 capacity, owner_words, bit_words, max_write;
    cc_i64 n_windows, paged, mask_format, mask_row_bytes;
    cc_u64 pos, owners, seqbits;                  // the mirror: int32, u64 word-major, u64
    cc_u64 cells, positions, read_len, width;     // step buffers (int64)
    cc_u64 seq_ids;                               // the step's ids (int64), padding = row 0's
    cc_u64 qo_indptr, kv_indptr, kv_indices;      // paged view (int32)
    cc_u64 run_seq, run_last, run_kv;             // per run: sequence, last position, offset
    cc_i64 windows[CC_MAX_WINDOWS];
    cc_u64 masks[CC_MAX_WINDOWS];
} cc_step_params;

// The paged attention kernels' arguments (cuda/attention.cu), passed by value.
typedef struct {
    const cc_i32* qo_indptr;      // [n_rows + 1]; entries past the last request repeat its end
    const cc_i32* kv_indptr;
    const cc_i32* kv_indices;
    const cc_i64* width;          // real rows; rows past it are padding
    cc_i64 q_s_tok, q_s_head;     // q strides (elements)
    cc_i64 o_s_tok, o_s_head;     // out strides (elements)
    cc_i32 n_rows, n_heads, n_kv_heads, head_dim, window;
    float scale;
} cc_paged_args;

#define CC_ATTN_THREADS 128        // threads of every attention block
#define CC_PREFILL_K 32            // kv entries a prefill block stages per iteration
#define CC_PREFILL_PAIRS 64        // most (query, head) pairs of a prefill tile

#endif
