// Kernel-variant microbenchmark for the permute copy and the unpermute gather (bf16).
// Not part of the package: it times candidate launch shapes against the shipped ones on
// one set of random row maps, with cudaEvents, next to a cudaMemcpy ceiling.
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/variants benchmarks/micro/variants.cu && /tmp/variants
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "check.cuh"


// ---- permute copies ------------------------------------------------------------------
// P0: shipped copy_rows_kernel: blocks over (token, 512-vector chunk), 128 threads x 4 loads.
constexpr int kCopyThreads = 128, kUnroll = 4;
constexpr long kCopyChunk = long{kCopyThreads} * kUnroll;
__global__ void __launch_bounds__(kCopyThreads) p0(const uint4* hidden, const int* row_map, long tokens,
                                                   long K, long nvec, uint4* out) {
  const long chunks = (nvec + kCopyChunk - 1) / kCopyChunk;
  for (long u = blockIdx.x; u < tokens * chunks; u += gridDim.x) {
    const long t = u / chunks, v0 = (u % chunks) * kCopyChunk + threadIdx.x;
    const uint4* src = hidden + t * nvec;
    uint4 value[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (v0 + j * kCopyThreads < nvec) value[j] = src[v0 + j * kCopyThreads];
    const int* rm = row_map + t * K;
    for (long k = 0; k < K; ++k) {
      const long r = rm[k];
      if (r < 0) continue;
      uint4* dst = out + r * nvec;
#pragma unroll
      for (int j = 0; j < kUnroll; ++j)
        if (v0 + j * kCopyThreads < nvec) dst[v0 + j * kCopyThreads] = value[j];
    }
  }
}

// P1: grid (token, chunk of blockDim vectors), one vector per thread; kStream: .cs hints.
template <bool kStream>
__global__ void p1(const uint4* hidden, const int* row_map, long tokens, long K, long nvec, uint4* out) {
  const long v = blockIdx.y * long(blockDim.x) + threadIdx.x;
  if (v >= nvec) return;
  for (long t = blockIdx.x; t < tokens; t += gridDim.x) {
    const uint4 x = kStream ? __ldcs(hidden + t * nvec + v) : hidden[t * nvec + v];
    const int* rm = row_map + t * K;
    for (long k = 0; k < K; ++k) {
      const long r = rm[k];
      if (r < 0) continue;
      if (kStream) __stcs(out + r * nvec + v, x); else out[r * nvec + v] = x;
    }
  }
}

// P2: row indices first (all K in registers, up to 8), then one load, then K stores.
template <bool kStream>
__global__ void p2(const uint4* hidden, const int* row_map, long tokens, long K, long nvec, uint4* out) {
  const long v = blockIdx.y * long(blockDim.x) + threadIdx.x;
  if (v >= nvec) return;
  for (long t = blockIdx.x; t < tokens; t += gridDim.x) {
    int r[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) r[k] = k < K ? row_map[t * K + k] : -1;
    const uint4 x = kStream ? __ldcs(hidden + t * nvec + v) : hidden[t * nvec + v];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (r[k] >= 0) {
        if (kStream) __stcs(out + r[k] * long(nvec) + v, x); else out[r[k] * long(nvec) + v] = x;
      }
  }
}

// Ideal: token t's copies go to rows t*K..t*K+K-1 (no row map).
__global__ void p_ideal(const uint4* hidden, long tokens, long K, long nvec, uint4* out) {
  const long v = blockIdx.y * long(blockDim.x) + threadIdx.x;
  if (v >= nvec) return;
  for (long t = blockIdx.x; t < tokens; t += gridDim.x) {
    const uint4 x = hidden[t * nvec + v];
    for (long k = 0; k < K; ++k) out[(t * K + k) * nvec + v] = x;
  }
}

__global__ void fill_kernel(uint4* out, long n) {
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x)
    out[i] = uint4{0, 0, 0, 0};
}


