// Grouped page4 QSA forward (SPEC §2): one CTA per group of 8 query rows.
//
// Variants (template VARIANT), all in this one kernel so they differ only where
// the comments marked "VARIANT:" say:
//   kUnfixed                   the route as the report found it: padding rows are
//                              loaded and masked by a select, so 0 * NaN reaches P@V
//   kKernelFix                 fix A (the report's): zero unattended panel rows after
//                              the load, between a leading and a trailing barrier
//   kMaskedLoad                fix C (this project's): the loader writes zeros for
//                              unattended rows instead of reading them; no barrier added
//   kKernelFixNoLeadingBarrier fix A minus its leading barrier: test-only, shows what
//                              that barrier protects (compute-sanitizer racecheck)
//
// Device code only (no torch headers): NVRTC compiles it for compute_70.
// Only SM70 tensor-core features: WMMA 16x16x16, fp16 in, fp32 accumulate.
//
// Work split, 8 warps (256 threads):
//   panel load  every thread: 16-byte loads of K/V codes, prefetched into registers one
//               tile ahead (SM70 has no cp.async), decoded to fp16 into shared memory
//   S = Q K^T   one warp per (active M-tile, 16-token half of the tile)
//   softmax     4 threads per score row, 8 columns each
//   O += P V    warp w owns output d-tiles w and w + 8 of every M-tile, as WMMA
//               accumulators in registers for the whole walk
//
// Shared memory (head_dim D, ld = D + 8 halves; rows = 16 * M-tiles <= 64):
//   Q [rows][ld] fp16 | K [32][ld] fp16 | V [32][ld] fp16 | S [rows][36] fp32 |
//   P [rows][40] fp16 | alpha [64] | tile masks [8] | row max / sum [64] each
//   Hq = 8, D = 256: 82 KB (V100 allows 96 KB with the opt-in).
//
// Speed (H200, data/bench_h200.json): one CTA walks its group's tiles in order, so a
// batch of 16 rows runs on 2 SMs; ncu: ~10k cycles and ~1600 issued instructions per
// warp per 32-token tile, 6.2 cycles per issued instruction (2 warps per scheduler):
// issue/latency-bound, not memory-bound.
#pragma once
#include <cuda_fp16.h>
#include <mma.h>

#include "fp8_decode.cuh"

