// Host glue: torch bindings for the device code in *.cuh.
//
// Every input is checked here (device, dtype, contiguity, shapes, head_dim,
// page_size, q_heads, index ranges) with a message naming the argument, so
// nothing reaches a kernel that could read outside its buffers. Range checks
// that need the data synchronise once (.item()); while a CUDA graph is being
// captured they cannot, and the kernels' own guards keep reads in bounds.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "fp8_decode.cuh"
#include "grouped_page4.cuh"
#include "xqa_page4.cuh"

namespace {

constexpr int kMaxQHeads = 8;
constexpr int kMaxHeadDim = 256;

// Messages are built from strings only (std::to_string, Device::str): on some hosts an
// extension that formats numbers through its own ostream crashes when c10 and the
// extension link different libstdc++ copies (seen with torch 2.11 + g++ 13).
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

std::string dtype_name(at::ScalarType s) { return c10::toString(s); }

bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), std::string(name) + ": expected a CUDA tensor, got device " + t.device().str());
  TORCH_CHECK(t.device() == device, std::string(name) + ": expected device " + device.str() + ", got " + t.device().str());
  TORCH_CHECK(t.is_contiguous(), std::string(name) + ": expected a contiguous tensor");
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype,
              std::string(name) + ": expected dtype " + dtype_name(dtype) + ", got " + dtype_name(t.scalar_type()));
}

// kv_cache: [pages, 2, page_size, 1, head_dim], uint8 codes (fp8) or fp16.
void check_kv_cache(const at::Tensor& kv, int kv_dtype, int head_dim, const at::Device& device) {
  check_cuda_tensor(kv, "kv_cache", device);
  TORCH_CHECK(kv_dtype >= qsa::kE4M3 && kv_dtype <= qsa::kFP16,
              "kv_dtype: expected 0 (e4m3), 1 (e5m2) or 2 (fp16), got " + num(kv_dtype));
  check_dtype(kv, "kv_cache", kv_dtype == qsa::kFP16 ? at::kHalf : at::kByte);
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(3) == 1,
              "kv_cache: expected shape [pages, 2, page_size, 1, head_dim], got " + shape(kv));
  TORCH_CHECK(kv.size(0) > 0, "kv_cache: expected at least one page");
  TORCH_CHECK(kv.size(2) > 0 && kv.size(2) % 4 == 0,
              "kv_cache: page_size (dim 2) must be a positive multiple of 4, got " + num(kv.size(2)));
  TORCH_CHECK(kv.size(4) == head_dim,
              "kv_cache: head_dim (dim 4) must be " + num(head_dim) + ", got " + num(kv.size(4)));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(kv.data_ptr()) % 16 == 0, "kv_cache: data must be 16-byte aligned");
}

void check_head_dim(int64_t head_dim, const char* name) {
  TORCH_CHECK(head_dim >= 16 && head_dim <= kMaxHeadDim && head_dim % 16 == 0,
              std::string(name) + ": head_dim must be a multiple of 16 in [16, 256], got " + num(head_dim));
}

// q: [rows, q_heads, head_dim] fp16.
void check_q(const at::Tensor& q, const char* name) {
  TORCH_CHECK(q.is_cuda(), std::string(name) + ": expected a CUDA tensor, got device " + q.device().str());
  TORCH_CHECK(q.is_contiguous(), std::string(name) + ": expected a contiguous tensor");
  check_dtype(q, name, at::kHalf);
  TORCH_CHECK(q.dim() == 3, std::string(name) + ": expected shape [rows, q_heads, head_dim], got " + shape(q));
  TORCH_CHECK(q.size(1) >= 1 && q.size(1) <= kMaxQHeads,
              std::string(name) + ": q_heads must be in [1, 8], got " + num(q.size(1)));
  check_head_dim(q.size(2), name);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0, std::string(name) + ": data must be 16-byte aligned");
}

// Fails with `message` when any element of `bad` is true (one host sync).
void check_none(const at::Tensor& bad, const std::string& message) {
  if (bad.numel() == 0) return;
  TORCH_CHECK(!bad.any().item<bool>(), message);
}