// P4: bulk-copy engine. One warp per block, persistent over tokens: lane 0 loads each token
// row into one of kStages shared-memory buffers (cp.async.bulk, completing on an mbarrier),
// lane k then writes it to row_map[t, k] with a bulk store; a buffer is refilled once its
// stores have read it.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__global__ void __launch_bounds__(32) p4(const char* hidden, const int* row_map, long tokens, long K, long row_bytes,
                                        int stages, char* out) {
  extern __shared__ __align__(128) char buf[];
  __shared__ __align__(8) uint64_t bars[16];
  const int lane = threadIdx.x;
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  auto issue_load = [&](long t, int s) {
    const uint32_t bar = smem_u32(&bars[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(uint32_t(row_bytes)) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(buf + s * row_bytes)), "l"(hidden + t * row_bytes), "r"(uint32_t(row_bytes)), "r"(bar)
                 : "memory");
  };
  if (lane == 0)
    for (int s = 0; s < stages; ++s) {
      const long t = blockIdx.x + long(s) * gridDim.x;
      if (t < tokens) issue_load(t, s);
    }
  for (long i = 0;; ++i) {
    const long t = blockIdx.x + i * gridDim.x;
    if (t >= tokens) break;
    const int s = int(i % stages);
    const uint32_t parity = uint32_t((i / stages) & 1);
    int r[1];
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(smem_u32(&bars[s])), "r"(parity) : "memory");
    for (long k = lane; k < K; k += 32) {
      r[0] = row_map[t * K + k];
      if (r[0] >= 0)
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     ::"l"(out + long(r[0]) * row_bytes), "r"(smem_u32(buf + s * row_bytes)), "r"(uint32_t(row_bytes))
                     : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    __syncwarp();
    const long next = t + long(stages) * gridDim.x;
    if (lane == 0 && next < tokens) issue_load(next, s);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// ---- unpermute gathers ---------------------------------------------------------------
__device__ __forceinline__ void bf16x8_to_f32(const uint4 raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 f32_to_bf16x8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&p);
  }
  return uint4{w[0], w[1], w[2], w[3]};
}

// U0: shipped unpermute_kernel (bf16 in/out, float weights): grid (token, chunk of 128 vectors),
// four converted loads in flight.
__global__ void __launch_bounds__(128) u0(const uint4* x, const int* row_map, const float* w, long tokens, long K,
                                          long rows, long nvec, uint4* out) {
  const long v = blockIdx.y * 128L + threadIdx.x;
  if (v >= nvec) return;
  for (long t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int* rm = row_map + t * K;
    float acc[8] = {};
    for (long k0 = 0; k0 < K; k0 += 4) {
      float f[4][8], wk[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const long r = k0 + j < K ? rm[k0 + j] : -1;
        wk[j] = 0.0f;
        if (r >= 0 && r < rows) {
          bf16x8_to_f32(x[r * nvec + v], f[j]);
          wk[j] = w[t * K + k0 + j];
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) f[j][i] = 0.0f;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (k0 + j >= K) break;
        const long r = rm[k0 + j];
        if (r < 0 || r >= rows) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += wk[j] * f[j][i];
      }
    }
    out[t * nvec + v] = f32_to_bf16x8(acc);
  }
}

// U1: one vector per thread, grid (token, chunk of blockDim vectors); row indices and weights
// of kBatch entries first, then kBatch raw 16-byte loads in flight, then the float sums.
template <int kBatch, bool kStream>
__global__ void u1(const uint4* x, const int* row_map, const float* w, long tokens, long K, long rows, long nvec,
                   uint4* out) {
  const long v = blockIdx.y * long(blockDim.x) + threadIdx.x;
  if (v >= nvec) return;
  for (long t = blockIdx.x; t < tokens; t += gridDim.x) {
    float acc[8] = {};
    for (long k0 = 0; k0 < K; k0 += kBatch) {
      int r[kBatch];
      float wk[kBatch];
      uint4 raw[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        r[j] = k0 + j < K ? row_map[t * K + k0 + j] : -1;
        if (r[j] >= rows) r[j] = -1;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (r[j] >= 0) raw[j] = kStream ? __ldcs(x + r[j] * long(nvec) + v) : x[r[j] * long(nvec) + v];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) wk[j] = k0 + j < K ? w[t * K + k0 + j] : 0.0f;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (r[j] < 0) continue;
        float f[8];
        bf16x8_to_f32(raw[j], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += wk[j] * f[i];
      }
    }
    const uint4 o = f32_to_bf16x8(acc);
    if (kStream) __stcs(out + t * nvec + v, o); else out[t * nvec + v] = o;
  }
}

// ---- harness -------------------------------------------------------------------------
template <typename F>
float median_us(F launch, int reps = 30) {
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3f);
  }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int sms() {
  int n;
  CK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0));
  return n;
}

void report(const char* shape, const char* name, double bytes, float us, double ceiling_tbps) {
  const double tbps = bytes / (us * 1e-6) / 1e12;
  printf("%-22s %-26s %9.1f us %6.2f TB/s %5.1f%%\n", shape, name, us, tbps, 100.0 * tbps / ceiling_tbps);
}

