// Grouped page4 QSA forward: one CTA of 512 threads per group of 8 query rows, walking
// the group's plan in tiles of 8 microblocks (32 tokens), with the per-tile structure
// of the upstream route (1CatAI/1Cat-vLLM, flash-attention-v100/kernel/
// flash_decode_paged.cu, flash_attention_grouped_verify_e5m2_partial_kernel with
// SPARSE_PAGE4; fix A as in the PR author's fork, https://github.com/1CatAI/1Cat-vLLM/pull/647).
//
// Per tile, in this order (K and V pass through ONE shared panel buffer, loaded
// synchronously: the global reads of a panel are issued after the barrier before it):
//   1. tile masks -> shared; K panel: every thread reads its 16-byte piece(s), decodes
//      them to fp16 and stores them                                    barrier B1
//      fix A: zero every K row no query attends (in 16-byte pieces)    barrier A1
//   2. S = Q K^T on the tensor cores for the active M-tiles             barrier B2
//   3. online softmax (fp32, NaN-ignoring fmaxf, P stored as fp16)      barrier B3
//   4. rescale the output accumulators; V panel into the same buffer
//      fix A: leading barrier A2, then zero every V row no query attends
//                                                                       barrier B4
//      finite_pv: B4 also ORs "this tile's V panel holds a NaN or Inf" over the CTA
//      (__syncthreads_or); only such a tile adds to each row the IEEE sum of p * v over
//      the non-finite values that row attends (4b), barrier F1, sets the panel's
//      non-finite values to 0, barrier F2
//   5. O += P V on the tensor cores (0 * NaN = NaN happens here)        barrier B5
//
// Barriers per tile (kBarriersPerTile below, recorded in the bench JSON):
//   kUnfixed                    5   the route as the report found it
//   kKernelFix                  7   fix A: its K pass adds A1, its V pass the leading A2
//   kMaskedLoad                 5   fix C (this project's): the loader writes zeros for
//                                   rows no query attends instead of reading them
//   kKernelFixNoLeadingBarrier  6   fix A without A2: test-only, compute-sanitizer
//                                   racecheck shows what A2 protects
//   kEarlyV                     5   NOT upstream, measured beside it: unfixed, with the
//                                   tile's V bytes read into registers together with K
//                                   (one global round trip per tile instead of two);
//                                   stored into the panel at the same point as above
//   kFinitePv                   5   this project's in-kernel complete fix (routes.labels
//                                   finite_pv): no zeroing pass; B4 is __syncthreads_or of
//                                   the loader's "non-finite V" flags. A tile whose V is all
//                                   finite runs as unfixed (p = 0 times a finite value is 0);
//                   (7 on a tile    a tile with a NaN or Inf first adds, per output element,
//                    with a NaN     the sum of p * v over the non-finite v its row attends
//                    or Inf in V)   (NaN, +Inf or -Inf, as IEEE gives it: 0 * Inf = NaN for
//                                   an attended token whose fp16 p is 0), then sets the
//                                   panel's non-finite values to 0 (F1, F2) before P@V. So a
//                                   row gets exactly the non-finite result of its own values,
//                                   and the rows of another request in the same group or
//                                   M-tile none: what kernel_fix cannot give when the group's
//                                   rows belong to several requests (it zeroes only rows NO
//                                   query attends).
//
// The one departure from upstream's memory traffic in the upstream-structured variants:
// the plan metadata of tile t+1 (its 8 microblock ids and masks, 64 bytes) is read into
// registers while tile t runs, so a panel load waits for its data, not for the id that
// the data's address depends on. The panel loads and barriers are unchanged by it.
//
// Faster than upstream inside that structure (the same global reads, barriers, zeroing
// passes and arithmetic per tile; results are bit-identical between these versions):
//   QK splits the head dims over two warps per (M-tile, 16-token n-tile) job (16 warps,
//   at most 8 jobs), two accumulators each, so a warp's dependent WMMA chain is 4 deep
//   (upstream: 16); at head_dim 256 its k-steps are straight-line code. The softmax uses
//   8 threads per score row (one microblock each, 3 shuffle steps) instead of a warp per
//   row, and e^x as one ex2 (its argument is clamped to >= -80, so __expf's subnormal
//   handling never applies). E4M3 decodes at 7-8 instructions per pair of codes; a
//   panel's 16-byte stores are ordered to avoid shared-memory bank conflicts. The
//   accumulator rescale skips M-tiles whose 16 rows all kept their max (a multiply by
//   exactly 1) and loads two row scales per fragment. P@V runs a warp's fragments as
//   straight-line code (an inactive M-tile's result is discarded by a select); on sm_80+
//   the fragments of a warp share their V loads (sm_70 reloads them: registers). Fix A's
//   zeroing passes assign 16 threads to each panel row (upstream walks the row's 16-byte
//   pieces with a compile-time divisor): the same stores, a few instructions per thread.
//   Global reads are read-only (__ldg), so ptxas may issue the V panel's reads before B3;
//   its shared-memory stores stay after it.
//
// Speed (H200, report geometry 16 rows x 8192 tokens, E4M3; evidence/ncu_variants_h200.txt,
// data/bench_h200.json): about 6,800 cycles (3.5 us) and 610 issued instructions per warp
// per tile, over five barrier-separated phases (K panel 22 %, QK 18 %, softmax 15 %,
// rescale + V panel 24 %, P@V 13 % of warp time). Leaving one part out at a time
// (benchmarks/tile_rig.py, same run): the two synchronous global round trips cost 1.1 us
// of the 3.5, QK 0.75, P@V 0.7, the E4M3 decode 0.2, the softmax 0.2, the rescale 0.15.
//
// Device code only (no torch headers): NVRTC compiles it for compute_70.
// Only SM70 tensor-core features: WMMA 16x16x16, fp16 in, fp32 accumulate.
//
// Shared memory (head_dim D, ld = D + 8 halves; rows = 16 * M-tiles <= 64):
//   Q [rows][ld] fp16 | KV panel [32][ld] fp16 | S [2][rows][36] fp32 (k-halves) |
//   P [rows][40] fp16 | row scale [64] | tile masks [8], M-tile query bits [4], rescale
//   flags [16 B] | row max / sum [64] each
//   Hq = 6, D = 256: 60,800 B; Hq = 8, D = 256: 75,136 B (V100: 96 KB with the opt-in).
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
  kEarlyV = 4,
  kFinitePv = 5,
};

