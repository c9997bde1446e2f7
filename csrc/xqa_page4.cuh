// Row-wise XQA page4 route: the clean comparison route.
//
// Each row reads only its token_count real tokens (unused slots hold INT64_MAX,
// sorted last, and are never touched), so the null block is never read.
// Tokens are split into partitions as upstream splits them: 256 tokens with fp32
// partials for fp8 caches, 1024 tokens with fp16 partials for fp16 caches.
// xqa_partition_kernel<FMT> writes, per (row, partition, head), the partition's
// normalised output O_p * v_scale / l_p in the partial dtype plus its max logit m_p
// and exp sum l_p (fp32); xqa_reduce_kernel<FMT> weighs partition p by
// exp(m_p - M) * l_p (M the max over partitions) and divides by the sum of the weights.
// CUDA cores only: this route is the reference for the grouped kernel's finite
// values, not a speed record.
//
// Device code only (no torch headers): NVRTC compiles it for compute_70.
#pragma once
#include <cuda_fp16.h>

#include "fp8_decode.cuh"

namespace qsa {
namespace xqa {
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeads = 8;
constexpr int kMaxHeadDim = 256;
static_assert(kWarps == kMaxHeads, "softmax: one warp per head");
static_assert(kThreads >= kMaxHeadDim, "P@V: one thread per head dim");

// Tokens per partition and the partials' dtype, per KV format (upstream's split).
// (A local type switch: NVRTC builds have no <type_traits>.)
template <bool HALF> struct PartialType { using type = float; };
template <> struct PartialType<true> { using type = __half; };
template <int FMT>
struct Partition {
  static constexpr int kTokens = FMT == kFP16 ? 1024 : 256;
  using Partial = typename PartialType<FMT == kFP16>::type;
};
__host__ __device__ constexpr int partition_tokens(int kv_dtype) { return kv_dtype == kFP16 ? 1024 : 256; }
__host__ __device__ constexpr int partial_bytes(int kv_dtype) { return kv_dtype == kFP16 ? 2 : 4; }
static_assert(Partition<kFP16>::kTokens == partition_tokens(kFP16) &&
              Partition<kE4M3>::kTokens == partition_tokens(kE4M3), "one partition size per format");

__device__ __forceinline__ float partial_to_float(float x) { return x; }
__device__ __forceinline__ float partial_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ void store_partial(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void store_partial(__half* dst, float x) { *dst = __float2half_rn(x); }
}  // namespace xqa

// Arguments of both XQA kernels (plain C: pointers, int, long long, float).
struct XqaParams {
  const __half* q;                // [n, q_heads, head_dim]
  const unsigned char* kv;        // [pages, 2, page_size, 1, head_dim]
  const long long* token_index;   // [n, T] physical token = page * page_size + in_page
  const int* token_count;         // [n] real tokens per row (<= T)
  void* part_o;                   // [n, parts, q_heads, head_dim] normalised partials:
                                  //   fp32 (fp8 KV) or fp16 (fp16 KV), see xqa::Partition
  float* part_m;                  // [n, parts, q_heads]
  float* part_l;                  // [n, parts, q_heads]
  __half* out;                    // [n, q_heads, head_dim]
  int q_heads, head_dim, page_size, T, parts;  // parts = ceil(T / partition_tokens(format))
  long long n_tokens;             // pages * page_size
  float qk_scale;                 // sm_scale * k_scale
  float v_scale;
};

// Shared memory: token byte offsets [P] | q [heads][D] f32 | p [heads][P] f32.
__host__ __device__ inline unsigned int xqa_smem_bytes(int q_heads, int head_dim, int kv_dtype) {
  const int P = xqa::partition_tokens(kv_dtype);
  return (unsigned int)(P * 8 + q_heads * head_dim * 4 + q_heads * P * 4);
}

// grid (parts, n): partition blockIdx.x of row blockIdx.y.
template <int FMT>
__global__ void __launch_bounds__(xqa::kThreads) xqa_partition_kernel(const XqaParams p) {
  using namespace xqa;
  constexpr int kPartition = Partition<FMT>::kTokens;
  using Partial = typename Partition<FMT>::Partial;
  extern __shared__ __align__(128) unsigned char smem[];
  const int Hq = p.q_heads, D = p.head_dim;
  long long* tok_off = reinterpret_cast<long long*>(smem);  // byte offset of the token's K row
  float* q_s = reinterpret_cast<float*>(smem + kPartition * 8);
  float* p_s = q_s + Hq * D;
  float* l_s = q_s;  // reused after the scores: the heads' exp sums (q is no longer read)

  const int row = blockIdx.y, part = blockIdx.x;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int begin = part * kPartition;
  const int n_tok = min(kPartition, min(p.token_count[row], p.T) - begin);
  if (n_tok <= 0) return;  // the reduce only reads partitions holding tokens

  const size_t row_bytes = (size_t)D * KvTraits<FMT>::kBytes;
  const size_t plane_bytes = (size_t)p.page_size * row_bytes;
  for (int i = tid; i < Hq * D; i += kThreads) q_s[i] = __half2float(p.q[(size_t)row * Hq * D + i]);
  for (int i = tid; i < n_tok; i += kThreads) {
    const long long token = p.token_index[(size_t)row * p.T + begin + i];
    const long long page = token / p.page_size, in_page = token % p.page_size;
    // The binding rejects out-of-range tokens; -1 (skip the token) only keeps a
    // CUDA-graph replay, where it cannot look at the data, inside the buffer.
    tok_off[i] = (token >= 0 && token < p.n_tokens)
                     ? page * 2 * (long long)plane_bytes + in_page * (long long)row_bytes : -1;
  }
  __syncthreads();  // q and token offsets are visible to every warp

  // Scores: one warp per token, lanes stride the head dims, then a warp sum.
  for (int i = warp; i < n_tok; i += kWarps) {
    if (tok_off[i] < 0) {  // warp-uniform
      if (lane < Hq) p_s[lane * kPartition + i] = __int_as_float(0xff800000u);  // -inf: p = 0
      continue;
    }
    const unsigned char* k_row = p.kv + tok_off[i];
    float acc[kMaxHeads];
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) acc[h] = 0.f;
    for (int d = lane; d < D; d += 32) {
      const float k = decode_to_float<FMT>(k_row + (size_t)d * KvTraits<FMT>::kBytes);
#pragma unroll
      for (int h = 0; h < kMaxHeads; ++h)
        if (h < Hq) acc[h] += q_s[h * D + d] * k;
    }
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      float v = acc[h];
      for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0 && h < Hq) p_s[h * kPartition + i] = v * p.qk_scale;
    }
  }
  __syncthreads();  // all scores are written before the per-head softmax

  // Partition softmax: warp h handles head h; p = exp(s - m_p) in fp32.
  if (warp < Hq) {
    float* ph = p_s + warp * kPartition;
    float m = __int_as_float(0xff800000u);  // -inf
    for (int i = lane; i < n_tok; i += 32) m = fmaxf(m, ph[i]);
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float l = 0.f;
    for (int i = lane; i < n_tok; i += 32) {
      const float e = expf(ph[i] - m);
      ph[i] = e;
      l += e;
    }
    for (int off = 16; off > 0; off /= 2) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) {
      const size_t o = ((size_t)row * p.parts + part) * Hq + warp;
      p.part_m[o] = m;
      p.part_l[o] = l;
      l_s[warp] = l;
    }
  }
  __syncthreads();  // probabilities replace the scores, and the exp sums are shared, before P@V

  // Partial O = sum_i p_i * v_i (fp32), one thread per head dim, all heads at once;
  // stored normalised (O * v_scale / l) in the partial dtype.
  Partial* part_o = reinterpret_cast<Partial*>(p.part_o);
  for (int d = tid; d < D; d += kThreads) {
    float o[kMaxHeads];
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) o[h] = 0.f;
    // Unrolled so several independent V loads are in flight: the loop is latency-bound.