struct Shape { const char* name; long T, K, H, E; };

int main() {
  const Shape shapes[] = {{"mixtral T=32768", 32768, 2, 4096, 8}, {"qwen3 T=16384", 16384, 8, 2048, 128},
                          {"deepseek T=16384", 16384, 8, 7168, 256}, {"mixtral T=4096", 4096, 2, 4096, 8},
                          {"qwen3 T=4096", 4096, 8, 2048, 128}, {"deepseek T=4096", 4096, 8, 7168, 256}};
  // Copy ceiling: 2 GiB device-to-device, read + write.
  const size_t cbytes = size_t(1) << 31;
  void *ca, *cb;
  CK(cudaMalloc(&ca, cbytes));
  CK(cudaMalloc(&cb, cbytes));
  fill_kernel<<<1024, 256>>>(static_cast<uint4*>(ca), cbytes / 16);
  const float copy_us = median_us([&] { CK(cudaMemcpyAsync(cb, ca, cbytes, cudaMemcpyDeviceToDevice)); });
  const double ceiling = 2.0 * cbytes / (copy_us * 1e-6) / 1e12;
  const float fill_us = median_us([&] { fill_kernel<<<sms() * 8, 256>>>(static_cast<uint4*>(cb), cbytes / 16); });
  printf("copy ceiling %.2f TB/s; write-only fill %.2f TB/s; %d SMs\n", ceiling,
         cbytes / (fill_us * 1e-6) / 1e12, sms());
  CK(cudaFree(ca));
  CK(cudaFree(cb));

  std::mt19937 rng(7);
  for (const Shape& s : shapes) {
    const long n = s.T * s.K, nvec = s.H / 8, row_bytes = s.H * 2;
    const double bytes = double(s.T) * s.H * 2 * (1 + s.K);
    // Random permutation of rows, and the row map a real routing gives: K distinct experts
    // per token, rows grouped by expert in flat-index order.
    std::vector<int> perm(n), routed(n), ids(n);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int> experts(s.E);
    std::iota(experts.begin(), experts.end(), 0);
    std::vector<long> count(s.E + 1, 0);
    for (long t = 0; t < s.T; ++t) {
      for (long k = 0; k < s.K; ++k) std::swap(experts[k], experts[k + rng() % (s.E - k)]);
      for (long k = 0; k < s.K; ++k) ids[t * s.K + k] = experts[k], ++count[experts[k] + 1];
    }
    for (long e = 0; e < s.E; ++e) count[e + 1] += count[e];
    for (long i = 0; i < n; ++i) routed[i] = int(count[ids[i]]++);
    std::vector<uint16_t> hx(n * s.H);
    std::uniform_int_distribution<int> bits(0x3c00, 0x3fff);  // bf16 values in [0.0078, 2)
    for (auto& e : hx) e = static_cast<uint16_t>(bits(rng));
    std::vector<float> hw(n);
    std::uniform_real_distribution<float> uw(0.1f, 1.0f);
    for (auto& e : hw) e = uw(rng);
    uint4 *hidden, *expanded, *out, *out_ref;
    int *row_map, *random_map;
    float* w;
    CK(cudaMalloc(&hidden, s.T * s.H * 2));
    CK(cudaMalloc(&expanded, n * s.H * 2));
    CK(cudaMalloc(&out, s.T * s.H * 2));
    CK(cudaMalloc(&out_ref, s.T * s.H * 2));
    CK(cudaMalloc(&row_map, n * 4));
    CK(cudaMalloc(&random_map, n * 4));
    CK(cudaMalloc(&w, n * 4));
    CK(cudaMemcpy(hidden, hx.data(), s.T * s.H * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(row_map, routed.data(), n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(random_map, perm.data(), n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w, hw.data(), n * 4, cudaMemcpyHostToDevice));
    const int big = 1 << 20;
    auto chunks = [&](int threads) { return unsigned((nvec + threads - 1) / threads); };
    const unsigned tokens_grid = unsigned(std::min<long>(s.T, big));
    char name[64];

    report(s.name, "P0 shipped", bytes, median_us([&] {
      const long units = s.T * ((nvec + kCopyChunk - 1) / kCopyChunk);
      p0<<<unsigned(std::min<long>(units, big)), kCopyThreads>>>(hidden, row_map, s.T, s.K, nvec, expanded);
    }), ceiling);
    report(s.name, "P0 shipped, random map", bytes, median_us([&] {
      const long units = s.T * ((nvec + kCopyChunk - 1) / kCopyChunk);
      p0<<<unsigned(std::min<long>(units, big)), kCopyThreads>>>(hidden, random_map, s.T, s.K, nvec, expanded);
    }), ceiling);
    report(s.name, "P1 128 thr .cs", bytes, median_us([&] {
      p1<true><<<dim3(tokens_grid, chunks(128)), 128>>>(hidden, row_map, s.T, s.K, nvec, expanded);
    }), ceiling);
    report(s.name, "P2 256 thr", bytes, median_us([&] {
      p2<false><<<dim3(tokens_grid, chunks(256)), 256>>>(hidden, row_map, s.T, s.K, nvec, expanded);
    }), ceiling);
    report(s.name, "P ideal rows 256 thr", bytes, median_us([&] {
      p_ideal<<<dim3(tokens_grid, chunks(256)), 256>>>(hidden, s.T, s.K, nvec, expanded);
    }), ceiling);
    std::vector<uint16_t> ref_rows(n * s.H), got_rows(n * s.H);
    CK(cudaMemset(expanded, 0, n * s.H * 2));
    p2<false><<<dim3(tokens_grid, chunks(256)), 256>>>(hidden, row_map, s.T, s.K, nvec, expanded);
    CK(cudaMemcpy(ref_rows.data(), expanded, n * s.H * 2, cudaMemcpyDeviceToHost));
    for (int stages : {2, 4, 8}) {
      const long smem = stages * row_bytes;
      if (smem > 200 * 1024) continue;
      CK(cudaFuncSetAttribute(p4, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      int per_sm = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, p4, 32, smem));
      for (int blocks_per_sm : {per_sm / 2, per_sm}) {
        if (blocks_per_sm < 1) continue;
        const unsigned grid = unsigned(std::min<long>(s.T, long(sms()) * blocks_per_sm));
        snprintf(name, sizeof name, "P4 bulk %d stages %d/SM", stages, blocks_per_sm);
        CK(cudaMemset(expanded, 0, n * s.H * 2));
        report(s.name, name, bytes, median_us([&] {
          p4<<<grid, 32, smem>>>(reinterpret_cast<const char*>(hidden), row_map, s.T, s.K, row_bytes, stages,
                                 reinterpret_cast<char*>(expanded));
        }), ceiling);
        CK(cudaMemcpy(got_rows.data(), expanded, n * s.H * 2, cudaMemcpyDeviceToHost));
        if (got_rows != ref_rows) printf("  MISMATCH %s\n", name);
      }
    }

    CK(cudaMemcpy(expanded, hx.data(), n * s.H * 2, cudaMemcpyHostToDevice));
    report(s.name, "U0 shipped, random map", bytes, median_us([&] {
      u0<<<dim3(tokens_grid, chunks(128)), 128>>>(expanded, random_map, w, s.T, s.K, n, nvec, out_ref);
    }), ceiling);
    report(s.name, "U0 shipped", bytes, median_us([&] {
      u0<<<dim3(tokens_grid, chunks(128)), 128>>>(expanded, row_map, w, s.T, s.K, n, nvec, out_ref);
    }), ceiling);
    std::vector<uint16_t> ref(s.T * s.H), got(s.T * s.H);
    CK(cudaMemcpy(ref.data(), out_ref, s.T * s.H * 2, cudaMemcpyDeviceToHost));
    auto check = [&](const char* name) {
      CK(cudaMemcpy(got.data(), out, s.T * s.H * 2, cudaMemcpyDeviceToHost));
      if (got != ref) printf("  MISMATCH %s\n", name);
      CK(cudaMemset(out, 0xff, s.T * s.H * 2));
    };
    for (int threads : {128, 256}) {
#define U1_CASE(B, S)                                                                                     \
  snprintf(name, sizeof name, "U1 %d thr batch %d%s", threads, B, S ? " .cs" : "");                        \
  report(s.name, name, bytes, median_us([&] {                                                             \
    u1<B, S><<<dim3(tokens_grid, chunks(threads)), threads>>>(expanded, row_map, w, s.T, s.K, n, nvec, out); \
  }), ceiling);                                                                                           \
  check(name);
      U1_CASE(2, false)
      U1_CASE(4, false)
      U1_CASE(8, false)
    }
    for (void* p : {(void*)hidden, (void*)expanded, (void*)out, (void*)out_ref, (void*)row_map, (void*)random_map,
                    (void*)w})
      CK(cudaFree(p));
  }
  return 0;
}
