// Row-wise XQA page4 route (SPEC §3): the clean comparison route.
//
// Each row reads only its token_count real tokens (unused slots hold INT64_MAX,
// sorted last, and are never touched), so the null block is never read.
// Tokens are split into partitions of 256: xqa_partition_kernel writes fp32
// partials (max, sum, unnormalised O) per (row, partition, head), and
// xqa_reduce_kernel merges them. CUDA cores only: this route is the reference
// for the grouped kernel's finite values, not a speed record.
//
// Device code only (no torch headers): NVRTC compiles it for compute_70.
#pragma once
#include <cuda_fp16.h>

#include "fp8_decode.cuh"

namespace qsa {
namespace xqa {
constexpr int kPartition = 256;  // tokens per partition (the real route's split)
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeads = 8;
constexpr int kMaxHeadDim = 256;
static_assert(kWarps == kMaxHeads, "softmax: one warp per head");
static_assert(kThreads >= kMaxHeadDim, "P@V: one thread per head dim");
}  // namespace xqa

struct XqaParams {
  const __half* q;                // [n, q_heads, head_dim]
  const unsigned char* kv;        // [pages, 2, page_size, 1, head_dim]
  const long long* token_index;   // [n, T] physical token = page * page_size + in_page
  const int* token_count;         // [n] real tokens per row (<= T)
  float* part_o;                  // [n, parts, q_heads, head_dim] scratch
  float* part_m;                  // [n, parts, q_heads]
  float* part_l;                  // [n, parts, q_heads]
  __half* out;                    // [n, q_heads, head_dim]
  int q_heads, head_dim, page_size, T, parts;
  long long n_tokens;             // pages * page_size
  float qk_scale;                 // sm_scale * k_scale
  float v_scale;
};

// Shared memory: q [heads][D] f32 | p [heads][256] f32 | token byte offsets [256].
__host__ __device__ inline unsigned int xqa_smem_bytes(int q_heads, int head_dim) {
  return (unsigned int)(q_heads * head_dim * 4 + q_heads * xqa::kPartition * 4 + xqa::kPartition * 8);
}

// grid (parts, n): partition blockIdx.x of row blockIdx.y.
template <int FMT>
__global__ void __launch_bounds__(xqa::kThreads) xqa_partition_kernel(const XqaParams p) {
  using namespace xqa;
  extern __shared__ __align__(128) unsigned char smem[];
  const int Hq = p.q_heads, D = p.head_dim;
  long long* tok_off = reinterpret_cast<long long*>(smem);  // byte offset of the token's K row
  float* q_s = reinterpret_cast<float*>(smem + kPartition * 8);
  float* p_s = q_s + Hq * D;

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
    }
  }
  __syncthreads();  // probabilities replace the scores before P@V reads them

  // Partial O = sum_i p_i * v_i (fp32), one thread per head dim, all heads at once.
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
      if (h < Hq) p.part_o[(((size_t)row * p.parts + part) * Hq + h) * D + d] = o[h];
  }
}

// grid (n): merge the partitions of row blockIdx.x; out = O * v_scale / l.
__global__ void __launch_bounds__(xqa::kThreads) xqa_reduce_kernel(const XqaParams p) {
  const int row = blockIdx.x, Hq = p.q_heads, D = p.head_dim;
  const int used = (min(p.token_count[row], p.T) + xqa::kPartition - 1) / xqa::kPartition;
  for (int i = threadIdx.x; i < Hq * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    float m = __int_as_float(0xff800000u);  // -inf
    for (int part = 0; part < used; ++part)
      m = fmaxf(m, p.part_m[((size_t)row * p.parts + part) * Hq + h]);
    float o = 0.f, l = 0.f;
    for (int part = 0; part < used; ++part) {
      const size_t s = ((size_t)row * p.parts + part) * Hq + h;
      const float w = expf(p.part_m[s] - m);
      o += w * p.part_o[s * D + d];
      l += w * p.part_l[s];
    }
    p.out[(size_t)row * Hq * D + i] = __float2half_rn(o * p.v_scale / l);
  }
}

}  // namespace qsa