namespace qsa {

enum Variant : int {
  kUnfixed = 0,
  kKernelFix = 1,
  kMaskedLoad = 2,
  kKernelFixNoLeadingBarrier = 3,
};

namespace grouped {

constexpr int kQueries = 8;         // query rows per group: the real route's group size
constexpr int kEntriesPerTile = 8;  // microblocks per tile (categories are padded to 8)
constexpr int kTileTokens = 32;     // 8 microblocks x 4 tokens
constexpr int kWmma = 16;           // WMMA m = n = k
constexpr int kMaxMTiles = 4;       // 8 queries x at most 8 heads = 64 score rows
constexpr int kMaxScoreRows = kMaxMTiles * kWmma;
constexpr int kMaxHeadDim = 256;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kThreadsPerRow = 4;                       // softmax threads per score row
constexpr int kColsPerThread = kTileTokens / kThreadsPerRow;
constexpr int kDTilesPerWarp = kMaxHeadDim / kWmma / kWarps;
constexpr int kRowPad = 8;               // halves added to each Q/K/V row: spreads banks
constexpr int kSLd = kTileTokens + 4;    // S row stride (floats)
constexpr int kPLd = kTileTokens + 8;    // P row stride (halves)

static_assert(kTileTokens == kEntriesPerTile * 4, "a microblock is 4 tokens");
static_assert(kTileTokens == 2 * kWmma, "QK has two 16-token n-tiles, P@V two k-steps");
static_assert(kThreads == kMaxScoreRows * kThreadsPerRow, "softmax: 4 threads per score row");
static_assert(kColsPerThread == 8, "softmax: a thread's 8 columns span exactly 2 microblocks");
static_assert(kMaxHeadDim % (kWmma * kWarps) == 0, "warps own equal numbers of d-tiles");
static_assert(kWarps >= 2 * kMaxMTiles, "one QK job (M-tile x n-tile) per warp");
static_assert(kMaxScoreRows / kWarps * kThreadsPerRow == 32,
              "a warp's softmax rows lie in one M-tile, so its skip decision is warp-uniform");
static_assert((kRowPad * 2) % 16 == 0 && kSLd % 4 == 0 && kPLd % 8 == 0,
              "WMMA ldm: multiple of 16 bytes");

// Byte offsets of the shared-memory regions, each 128-byte aligned. Host and
// device compute the same layout from (q_heads, head_dim).
struct SmemLayout {
  int ld;       // Q/K/V row stride in halves
  int m_tiles;  // ceil(8 * q_heads / 16)
  unsigned int q, k, v, s, p, alpha, tile_mask, row_m, row_l, total;
};

__host__ __device__ inline unsigned int align128(unsigned int x) { return (x + 127u) & ~127u; }

__host__ __device__ inline SmemLayout smem_layout(int q_heads, int head_dim) {
  SmemLayout L;
  L.ld = head_dim + kRowPad;
  L.m_tiles = (kQueries * q_heads + kWmma - 1) / kWmma;
  const unsigned int rows = (unsigned int)L.m_tiles * kWmma;
  unsigned int off = 0;
  L.q = off;         off = align128(off + rows * L.ld * 2);
  L.k = off;         off = align128(off + kTileTokens * L.ld * 2);
  L.v = off;         off = align128(off + kTileTokens * L.ld * 2);
  L.s = off;         off = align128(off + rows * kSLd * 4);
  L.p = off;         off = align128(off + rows * kPLd * 2);
  L.alpha = off;     off = align128(off + kMaxScoreRows * 4);
  L.tile_mask = off; off = align128(off + kEntriesPerTile * 4);
  L.row_m = off;     off = align128(off + kMaxScoreRows * 4);
  L.row_l = off;     off = align128(off + kMaxScoreRows * 4);
  L.total = off;
  return L;
}

}  // namespace grouped

// Arguments of the grouped forward. Shapes are checked by the binding.
struct GroupedParams {
  const __half* q;               // [rows, q_heads, head_dim]
  const unsigned char* kv;       // [pages, 2, page_size, 1, head_dim] codes (fp8) or fp16
  const long long* group_rows;   // [groups, 8] row of q for each query of the group
  const int* microblocks;        // [groups, cap] physical microblock ids
  const int* masks;              // [groups, cap] bit query*4 + token_in_microblock
  const int* seq_len;            // [groups] tokens incl. padding, multiple of 32
  __half* out;                   // [groups, 8, q_heads, head_dim]
  float* lse;                    // [groups, 8, q_heads] or nullptr
  int q_heads, head_dim, page_size, cap;
  long long q_rows;              // rows of q
  long long n_microblocks;       // pages * page_size / 4
  float qk_scale;                // sm_scale * k_scale
  float v_scale;
};

template <int FMT, int VARIANT>
__global__ void __launch_bounds__(grouped::kThreads, 1)
grouped_page4_forward(const GroupedParams p) {
  using namespace nvcuda;
  using namespace grouped;
  using FragA = wmma::fragment<wmma::matrix_a, kWmma, kWmma, kWmma, __half, wmma::row_major>;
  using FragKt = wmma::fragment<wmma::matrix_b, kWmma, kWmma, kWmma, __half, wmma::col_major>;
  using FragV = wmma::fragment<wmma::matrix_b, kWmma, kWmma, kWmma, __half, wmma::row_major>;
  using FragAcc = wmma::fragment<wmma::accumulator, kWmma, kWmma, kWmma, float>;
  static_assert(FragAcc::num_elements == 8, "accumulator element map holds 8 entries");

  // Stored elements per 16-byte load, and the register slots a thread needs to hold
  // one 32-token panel of the largest head_dim.
  constexpr int kElems16 = KvTraits<FMT>::kElemsPer16B;
  constexpr int kSlots = kTileTokens * kMaxHeadDim / kElems16 / kThreads;
  static_assert(kSlots * kThreads * kElems16 == kTileTokens * kMaxHeadDim, "even panel split");

  extern __shared__ __align__(128) unsigned char smem[];
  const SmemLayout L = smem_layout(p.q_heads, p.head_dim);
  __half* Qs = reinterpret_cast<__half*>(smem + L.q);
  __half* Ks = reinterpret_cast<__half*>(smem + L.k);
  __half* Vs = reinterpret_cast<__half*>(smem + L.v);
  float* Ss = reinterpret_cast<float*>(smem + L.s);
  __half* Ps = reinterpret_cast<__half*>(smem + L.p);
  float* alpha_s = reinterpret_cast<float*>(smem + L.alpha);
  unsigned int* tile_mask_s = reinterpret_cast<unsigned int*>(smem + L.tile_mask);
  float* row_m_s = reinterpret_cast<float*>(smem + L.row_m);
  float* row_l_s = reinterpret_cast<float*>(smem + L.row_l);

  const int tid = threadIdx.x, warp = tid / 32;
  const int g = blockIdx.x;
  const int D = p.head_dim, Hq = p.q_heads, ld = L.ld, m_tiles = L.m_tiles;
  const int score_rows = kQueries * Hq;
  const int d_tiles = D / kWmma;
  // The binding rejects out-of-range ids, seq_len and rows with a Python error; the
  // clamps and guards below only keep a CUDA-graph replay (where it cannot look at
  // the data) inside the buffers: bad ids read nothing, bad rows give zero queries.
  const int n_tiles = max(0, min(p.seq_len[g], p.cap * 4) / kTileTokens);
  const int* mb_g = p.microblocks + (size_t)g * p.cap;
  const unsigned int* mask_g = reinterpret_cast<const unsigned int*>(p.masks) + (size_t)g * p.cap;

  // ---- Q -> shared memory: score row r = query * Hq + head; padding rows are zero.
  {
    const int vec_per_row = D / 8;
    for (int i = tid; i < m_tiles * kWmma * vec_per_row; i += kThreads) {
      const int r = i / vec_per_row, c = (i % vec_per_row) * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < score_rows) {
        const long long row = p.group_rows[g * kQueries + r / Hq];
        if (row >= 0 && row < p.q_rows)
          val = *reinterpret_cast<const uint4*>(p.q + (row * Hq + r % Hq) * D + c);
      }
      *reinterpret_cast<uint4*>(Qs + r * ld + c) = val;
    }
  }
  // ---- Accumulator element -> (row, col) map. WMMA leaves the layout unspecified
  // (it differs between sm70 and sm80+), so read it once from a matrix whose
  // element (r, c) holds r * 16 + c. Ss is free scratch until the first tile.
  for (int i = tid; i < kWmma * kWmma; i += kThreads) Ss[(i / kWmma) * kSLd + i % kWmma] = (float)i;
  __syncthreads();  // the map matrix is written before any warp loads it
  int elem_rc[FragAcc::num_elements];
  {
    FragAcc map;
    wmma::load_matrix_sync(map, Ss, kSLd, wmma::mem_row_major);
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; ++e) elem_rc[e] = (int)map.x[e];
  }
  __syncthreads();  // every warp has read the map before Ss holds scores

  // ---- Per-thread state.
  // Softmax: score row r, columns 8*quarter .. 8*quarter+7 of each tile.
  const int r = tid / kThreadsPerRow, quarter = tid % kThreadsPerRow;
  const int query = r / Hq;  // >= 8 for padding rows: they attend nothing
  float row_m = -1e30f, row_l = 0.f;
  // O: this warp's d-tiles (warp + i * kWarps) of every M-tile, in registers.
  FragAcc acc_o[kMaxMTiles][kDTilesPerWarp];