// __syncthreads() per tile of each variant (see the file comment).
__host__ __device__ constexpr int kBarriersPerTile(int variant) {  // kFinitePv: B4 is a __syncthreads_or
  return variant == kKernelFix ? 7 : variant == kKernelFixNoLeadingBarrier ? 6 : 5;
}

namespace grouped {

constexpr int kQueries = 8;         // query rows per group: the real route's group size
constexpr int kEntriesPerTile = 8;  // microblocks per tile (categories are padded to 8)
constexpr int kTileTokens = 32;     // 8 microblocks x 4 tokens
constexpr int kWmma = 16;           // WMMA m = n = k
constexpr int kMaxMTiles = 4;       // 8 queries x at most 8 heads = 64 score rows
constexpr int kMaxScoreRows = kMaxMTiles * kWmma;
constexpr int kMaxHeadDim = 256;
constexpr int kWarps = 16;          // 512 threads, as upstream
constexpr int kThreads = kWarps * 32;
constexpr int kNTiles = kTileTokens / kWmma;            // QK n-tiles per tile
constexpr int kQkJobs = kMaxMTiles * kNTiles;           // (M-tile, n-tile) jobs
constexpr int kKSplit = kWarps / kQkJobs;               // warps per job, each a range of head dims
constexpr int kThreadsPerRow = kThreads / kMaxScoreRows;  // softmax threads per score row
constexpr int kColsPerThread = kTileTokens / kThreadsPerRow;
constexpr int kMaxFrags = kMaxMTiles * (kMaxHeadDim / kWmma) / kWarps;  // P@V accumulators per warp
constexpr int kRowPad = 8;               // halves added to each Q/panel row: spreads banks
constexpr int kSLd = kTileTokens + 4;    // S row stride (floats)
constexpr int kPLd = kTileTokens + 8;    // P row stride (halves)

static_assert(kTileTokens == kEntriesPerTile * 4, "a microblock is 4 tokens");
static_assert(kTileTokens == 2 * kWmma, "QK has two 16-token n-tiles, P@V two k-steps");
static_assert(kQkJobs * kKSplit == kWarps && kKSplit == 2, "QK: every warp has one job half");
static_assert(kThreadsPerRow * kMaxScoreRows == kThreads && kColsPerThread == 4,
              "softmax: 8 threads per score row, each exactly one microblock (4 columns)");
static_assert(32 % kThreadsPerRow == 0 && kWmma * kThreadsPerRow % 32 == 0,
              "softmax: a warp's rows lie in one M-tile (its guards are warp-uniform)");
static_assert(kMaxFrags * kWarps == kMaxMTiles * (kMaxHeadDim / kWmma), "P@V: equal fragment split");
static_assert(kThreads >= kEntriesPerTile, "one thread per tile mask");
static_assert((kRowPad * 2) % 16 == 0 && kSLd % 4 == 0 && kPLd % 8 == 0,
              "WMMA ldm and 16-byte vector accesses: multiples of 16 bytes");

// Byte offsets of the shared-memory regions, each 128-byte aligned. Host and
// device compute the same layout from (q_heads, head_dim).
struct SmemLayout {
  int ld;       // Q / panel row stride in halves
  int m_tiles;  // ceil(8 * q_heads / 16)
  unsigned int q, kv, s, s_half, p, scale, tile_mask, row_m, row_l, total;
};

__host__ __device__ constexpr unsigned int align128(unsigned int x) { return (x + 127u) & ~127u; }

__host__ __device__ constexpr SmemLayout smem_layout(int q_heads, int head_dim) {
  SmemLayout L{};
  L.ld = head_dim + kRowPad;
  L.m_tiles = (kQueries * q_heads + kWmma - 1) / kWmma;
  const unsigned int rows = (unsigned int)L.m_tiles * kWmma;
  unsigned int off = 0;
  L.q = off;         off = align128(off + rows * L.ld * 2);
  L.kv = off;        off = align128(off + kTileTokens * L.ld * 2);
  L.s = off;         L.s_half = rows * kSLd;  // floats between the two k-halves of S
  off = align128(off + kKSplit * rows * kSLd * 4);
  L.p = off;         off = align128(off + rows * kPLd * 2);
  L.scale = off;     off = align128(off + kMaxScoreRows * 4);
  // tile masks [8] | M-tile query bits [4] | per-warp "a row scale is not 1" flags [16 bytes]
  L.tile_mask = off; off = align128(off + (kEntriesPerTile + kMaxMTiles) * 4 + kWarps);
  L.row_m = off;     off = align128(off + kMaxScoreRows * 4);
  L.row_l = off;     off = align128(off + kMaxScoreRows * 4);
  L.total = off;
  return L;
}
static_assert(smem_layout(8, kMaxHeadDim).total <= 96 * 1024, "largest shape fits a V100's 96 KB");

constexpr float kNegInf = -1.0e30f;  // masked score and initial row max, as upstream
constexpr float kExpFloor = -80.f;   // exponent clamp of P and of the rescale factor

// e^x for x >= kExpFloor, as __expf computes it (the hardware 2^x of x * log2(e), both
// rounded to float) minus __expf's subnormal-result handling: every argument here is
// clamped to >= -80, so 2^(x log2 e) >= 2^-116 is a normal float and the flush-to-zero
// form gives the same bits in one instruction instead of six.
__device__ __forceinline__ float exp_clamped(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

}  // namespace grouped

// Arguments of the grouped forward (plain C: pointers, int, long long, float). Shapes
// are checked by the binding.
struct GroupedParams {
  const __half* q;               // [rows, q_heads, head_dim]
  const unsigned char* kv;       // [pages, 2, page_size, 1, head_dim] codes (fp8) or fp16
  const long long* group_rows;   // [groups, 8] row of q for each query of the group (-1: an empty slot)
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
  static_assert(VARIANT >= kUnfixed && VARIANT <= kFinitePv, "unknown variant");
  constexpr bool kFixA = VARIANT == kKernelFix || VARIANT == kKernelFixNoLeadingBarrier;
  constexpr bool kMasked = VARIANT == kMaskedLoad;
  constexpr bool kVEarly = VARIANT == kEarlyV;
  constexpr bool kFinite = VARIANT == kFinitePv;