#pragma unroll 8
    for (int i = 0; i < n_tok; ++i) {
      if (tok_off[i] < 0) continue;
      const float v = decode_to_float<FMT>(p.kv + tok_off[i] + plane_bytes + (size_t)d * KvTraits<FMT>::kBytes);
#pragma unroll
      for (int h = 0; h < kMaxHeads; ++h)
        if (h < Hq) o[h] += p_s[h * kPartition + i] * v;
    }
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h)
      if (h < Hq)
        store_partial(part_o + (((size_t)row * p.parts + part) * Hq + h) * D + d, o[h] * p.v_scale / l_s[h]);
  }
}

// grid (n): merge the partitions of row blockIdx.x: out = sum_p w_p * partial_p / sum_p w_p,
// w_p = exp(m_p - M) * l_p.
template <int FMT>
__global__ void __launch_bounds__(xqa::kThreads) xqa_reduce_kernel(const XqaParams p) {
  using Partial = typename xqa::Partition<FMT>::Partial;
  const int row = blockIdx.x, Hq = p.q_heads, D = p.head_dim;
  const int used = (min(p.token_count[row], p.T) + xqa::Partition<FMT>::kTokens - 1) / xqa::Partition<FMT>::kTokens;
  const Partial* part_o = reinterpret_cast<const Partial*>(p.part_o);
  for (int i = threadIdx.x; i < Hq * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    float m = __int_as_float(0xff800000u);  // -inf
    for (int part = 0; part < used; ++part)
      m = fmaxf(m, p.part_m[((size_t)row * p.parts + part) * Hq + h]);
    float o = 0.f, wsum = 0.f;
    for (int part = 0; part < used; ++part) {
      const size_t s = ((size_t)row * p.parts + part) * Hq + h;
      const float w = expf(p.part_m[s] - m) * p.part_l[s];
      o += w * xqa::partial_to_float(part_o[s * D + d]);
      wsum += w;
    }
    p.out[(size_t)row * Hq * D + i] = __float2half_rn(o / wsum);
  }
}

}  // namespace qsa
