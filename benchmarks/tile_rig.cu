// Kernel-tuning rig: times the grouped forward of one copy of csrc/ without torch, so a
// change to the kernel can be compiled on any machine with nvcc and timed on the GPU node
// in seconds (no extension build). Driven by benchmarks/tile_rig.py, which writes the
// cases and compares each build's output with the first build's.
//   tile_rig CASE_DIR OUT_DIR [REPS]
// CASE_DIR holds case0/, case1/, ... (meta.txt + raw arrays, written by tile_rig.py).
// Prints one line per variant: median us per launch, us per tile of the longest group.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "grouped_page4.cuh"

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

static std::vector<char> read_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) { std::fprintf(stderr, "cannot open %s\n", path.c_str()); std::exit(2); }
  std::fseek(f, 0, SEEK_END);
  const long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<char> buf(n);
  if (n && std::fread(buf.data(), 1, n, f) != (size_t)n) { std::fprintf(stderr, "short read %s\n", path.c_str()); std::exit(2); }
  std::fclose(f);
  return buf;
}

template <class T>
static T* upload(const std::string& path, size_t* count = nullptr) {
  const std::vector<char> host = read_file(path);
  void* dev = nullptr;
  CHECK(cudaMalloc(&dev, std::max<size_t>(host.size(), 16)));
  CHECK(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice));
  if (count) *count = host.size() / sizeof(T);
  return static_cast<T*>(dev);
}

struct Case {
  qsa::GroupedParams p{};
  int groups = 0, longest_tiles = 0;
  unsigned int smem = 0;
};

static Case load_case(const std::string& dir) {
  Case c;
  int rows, fmt;
  double qk_scale, v_scale;
  long long pages;
  FILE* f = std::fopen((dir + "/meta.txt").c_str(), "r");
  if (!f || std::fscanf(f, "%d %d %d %d %d %d %lld %d %lf %lf", &rows, &c.p.q_heads, &c.p.head_dim, &c.groups,
                        &c.p.cap, &c.p.page_size, &pages, &fmt, &qk_scale, &v_scale) != 10) {
    std::fprintf(stderr, "bad %s/meta.txt\n", dir.c_str());
    std::exit(2);
  }
  std::fclose(f);
  c.p.q = upload<__half>(dir + "/q.bin");
  c.p.kv = upload<unsigned char>(dir + "/kv.bin");
  c.p.group_rows = upload<long long>(dir + "/group_rows.bin");
  c.p.microblocks = upload<int>(dir + "/microblocks.bin");
  c.p.masks = upload<int>(dir + "/masks.bin");
  c.p.seq_len = upload<int>(dir + "/seq_len.bin");
  const std::vector<char> sl = read_file(dir + "/seq_len.bin");
  for (size_t i = 0; i < sl.size() / 4; ++i) c.longest_tiles = std::max(c.longest_tiles, reinterpret_cast<const int*>(sl.data())[i] / 32);
  CHECK(cudaMalloc(&c.p.out, (size_t)c.groups * 8 * c.p.q_heads * c.p.head_dim * 2));
  c.p.lse = nullptr;
  c.p.q_rows = rows;
  c.p.n_microblocks = pages * (c.p.page_size / 4);
  c.p.qk_scale = (float)qk_scale;
  c.p.v_scale = (float)v_scale;
  c.smem = qsa::grouped::smem_layout(c.p.q_heads, c.p.head_dim).total;
  return c;
}

using Kernel = void (*)(const qsa::GroupedParams);

int main(int argc, char** argv) {
  if (argc < 3) { std::fprintf(stderr, "usage: %s CASE_DIR OUT_DIR [REPS]\n", argv[0]); return 2; }
  const std::string cases_dir = argv[1], out_dir = argv[2];
  const int reps = argc > 3 ? std::atoi(argv[3]) : 30;
  std::vector<Case> cases;
  for (int i = 0;; ++i) {
    const std::string d = cases_dir + "/case" + std::to_string(i);
    FILE* probe = std::fopen((d + "/meta.txt").c_str(), "r");
    if (!probe) break;
    std::fclose(probe);
    cases.push_back(load_case(d));
  }
  if (cases.empty()) { std::fprintf(stderr, "no cases in %s\n", cases_dir.c_str()); return 2; }
  const struct { const char* name; Kernel k; } variants[] = {
      {"unfixed", qsa::grouped_page4_forward<qsa::kE4M3, qsa::kUnfixed>},
      {"kernel_fix", qsa::grouped_page4_forward<qsa::kE4M3, qsa::kKernelFix>},
      {"masked_load", qsa::grouped_page4_forward<qsa::kE4M3, qsa::kMaskedLoad>},
  };
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, 2 * (size_t)l2));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  double tiles = 0;
  for (const Case& c : cases) tiles += c.longest_tiles;
  tiles /= cases.size();
  for (const auto& v : variants) {
    CHECK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cases[0].smem));
    auto launch = [&](const Case& c) { v.k<<<c.groups, qsa::grouped::kThreads, c.smem>>>(c.p); };
    for (int i = 0; i < 5; ++i) launch(cases[i % cases.size()]);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    for (int flushed = 1; flushed >= 0; --flushed) {
      std::vector<float> ms;
      for (int i = 0; i < reps; ++i) {
        if (flushed) CHECK(cudaMemsetAsync(flush, i & 0xFF, 2 * (size_t)l2));
        CHECK(cudaEventRecord(t0));
        launch(cases[i % cases.size()]);
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float m = 0;
        CHECK(cudaEventElapsedTime(&m, t0, t1));
        ms.push_back(m);
      }
      CHECK(cudaGetLastError());
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2] * 1e3;
      std::printf("%-12s %-9s %9.2f us %7.3f us/tile (%.0f tiles)\n", v.name, flushed ? "L2-flush" : "L2-warm", med,
                  med / tiles, tiles);
    }
    launch(cases[0]);
    CHECK(cudaDeviceSynchronize());
    const Case& c = cases[0];
    std::vector<char> host((size_t)c.groups * 8 * c.p.q_heads * c.p.head_dim * 2);
    CHECK(cudaMemcpy(host.data(), c.p.out, host.size(), cudaMemcpyDeviceToHost));
    FILE* f = std::fopen((out_dir + "/out_" + v.name + ".bin").c_str(), "wb");
    if (!f || std::fwrite(host.data(), 1, host.size(), f) != host.size()) { std::fprintf(stderr, "cannot write output\n"); return 2; }
    std::fclose(f);
  }
  return 0;
}