  // Stored elements per 16-byte load, and the 16-byte pieces ("slots") a thread loads
  // per panel at the largest head_dim: one for fp8, two for fp16.
  constexpr int kElems16 = KvTraits<FMT>::kElemsPer16B;
  constexpr int kSlots = kTileTokens * kMaxHeadDim / kElems16 / kThreads;
  static_assert(kSlots * kThreads * kElems16 == kTileTokens * kMaxHeadDim, "even panel split");

  extern __shared__ __align__(128) unsigned char smem[];
  const SmemLayout L = smem_layout(p.q_heads, p.head_dim);
  __half* Qs = reinterpret_cast<__half*>(smem + L.q);
  __half* KVs = reinterpret_cast<__half*>(smem + L.kv);
  float* Ss = reinterpret_cast<float*>(smem + L.s);
  __half* Ps = reinterpret_cast<__half*>(smem + L.p);
  float* scale_s = reinterpret_cast<float*>(smem + L.scale);
  unsigned int* tile_mask_s = reinterpret_cast<unsigned int*>(smem + L.tile_mask);
  unsigned int* mtile_bits_s = tile_mask_s + kEntriesPerTile;
  unsigned char* rescale_s = reinterpret_cast<unsigned char*>(mtile_bits_s + kMaxMTiles);
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
  // Packed 4 bits per element (row in elem_row, column in elem_col): registers are
  // the scarce resource at 512 threads (128 per thread).
  unsigned int elem_row = 0, elem_col = 0;
  {
    FragAcc map;
    wmma::load_matrix_sync(map, Ss, kSLd, wmma::mem_row_major);
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; ++e) {
      elem_row |= ((unsigned int)map.x[e] / kWmma) << (4 * e);
      elem_col |= ((unsigned int)map.x[e] % kWmma) << (4 * e);
    }
  }
  // The rows of this thread's elements as a pair: on the layouts seen (a thread's elements
  // lie in two rows on sm_80+) the rescale loads two row scales instead of eight. Bits 0..3
  // row A, 4..7 row B, 8..15 "element e is in row B", bit 16 "more than two rows" (then
  // the rescale reads every element's row).
  unsigned int row_pair;
  {
    const unsigned int ra = elem_row & 0xFu;
    unsigned int rb = ra, in_b = 0, more = 0;
#pragma unroll
    for (int e = 1; e < FragAcc::num_elements; ++e) {
      const unsigned int r = (elem_row >> (4 * e)) & 0xFu;
      if (r != ra && rb == ra) rb = r;
      if (r == rb && r != ra) in_b |= 1u << e;
      else if (r != ra) more = 1;
    }
    row_pair = ra | rb << 4 | in_b << 8 | more << 16;
  }