#pragma unroll
  for (int mt = 0; mt < kMaxMTiles; ++mt)
#pragma unroll
    for (int i = 0; i < kDTilesPerWarp; ++i) wmma::fill_fragment(acc_o[mt][i], 0.f);

  // ---- Panel loader. Slot s of this thread is the 16-byte piece c = tid + s*kThreads
  // of the panel: token j = c / per_row, piece c % per_row, in both the K and V plane.
  // Software pipeline, since SM70 has no cp.async: while tile t is computed, the bytes
  // of tile t+1 are in flight into kreg/vreg, and the microblock ids of tile t+2 (which
  // t+2's addresses depend on) into slot_mb/slot_bits.
  const int per_row = D / kElems16;
  const int panel_pieces = kTileTokens * per_row;
  const int mb_per_page = p.page_size / 4;
  const size_t row_bytes = (size_t)D * KvTraits<FMT>::kBytes;
  const size_t plane_bytes = (size_t)p.page_size * row_bytes;
  int slot_j[kSlots], slot_col[kSlots];  // token and first column of each slot (-1: no slot)
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int c = tid + s * kThreads;
    slot_j[s] = c < panel_pieces ? c / per_row : -1;
    slot_col[s] = (c % per_row) * kElems16;
  }
  int slot_mb[kSlots];
  unsigned int slot_bits[kSlots];  // mask bits of the slot's token (any query)
  uint4 kreg[kSlots], vreg[kSlots];

  auto load_ids = [&](int t) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int j = slot_j[s];
      slot_mb[s] = -1;  // -1: nothing to read
      slot_bits[s] = 0;
      if (j >= 0 && t < n_tiles) {
        const int e = t * kEntriesPerTile + j / 4;
        const int mb = __ldg(mb_g + e);
        slot_mb[s] = (mb >= 0 && mb < p.n_microblocks) ? mb : -1;
        slot_bits[s] = __ldg(mask_g + e) & (0x11111111u << (j & 3));
      }
    }
  };
  auto load_data = [&](int t) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      kreg[s] = make_uint4(0, 0, 0, 0);
      vreg[s] = make_uint4(0, 0, 0, 0);
      // VARIANT: fix C never reads a token that no query attends (its zeros stay).
      const bool read = slot_mb[s] >= 0 && (VARIANT != kMaskedLoad || slot_bits[s] != 0);
      if (read) {
        const int page = slot_mb[s] / mb_per_page;
        const int in_page = (slot_mb[s] - page * mb_per_page) * 4 + (slot_j[s] & 3);
        const unsigned char* k_src =
            p.kv + (size_t)page * 2 * plane_bytes + (size_t)in_page * row_bytes + (size_t)slot_col[s] * KvTraits<FMT>::kBytes;
        kreg[s] = __ldg(reinterpret_cast<const uint4*>(k_src));
        vreg[s] = __ldg(reinterpret_cast<const uint4*>(k_src + plane_bytes));
      }
    }
  };
  auto store_panels = [&]() {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      if (slot_j[s] >= 0) {
        store_decoded_16B<FMT>(Ks + slot_j[s] * ld + slot_col[s], kreg[s]);
        store_decoded_16B<FMT>(Vs + slot_j[s] * ld + slot_col[s], vreg[s]);
      }
    }
  };

  load_ids(0);
  load_data(0);
  load_ids(1);
  unsigned int next_tile_mask = (tid < kEntriesPerTile && n_tiles > 0) ? __ldg(mask_g + tid) : 0u;

  for (int t = 0; t < n_tiles; ++t) {
    // ---- 1. Panels of tile t -> shared memory; start loading tile t+1.
    store_panels();
    if (tid < kEntriesPerTile) tile_mask_s[tid] = next_tile_mask;
    load_data(t + 1);
    load_ids(t + 2);
    next_tile_mask = (tid < kEntriesPerTile && t + 1 < n_tiles)
                         ? __ldg(mask_g + (t + 1) * kEntriesPerTile + tid) : 0u;

    // VARIANT: fix A zeroes every panel row that no query attends, so P@V computes
    // 0 * 0 instead of 0 * NaN. Rows are zeroed in 16-byte pieces by a thread mapping
    // other than the loader's, as in the real route: another thread's panel store
    // could land after the zero and bring the NaN back, hence the leading barrier.
    if (VARIANT == kKernelFix || VARIANT == kKernelFixNoLeadingBarrier) {
      // VARIANT: kKernelFixNoLeadingBarrier omits this barrier on purpose (racecheck demo).
      if (VARIANT == kKernelFix) __syncthreads();  // panel stores and tile masks land before the zeroing
      const int vec_per_row = D / 8;
      for (int i = tid; i < 2 * kTileTokens * vec_per_row; i += kThreads) {
        const int plane = i / (kTileTokens * vec_per_row);
        const int j = (i / vec_per_row) % kTileTokens;
        if ((tile_mask_s[j / 4] & (0x11111111u << (j & 3))) == 0u) {
          __half* panel = plane == 0 ? Ks : Vs;
          *reinterpret_cast<uint4*>(panel + j * ld + (i % vec_per_row) * 8) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    __syncthreads();  // panels (zeroed rows included, for fix A) and tile masks are visible to QK, softmax, P@V

    // ---- 2. Active M-tiles: those touched by a query with any bit in the tile.
    unsigned int tile_or = 0;
#pragma unroll
    for (int e = 0; e < kEntriesPerTile; ++e) tile_or |= tile_mask_s[e];
    unsigned int active = 0;
    for (int qq = 0; qq < kQueries; ++qq)
      if ((tile_or >> (4 * qq)) & 0xFu)
        for (int mt = (qq * Hq) / kWmma; mt <= (qq * Hq + Hq - 1) / kWmma; ++mt) active |= 1u << mt;

    // ---- 3. S = Q K^T for the active M-tiles (unscaled, fp32).
    for (int job = warp; job < 2 * m_tiles; job += kWarps) {
      const int mt = job / 2, nt = job % 2;
      if (!((active >> mt) & 1u)) continue;  // warp-uniform
      // Two accumulators (even / odd k-steps) halve the dependent MMA chain; their
      // fragments share one layout, so they add element-wise.
      FragAcc s_acc[2];
      wmma::fill_fragment(s_acc[0], 0.f);
      wmma::fill_fragment(s_acc[1], 0.f);
      for (int kt = 0; kt < d_tiles; kt += 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (kt + h >= d_tiles) break;  // d_tiles is odd for head_dim 16, 48, ...
          FragA a;
          FragKt b;
          wmma::load_matrix_sync(a, Qs + mt * kWmma * ld + (kt + h) * kWmma, ld);
          wmma::load_matrix_sync(b, Ks + nt * kWmma * ld + (kt + h) * kWmma, ld);
          wmma::mma_sync(s_acc[h], a, b, s_acc[h]);
        }
      }
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; ++e) s_acc[0].x[e] += s_acc[1].x[e];
      wmma::store_matrix_sync(Ss + mt * kWmma * kSLd + nt * kWmma, s_acc[0], kSLd, wmma::mem_row_major);
    }
    __syncthreads();  // S is complete before the softmax reads it

    // ---- 4. Online softmax, 4 threads per row; masking is a select, so NaN in an
    // unattended K row is discarded here (V is another matter: step 5).
    if (r < m_tiles * kWmma && ((active >> (r / kWmma)) & 1u)) {  // warp-uniform
      float s[kColsPerThread];
      bool att[kColsPerThread];
      float tile_max = -1e30f;
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
        const int col = quarter * kColsPerThread + c;
        att[c] = query < kQueries && ((tile_mask_s[col / 4] >> (query * 4 + (col & 3))) & 1u);
        s[c] = att[c] ? Ss[r * kSLd + col] * p.qk_scale : -1e30f;
        tile_max = fmaxf(tile_max, s[c]);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(row_m, tile_max);
      const float alpha = expf(row_m - m_new);
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
        // P is rounded to fp16 (it feeds the tensor cores); the row sum adds the rounded values.
        const __half ph = __float2half_rn(att[c] ? expf(fmaxf(s[c] - m_new, -80.f)) : 0.f);
        Ps[r * kPLd + quarter * kColsPerThread + c] = ph;
        sum += __half2float(ph);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      row_l = row_l * alpha + sum;
      row_m = m_new;
      if (quarter == 0) alpha_s[r] = alpha;
    }
    __syncthreads();  // P and alpha are complete before P@V reads them

    // ---- 5. O = O * alpha + P V on the tensor cores. Every P, zero included, is
    // multiplied: 0 * NaN = NaN is the bug being reproduced, so nothing is skipped.
    {
      FragV v_frag[kDTilesPerWarp][2];
#pragma unroll
      for (int i = 0; i < kDTilesPerWarp; ++i) {
        const int dt = warp + i * kWarps;
        if (dt < d_tiles) {
#pragma unroll
          for (int kk = 0; kk < 2; ++kk)
            wmma::load_matrix_sync(v_frag[i][kk], Vs + kk * kWmma * ld + dt * kWmma, ld);
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMaxMTiles; ++mt) {
        if (mt >= m_tiles || !((active >> mt) & 1u)) continue;  // warp-uniform
        FragA p_frag[2];
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
          wmma::load_matrix_sync(p_frag[kk], Ps + mt * kWmma * kPLd + kk * kWmma, kPLd);
        float alpha[FragAcc::num_elements];  // per element: its row's rescale factor
#pragma unroll
        for (int e = 0; e < FragAcc::num_elements; ++e) alpha[e] = alpha_s[mt * kWmma + elem_rc[e] / kWmma];
#pragma unroll
        for (int i = 0; i < kDTilesPerWarp; ++i) {
          if (warp + i * kWarps >= d_tiles) continue;  // warp-uniform
#pragma unroll
          for (int e = 0; e < FragAcc::num_elements; ++e) acc_o[mt][i].x[e] *= alpha[e];
          wmma::mma_sync(acc_o[mt][i], p_frag[0], v_frag[i][0], acc_o[mt][i]);
          wmma::mma_sync(acc_o[mt][i], p_frag[1], v_frag[i][1], acc_o[mt][i]);
        }
      }
    }
    __syncthreads();  // P@V and the softmax are done with K, V, P, alpha and tile masks before tile t+1 overwrites them
  }

  // ---- 6. out = O * v_scale / l (l == 0, a row that attended nothing, gives NaN).
  if (quarter == 0 && r < kMaxScoreRows) {
    row_m_s[r] = row_m;
    row_l_s[r] = row_l;
  }
  __syncthreads();  // row sums are visible to the warps that own the rows' outputs
#pragma unroll
  for (int mt = 0; mt < kMaxMTiles; ++mt) {
    if (mt >= m_tiles) continue;
#pragma unroll
    for (int i = 0; i < kDTilesPerWarp; ++i) {
      const int dt = warp + i * kWarps;
      if (dt >= d_tiles) continue;
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; ++e) {
        const int row = mt * kWmma + elem_rc[e] / kWmma;
        if (row >= score_rows) continue;
        const int col = dt * kWmma + elem_rc[e] % kWmma;
        const size_t o = (((size_t)g * kQueries + row / Hq) * Hq + row % Hq) * D + col;
        p.out[o] = __float2half_rn(acc_o[mt][i].x[e] * p.v_scale / row_l_s[row]);
      }
    }
  }
  if (p.lse != nullptr && quarter == 0 && r < score_rows)
    p.lse[((size_t)g * kQueries + query) * Hq + r % Hq] = row_m + logf(row_l);
}

}  // namespace qsa
