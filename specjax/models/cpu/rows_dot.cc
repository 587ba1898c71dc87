// y[M, N] = x[M, K] @ W[K, N] for a few activation rows (a decode or verify block), with W packed
// as [N/16, K, 16]: each block of 16 output columns is one contiguous stream over k.
//
// A decode step and a verify step are bound by reading the weights. XLA:CPU's dot streams them
// at 19 GB/s for one row and 10-12 GB/s for 5-16 rows (benchmarks/roofline.py), which is what
// makes verifying K drafts cost 1.6-1.9x a decode step. Here every weight is read once, in order,
// for up to 12 rows held in registers (more rows re-read a block from L2, not from memory), the
// column blocks are split between XLA's own intra-op threads, and each output is summed over k
// in one order that does not depend on M: a row's result is bit-identical whether it is
// computed alone or in a verify block.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPECJAX_RELAX() _mm_pause()
#else
#define SPECJAX_RELAX() std::this_thread::yield()
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;     // columns per packed block
constexpr int64_t kRowTile = 12;   // rows held in registers at once (2 x 12 accumulators)
constexpr int64_t kChunk = 4;      // column blocks per task

// Runs f(c) for c in [0, n) on the calling thread and XLA's intra-op pool. Chunks are claimed
// from a shared counter, so the caller never waits for a task no thread has started (the pool
// may be busy, or the caller may be its only thread); the state outlives late helpers.
template <typename F>
void parallel_chunks(ffi::ThreadPool& pool, int64_t n, F f) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  auto run = [st, n, f]() {
    for (int64_t c; (c = st->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      f(c);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(run)(run));  // a copy each (Schedule takes F&&)
  run();
  while (st->done.load(std::memory_order_acquire) < n) SPECJAX_RELAX();
}

// Column blocks [b0, b1) of y. Each output is a sum over k in increasing order, one FMA per k.
void blocks(const float* __restrict x, const float* __restrict wp, float* __restrict y, int64_t M, int64_t K,
            int64_t N, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two = b + 1 < b1;
    const float* __restrict w0 = wp + b * K * kLanes;
    const float* __restrict w1 = w0 + K * kLanes;
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int64_t mm = std::min(kRowTile, M - m0);
#if defined(__AVX512F__)
      __m512 a0[kRowTile], a1[kRowTile];
      for (int i = 0; i < kRowTile; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const __m512 v0 = _mm512_loadu_ps(w0 + k * kLanes);
        const __m512 v1 = two ? _mm512_loadu_ps(w1 + k * kLanes) : _mm512_setzero_ps();
#pragma GCC unroll 12
        for (int i = 0; i < kRowTile; ++i) {
          if (i < mm) {
            const __m512 xb = _mm512_set1_ps(x[(m0 + i) * K + k]);
            a0[i] = _mm512_fmadd_ps(xb, v0, a0[i]);
            a1[i] = _mm512_fmadd_ps(xb, v1, a1[i]);
          }
        }
      }
      for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
        const int64_t col = (b + h) * kLanes, width = std::min(kLanes, N - col);
        const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
        for (int64_t i = 0; i < mm; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N + col, keep, h ? a1[i] : a0[i]);
      }
#else
      float a[2][kRowTile][kLanes] = {};
      for (int64_t k = 0; k < K; ++k)
        for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
          const float* __restrict v = (h ? w1 : w0) + k * kLanes;
          for (int64_t i = 0; i < mm; ++i) {
            const float xi = x[(m0 + i) * K + k];
            for (int64_t l = 0; l < kLanes; ++l) a[h][i][l] = __builtin_fmaf(xi, v[l], a[h][i][l]);
          }
        }
      for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
        const int64_t col = (b + h) * kLanes, width = std::min(kLanes, N - col);
        for (int64_t i = 0; i < mm; ++i) std::memcpy(y + (m0 + i) * N + col, a[h][i], sizeof(float) * width);
      }
#endif
    }
  }
}

ffi::Error RowsPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = wp.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kLanes || wd[1] != xd[1] ||
      yd[0] != xd[0] || (yd[1] + kLanes - 1) / kLanes != wd[0])
    return ffi::Error::InvalidArgument("rows_packed: expected x [M, K], w [ceil(N/16), K, 16], y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1], nb = wd[0];
  const float *xp = x.typed_data(), *w = wp.typed_data();
  float* out = y->typed_data();
  parallel_chunks(pool, (nb + kChunk - 1) / kChunk, [=](int64_t c) {
    blocks(xp, w, out, M, K, N, c * kChunk, std::min(nb, (c + 1) * kChunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowsPacked, RowsPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