  // ---- Softmax role: score row srow, columns 4*seg .. 4*seg+3 = microblock seg of the tile.
  const int srow = tid / kThreadsPerRow, seg = tid % kThreadsPerRow;
  const int squery = srow / Hq;  // >= 8 for padding rows: they attend nothing
  float row_max = kNegInf, row_sum = 0.f;

  // ---- P@V role: accumulator i of this warp is output tile warp + 16 i, i.e. M-tile
  // f_mt, d-tile f_dt (for D = 256: d-tile `warp` of every M-tile, as upstream).
  // Packed a byte per fragment: M-tile in bits 6..7, d-tile in bits 0..4; bit 5 set (and
  // M-tile, d-tile 0, valid addresses) when the warp has no such fragment.
  FragAcc acc[kMaxFrags];
  unsigned int frag_pos = 0;
#pragma unroll
  for (int i = 0; i < kMaxFrags; ++i) {
    wmma::fill_fragment(acc[i], 0.f);
    const int idx = warp + i * kWarps;
    const int mt = idx / d_tiles, dt = idx % d_tiles;
    frag_pos |= (mt < m_tiles ? (unsigned int)(mt << 6 | dt) : 0x20u) << (8 * i);
  }
  auto frag_ok = [&](int i) { return ((frag_pos >> (8 * i)) & 0x20u) == 0u; };
  // This warp's fragments are a prefix 0 .. n_frags-1 (output tile warp + 16 i exists
  // while it is below m_tiles * d_tiles).
  int n_frags = 0;
#pragma unroll
  for (int i = 0; i < kMaxFrags; ++i) n_frags += frag_ok(i) ? 1 : 0;
  auto frag_mt = [&](int i) { return (int)((frag_pos >> (8 * i + 6)) & 3u); };
  auto frag_dt = [&](int i) { return (int)((frag_pos >> (8 * i)) & 0x1Fu); };
  static_assert(kMaxMTiles <= 4 && kMaxHeadDim / kWmma <= 32, "fragment position packing");
  // Queries of each M-tile as mask nibbles, in shared memory: M-tile m is active in a
  // tile when the OR of the tile's masks has a bit in mtile_bits_s[m].
  if (tid < kMaxMTiles) {
    unsigned int bits = 0;
    if (tid < m_tiles)
      for (int qq = (tid * kWmma) / Hq; qq <= min(kQueries - 1, (tid * kWmma + kWmma - 1) / Hq); ++qq)
        bits |= 0xFu << (4 * qq);
    mtile_bits_s[tid] = bits;
  }
  __syncthreads();  // every warp has read the element map before Ss holds scores; mtile_bits_s is visible

