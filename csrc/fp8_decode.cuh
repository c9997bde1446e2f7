// KV-cache code -> fp16 decoding, as the SM70 grouped page4 route does it (E4M3 fn and E5M2 codes, or fp16).
//
// Device code only: no torch headers, so NVRTC can compile it for compute_70
// (tests/tools/test_nvrtc_sm70.py). The scale is NOT applied here: the kernels fold
// k_scale into the score scale and v_scale into the output, like the real route.
#pragma once
#include <cuda_fp16.h>

namespace qsa {

// Storage formats of kv_cache. The numbers are part of the binding's interface.
enum KvFormat : int { kE4M3 = 0, kE5M2 = 1, kFP16 = 2 };

// Bytes of one stored element.
template <int FMT>
struct KvTraits {
  static_assert(FMT == kE4M3 || FMT == kE5M2 || FMT == kFP16, "unknown KV format");
  static constexpr int kBytes = (FMT == kFP16) ? 2 : 1;
  static constexpr int kElemsPer16B = 16 / kBytes;  // elements in one 16-byte load
};

// One E4M3 (fn variant) code -> fp16 bits, branch-free (XQA decodes element by
// element with it). Every E4M3 value is exact in fp16:
//   magnitude m = code & 0x7F placed at fp16 bits m << 7 reads as 2^-8 times the E4M3
//   value, normals and subnormals alike (fp16 keeps subnormals), so one exact fp16
//   multiply by 256 rebiases it; NaN 0x7F / 0xFF becomes fp16 0x7E00 / 0xFE00, the
//   real route's NaN; the sign bit moves from bit 7 to bit 15.
__device__ __forceinline__ unsigned int e4m3_to_half_bits(unsigned int code) {
  const unsigned int mag = code & 0x7Fu;
  const __half scaled = __hmul(__ushort_as_half((unsigned short)(mag << 7)), __ushort_as_half(0x5C00));  // x 256
  const unsigned int bits = mag == 0x7Fu ? 0x7E00u : (unsigned int)__half_as_ushort(scaled);
  return bits | ((code & 0x80u) << 8);
}

__device__ __forceinline__ __half2 bits_to_half2(unsigned int bits) {
  __half2 h;
  *reinterpret_cast<unsigned int*>(&h) = bits;
  return h;
}

__device__ __forceinline__ unsigned int half2_to_bits(__half2 h) { return *reinterpret_cast<unsigned int*>(&h); }

// Two E4M3 codes, one in the HIGH byte of each 16-bit lane of `hi` (low bytes zero),
// -> two fp16 (packed). Seven instructions per pair (PRMT to build `hi`, shift, and,
// HMUL2, HSET2, two LOP3), about half of a per-lane compare-and-select decoder: the
// panel loader runs it on every code of every tile, so it is on the tile's critical path.
//   magnitude at fp16 bits 7..13 (the sign bit 14 masked off) reads as 2^-8 x the E4M3
//   value, normals and subnormals alike; one exact multiply by 256 rebiases it;
//   magnitude 0x7F (E4M3 NaN) is 0x3F80 there, found by a lane-wise fp16 compare and
//   replaced by 0x7E00; the sign is already at bit 15 of each lane.
__device__ __forceinline__ unsigned int e4m3x2_hi_to_half2_bits(unsigned int hi) {
  const unsigned int mag = (hi >> 1) & 0x3F803F80u;
  const unsigned int scaled = half2_to_bits(__hmul2(bits_to_half2(mag), bits_to_half2(0x5C005C00u)));  // x 256
  const unsigned int nan = __heq2_mask(bits_to_half2(mag), bits_to_half2(0x3F803F80u));  // 0xFFFF per NaN lane
  return ((scaled & ~nan) | (0x7E007E00u & nan)) | (hi & 0x80008000u);
}

// E5M2 is the high byte of an fp16: Inf and NaN codes stay Inf and NaN.
__device__ __forceinline__ unsigned int e5m2_to_half_bits(unsigned int code) {
  return (code & 0xFFu) << 8;
}

// One stored element (1 byte for fp8, 2 for fp16) -> fp16 bits.
template <int FMT>
__device__ __forceinline__ unsigned int decode_bits(unsigned int raw) {
  if (FMT == kE4M3) return e4m3_to_half_bits(raw & 0xFFu);
  if (FMT == kE5M2) return e5m2_to_half_bits(raw);
  return raw & 0xFFFFu;
}

// Four fp8 codes packed little-endian in a word -> two words of fp16 pairs. A byte
// permute puts codes 0, 1 (then 2, 3) in the high bytes of the two lanes: that is
// already E5M2's fp16, and E4M3's input form above.
template <int FMT>
__device__ __forceinline__ void decode_word(unsigned int w, unsigned int& lo, unsigned int& hi) {
  const unsigned int codes01 = __byte_perm(w, 0u, 0x1404);  // bytes: 0, c0, 0, c1
  const unsigned int codes23 = __byte_perm(w, 0u, 0x3424);  // bytes: 0, c2, 0, c3
  if (FMT == kE4M3) {
    lo = e4m3x2_hi_to_half2_bits(codes01);
    hi = e4m3x2_hi_to_half2_bits(codes23);
  } else {
    lo = codes01;
    hi = codes23;
  }
}

// One 16-byte load of fp8 codes -> 16 fp16 values, as two 16-byte halves (codes 0..7
// in `first`, 8..15 in `second`).
template <int FMT>
__device__ __forceinline__ void decode_fp8_16B(uint4 raw, uint4& first, uint4& second) {
  static_assert(FMT == kE4M3 || FMT == kE5M2, "fp8 formats only");
  decode_word<FMT>(raw.x, first.x, first.y);
  decode_word<FMT>(raw.y, first.z, first.w);
  decode_word<FMT>(raw.z, second.x, second.y);
  decode_word<FMT>(raw.w, second.z, second.w);
}

// Whether one 16-byte load of stored elements holds a NaN or an Inf, from the codes alone:
// E4M3 NaN is 0x7F / 0xFF (no Inf), E5M2 and fp16 are non-finite when the exponent field is
// all ones. (x & m) ^ m has a zero byte (fp16: half) exactly at such an element, and the
// classic zero-lane test finds one (a borrow can only add lanes above a zero lane).
template <int FMT>
__device__ __forceinline__ bool nonfinite_16B(uint4 raw) {
  constexpr unsigned int m = FMT == kE4M3 ? 0x7F7F7F7Fu : FMT == kE5M2 ? 0x7C7C7C7Cu : 0x7C007C00u;
  constexpr unsigned int lo = FMT == kFP16 ? 0x00010001u : 0x01010101u;
  constexpr unsigned int hi = FMT == kFP16 ? 0x80008000u : 0x80808080u;
  const unsigned int a = (raw.x & m) ^ m, b = (raw.y & m) ^ m, c = (raw.z & m) ^ m, d = (raw.w & m) ^ m;
  return (((a - lo) & ~a) | ((b - lo) & ~b) | ((c - lo) & ~c) | ((d - lo) & ~d)) & hi;
}

// One 16-byte load of stored elements -> fp16 at dst (32 bytes for fp8, 16 for
// fp16). dst must be 16-byte aligned. The decode_panel debug binding uses it; the
// grouped panel loader uses decode_fp8_16B with its own store order.
template <int FMT>
__device__ __forceinline__ void store_decoded_16B(__half* dst, uint4 raw) {
  uint4* out = reinterpret_cast<uint4*>(dst);
  if constexpr (FMT == kFP16) {
    out[0] = raw;
  } else {
    uint4 a, b;
    decode_fp8_16B<FMT>(raw, a, b);
    out[0] = a;
    out[1] = b;
  }
}

// One element at p (a byte for fp8, an fp16 for fp16) -> float. Used by XQA.
template <int FMT>
__device__ __forceinline__ float decode_to_float(const unsigned char* p) {
  unsigned int raw;
  if (FMT == kFP16) {
    raw = *reinterpret_cast<const unsigned short*>(p);
  } else {
    raw = *p;
  }
  return __half2float(__ushort_as_half((unsigned short)decode_bits<FMT>(raw)));
}

// Debug kernel: decode whole microblocks (4 tokens each) of one plane with the
// same store_decoded_16B the forward kernels use.
//   kv:          [pages, 2, page_size, 1, head_dim] stored elements
//   microblocks: [n] physical microblock ids (checked by the binding)
//   out:         [n * 4, head_dim] fp16
template <int FMT>
__global__ void decode_panel_kernel(const unsigned char* __restrict__ kv,
                                    const int* __restrict__ microblocks, int n, int plane,
                                    int page_size, int head_dim, __half* __restrict__ out) {
  const int per_row = head_dim / KvTraits<FMT>::kElemsPer16B;
  const long long total = (long long)n * 4 * per_row;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / per_row;  // output row = microblock * 4 + token
    const int chunk = (int)(i % per_row);
    const long long token = (long long)microblocks[row / 4] * 4 + (row % 4);
    const long long page = token / page_size;
    const long long in_page = token % page_size;
    const size_t row_bytes = (size_t)head_dim * KvTraits<FMT>::kBytes;
    const unsigned char* src =
        kv + ((size_t)(page * 2 + plane) * page_size + in_page) * row_bytes + (size_t)chunk * 16;
    store_decoded_16B<FMT>(out + row * head_dim + (long long)chunk * KvTraits<FMT>::kElemsPer16B,
                           *reinterpret_cast<const uint4*>(src));
  }
}

}  // namespace qsa