template <int FMT, int VARIANT>
void launch_grouped(const qsa::GroupedParams& p, int groups, unsigned int smem, cudaStream_t stream) {
  auto kernel = qsa::grouped_page4_forward<FMT, VARIANT>;
  // Above 48 KB of dynamic shared memory a kernel must opt in (V100 allows 96 KB).
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<groups, qsa::grouped::kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int FMT>
void dispatch_variant(int variant, const qsa::GroupedParams& p, int groups, unsigned int smem,
                      cudaStream_t stream) {
  switch (variant) {
    case qsa::kUnfixed: return launch_grouped<FMT, qsa::kUnfixed>(p, groups, smem, stream);
    case qsa::kKernelFix: return launch_grouped<FMT, qsa::kKernelFix>(p, groups, smem, stream);
    case qsa::kMaskedLoad: return launch_grouped<FMT, qsa::kMaskedLoad>(p, groups, smem, stream);
    case qsa::kKernelFixNoLeadingBarrier:
      return launch_grouped<FMT, qsa::kKernelFixNoLeadingBarrier>(p, groups, smem, stream);
    case qsa::kEarlyV: return launch_grouped<FMT, qsa::kEarlyV>(p, groups, smem, stream);
    case qsa::kFinitePv: return launch_grouped<FMT, qsa::kFinitePv>(p, groups, smem, stream);
    default: TORCH_CHECK(false, "variant: expected 0..5, got " + num(variant));
  }
}

// Returns (out [groups, 8, q_heads, head_dim] fp16, lse [groups, 8, q_heads] fp32 or empty).
std::vector<at::Tensor> grouped_forward(const at::Tensor& q, const at::Tensor& kv_cache, double k_scale,
                                        double v_scale, const at::Tensor& group_rows_in,
                                        const at::Tensor& microblocks, const at::Tensor& masks,
                                        const at::Tensor& seq_len, int64_t kv_dtype, double sm_scale,
                                        int64_t variant, bool return_lse) {
  check_q(q, "q");
  const at::Device device = q.device();
  const int q_heads = (int)q.size(1), head_dim = (int)q.size(2);
  check_kv_cache(kv_cache, (int)kv_dtype, head_dim, device);
  TORCH_CHECK(variant >= qsa::kUnfixed && variant <= qsa::kFinitePv, "variant: expected 0..5, got " + num(variant));
  check_cuda_tensor(group_rows_in, "group_rows", device);
  TORCH_CHECK(group_rows_in.scalar_type() == at::kLong || group_rows_in.scalar_type() == at::kInt,
              "group_rows: expected dtype int64 or int32, got " + dtype_name(group_rows_in.scalar_type()));
  TORCH_CHECK(group_rows_in.dim() == 2 && group_rows_in.size(1) == 8,
              "group_rows: expected shape [groups, 8], got " + shape(group_rows_in));
  const int64_t groups = group_rows_in.size(0);
  for (auto [t, name] : {std::pair{&microblocks, "microblocks"}, std::pair{&masks, "masks"}}) {
    check_cuda_tensor(*t, name, device);
    check_dtype(*t, name, at::kInt);
    TORCH_CHECK(t->dim() == 2 && t->size(0) == groups,
                std::string(name) + ": expected shape [groups=" + num(groups) + ", cap], got " + shape(*t));
  }
  TORCH_CHECK(masks.sizes() == microblocks.sizes(),
              "masks: expected the shape of microblocks " + shape(microblocks) + ", got " + shape(masks));
  check_cuda_tensor(seq_len, "seq_len", device);
  check_dtype(seq_len, "seq_len", at::kInt);
  TORCH_CHECK(seq_len.dim() == 1 && seq_len.size(0) == groups,
              "seq_len: expected shape [groups=" + num(groups) + "], got " + shape(seq_len));
  TORCH_CHECK(std::isfinite(k_scale) && std::isfinite(v_scale) && std::isfinite(sm_scale),
              "k_scale, v_scale, sm_scale: expected finite numbers");

  const int64_t cap = microblocks.size(1);
  const int64_t page_size = kv_cache.size(2);
  const int64_t n_microblocks = kv_cache.size(0) * (page_size / 4);
  const at::Tensor group_rows = group_rows_in.to(at::kLong);
  at::Tensor out = at::empty({groups, 8, q_heads, head_dim}, q.options());
  at::Tensor lse = return_lse ? at::empty({groups, 8, q_heads}, q.options().dtype(at::kFloat)) : at::Tensor();
  if (groups == 0) return {out, lse};

  // Data-dependent ranges (skipped while capturing a CUDA graph; see the file comment).
  if (!capturing()) {
    check_none((group_rows < -1) | (group_rows >= q.size(0)),
               "group_rows: every row index must be in [0, rows=" + std::to_string(q.size(0)) +
                   ") or -1 (an empty query slot of a padded group)");
    check_none((seq_len < 0) | (seq_len > 4 * cap) | (seq_len.remainder(32) != 0),
               "seq_len: every entry must be a multiple of 32 in [0, 4 * cap=" + std::to_string(4 * cap) + "]");
    if (cap > 0) {
      const at::Tensor used = at::arange(cap, seq_len.options()).unsqueeze(0) * 4 < seq_len.unsqueeze(1);
      check_none(used & ((microblocks < 0) | (microblocks >= n_microblocks)),
                 "microblocks: every used id must be in [0, pages * page_size / 4 = " +
                     std::to_string(n_microblocks) + ")");
    }
  }

  const c10::cuda::CUDAGuard guard(device);
  qsa::GroupedParams p;
  p.q = reinterpret_cast<const __half*>(q.data_ptr<at::Half>());
  p.kv = reinterpret_cast<const unsigned char*>(kv_cache.data_ptr());
  p.group_rows = reinterpret_cast<const long long*>(group_rows.data_ptr<int64_t>());
  p.microblocks = microblocks.data_ptr<int>();
  p.masks = masks.data_ptr<int>();
  p.seq_len = seq_len.data_ptr<int>();
  p.out = reinterpret_cast<__half*>(out.data_ptr<at::Half>());
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  p.q_heads = q_heads;
  p.head_dim = head_dim;
  p.page_size = (int)page_size;
  p.cap = (int)cap;
  p.q_rows = q.size(0);
  p.n_microblocks = n_microblocks;
  p.qk_scale = (float)(sm_scale * k_scale);
  p.v_scale = (float)v_scale;
  const unsigned int smem = qsa::grouped::smem_layout(q_heads, head_dim).total;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (kv_dtype) {
    case qsa::kE4M3: dispatch_variant<qsa::kE4M3>((int)variant, p, (int)groups, smem, stream); break;
    case qsa::kE5M2: dispatch_variant<qsa::kE5M2>((int)variant, p, (int)groups, smem, stream); break;
    default: dispatch_variant<qsa::kFP16>((int)variant, p, (int)groups, smem, stream); break;
  }
  return {out, lse};
}

template <int FMT>
void launch_xqa(const qsa::XqaParams& p, int n, cudaStream_t stream) {
  const unsigned int smem = qsa::xqa_smem_bytes(p.q_heads, p.head_dim, FMT);
  auto kernel = qsa::xqa_partition_kernel<FMT>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<dim3(p.parts, n), qsa::xqa::kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  qsa::xqa_reduce_kernel<FMT><<<n, qsa::xqa::kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Returns out [n, q_heads, head_dim] fp16.
at::Tensor xqa_forward(const at::Tensor& q_rows, const at::Tensor& kv_cache, double k_scale, double v_scale,
                       const at::Tensor& token_index, const at::Tensor& token_count, int64_t kv_dtype,
                       double sm_scale) {
  check_q(q_rows, "q_rows");
  const at::Device device = q_rows.device();
  const int64_t n = q_rows.size(0);
  const int q_heads = (int)q_rows.size(1), head_dim = (int)q_rows.size(2);
  check_kv_cache(kv_cache, (int)kv_dtype, head_dim, device);
  check_cuda_tensor(token_index, "token_index", device);
  check_dtype(token_index, "token_index", at::kLong);
  TORCH_CHECK(token_index.dim() == 2 && token_index.size(0) == n,
              "token_index: expected shape [n=" + num(n) + ", T], got " + shape(token_index));
  check_cuda_tensor(token_count, "token_count", device);
  check_dtype(token_count, "token_count", at::kInt);
  TORCH_CHECK(token_count.dim() == 1 && token_count.size(0) == n,
              "token_count: expected shape [n=" + num(n) + "], got " + shape(token_count));
  TORCH_CHECK(std::isfinite(k_scale) && std::isfinite(v_scale) && std::isfinite(sm_scale),
              "k_scale, v_scale, sm_scale: expected finite numbers");
  at::Tensor out = at::empty({n, q_heads, head_dim}, q_rows.options());
  const int64_t T = token_index.size(1);
  if (n == 0) return out;
  TORCH_CHECK(T > 0, "token_index: expected at least one slot per row");

  const int64_t n_tokens = kv_cache.size(0) * kv_cache.size(2);
  if (!capturing()) {  // data-dependent ranges; see the file comment
    check_none((token_count < 0) | (token_count > T),
               "token_count: every entry must be in [0, T=" + std::to_string(T) + "]");
    const at::Tensor used = at::arange(T, token_count.options()).unsqueeze(0) < token_count.unsqueeze(1);
    check_none(used & ((token_index < 0) | (token_index >= n_tokens)),
               "token_index: every real slot must be in [0, pages * page_size = " + std::to_string(n_tokens) + ")");
  }

  const c10::cuda::CUDAGuard guard(device);
  // Upstream's split: 256-token partitions with fp32 partials (fp8), 1024 with fp16 (fp16 KV).
  const int partition = qsa::xqa::partition_tokens((int)kv_dtype);
  const int parts = (int)((T + partition - 1) / partition);
  at::Tensor part_o = at::empty({n, parts, q_heads, head_dim},
                                q_rows.options().dtype(qsa::xqa::partial_bytes((int)kv_dtype) == 2 ? at::kHalf : at::kFloat));
  at::Tensor part_ml = at::empty({2, n, parts, q_heads}, q_rows.options().dtype(at::kFloat));
  qsa::XqaParams p;
  p.q = reinterpret_cast<const __half*>(q_rows.data_ptr<at::Half>());
  p.kv = reinterpret_cast<const unsigned char*>(kv_cache.data_ptr());
  p.token_index = reinterpret_cast<const long long*>(token_index.data_ptr<int64_t>());
  p.token_count = token_count.data_ptr<int>();
  p.part_o = part_o.data_ptr();
  p.part_m = part_ml[0].data_ptr<float>();
  p.part_l = part_ml[1].data_ptr<float>();
  p.out = reinterpret_cast<__half*>(out.data_ptr<at::Half>());
  p.q_heads = q_heads;
  p.head_dim = head_dim;
  p.page_size = (int)kv_cache.size(2);
  p.T = (int)T;
  p.parts = parts;
  p.n_tokens = n_tokens;
  p.qk_scale = (float)(sm_scale * k_scale);
  p.v_scale = (float)v_scale;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (kv_dtype) {
    case qsa::kE4M3: launch_xqa<qsa::kE4M3>(p, (int)n, stream); break;
    case qsa::kE5M2: launch_xqa<qsa::kE5M2>(p, (int)n, stream); break;
    default: launch_xqa<qsa::kFP16>(p, (int)n, stream); break;
  }
  return out;
}

// Returns [len(microblocks) * 4, head_dim] fp16: the tokens as the kernels decode them (no scale).
at::Tensor decode_panel(const at::Tensor& kv_cache, const at::Tensor& microblocks, int64_t plane,
                        int64_t kv_dtype) {
  TORCH_CHECK(kv_cache.dim() == 5, "kv_cache: expected shape [pages, 2, page_size, 1, head_dim], got " + shape(kv_cache));
  const int head_dim = (int)kv_cache.size(4);
  check_head_dim(head_dim, "kv_cache");
  check_kv_cache(kv_cache, (int)kv_dtype, head_dim, kv_cache.device());
  check_cuda_tensor(microblocks, "microblocks", kv_cache.device());
  check_dtype(microblocks, "microblocks", at::kInt);
  TORCH_CHECK(microblocks.dim() == 1, "microblocks: expected shape [n], got " + shape(microblocks));
  TORCH_CHECK(plane == 0 || plane == 1, "plane: expected 0 (K) or 1 (V), got " + num(plane));
  const int64_t n = microblocks.size(0);
  const int64_t n_microblocks = kv_cache.size(0) * (kv_cache.size(2) / 4);
  at::Tensor out = at::empty({n * 4, head_dim}, kv_cache.options().dtype(at::kHalf));
  if (n == 0) return out;
  // This debug binding has no in-kernel guard: its range check always synchronises.
  TORCH_CHECK(!capturing(), "decode_panel: not capturable in a CUDA graph");
  TORCH_CHECK(!((microblocks < 0) | (microblocks >= n_microblocks)).any().item<bool>(),
              "microblocks: every id must be in [0, pages * page_size / 4 = " + num(n_microblocks) + ")");
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int threads = 256;
  const int blocks = (int)std::min<int64_t>((n * 4 * head_dim / 8 + threads - 1) / threads, 4096);
  const auto* kv = reinterpret_cast<const unsigned char*>(kv_cache.data_ptr());
  auto* o = reinterpret_cast<__half*>(out.data_ptr<at::Half>());
  const int page_size = (int)kv_cache.size(2);
  switch (kv_dtype) {
    case qsa::kE4M3:
      qsa::decode_panel_kernel<qsa::kE4M3><<<blocks, threads, 0, stream>>>(
          kv, microblocks.data_ptr<int>(), (int)n, (int)plane, page_size, head_dim, o);
      break;
    case qsa::kE5M2:
      qsa::decode_panel_kernel<qsa::kE5M2><<<blocks, threads, 0, stream>>>(
          kv, microblocks.data_ptr<int>(), (int)n, (int)plane, page_size, head_dim, o);
      break;
    default:
      qsa::decode_panel_kernel<qsa::kFP16><<<blocks, threads, 0, stream>>>(
          kv, microblocks.data_ptr<int>(), (int)n, (int)plane, page_size, head_dim, o);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qsa_lab compiled kernels: grouped page4 forward (unfixed / fix A / fix C / early V), XQA page4, decoder";
  m.def("grouped_forward", &grouped_forward, "grouped page4 forward (see qsa_lab.kernels.grouped_forward)");
  m.def("xqa_forward", &xqa_forward, "row-wise XQA page4 forward (see qsa_lab.kernels.xqa_forward)");
  m.def("decode_panel", &decode_panel, "decode microblocks with the kernels' decoder (debug)");
}