  // ---- Panel loader role. Slot s of this thread is the 16-byte piece c = tid + s*512
  // of the panel: token j = c / per_row, first column (c % per_row) * kElems16.
  const int per_row = D / kElems16;
  const int panel_pieces = kTileTokens * per_row;
  const int page_size = p.page_size;
  const int mb_per_page = page_size / 4;
  const bool page_pow2 = (mb_per_page & (mb_per_page - 1)) == 0;
  const int mb_shift = __ffs(mb_per_page) - 1;
  const size_t row_bytes = (size_t)D * KvTraits<FMT>::kBytes;
  const size_t plane_bytes = (size_t)page_size * row_bytes;
  int slot_j[kSlots], slot_col[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int c = tid + s * kThreads;
    slot_j[s] = c < panel_pieces ? c / per_row : -1;
    slot_col[s] = (c % per_row) * kElems16;
  }
  // Global address of slot s's piece of microblock mb in the K plane (the V plane is
  // plane_bytes on). 32-bit index math (ids are int32); only the byte offset is 64-bit.
  auto piece_src = [&](int s, int mb) {
    const int page = page_pow2 ? (mb >> mb_shift) : mb / mb_per_page;
    const int in_page = (mb - page * mb_per_page) * 4 + (slot_j[s] & 3);
    return p.kv + ((size_t)page * 2 * page_size + in_page) * row_bytes + (size_t)slot_col[s] * KvTraits<FMT>::kBytes;
  };
  // Plan metadata of the next tile, read one tile ahead (see the file comment), kept as
  // the address each slot reads (nullptr: nothing to read, the piece stays zero), so the
  // address arithmetic runs while the current tile waits, not on the panel load's path.
  const unsigned char* next_src[kSlots];
  unsigned int next_tile_mask = 0;
  auto load_meta = [&](int t) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      next_src[s] = nullptr;
      const int j = slot_j[s];
      if (j >= 0 && t < n_tiles) {
        const int e = t * kEntriesPerTile + j / 4;
        const int mb = __ldg(mb_g + e);
        // VARIANT: fix C never reads a token that no query attends.
        const bool read = !kMasked || (__ldg(mask_g + e) & (0x11111111u << (j & 3))) != 0u;
        if (read && mb >= 0 && mb < p.n_microblocks) next_src[s] = piece_src(s, mb);
      }
    }
    if (tid < kEntriesPerTile) next_tile_mask = t < n_tiles ? __ldg(mask_g + t * kEntriesPerTile + tid) : 0u;
  };
  auto store_piece = [&](int s, uint4 raw) {
    __half* dst = KVs + slot_j[s] * ld + slot_col[s];
    if constexpr (FMT == kFP16) {
      *reinterpret_cast<uint4*>(dst) = raw;
    } else {
      // The piece is two 16-byte stores. Threads 4..7 of each 8 store their halves in the
      // other order, so the 8 first stores of a quarter-warp hit 8 different 16-byte bank
      // groups (in piece order they would hit 4, twice each: a 2-way conflict).
      const unsigned int swap = (tid >> 2) & 1u;
      const uint4 in = swap ? make_uint4(raw.z, raw.w, raw.x, raw.y) : raw;
      uint4 first, second;
      decode_fp8_16B<FMT>(in, first, second);
      reinterpret_cast<uint4*>(dst)[swap] = first;
      reinterpret_cast<uint4*>(dst)[swap ^ 1u] = second;
    }
  };
  // Fix A's zeroing pass: every 16-byte piece of a panel row no query attends, with a
  // thread mapping other than the loader's (as upstream), so without a barrier between
  // them a loader store of another thread may land after the zero.
  auto zero_unattended_rows = [&]() {
    constexpr int kThreadsPerRow16 = kThreads / kTileTokens;  // 16 threads per panel row
    const int j = tid / kThreadsPerRow16;
    if ((tile_mask_s[j / 4] & (0x11111111u << (j & 3))) == 0u)
      for (int c = (tid % kThreadsPerRow16) * 8; c < D; c += kThreadsPerRow16 * 8)
        *reinterpret_cast<uint4*>(KVs + j * ld + c) = make_uint4(0, 0, 0, 0);
  };

  load_meta(0);
  for (int t = 0; t < n_tiles; ++t) {
    const unsigned char* cur_src[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) cur_src[s] = next_src[s];
    if (tid < kEntriesPerTile) tile_mask_s[tid] = next_tile_mask;
    // Loop-invariant values the compiler would otherwise expand once into ~60 live
    // registers (every element's scale address, every slot's offsets): re-derived per
    // tile from these few words instead, which keeps the kernel under 128 registers
    // (512 threads) without spilling.
    asm volatile("" : "+r"(elem_row), "+r"(elem_col), "+r"(frag_pos), "+r"(row_pair));
#pragma unroll
    for (int s = 0; s < kSlots; ++s) asm volatile("" : "+r"(slot_j[s]), "+r"(slot_col[s]));

    // ---- 1. K panel (and, for kEarlyV only, the V bytes into registers).
    uint4 k_raw[kSlots], v_raw[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      k_raw[s] = v_raw[s] = make_uint4(0, 0, 0, 0);
      if (cur_src[s] != nullptr) {
        const unsigned char* src = cur_src[s];
        k_raw[s] = __ldg(reinterpret_cast<const uint4*>(src));
        if (kVEarly) v_raw[s] = __ldg(reinterpret_cast<const uint4*>(src + plane_bytes));  // VARIANT
      }
    }
    load_meta(t + 1);  // in flight during this tile; used by the next one
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
      if (slot_j[s] >= 0) store_piece(s, k_raw[s]);
    __syncthreads();  // B1: K panel and tile masks are visible to every warp
    if (kFixA) {  // VARIANT: fix A's K pass
      zero_unattended_rows();
      __syncthreads();  // A1: the zeroed K rows are visible to QK
    }

    // Active M-tiles of this tile (identical in every thread).
    static_assert(kEntriesPerTile == 8 && kMaxMTiles == 4, "masks read as two uint4, M-tile bits as one");
    const uint4 ma = reinterpret_cast<const uint4*>(tile_mask_s)[0], mb4 = reinterpret_cast<const uint4*>(tile_mask_s)[1];
    const unsigned int tile_or = ma.x | ma.y | ma.z | ma.w | mb4.x | mb4.y | mb4.z | mb4.w;
    const uint4 qb = reinterpret_cast<const uint4*>(mtile_bits_s)[0];
    const unsigned int active = ((tile_or & qb.x) != 0u ? 1u : 0u) | ((tile_or & qb.y) != 0u ? 2u : 0u) |
                                ((tile_or & qb.z) != 0u ? 4u : 0u) | ((tile_or & qb.w) != 0u ? 8u : 0u);

    // ---- 2. S = Q K^T (unscaled fp32): warp -> job (M-tile, n-tile) and k-half.
    {
      const int job = warp % kQkJobs, half = warp / kQkJobs;
      const int mt = job / kNTiles, nt = job % kNTiles;
      if (mt < m_tiles && ((active >> mt) & 1u)) {  // warp-uniform
        // This warp's k-steps: k0 .. k0 + nk - 1, alternating between two accumulators
        // (even / odd k-steps: the same fragment layout, added element-wise at the end),
        // which halves the dependent MMA chain. At the largest head_dim the steps are
        // straight-line code: one lane offset, constant steps, loads running ahead of
        // the MMAs (a per-step guard would make the compiler rebuild the address each step).
        const int k_per_half = (d_tiles + 1) / 2;
        const int k0 = half * k_per_half, nk = min(k_per_half, d_tiles - k0);
        const __half* qa = Qs + mt * kWmma * ld + k0 * kWmma;
        const __half* kb = KVs + nt * kWmma * ld + k0 * kWmma;
        FragAcc s_acc[2];
        wmma::fill_fragment(s_acc[0], 0.f);
        wmma::fill_fragment(s_acc[1], 0.f);
        auto qk_step = [&](int i, FragAcc& acc) {
          FragA a;
          FragKt b;
          wmma::load_matrix_sync(a, qa + i * kWmma, ld);
          wmma::load_matrix_sync(b, kb + i * kWmma, ld);
          wmma::mma_sync(acc, a, b, acc);
        };
        constexpr int kMaxSteps = kMaxHeadDim / kWmma / kKSplit;
        if (nk == kMaxSteps) {  // warp-uniform
#pragma unroll
          for (int i = 0; i < kMaxSteps; i += 2) {
            qk_step(i, s_acc[0]);
            qk_step(i + 1, s_acc[1]);
          }
        } else {
          for (int i = 0; i < nk; i += 2) {
            qk_step(i, s_acc[0]);
            if (i + 1 < nk) qk_step(i + 1, s_acc[1]);
          }
        }
#pragma unroll
        for (int e = 0; e < FragAcc::num_elements; ++e) s_acc[0].x[e] += s_acc[1].x[e];
        wmma::store_matrix_sync(Ss + half * L.s_half + mt * kWmma * kSLd + nt * kWmma, s_acc[0], kSLd,
                                wmma::mem_row_major);
      }
    }
    __syncthreads();  // B2: both k-halves of S are complete before the softmax reads them

    // ---- 3. Online softmax, as upstream: masking is a select to -1e30; fmaxf ignores a
    // NaN score, whose probability is then exp(-80) (0 in fp16); the row sum adds the
    // fp32 probabilities; max and sum move only when the tile adds mass (tile_sum > 0).
    // Rows of inactive M-tiles see no mask bit, so they change nothing (scale 1) and
    // their stale S is never used.
    if (srow < m_tiles * kWmma) {  // warp-uniform
      const unsigned int vis = squery < kQueries ? (tile_mask_s[seg] >> (4 * squery)) & 0xFu : 0u;
      const float4 a = *reinterpret_cast<const float4*>(Ss + srow * kSLd + seg * 4);
      const float4 b = *reinterpret_cast<const float4*>(Ss + L.s_half + srow * kSLd + seg * 4);
      float sc[kColsPerThread] = {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w};
      float tile_max = kNegInf;
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
        sc[c] = ((vis >> c) & 1u) ? sc[c] * p.qk_scale : kNegInf;
        tile_max = fmaxf(tile_max, sc[c]);
      }
#pragma unroll
      for (int off = 1; off < kThreadsPerRow; off *= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
      const float new_max = fmaxf(row_max, tile_max);
      float pr[kColsPerThread], tile_sum = 0.f;
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
        pr[c] = ((vis >> c) & 1u) ? exp_clamped(fmaxf(sc[c] - new_max, kExpFloor)) : 0.f;
        tile_sum += pr[c];
      }
#pragma unroll
      for (int off = 1; off < kThreadsPerRow; off *= 2) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, off);
      const float exp_diff = tile_sum > 0.f ? exp_clamped(fmaxf(row_max - new_max, kExpFloor)) : 1.f;
      const __half2 p01 = __floats2half2_rn(pr[0], pr[1]), p23 = __floats2half2_rn(pr[2], pr[3]);
      uint2 packed;
      packed.x = half2_to_bits(p01);
      packed.y = half2_to_bits(p23);
      *reinterpret_cast<uint2*>(Ps + srow * kPLd + seg * 4) = packed;
      if (tile_sum > 0.f) {
        row_sum = row_sum * exp_diff + tile_sum;
        row_max = new_max;
      }
      if (seg == 0) scale_s[srow] = exp_diff;
      // Per warp (4 rows of one M-tile): does any row rescale? P@V skips multiplying by
      // 1 (exact) for M-tiles whose running maxima all stayed put, most tiles of a walk.
      const bool moved = __any_sync(0xffffffffu, exp_diff != 1.f);
      if ((tid & 31) == 0) rescale_s[warp] = moved ? 1 : 0;
    }
    __syncthreads();  // B3: P and the row scales are complete; every warp is done with the K panel

    // ---- 4. V panel into the same buffer. Its global reads are issued first, so the
    // accumulator rescale below runs while they are in flight.
    if (!kVEarly) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s)
        if (cur_src[s] != nullptr) v_raw[s] = __ldg(reinterpret_cast<const uint4*>(cur_src[s] + plane_bytes));
    }
    {
      static_assert(kWmma * kThreadsPerRow / 32 == 4, "4 softmax warps (4 flag bytes) per M-tile");
      const unsigned int* flags = reinterpret_cast<const unsigned int*>(rescale_s);
#pragma unroll
      for (int i = 0; i < kMaxFrags; ++i) {
        // warp-uniform; inactive M-tiles (scale 1) and M-tiles whose rows all keep their max are skipped
        if (!frag_ok(i) || !((active >> frag_mt(i)) & 1u) || flags[frag_mt(i)] == 0u) continue;
        const float* row_scale = scale_s + frag_mt(i) * kWmma;
        if (row_pair >> 16) {
#pragma unroll
          for (int e = 0; e < FragAcc::num_elements; ++e) acc[i].x[e] *= row_scale[(elem_row >> (4 * e)) & 0xFu];
        } else {
          const float sa = row_scale[row_pair & 0xFu], sb = row_scale[(row_pair >> 4) & 0xFu];
#pragma unroll
          for (int e = 0; e < FragAcc::num_elements; ++e) acc[i].x[e] *= ((row_pair >> (8 + e)) & 1u) ? sb : sa;
        }
      }
    }
    bool v_nonfinite = false;  // finite_pv: a V element this thread stored is NaN or Inf
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
      if (slot_j[s] >= 0) {
        store_piece(s, v_raw[s]);
        if (kFinite) v_nonfinite |= nonfinite_16B<FMT>(v_raw[s]);  // VARIANT
      }
    if (kFixA) {  // VARIANT: fix A's V pass
      // VARIANT: kKernelFixNoLeadingBarrier omits A2 on purpose (racecheck demo).
      if (VARIANT == kKernelFix) __syncthreads();  // A2: every V store landed before any zeroing
      zero_unattended_rows();
    }
    bool tile_nonfinite = false;  // finite_pv: some V element of this tile is NaN or Inf (CTA-uniform)
    if (kFinite)  // VARIANT
      tile_nonfinite = __syncthreads_or(v_nonfinite) != 0;  // B4, and every thread learns the OR of the flags
    else
      __syncthreads();  // B4: the V panel (zeroed rows included, for fix A) is visible to P@V

    // ---- 4b. VARIANT: finite_pv on a tile whose V holds a NaN or Inf (CTA-uniform branch).
    // First each output element of an active M-tile adds the IEEE sum of p * v over the
    // non-finite v of its column that its row's query attends (NaN, +Inf or -Inf; 0 * Inf =
    // NaN for an attended token whose fp16 p is 0); then the panel's non-finite values become
    // 0, so P@V below multiplies finite values only. The sum is added before P@V instead of
    // after it: a non-finite accumulator stays the same non-finite class whatever finite
    // value is added, so the result is the one the emulation's order gives. Rare (a tile with
    // non-finite V), so written for clarity: one pass over the 32 tokens per element.
    if (kFinite && tile_nonfinite) {
      auto add_attended_nonfinite = [&](int i) {  // i is a constant at every call: acc[i] stays in registers
        if (!((active >> frag_mt(i)) & 1u)) return;  // warp-uniform: an inactive M-tile sees nothing of this tile
#pragma unroll
        for (int e = 0; e < FragAcc::num_elements; ++e) {
          const int row = frag_mt(i) * kWmma + ((elem_row >> (4 * e)) & 0xFu);
          const int col = frag_dt(i) * kWmma + ((elem_col >> (4 * e)) & 0xFu);
          const int query = row / Hq;  // >= 8 for padding rows: they attend nothing
          if (query >= kQueries) continue;
          float sum = 0.f;
          bool hit = false;
          for (int j = 0; j < kTileTokens; ++j) {
            const __half v = KVs[j * ld + col];
            if ((__half_as_ushort(v) & 0x7C00u) == 0x7C00u && ((tile_mask_s[j / 4] >> (4 * query + (j & 3))) & 1u)) {
              sum += __half2float(Ps[row * kPLd + j]) * __half2float(v);
              hit = true;
            }
          }
          if (hit) acc[i].x[e] += sum;
        }
      };
      switch (n_frags) {  // warp-uniform
        case 4: add_attended_nonfinite(0); add_attended_nonfinite(1); add_attended_nonfinite(2); add_attended_nonfinite(3); break;
        case 3: add_attended_nonfinite(0); add_attended_nonfinite(1); add_attended_nonfinite(2); break;
        case 2: add_attended_nonfinite(0); add_attended_nonfinite(1); break;
        case 1: add_attended_nonfinite(0); break;
        default: break;
      }
      __syncthreads();  // F1: every warp has read the raw V panel before any value of it becomes 0
      for (int c = tid; c < kTileTokens * D / 8; c += kThreads) {  // 8 halves at a time
        uint4* piece = reinterpret_cast<uint4*>(KVs + (c / (D / 8)) * ld + (c % (D / 8)) * 8);
        uint4 w = *piece;
        unsigned int* h = reinterpret_cast<unsigned int*>(&w);
        bool changed = false;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const unsigned int keep = ((h[k] & 0x7C00u) == 0x7C00u ? 0u : 0xFFFFu) |
                                    ((h[k] & 0x7C000000u) == 0x7C000000u ? 0u : 0xFFFF0000u);
          changed |= keep != 0xFFFFFFFFu;
          h[k] &= keep;
        }
        if (changed) *piece = w;
      }
      __syncthreads();  // F2: the panel with its non-finite values set to 0 is visible to P@V
    }

    // ---- 5. O += P V on the tensor cores. Every P, zero included, is multiplied:
    // 0 * NaN = NaN is the bug being reproduced, so nothing is skipped but inactive M-tiles.
    // The warp's fragments run as straight-line code (one copy per fragment count), so
    // their loads and MMAs interleave; an inactive M-tile's result is discarded by a
    // select (its rows must not see this tile, not even 0 * NaN).
    auto load_v = [&](int i, FragV (&vb)[2]) {
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) wmma::load_matrix_sync(vb[kk], KVs + kk * kWmma * ld + frag_dt(i) * kWmma, ld);
    };
    auto mma_frag = [&](int i, const FragV (&vb)[2]) {  // i is a constant at every call: acc[i] stays in registers
      FragA pa[2];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) wmma::load_matrix_sync(pa[kk], Ps + frag_mt(i) * kWmma * kPLd + kk * kWmma, kPLd);
      FragAcc sum = acc[i];
      wmma::mma_sync(sum, pa[0], vb[0], sum);
      wmma::mma_sync(sum, pa[1], vb[1], sum);
      const bool on = (active >> frag_mt(i)) & 1u;
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; ++e) acc[i].x[e] = on ? sum.x[e] : acc[i].x[e];
    };
    static_assert(kMaxFrags == 4, "one case per fragment count");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr bool kShareV = true;   // sm_80+: a V fragment is 4 registers per thread
#else
    constexpr bool kShareV = false;  // sm_70: WMMA keeps 8 per fragment; holding two through the loop spills
#endif
    if (kShareV && kWarps % d_tiles == 0) {  // warp-uniform: a warp's fragments share one d-tile: one V load
      FragV vb[2];
      load_v(0, vb);
      switch (n_frags) {  // warp-uniform, the same every tile
        case 4: mma_frag(0, vb); mma_frag(1, vb); mma_frag(2, vb); mma_frag(3, vb); break;
        case 3: mma_frag(0, vb); mma_frag(1, vb); mma_frag(2, vb); break;
        case 2: mma_frag(0, vb); mma_frag(1, vb); break;
        case 1: mma_frag(0, vb); break;
        default: break;
      }
    } else {
      auto p_at_v = [&](int i) {
        FragV vb[2];
        load_v(i, vb);
        mma_frag(i, vb);
      };
      switch (n_frags) {
        case 4: p_at_v(0); p_at_v(1); p_at_v(2); p_at_v(3); break;
        case 3: p_at_v(0); p_at_v(1); p_at_v(2); break;
        case 2: p_at_v(0); p_at_v(1); break;
        case 1: p_at_v(0); break;
        default: break;
      }
    }
    __syncthreads();  // B5: P@V is done with the panel, P and the tile masks before tile t+1 overwrites them
  }

  // ---- 6. out = O * v_scale / sum (0 when the sum is 0); lse = max + log(sum) (-1e30).
  if (seg == 0) {
    row_m_s[srow] = row_max;
    row_l_s[srow] = row_sum;
  }
  __syncthreads();  // row sums are visible to the warps that own the rows' outputs
#pragma unroll
  for (int i = 0; i < kMaxFrags; ++i) {
    if (!frag_ok(i)) continue;
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; ++e) {
      const int row = frag_mt(i) * kWmma + ((elem_row >> (4 * e)) & 0xFu);
      if (row >= score_rows) continue;
      const int col = frag_dt(i) * kWmma + ((elem_col >> (4 * e)) & 0xFu);
      const float l = row_l_s[row];
      const size_t o = (((size_t)g * kQueries + row / Hq) * Hq + row % Hq) * D + col;
      p.out[o] = __float2half_rn(l > 0.f ? acc[i].x[e] * p.v_scale / l : 0.f);
    }
  }
  if (p.lse != nullptr && seg == 0 && srow < score_rows)
    p.lse[((size_t)g * kQueries + squery) * Hq + srow % Hq] = row_sum > 0.f ? row_max + logf(row_sum) : kNegInf;
}

}  // namespace qsa
