// y[M, N] = x[M, K] @ W[K, N] for a few activation rows (a decode or verify block), with W packed
// per block of 16 output columns, each block one contiguous stream over k. Three weight formats:
//   f32:  [N/16, K, 16] float32;
//   q4_1: GGUF Q4_1 kept as it is stored (32 k per group, w = q * d + m, q a 4-bit code, d and m
//         float16 per column and group): codes [N/16, K/32, 16, 16] bytes (byte kk of a group holds
//         k = kk in its low nibble and k = kk + 16 in its high one, for 16 columns), scales
//         [N/16, K/32, 2, 16] float16 (d, then m);
//   q8_0: GGUF Q8_0 (w = q * d, q int8): codes [N/16, K/32, 32, 16] int8, scales [N/16, K/32, 16].
// The int8 and bfloat16 activation paths (below) read the GGUF codes in a paired layout: rows k and
// k + 1 of a block interleaved per column, codes [N/16, K/32, 8 | 16, 32] (q4_1 | q8_0).
//
// A decode step and a verify step are bound by reading the weights. XLA:CPU's dot streams them
// at 19 GB/s for one row and 10-12 GB/s for 5-16 rows (benchmarks/roofline.py), which is what
// makes verifying K drafts cost 1.6-1.9x a decode step. Here every weight is read once, in order,
// for up to 12 rows held in registers (more rows re-read a block from L2, not from memory), the
// column blocks are split between XLA's own intra-op threads, and each output is summed over k
// in one order that does not depend on M: a row's result is bit-identical whether it is
// computed alone or in a verify block. The GGUF formats read 4.6-8.5 bits a weight instead of 32
// and decode in registers to exactly the float32 values the loader's dequantization gives
// (q * d is exact in float32, so one fused q * d + m rounds as numpy's multiply-then-add does).
// Three builds of the same sums: AVX-512 (a block is one __m512), AVX2 + FMA + F16C (a block is
// two __m256 halves, rows in register sub-tiles of 3), and portable loops; every one does the same
// FMAs per output in the same order, so all three give the same bits.

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <memory>
#include <thread>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECJAX_AVX2 1  // each 16-lane block as two __m256 halves (lanes 0-7, 8-15)
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPECJAX_RELAX() _mm_pause()
#else
#define SPECJAX_RELAX() std::this_thread::yield()
#endif

#include "rows_dot_ffi.h"

// The handlers speak XLA's FFI C API directly, through the few types below (named as in
// xla/ffi/api/ffi.h, which the kernels were first written against). That header's binding
// templates took about 5 s of g++ on a 2-core machine, more than the kernels themselves: a
// cold start waited for them. The checks are the ones its binding made: operand and result
// counts, buffer element types.
namespace ffi {

enum DataType : int {
  F32 = XLA_FFI_DataType_F32, F16 = XLA_FFI_DataType_F16, S32 = XLA_FFI_DataType_S32,
  PRED = XLA_FFI_DataType_PRED, S8 = XLA_FFI_DataType_S8, U8 = XLA_FFI_DataType_U8,
  ANY = XLA_FFI_DataType_INVALID,  // an AnyBuffer's "type": not checked
};

template <int T> struct Native;
template <> struct Native<F32> { using type = float; };
template <> struct Native<F16> { using type = uint16_t; };
template <> struct Native<S32> { using type = int32_t; };
template <> struct Native<PRED> { using type = bool; };

class Error {
 public:
  static Error Success() { return Error(XLA_FFI_Error_Code_OK, ""); }
  static Error InvalidArgument(const char* msg) { return Error(XLA_FFI_Error_Code_INVALID_ARGUMENT, msg); }
  bool failure() const { return code_ != XLA_FFI_Error_Code_OK; }
  XLA_FFI_Error_Code code() const { return code_; }
  const char* message() const { return msg_; }  // (a string literal: outlives the call)

 private:
  Error(XLA_FFI_Error_Code code, const char* msg) : code_(code), msg_(msg) {}
  XLA_FFI_Error_Code code_;
  const char* msg_;
};

class Dims {  // a buffer's dimensions
 public:
  Dims(const int64_t* d, int64_t n) : d_(d), n_(n) {}
  size_t size() const { return static_cast<size_t>(n_); }
  int64_t operator[](size_t i) const { return d_[i]; }
  const int64_t* begin() const { return d_; }
  const int64_t* end() const { return d_ + n_; }

 private:
  const int64_t* d_;
  int64_t n_;
};

class AnyBuffer {
 public:
  explicit AnyBuffer(void* b) : b_(static_cast<XLA_FFI_Buffer*>(b)) {}
  Dims dimensions() const { return Dims(b_->dims, b_->rank); }
  DataType element_type() const { return static_cast<DataType>(b_->dtype); }
  void* untyped_data() const { return b_->data; }

 protected:
  XLA_FFI_Buffer* b_;
};

template <int T>
class Buffer : public AnyBuffer {
 public:
  using AnyBuffer::AnyBuffer;
  typename Native<T>::type* typed_data() const { return static_cast<typename Native<T>::type*>(b_->data); }
  const Buffer* operator->() const { return this; }  // (a result is used as ffi.h's ResultBuffer was)
};

template <int T>
using ResultBuffer = Buffer<T>;

class ThreadPool {  // XLA's intra-op pool
 public:
  ThreadPool(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx) : api_(api), ctx_(ctx) {}

  int64_t num_threads() const {
    int64_t n = 0;
    XLA_FFI_ThreadPool_NumThreads_Args a{XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE, nullptr, ctx_, &n};
    return Ok(api_->XLA_FFI_ThreadPool_NumThreads(&a)) ? n : 0;
  }

  // Runs a copy of f on a pool thread; where the pool refuses, f does not run (every caller
  // here also does the work itself: parallel_chunks).
  template <typename F>
  void Schedule(F&& f) {
    using Task = typename std::decay<F>::type;
    Task* task = new Task(std::forward<F>(f));
    XLA_FFI_ThreadPool_Schedule_Args a{XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE, nullptr, ctx_,
                                       [](void* data) {
                                         Task* t = static_cast<Task*>(data);
                                         (*t)();
                                         delete t;
                                       },
                                       task};
    if (!Ok(api_->XLA_FFI_ThreadPool_Schedule(&a))) delete task;
  }

 private:
  bool Ok(XLA_FFI_Error* e) const {
    if (e == nullptr) return true;
    XLA_FFI_Error_Destroy_Args d{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr, e};
    api_->XLA_FFI_Error_Destroy(&d);
    return false;
  }
  const XLA_FFI_Api* api_;
  XLA_FFI_ExecutionContext* ctx_;
};

// One call: answers XLA's registration query (the metadata extension), checks the operands'
// and results' counts and element types, and turns a failed ffi::Error into XLA's.
class Call {
 public:
  explicit Call(XLA_FFI_CallFrame* f) : f_(f) {}

  void* arg(int i) const { return view_[i] != nullptr ? view_[i] : f_->args.args[i]; }
  void* ret(int i) const { return f_->rets.rets[i]; }
  ThreadPool pool() const { return ThreadPool(f_->api, f_->ctx); }

  // False: a metadata query answered (error() is null) or bad operands (error() says which).
  // `extra`: operands after the typed ones that the caller checks (Layered's layer index).
  bool Runnable(std::initializer_list<int> args, std::initializer_list<int> rets, int64_t extra = 0) {
    if (specjax_answer_metadata(f_)) return false;
    if (f_->stage != XLA_FFI_ExecutionStage_EXECUTE) return Fail("called outside the execute stage");
    if (f_->args.size != static_cast<int64_t>(args.size()) + extra ||
        f_->rets.size != static_cast<int64_t>(rets.size()))
      return Fail("wrong number of operands or results");
    int i = 0;
    for (int t : args) {
      if (f_->args.types[i] != XLA_FFI_ArgType_BUFFER ||
          (t != ANY && static_cast<XLA_FFI_Buffer*>(f_->args.args[i])->dtype != t))
        return Fail("wrong operand element type");
      ++i;
    }
    i = 0;
    for (int t : rets) {
      if (f_->rets.types[i] != XLA_FFI_RetType_BUFFER || static_cast<XLA_FFI_Buffer*>(f_->rets.rets[i])->dtype != t)
        return Fail("wrong result element type");
      ++i;
    }
    return true;
  }

  // Runnable for a call whose operands from `stacked_from` on may come as stacks [L, ...] of one
  // weight per layer, followed by one more operand, the layer index (an int32 scalar): arg() then
  // gives layer i of each stack as a buffer of its own, a pointer into the stack and no copy (a
  // scanned forward reads layer i's weights this way, ForwardOptions.scan_layers). Without the
  // index operand the operands are the layer's own.
  bool RunnableLayered(std::initializer_list<int> args, std::initializer_list<int> rets, int stacked_from) {
    const int64_t n = static_cast<int64_t>(args.size());
    if (f_->stage != XLA_FFI_ExecutionStage_EXECUTE || f_->args.size != n + 1) return Runnable(args, rets);
    if (!Runnable(args, rets, 1)) return false;
    const XLA_FFI_Buffer* li = static_cast<XLA_FFI_Buffer*>(f_->args.args[n]);
    if (f_->args.types[n] != XLA_FFI_ArgType_BUFFER || li->dtype != XLA_FFI_DataType_S32 || li->rank != 0)
      return Fail("the layer operand must be an int32 scalar");
    const int64_t layer = *static_cast<const int32_t*>(li->data);
    for (int64_t i = stacked_from; i < n; ++i) {
      const XLA_FFI_Buffer* b = static_cast<XLA_FFI_Buffer*>(f_->args.args[i]);
      if (b->rank < 1 || layer < 0 || layer >= b->dims[0]) return Fail("layer index outside the stacked weights");
      int64_t per_layer = ElementBytes(b->dtype);
      for (int64_t d = 1; d < b->rank; ++d) per_layer *= b->dims[d];
      views_[i] = *b;
      views_[i].rank = b->rank - 1;
      views_[i].dims = b->dims + 1;
      views_[i].data = static_cast<char*>(b->data) + layer * per_layer;
      view_[i] = &views_[i];
    }
    return true;
  }

  XLA_FFI_Error* Result(const Error& e) const { return e.failure() ? Make(e.code(), e.message()) : error_; }
  XLA_FFI_Error* error() const { return error_; }

 private:
  bool Fail(const char* msg) {
    error_ = Make(XLA_FFI_Error_Code_INVALID_ARGUMENT, msg);
    return false;
  }
  XLA_FFI_Error* Make(XLA_FFI_Error_Code code, const char* msg) const {
    XLA_FFI_Error_Create_Args a{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr, msg, code};
    return f_->api->XLA_FFI_Error_Create(&a);
  }
  static int64_t ElementBytes(int dtype) {
    switch (dtype) {
      case XLA_FFI_DataType_F32: case XLA_FFI_DataType_S32: return 4;
      case XLA_FFI_DataType_F16: return 2;
      default: return 1;  // S8, U8, PRED
    }
  }
  static constexpr int kMaxArgs = 8;
  XLA_FFI_CallFrame* f_;
  XLA_FFI_Error* error_ = nullptr;
  XLA_FFI_Buffer views_[kMaxArgs] = {};
  void* view_[kMaxArgs] = {};
};

}  // namespace ffi

namespace {

constexpr int64_t kLanes = 16;     // columns per packed block
constexpr int64_t kRowTile = 12;   // rows held in registers at once (2 x 12 accumulators)
constexpr int64_t kChunk = 4;      // column blocks per task
#if defined(SPECJAX_AVX2)
constexpr int kRowTile2 = 3;       // AVX2: rows per register sub-tile (at most 3 x 4 of the 16 ymm)
#endif

// A call of at most this many activation rows (an int8 or bfloat16 projection's rows, the
// attention's block tokens) runs on the calling thread alone (specjax_set_solo_rows; rows_dot.set_solo_rows). On
// the 2-vCPU AVX-512 EPYC, whose vCPUs share one core's units, waking XLA's helper for each of a
// decode step's ~150 calls cost more than it bought: plain decoding 1.05-1.09x faster with both
// alone (the projections alone: no faster), blocks of 4 and more rows slower (BENCHMARKS.md). The
// outputs are the same bits either way.
std::atomic<int64_t> g_solo_rows{0};

// Runs f(c) for c in [0, n) on the calling thread and XLA's intra-op pool (the caller alone for
// `rows` <= g_solo_rows). Chunks are claimed from a shared counter, so the caller never waits for
// a task no thread has started (the pool may be busy, or the caller may be its only thread); the
// state outlives late helpers.
template <typename F>
void parallel_chunks(ffi::ThreadPool& pool, int64_t n, F f, int64_t rows = INT64_MAX) {
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
  int64_t helpers = rows <= g_solo_rows.load(std::memory_order_relaxed) ? 0 : std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(run)(run));  // a copy each (Schedule takes F&&)
  run();
  while (st->done.load(std::memory_order_acquire) < n) SPECJAX_RELAX();
}

// float16 bits -> float32 (the scalar path; the AVX-512 one converts 16 at once).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: value man * 2^-24, exact in float32
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Stores the accumulators of one row tile for column blocks b (and b + 1 when `two`).
inline void store_tile(float* __restrict y, const float (*a)[kRowTile][kLanes], int64_t m0, int64_t mm, int64_t N,
                       int64_t b, bool two) {
  for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
    const int64_t col = (b + h) * kLanes, width = std::min(kLanes, N - col);
    for (int64_t i = 0; i < mm; ++i) std::memcpy(y + (m0 + i) * N + col, a[h][i], sizeof(float) * width);
  }
}

#if defined(__AVX512F__)
inline void store_tile(float* __restrict y, const __m512* a0, const __m512* a1, int64_t m0, int64_t mm, int64_t N,
                       int64_t b, bool two) {
  for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
    const int64_t col = (b + h) * kLanes, width = std::min(kLanes, N - col);
    const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
    for (int64_t i = 0; i < mm; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N + col, keep, h ? a1[i] : a0[i]);
  }
}

// tile(std::integral_constant<int, R>{}) for R = rr, 1 <= rr <= Max: a register tile's row count as
// a compile-time constant (its accumulators an array the compiler keeps in registers).
template <int Max, typename T>
inline void with_rows(int64_t rr, T tile) {
  if constexpr (Max > 1) {
    if (rr < Max) return with_rows<Max - 1>(rr, tile);
  }
  tile(std::integral_constant<int, Max>{});
}

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc{0,1}[i] += x[i, k] * v{0,1} for the tile's rows.
#define SPECJAX_ROWS_FMA(k, v0, v1)                                   \
  _Pragma("GCC unroll 12") for (int i = 0; i < kRowTile; ++i) {       \
    if (i < mm) {                                                     \
      const __m512 xb = _mm512_set1_ps(x[(m0 + i) * K + (k)]);        \
      a0[i] = _mm512_fmadd_ps(xb, v0, a0[i]);                         \
      a1[i] = _mm512_fmadd_ps(xb, v1, a1[i]);                         \
    }                                                                 \
  }
#elif defined(SPECJAX_AVX2)
// Stores sub-tile accumulators a[i][0..3] (block b lanes 0-7, 8-15; block b + 1 likewise) of rows
// [m0, m0 + mm) for column blocks b (and b + 1 when `two`).
inline void store_tile(float* __restrict y, const __m256 (*a)[4], int64_t m0, int64_t mm, int64_t N, int64_t b,
                       bool two) {
  for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
    const int64_t col = (b + h) * kLanes, width = std::min(kLanes, N - col);
    for (int64_t i = 0; i < mm; ++i) {
      float* __restrict out = y + (m0 + i) * N + col;
      if (width == kLanes) {
        _mm256_storeu_ps(out, a[i][2 * h]);
        _mm256_storeu_ps(out + 8, a[i][2 * h + 1]);
      } else {
        alignas(32) float t[kLanes];
        _mm256_store_ps(t, a[i][2 * h]);
        _mm256_store_ps(t + 8, a[i][2 * h + 1]);
        std::memcpy(out, t, sizeof(float) * width);
      }
    }
  }
}

inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

// a[i][j] += x[r0 + i, k] * v_j for the sub-tile's R rows (v0, v1: block b; v2, v3: block b + 1).
#define SPECJAX_ROWS_FMA2(k, v0, v1, v2, v3)                              \
  _Pragma("GCC unroll 3") for (int i = 0; i < R; ++i) {                   \
    const __m256 xb = _mm256_set1_ps(x[(r0 + i) * K + (k)]);              \
    a[i][0] = _mm256_fmadd_ps(xb, v0, a[i][0]);                           \
    a[i][1] = _mm256_fmadd_ps(xb, v1, a[i][1]);                           \
    a[i][2] = _mm256_fmadd_ps(xb, v2, a[i][2]);                           \
    a[i][3] = _mm256_fmadd_ps(xb, v3, a[i][3]);                           \
  }

// Runs tile(r0, std::integral_constant<int, R>) for sub-tiles [r0, r0 + R), R <= kRowTile2, of [m0, m0 + mm),
// so the accumulators of a one-row decode step are 4 registers, not 12. Every output is one chain
// of dependent FMAs (its fixed order over k), so a sub-tile of R rows keeps 4 R chains in flight:
// one row (4) cannot cover the FMA latency, two (8) can. Past one row, sub-tiles are 3 or 2 rows,
// never 1 (4 rows: 2 + 2, not 3 + 1, which took 1.5x the time of 3 rows on an AVX2 EPYC).
template <typename T>
inline void row_subtiles(int64_t m0, int64_t mm, T tile) {
  for (int64_t r0 = m0; r0 < m0 + mm; ) {
    const int64_t rest = m0 + mm - r0, rr = rest == 4 ? 2 : std::min<int64_t>(kRowTile2, rest);
    if (rr == 1) tile(r0, std::integral_constant<int, 1>{});
    else if (rr == 2) tile(r0, std::integral_constant<int, 2>{});
    else tile(r0, std::integral_constant<int, 3>{});
    r0 += rr;
  }
}
#endif

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
        SPECJAX_ROWS_FMA(k, v0, v1)
      }
      store_tile(y, a0, a1, m0, mm, N, b, two);
#elif defined(SPECJAX_AVX2)
      row_subtiles(m0, mm, [&](int64_t r0, auto rows) {
        constexpr int R = decltype(rows)::value;
        __m256 a[R][4];
        for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
        const __m256 zero = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; ++k) {
          const __m256 v0 = _mm256_loadu_ps(w0 + k * kLanes), v1 = _mm256_loadu_ps(w0 + k * kLanes + 8);
          const __m256 v2 = two ? _mm256_loadu_ps(w1 + k * kLanes) : zero;
          const __m256 v3 = two ? _mm256_loadu_ps(w1 + k * kLanes + 8) : zero;
          SPECJAX_ROWS_FMA2(k, v0, v1, v2, v3)
        }
        store_tile(y, a, r0, R, N, b, two);
      });
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
      store_tile(y, a, m0, mm, N, b, two);
#endif
    }
  }
}

// A decode step streams its weights from memory once (96 MB on SmolLM2, no reuse), and one core's
// hardware prefetchers alone kept the tiles at 27-31 GB/s: every path (float32, int8, bfloat16)
// asks for the codes and scale line of the group kPrefetchBytes of codes ahead of the one it
// decodes (past its column block's last group: the next block's, which follows it; a prefetch
// never faults). 16 KB ahead took the AVX-512 EPYC's bfloat16 decode step from 4.5 to 3.7 ms
// (4 KB: 4.1, 32 KB: 3.8) and its float32 one from 6.7-6.9 to 5.3-5.7 ms; the AVX2 build's
// float32 chain of projections there from 9.4 to 6.9 ms.
constexpr int64_t kPrefetchBytes = 16384;

template <bool Q8>
inline void prefetch_ahead(const uint8_t* qb, const uint16_t* sb, int64_t g) {
  constexpr int64_t kCodeBytes = Q8 ? 32 * kLanes : 16 * kLanes, kScaleBytes = (Q8 ? 1 : 2) * kLanes * 2;
  constexpr int64_t ahead = kPrefetchBytes / kCodeBytes;
  const uint8_t* c = qb + (g + ahead) * kCodeBytes;
  for (int64_t l = 0; l < kCodeBytes; l += 64) __builtin_prefetch(c + l, 0, 3);
  __builtin_prefetch(reinterpret_cast<const uint8_t*>(sb) + (g + ahead) * kScaleBytes, 0, 3);
}

#if defined(SPECJAX_AVX2)
// AVX2: decodes group g of column blocks b (codes q0, scales s0) and b + 1 (q1, s1; zeros unless
// `two`) and hands each k's four vectors (block b lanes 0-7, 8-15, block b + 1 likewise) to
// sink(k within the group, v0, v1, v2, v3) in the order every path sums them: q8_0 k = 0..31,
// q4_1 k = kk, kk + 16 for kk = 0..15 (a code byte's two nibbles).
template <bool Q8, typename Sink>
inline void decode_group(const uint8_t* __restrict q0, const uint8_t* __restrict q1, const uint16_t* __restrict s0,
                         const uint16_t* __restrict s1, int64_t g, bool two, Sink sink) {
  constexpr int64_t kCodes = Q8 ? 32 * kLanes : 16 * kLanes;  // bytes of codes per group and block
  constexpr int64_t kScales = Q8 ? kLanes : 2 * kLanes;       // float16 scales per group and block
  prefetch_ahead<Q8>(q0, s0, g);
  if (two) prefetch_ahead<Q8>(q1, s1, g);
  const __m256 zero = _mm256_setzero_ps();
  const uint8_t* __restrict c0 = q0 + g * kCodes;
  const uint8_t* __restrict c1 = q1 + g * kCodes;
  const uint16_t* __restrict e0 = s0 + g * kScales;
  const uint16_t* __restrict e1 = s1 + g * kScales;
  const __m256 d0 = half8(e0), d1 = half8(e0 + 8);
  const __m256 d2 = two ? half8(e1) : zero, d3 = two ? half8(e1 + 8) : zero;
  if constexpr (Q8) {
    for (int64_t kk = 0; kk < 32; ++kk) {
      const uint8_t* p0 = c0 + kk * kLanes;
      const uint8_t* p1 = c1 + kk * kLanes;
      sink(kk, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p0))), d0),
           _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p0 + 8))), d1),
           two ? _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p1))), d2) : zero,
           two ? _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p1 + 8))), d3) : zero);
    }
  } else {
    const __m256 n0 = half8(e0 + kLanes), n1 = half8(e0 + kLanes + 8);
    const __m256 n2 = two ? half8(e1 + kLanes) : zero, n3 = two ? half8(e1 + kLanes + 8) : zero;
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t kk = 0; kk < 16; ++kk) {
      const uint8_t* p0 = c0 + kk * kLanes;
      const uint8_t* p1 = c1 + kk * kLanes;
      const __m256i u0 = _mm256_cvtepu8_epi32(load8(p0)), u1 = _mm256_cvtepu8_epi32(load8(p0 + 8));
      const __m256i u2 = two ? _mm256_cvtepu8_epi32(load8(p1)) : _mm256_setzero_si256();
      const __m256i u3 = two ? _mm256_cvtepu8_epi32(load8(p1 + 8)) : _mm256_setzero_si256();
#define SPECJAX_Q4(d, n, op) _mm256_fmadd_ps(_mm256_cvtepi32_ps(op), d, n)
      sink(kk, SPECJAX_Q4(d0, n0, _mm256_and_si256(u0, low)), SPECJAX_Q4(d1, n1, _mm256_and_si256(u1, low)),
           SPECJAX_Q4(d2, n2, _mm256_and_si256(u2, low)), SPECJAX_Q4(d3, n3, _mm256_and_si256(u3, low)));
      sink(kk + 16, SPECJAX_Q4(d0, n0, _mm256_srli_epi32(u0, 4)), SPECJAX_Q4(d1, n1, _mm256_srli_epi32(u1, 4)),
           SPECJAX_Q4(d2, n2, _mm256_srli_epi32(u2, 4)), SPECJAX_Q4(d3, n3, _mm256_srli_epi32(u3, 4)));
#undef SPECJAX_Q4
    }
  }
}

// AVX2, more rows than one register sub-tile (a verify block): each group's weights are decoded
// once into w, 4 KB that stay in L1, and every sub-tile's FMAs read them there, so a row past the
// third costs its FMAs, not another decode of the group (the fused loop in blocks_gguf decodes
// per sub-tile: 2.5x a one-row pass for 4 rows, 4x for 7). The sub-tiles' accumulators wait in
// acc between groups. The decode, the FMAs and their order per output are the fused loop's, so
// the bits are too.
template <bool Q8>
void decoded_subtiles(const float* __restrict x, const uint8_t* __restrict q0, const uint8_t* __restrict q1,
                      const uint16_t* __restrict s0, const uint16_t* __restrict s1, float* __restrict y, int64_t K,
                      int64_t N, int64_t ng, int64_t b, bool two, int64_t m0, int64_t mm) {
  alignas(32) float w[32][4][8];  // [step of the summing order][block b lanes 0-7, 8-15, block b + 1 ...]
  alignas(32) float acc[kRowTile][4][8] = {};
  for (int64_t g = 0; g < ng; ++g) {
    decode_group<Q8>(q0, q1, s0, s1, g, two, [&](int64_t k, __m256 v0, __m256 v1, __m256 v2, __m256 v3) {
      const int64_t step = Q8 ? k : (k < 16 ? 2 * k : 2 * (k - 16) + 1);
      _mm256_store_ps(w[step][0], v0);
      _mm256_store_ps(w[step][1], v1);
      _mm256_store_ps(w[step][2], v2);
      _mm256_store_ps(w[step][3], v3);
    });
    row_subtiles(m0, mm, [&](int64_t r0, auto rows) {
      constexpr int R = decltype(rows)::value;
      __m256 a[R][4];
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = _mm256_load_ps(acc[r0 - m0 + i][j]);
      for (int64_t step = 0; step < 32; ++step) {
        const int64_t k = g * 32 + (Q8 ? step : (step >> 1) + ((step & 1) << 4));
        const __m256 v0 = _mm256_load_ps(w[step][0]), v1 = _mm256_load_ps(w[step][1]);
        const __m256 v2 = _mm256_load_ps(w[step][2]), v3 = _mm256_load_ps(w[step][3]);
        SPECJAX_ROWS_FMA2(k, v0, v1, v2, v3)
      }
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < 4; ++j) _mm256_store_ps(acc[r0 - m0 + i][j], a[i][j]);
    });
  }
  __m256 out[kRowTile][4];
  for (int64_t i = 0; i < mm; ++i)
    for (int j = 0; j < 4; ++j) out[i][j] = _mm256_load_ps(acc[i][j]);
  store_tile(y, out, m0, mm, N, b, two);
}
#endif

// Column blocks [b0, b1) of a q4_1 (Q8 = false) or q8_0 (Q8 = true) weight; sums over k in
// increasing order of (group, kk), one FMA per k (q4_1: kk and kk + 16 in turn).
template <bool Q8>
void blocks_gguf(const float* __restrict x, const uint8_t* __restrict qs, const uint16_t* __restrict sc,
                 float* __restrict y, int64_t M, int64_t K, int64_t N, int64_t b0, int64_t b1) {
  const int64_t ng = K / 32;
  constexpr int64_t kCodes = Q8 ? 32 * kLanes : 16 * kLanes;  // bytes of codes per group and block
  constexpr int64_t kScales = Q8 ? kLanes : 2 * kLanes;       // float16 scales per group and block
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two = b + 1 < b1;
    const uint8_t* __restrict q0 = qs + b * ng * kCodes;
    const uint8_t* __restrict q1 = q0 + ng * kCodes;
    const uint16_t* __restrict s0 = sc + b * ng * kScales;
    const uint16_t* __restrict s1 = s0 + ng * kScales;
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int64_t mm = std::min(kRowTile, M - m0);
#if defined(__AVX512F__)
      __m512 a0[kRowTile], a1[kRowTile];
      for (int i = 0; i < kRowTile; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
      const __m512 zero = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; ++g) {
        prefetch_ahead<Q8>(q0, s0, g);
        if (two) prefetch_ahead<Q8>(q1, s1, g);
        const uint8_t* __restrict c0 = q0 + g * kCodes;
        const uint8_t* __restrict c1 = q1 + g * kCodes;
        const __m512 d0 = half16(s0 + g * kScales), d1 = two ? half16(s1 + g * kScales) : zero;
        if constexpr (Q8) {
          for (int64_t kk = 0; kk < 32; ++kk) {
            const __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(c0 + kk * kLanes)))), d0);
            const __m512 v1 = two ? _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(c1 + kk * kLanes)))), d1) : zero;
            SPECJAX_ROWS_FMA(g * 32 + kk, v0, v1)
          }
        } else {
          const __m512 mn0 = half16(s0 + g * kScales + kLanes), mn1 = two ? half16(s1 + g * kScales + kLanes) : zero;
          const __m512i low = _mm512_set1_epi32(15);
          for (int64_t kk = 0; kk < 16; ++kk) {
            const __m512i u0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c0 + kk * kLanes)));
            const __m512i u1 = two ? _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c1 + kk * kLanes)))
                                   : _mm512_setzero_si512();
            const __m512 lo0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(u0, low)), d0, mn0);
            const __m512 lo1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(u1, low)), d1, mn1);
            SPECJAX_ROWS_FMA(g * 32 + kk, lo0, lo1)
            const __m512 hi0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(u0, 4)), d0, mn0);
            const __m512 hi1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(u1, 4)), d1, mn1);
            SPECJAX_ROWS_FMA(g * 32 + kk + 16, hi0, hi1)
          }
        }
      }
      store_tile(y, a0, a1, m0, mm, N, b, two);
#elif defined(SPECJAX_AVX2)
      const __m256 zero = _mm256_setzero_ps();
      if (mm > kRowTile2) {
        decoded_subtiles<Q8>(x, q0, q1, s0, s1, y, K, N, ng, b, two, m0, mm);
        continue;
      }
      row_subtiles(m0, mm, [&](int64_t r0, auto rows) {
        constexpr int R = decltype(rows)::value;
        __m256 a[R][4];
        for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = zero;
        for (int64_t g = 0; g < ng; ++g)
          decode_group<Q8>(q0, q1, s0, s1, g, two, [&](int64_t kk, __m256 v0, __m256 v1, __m256 v2, __m256 v3) {
            SPECJAX_ROWS_FMA2(g * 32 + kk, v0, v1, v2, v3)
          });
        store_tile(y, a, r0, R, N, b, two);
      });
#else
      float a[2][kRowTile][kLanes] = {};
      float w[32][kLanes];  // one group's weights, in the AVX-512 path's k order
      for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
        const uint8_t* __restrict qb = h ? q1 : q0;
        const uint16_t* __restrict sb = h ? s1 : s0;
        for (int64_t g = 0; g < ng; ++g) {
          const uint8_t* __restrict c = qb + g * kCodes;
          for (int64_t l = 0; l < kLanes; ++l) {
            const float d = half_to_float(sb[g * kScales + l]);
            if constexpr (Q8) {
              for (int64_t kk = 0; kk < 32; ++kk) w[kk][l] = static_cast<float>(static_cast<int8_t>(c[kk * kLanes + l])) * d;
            } else {
              const float mn = half_to_float(sb[g * kScales + kLanes + l]);
              for (int64_t kk = 0; kk < 16; ++kk) {  // q4_1 order: kk, kk + 16, kk + 1, kk + 17, ...
                w[2 * kk][l] = __builtin_fmaf(static_cast<float>(c[kk * kLanes + l] & 15), d, mn);
                w[2 * kk + 1][l] = __builtin_fmaf(static_cast<float>(c[kk * kLanes + l] >> 4), d, mn);
              }
            }
          }
          for (int64_t step = 0; step < 32; ++step) {
            const int64_t k = g * 32 + (Q8 ? step : (step >> 1) + ((step & 1) << 4));
            for (int64_t i = 0; i < mm; ++i) {
              const float xi = x[(m0 + i) * K + k];
              for (int64_t l = 0; l < kLanes; ++l) a[h][i][l] = __builtin_fmaf(xi, w[step][l], a[h][i][l]);
            }
          }
        }
      }
      store_tile(y, a, m0, mm, N, b, two);
#endif
    }
  }
}

// ---------------------------------------------------------------- int8 activations (rows_activations int8)
// The GGUF formats with each activation row rounded to int8 per group of 32 k first, as llama.cpp
// rounds its activations: dx = amax / 127 and xq = x * 127 / amax to nearest (ties to even), so
// the weights multiply integer codes. The model this computes is the dot product of the rounded
// row x~ = dx * xq with the same weights: y[m, c] = sum over groups g, in increasing order, of
// fma(d_c * dx, S, .) then (q4_1) fma(m_c, sx, .), where S = sum_k xq_k q_kc is an exact integer
// sum and sx = dx * sum_k xq_k. Integer sums are exact in any order, so every build and every row
// count gives the same bits, and a row's result still does not depend on the rows beside it.
// Per 64 weights of a q4_1 block a row costs two byte multiply-adds (vpmaddubsw) and two adds,
// against 16 float conversions and FMAs with float activations.

constexpr int kRowTileI8 = 3;  // rows per register tile of the int8 path

struct QuantRows {  // the int8 rounding of x [M, K]
  std::unique_ptr<int8_t[]> q;     // [M, K] codes
  std::unique_ptr<int16_t[]> q16;  // [M, K] the same codes widened (q8_0 weights multiply int16 pairs)
  std::unique_ptr<float[]> d, s;   // [M, K / 32]: dx, and dx * (sum of the group's codes)
  std::unique_ptr<int32_t[]> n;    // [M, K / 32]: the sum of the group's codes
};

// Rounds the rows of x (its bits must not depend on the build: the scalar steps, which AVX-512
// does in lanes with the same exact roundings). A
// group holding a NaN or an infinity gets dx = NaN, so its rows' outputs are NaN as with floats.
QuantRows quantize_rows(const float* __restrict x, int64_t M, int64_t K, bool wide) {
  const int64_t ng = K / 32;
  QuantRows r{std::make_unique<int8_t[]>(M * K), wide ? std::make_unique<int16_t[]>(M * K) : nullptr,
              std::make_unique<float[]>(M * ng), std::make_unique<float[]>(M * ng),
              std::make_unique<int32_t[]>(M * ng)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float* __restrict xs = x + m * K + g * 32;
      auto scales = [&](float d, int32_t sum) {
        r.d[m * ng + g] = d;
        r.s[m * ng + g] = d * static_cast<float>(sum);
        r.n[m * ng + g] = sum;
      };
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // the scalar steps below in 16 lanes, each exactly rounded (|x|, max, one multiply, round to
      // nearest even, clamp), so the same bits; a group with a NaN or an infinity goes on below
      const __m512 x0 = _mm512_loadu_ps(xs), x1 = _mm512_loadu_ps(xs + 16);
      const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
      const __m512 big = _mm512_set1_ps(3.4028234663852886e38f);
      if ((_mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ)) == 0) {
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        auto codes = [&](__m512 v) {
          const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          return _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
        };
        const __m512i c0 = codes(x0), c1 = codes(x1);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.get() + m * K + g * 32), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.get() + m * K + g * 32 + 16), _mm512_cvtepi32_epi8(c1));
        if (wide) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q16.get() + m * K + g * 32), _mm512_cvtepi32_epi16(c0));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q16.get() + m * K + g * 32 + 16), _mm512_cvtepi32_epi16(c1));
        }
        scales(amax / 127.0f, _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1)));
        continue;
      }
#endif
      float amax = 0.0f;
      bool finite = true;
      for (int k = 0; k < 32; ++k) {
        const float a = std::fabs(xs[k]);
        finite = finite && a <= 3.4028234663852886e38f;
        amax = a > amax ? a : amax;
      }
      const float d = finite ? amax / 127.0f : __builtin_nanf("");
      const float id = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) {
        const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xs[k] * id)));
        const int8_t q = static_cast<int8_t>(finite ? v : 0.0f);
        r.q[m * K + g * 32 + k] = q;
        if (wide) r.q16[m * K + g * 32 + k] = q;
        sum += q;
      }
      scales(d, sum);
    }
  return r;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECJAX_I8_VEC 1
inline __m256 i8_half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 32 code bytes of one block in the paired layout: 16-bit lane c holds rows (k, k + 1) of column
// c, the pairs vpmaddubsw / vpmaddwd multiply. (Interleaving them here instead, with a lane-crossing
// permute and a byte shuffle per 32 bytes, made this path 2.2x slower on an AVX2 EPYC.)
inline __m256i pair_rows(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline void store16(float* __restrict out, __m256 lo, __m256 hi, int64_t width) {
  if (width == kLanes) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  } else {
    alignas(32) float t[kLanes];
    _mm256_store_ps(t, lo);
    _mm256_store_ps(t + 8, hi);
    std::memcpy(out, t, sizeof(float) * width);
  }
}

// Rows [r0, r0 + R) of one column block: codes and scales of the block, every group.
template <bool Q8, int R>
void tile_i8(const QuantRows& xr, const uint8_t* __restrict qb, const uint16_t* __restrict sb, float* __restrict y,
             int64_t r0, int64_t K, int64_t N, int64_t col) {
  const int64_t ng = K / 32;
  __m256 f[R][2];
  for (int i = 0; i < R; ++i) f[i][0] = f[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    prefetch_ahead<Q8>(qb, sb, g);
    __m256i s0[R], s1[R];  // int32 sums S of columns 0-7 and 8-15
    if constexpr (Q8) {
      const uint8_t* __restrict c = qb + g * 32 * kLanes;
      for (int i = 0; i < R; ++i) s0[i] = s1[i] = _mm256_setzero_si256();
      for (int p = 0; p < 16; ++p) {  // k = 2p, 2p + 1
        const __m256i w = pair_rows(c + 2 * p * kLanes);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
        for (int i = 0; i < R; ++i) {
          int32_t pair;
          std::memcpy(&pair, xr.q16.get() + (r0 + i) * K + g * 32 + 2 * p, 4);
          const __m256i xb = _mm256_set1_epi32(pair);
          s0[i] = _mm256_add_epi32(s0[i], _mm256_madd_epi16(w0, xb));
          s1[i] = _mm256_add_epi32(s1[i], _mm256_madd_epi16(w1, xb));
        }
      }
    } else {
      // byte kk of a column holds k = kk (low nibble) and kk + 16 (high); int16 sums of 8 pairs
      // stay below 8 * 2 * 15 * 127 = 30480, so low and high halves are summed apart, then widened
      const uint8_t* __restrict c = qb + g * 16 * kLanes;
      const __m256i low = _mm256_set1_epi8(15);
      __m256i lo[R], hi[R];
      for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {  // k = 2p, 2p + 1 and 16 + 2p, 17 + 2p
        const __m256i w = pair_rows(c + 2 * p * kLanes);
        const __m256i wl = _mm256_and_si256(w, low), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int i = 0; i < R; ++i) {
          const int8_t* xq = xr.q.get() + (r0 + i) * K + g * 32;
          int16_t pl, ph;
          std::memcpy(&pl, xq + 2 * p, 2);
          std::memcpy(&ph, xq + 16 + 2 * p, 2);
          lo[i] = _mm256_add_epi16(lo[i], _mm256_maddubs_epi16(wl, _mm256_set1_epi16(pl)));
          hi[i] = _mm256_add_epi16(hi[i], _mm256_maddubs_epi16(wh, _mm256_set1_epi16(ph)));
        }
      }
      for (int i = 0; i < R; ++i) {
        s0[i] = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo[i])),
                                 _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi[i])));
        s1[i] = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo[i], 1)),
                                 _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi[i], 1)));
      }
    }
    const uint16_t* __restrict e = sb + g * (Q8 ? kLanes : 2 * kLanes);
    const __m256 d0 = i8_half8(e), d1 = i8_half8(e + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 dx = _mm256_set1_ps(xr.d[(r0 + i) * ng + g]);
      f[i][0] = _mm256_fmadd_ps(_mm256_mul_ps(d0, dx), _mm256_cvtepi32_ps(s0[i]), f[i][0]);
      f[i][1] = _mm256_fmadd_ps(_mm256_mul_ps(d1, dx), _mm256_cvtepi32_ps(s1[i]), f[i][1]);
      if constexpr (!Q8) {
        const __m256 sx = _mm256_set1_ps(xr.s[(r0 + i) * ng + g]);
        f[i][0] = _mm256_fmadd_ps(i8_half8(e + kLanes), sx, f[i][0]);
        f[i][1] = _mm256_fmadd_ps(i8_half8(e + kLanes + 8), sx, f[i][1]);
      }
    }
  }
  for (int i = 0; i < R; ++i) store16(y + (r0 + i) * N + col, f[i][0], f[i][1], std::min(kLanes, N - col));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define SPECJAX_VNNI 1
// AVX-512 VNNI: vpdpbusd adds four byte products (unsigned x signed) into each 32-bit lane, 64
// multiply-adds an instruction against vpmaddubsw's 32 and a widening add. A group's codes are
// made ready once per column block (two pairs of rows to one quad of rows per column by one
// vpermb, nibbles split, q8_0 made unsigned) and every row of the tile then costs 8 vpdpbusd per
// 32 k x 16 columns. The integer sums S are exact, so they are the other builds' S, and the float
// steps after them are theirs too: the same bits.
// acc + the byte products of w (unsigned) and the 4 bytes at p (signed), p's word broadcast by the
// instruction itself ({1to16}): GCC 12 loads it with a vpbroadcastd of its own, a third more
// instructions per row of a tile.
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

constexpr int kRowTileVnni = 8;

struct QuadIndex {
  alignas(64) uint8_t b[64];
};
// byte 4c + j of a quad = byte j of column c in rows 2p, 2p + 1 (pair p: bytes 2c, 2c + 1 of the
// first 32) then 2p + 2, 2p + 3 (pair p + 1: the next 32)
constexpr QuadIndex make_quad_index() {
  QuadIndex q{};
  for (int c = 0; c < 16; ++c)
    for (int j = 0; j < 4; ++j) q.b[4 * c + j] = static_cast<uint8_t>((j < 2 ? 0 : 32) + 2 * c + (j & 1));
  return q;
}
constexpr QuadIndex kQuadIndex = make_quad_index();

// Rows [r0, r0 + R) of one column block. Quad q of a group is k = 4q .. 4q + 3 in both formats
// (q4_1: quads 0-3 the low nibbles of code rows 0-15, k = 0-15; quads 4-7 the high, k = 16-31).
// q8_0's signed codes go in as w + 128 (vpdpbusd's unsigned side), and S = S' - 128 * sum(xq).
template <bool Q8, int R>
void tile_vnni(const QuantRows& xr, const uint8_t* __restrict qb, const uint16_t* __restrict sb, float* __restrict y,
               int64_t r0, int64_t K, int64_t N, int64_t col) {
  const int64_t ng = K / 32;
  const __m512i idx = _mm512_load_si512(kQuadIndex.b);
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    prefetch_ahead<Q8>(qb, sb, g);
    __m512i w[8];
    if constexpr (Q8) {
      const uint8_t* __restrict c = qb + g * 32 * kLanes;
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int q = 0; q < 8; ++q)
        w[q] = _mm512_xor_si512(_mm512_permutexvar_epi8(idx, _mm512_loadu_si512(c + 64 * q)), flip);
    } else {
      const uint8_t* __restrict c = qb + g * 16 * kLanes;
      const __m512i low = _mm512_set1_epi8(15);
      for (int q = 0; q < 4; ++q) {
        const __m512i b = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(c + 64 * q));
        w[q] = _mm512_and_si512(b, low);
        w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
      }
    }
    const uint16_t* __restrict e = sb + g * (Q8 ? kLanes : 2 * kLanes);
    const __m512 d = half16(e), mn = Q8 ? _mm512_setzero_ps() : half16(e + kLanes);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const int8_t* __restrict xq = xr.q.get() + (r0 + i) * K + g * 32;
      __m512i s0 = _mm512_setzero_si512(), s1 = s0;  // two chains of four
      _Pragma("GCC unroll 8") for (int q = 0; q < 8; q += 2) {
        s0 = dpbusd_bcast(s0, w[q], xq + 4 * q);
        s1 = dpbusd_bcast(s1, w[q + 1], xq + 4 * q + 4);
      }
      __m512i S = _mm512_add_epi32(s0, s1);
      if constexpr (Q8) S = _mm512_sub_epi32(S, _mm512_set1_epi32(128 * xr.n[(r0 + i) * ng + g]));
      const __m512 dx = _mm512_set1_ps(xr.d[(r0 + i) * ng + g]);
      f[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(S), f[i]);
      if constexpr (!Q8) f[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xr.s[(r0 + i) * ng + g]), f[i]);
    }
  }
  store_tile(y, f, f, r0, R, N, col / kLanes, false);
}

#endif

// Column blocks [b0, b1) of a q4_1 / q8_0 weight against the rounded rows.
template <bool Q8>
void blocks_gguf_i8(const QuantRows& xr, const uint8_t* __restrict qs, const uint16_t* __restrict sc,
                    float* __restrict y, int64_t M, int64_t K, int64_t N, int64_t b0, int64_t b1) {
  const int64_t ng = K / 32;
  constexpr int64_t kCodes = Q8 ? 32 * kLanes : 16 * kLanes;
  constexpr int64_t kScales = Q8 ? kLanes : 2 * kLanes;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* __restrict qb = qs + b * ng * kCodes;
    const uint16_t* __restrict sb = sc + b * ng * kScales;
    const int64_t col = b * kLanes;
#if defined(SPECJAX_VNNI)
    for (int64_t r0 = 0; r0 < M; r0 += kRowTileVnni)
      with_rows<kRowTileVnni>(std::min<int64_t>(kRowTileVnni, M - r0),
                              [&](auto R) { tile_vnni<Q8, decltype(R)::value>(xr, qb, sb, y, r0, K, N, col); });
#elif defined(SPECJAX_I8_VEC)
    for (int64_t r0 = 0; r0 < M; r0 += kRowTileI8) {
      const int64_t rr = std::min<int64_t>(kRowTileI8, M - r0);
      if (rr == 1) tile_i8<Q8, 1>(xr, qb, sb, y, r0, K, N, col);
      else if (rr == 2) tile_i8<Q8, 2>(xr, qb, sb, y, r0, K, N, col);
      else tile_i8<Q8, 3>(xr, qb, sb, y, r0, K, N, col);
    }
#else
    const int64_t width = std::min(kLanes, N - col);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t l = 0; l < width; ++l) {
        float acc = 0.0f;
        for (int64_t g = 0; g < ng; ++g) {
          const uint8_t* __restrict c = qb + g * kCodes;
          const int8_t* __restrict xq = xr.q.get() + m * K + g * 32;
          int32_t S = 0;
          for (int64_t kk = 0; kk < (Q8 ? 32 : 16); ++kk) {
            const uint8_t byte = c[(kk >> 1) * 2 * kLanes + 2 * l + (kk & 1)];  // row kk of column l (paired)
            if constexpr (Q8) {
              S += static_cast<int32_t>(xq[kk]) * static_cast<int8_t>(byte);
            } else {
              S += static_cast<int32_t>(xq[kk]) * (byte & 15) + static_cast<int32_t>(xq[kk + 16]) * (byte >> 4);
            }
          }
          const float dx = xr.d[m * ng + g];
          acc = __builtin_fmaf(half_to_float(sb[g * kScales + l]) * dx, static_cast<float>(S), acc);
          if constexpr (!Q8) acc = __builtin_fmaf(half_to_float(sb[g * kScales + kLanes + l]), xr.s[m * ng + g], acc);
        }
        y[m * N + col + l] = acc;
      }
#endif
  }
}

// ---------------------------------------------------------------- bfloat16 activations (rows_activations bfloat16)
// Each activation rounded to bfloat16 (to nearest, ties to even; below float32's smallest normal
// to zero), multiplied in pairs by the GGUF weights' integer codes (exact in bfloat16): per group
// g in increasing order, y[m, c] = fma(d_c, S, .) then (q4_1) fma(m_c, sx, .), with S = A + B,
// A (B) the sum over k = 0..15 (16..31) of x~_k q_kc as AVX512_BF16's vdpbf16ps adds it: per
// pair (2p, 2p + 1), acc + x~_{2p+1} q_{2p+1}, rounded, then + x~_{2p} q_{2p}, rounded (such a
// product is exact in float32), each result below the smallest normal flushed to zero (the
// instruction's order, checked on the AVX-512 EPYC); sx is the group's sum of x~ in one fixed
// tree. The other builds compute the same sequence in scalar code, so every build gives the same
// bits, and a row's result does not depend on the rows beside it. Half the float32 path's
// multiply instructions per row (two multiply-adds per lane and instruction) and a cheaper decode
// of the codes (the AR step 0.77x float32's on the AVX-512 EPYC; a verified row costs the same
// there: BENCHMARKS.md), with the rounding error of bfloat16 (8 significant bits), not of int8.

struct Bf16Rows {                      // the bfloat16 rounding of x [M, K]
  std::unique_ptr<uint16_t[]> b;       // [M, K]
  std::unique_ptr<float[]> sx;         // [M, K / 32]: each group's sum of the rounded values
};

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  if ((u & 0x7F800000u) == 0) return static_cast<uint16_t>(sign);                     // zero, subnormal
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7FC0u);  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The group's sum of its 32 rounded values: lanes j and j + 16 added, then halves (j + 8, j + 4,
// j + 2, j + 1) in turn, as the AVX-512 reduction below does it.
inline float group_sum_bf16(const uint16_t* __restrict xb) {
  float t[16];
  for (int j = 0; j < 16; ++j) t[j] = from_bf16(xb[j]) + from_bf16(xb[j + 16]);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) t[j] = t[j] + t[j + w];
  return t[0];
}

Bf16Rows round_rows_bf16(const float* __restrict x, int64_t M, int64_t K) {
  const int64_t ng = K / 32;
  Bf16Rows r{std::make_unique<uint16_t[]>(M * K), std::make_unique<float[]>(M * ng)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float* __restrict xs = x + m * K + g * 32;
      uint16_t* __restrict xb = r.b.get() + m * K + g * 32;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // to_bf16 in 16 lanes (integer steps, the same bits), then group_sum_bf16's tree
      auto round16 = [](__m512 v) {
        const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
        const __m512i sign = _mm512_and_si512(hi, _mm512_set1_epi32(0x8000));
        __m512i b = _mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(hi, _mm512_set1_epi32(1)))), 16);
        b = _mm512_mask_mov_epi32(b, _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7F800000)), sign);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                      _mm512_set1_epi32(0x7F800000));
        b = _mm512_mask_mov_epi32(b, nan, _mm512_or_si512(sign, _mm512_set1_epi32(0x7FC0)));
        return b;
      };
      const __m512i b0 = round16(_mm512_loadu_ps(xs)), b1 = round16(_mm512_loadu_ps(xs + 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb), _mm512_cvtepi32_epi16(b0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + 16), _mm512_cvtepi32_epi16(b1));
      const __m512 t = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b0, 16)),
                                     _mm512_castsi512_ps(_mm512_slli_epi32(b1, 16)));
      const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(t), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
      const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
      const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
      r.sx[m * ng + g] = _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
#else
      for (int k = 0; k < 32; ++k) xb[k] = to_bf16(xs[k]);
      r.sx[m * ng + g] = group_sum_bf16(xb);
#endif
    }
  return r;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPECJAX_BF16 1
// acc + the pair products of w and the bfloat16 pair at p, broadcast by the instruction ({1to16}:
// no vpbroadcastd of its own, as with dpbusd_bcast).
inline __m512 dpbf16_bcast(__m512 acc, __m512i w, const uint16_t* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

constexpr int kRowTileBf16 = 8;

struct Bf16Codes {
  alignas(64) uint16_t w[32];
};
constexpr Bf16Codes make_bf16_codes() {  // word i = bfloat16(i) for a 4-bit code i (exact)
  Bf16Codes t{};
  for (int i = 1; i < 16; ++i) {
    int e = 0;
    while ((i >> (e + 1)) != 0) ++e;  // 2^e <= i
    t.w[i] = static_cast<uint16_t>(((127 + e) << 7) | (((i << 7) >> e) & 0x7F));
  }
  return t;
}
constexpr Bf16Codes kBf16Codes = make_bf16_codes();

// Rows [r0, r0 + R) of one column block (the paired layout, as the int8 path reads it). A group's
// codes become 16 vectors of bfloat16 pairs once per column block; a row then costs 16 vdpbf16ps
// per 32 k x 16 columns. Word 2c + j of pair row p is row 2p + j of column c (q4_1: its low
// nibble k = 2p + j, its high nibble k = 2p + 16 + j; q8_0 pair rows 0-15: k = 2p + j).
template <bool Q8, int R>
void tile_bf16(const Bf16Rows& xr, const uint8_t* __restrict qb, const uint16_t* __restrict sb, float* __restrict y,
               int64_t r0, int64_t K, int64_t N, int64_t col) {
  const int64_t ng = K / 32;
  const __m512i table = _mm512_load_si512(kBf16Codes.w);
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    prefetch_ahead<Q8>(qb, sb, g);
    __m512i w[16];
    if constexpr (Q8) {
      const uint8_t* __restrict c = qb + g * 32 * kLanes;
      for (int p = 0; p < 16; ++p) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32 * p))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32 * p + 16))));
        w[p] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // words 0-15: lo (exact integers)
      }
    } else {
      const uint8_t* __restrict c = qb + g * 16 * kLanes;
      const __m512i low = _mm512_set1_epi16(15);
      for (int p = 0; p < 8; ++p) {
        const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p)));
        w[p] = _mm512_permutexvar_epi16(_mm512_and_si512(u, low), table);
        w[p + 8] = _mm512_permutexvar_epi16(_mm512_srli_epi16(u, 4), table);
      }
    }
    const uint16_t* __restrict e = sb + g * (Q8 ? kLanes : 2 * kLanes);
    const __m512 d = half16(e), mn = Q8 ? _mm512_setzero_ps() : half16(e + kLanes);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const uint16_t* __restrict xb = xr.b.get() + (r0 + i) * K + g * 32;
      __m512 a = _mm512_setzero_ps(), b = a;  // k = 0-15, 16-31
      _Pragma("GCC unroll 8") for (int p = 0; p < 8; ++p) {
        a = dpbf16_bcast(a, w[p], xb + 2 * p);
        b = dpbf16_bcast(b, w[p + 8], xb + 16 + 2 * p);
      }
      f[i] = _mm512_fmadd_ps(d, _mm512_add_ps(a, b), f[i]);
      if constexpr (!Q8) f[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xr.sx[(r0 + i) * ng + g]), f[i]);
    }
  }
  store_tile(y, f, f, r0, R, N, col / kLanes, false);
}

#endif

inline float ftz(float a) { return std::fabs(a) < 1.17549435e-38f ? std::copysign(0.0f, a) : a; }  // (vdpbf16ps keeps the sign)

// Column blocks [b0, b1) of a q4_1 / q8_0 weight (paired layout) against the rounded rows.
template <bool Q8>
void blocks_gguf_bf16(const Bf16Rows& xr, const uint8_t* __restrict qs, const uint16_t* __restrict sc,
                      float* __restrict y, int64_t M, int64_t K, int64_t N, int64_t b0, int64_t b1) {
  const int64_t ng = K / 32;
  constexpr int64_t kCodes = Q8 ? 32 * kLanes : 16 * kLanes;
  constexpr int64_t kScales = Q8 ? kLanes : 2 * kLanes;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* __restrict qb = qs + b * ng * kCodes;
    const uint16_t* __restrict sb = sc + b * ng * kScales;
    const int64_t col = b * kLanes;
#if defined(SPECJAX_BF16)
    for (int64_t r0 = 0; r0 < M; r0 += kRowTileBf16)
      with_rows<kRowTileBf16>(std::min<int64_t>(kRowTileBf16, M - r0),
                              [&](auto R) { tile_bf16<Q8, decltype(R)::value>(xr, qb, sb, y, r0, K, N, col); });
#else
    const int64_t width = std::min(kLanes, N - col);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t l = 0; l < width; ++l) {
        float acc = 0.0f;
        for (int64_t g = 0; g < ng; ++g) {
          const uint8_t* __restrict c = qb + g * kCodes;
          const uint16_t* __restrict xb = xr.b.get() + m * K + g * 32;
          auto code = [&](int64_t k) -> float {  // q of row k, column l
            if constexpr (Q8) return static_cast<float>(static_cast<int8_t>(c[(k >> 1) * 2 * kLanes + 2 * l + (k & 1)]));
            const uint8_t byte = c[((k & 15) >> 1) * 2 * kLanes + 2 * l + (k & 1)];
            return static_cast<float>(k < 16 ? byte & 15 : byte >> 4);
          };
          float half[2];
          for (int h = 0; h < 2; ++h) {
            float a = 0.0f;
            for (int64_t p = 0; p < 8; ++p) {
              const int64_t k = 16 * h + 2 * p;
              a = ftz(a + from_bf16(xb[k + 1]) * code(k + 1));
              a = ftz(a + from_bf16(xb[k]) * code(k));
            }
            half[h] = a;
          }
          acc = __builtin_fmaf(half_to_float(sb[g * kScales + l]), half[0] + half[1], acc);
          if constexpr (!Q8) acc = __builtin_fmaf(half_to_float(sb[g * kScales + kLanes + l]), xr.sx[m * ng + g], acc);
        }
        y[m * N + col + l] = acc;
      }
#endif
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

// The operands' shapes and types for a q4_1 (Q8 = false) or q8_0 weight.
template <bool Q8, bool Paired = false>
ffi::Error check_gguf(const ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& codes, const ffi::Buffer<ffi::F16>& scales,
                      ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  auto cd = codes.dimensions();
  auto sd = scales.dimensions();
  auto yd = y->dimensions();
  const int64_t per_group = (Q8 ? 32 : 16) / (Paired ? 2 : 1);
  const bool ok = xd.size() == 2 && yd.size() == 2 && cd.size() == 4 && yd[0] == xd[0] && xd[1] % 32 == 0 &&
                  cd[0] == (yd[1] + kLanes - 1) / kLanes && cd[1] == xd[1] / 32 && cd[2] == per_group &&
                  cd[3] == (Paired ? 2 : 1) * kLanes && codes.element_type() == (Q8 ? ffi::DataType::S8 : ffi::DataType::U8) &&
                  (Q8 ? sd.size() == 3 && sd[0] == cd[0] && sd[1] == cd[1] && sd[2] == kLanes
                      : sd.size() == 4 && sd[0] == cd[0] && sd[1] == cd[1] && sd[2] == 2 && sd[3] == kLanes);
  if (!ok)
    return ffi::Error::InvalidArgument(
        Paired ? (Q8 ? "rows_q8_0_i8 / _bf16: expected x [M, K], codes int8 [ceil(N/16), K/32, 16, 32], "
                       "scales [ceil(N/16), K/32, 16], y [M, N]"
                     : "rows_q4_1_i8 / _bf16: expected x [M, K], codes uint8 [ceil(N/16), K/32, 8, 32], "
                       "scales [ceil(N/16), K/32, 2, 16], y [M, N]")
               : (Q8 ? "rows_q8_0: expected x [M, K], codes int8 [ceil(N/16), K/32, 32, 16], "
                       "scales [ceil(N/16), K/32, 16], y [M, N]"
                     : "rows_q4_1: expected x [M, K], codes uint8 [ceil(N/16), K/32, 16, 16], "
                       "scales [ceil(N/16), K/32, 2, 16], y [M, N]"));
  return ffi::Error::Success();
}

template <bool Q8>
ffi::Error RowsGguf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                    ffi::Buffer<ffi::F16> scales, ffi::ResultBuffer<ffi::F32> y) {
  if (ffi::Error e = check_gguf<Q8>(x, codes, scales, y); e.failure()) return e;
  auto xd = x.dimensions();
  auto cd = codes.dimensions();
  auto yd = y->dimensions();
  const int64_t M = xd[0], K = xd[1], N = yd[1], nb = cd[0];
  const float* xp = x.typed_data();
  const uint8_t* qp = static_cast<const uint8_t*>(codes.untyped_data());
  const uint16_t* sp = scales.typed_data();
  float* out = y->typed_data();
  // (float32 activations never alone: their decode of the codes to floats keeps both vCPUs busy,
  // a decode step 1.4x slower on one)
  parallel_chunks(pool, (nb + kChunk - 1) / kChunk, [=](int64_t c) {
    blocks_gguf<Q8>(xp, qp, sp, out, M, K, N, c * kChunk, std::min(nb, (c + 1) * kChunk));
  });
  return ffi::Error::Success();
}

template <bool Q8>
ffi::Error RowsGgufI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                      ffi::Buffer<ffi::F16> scales, ffi::ResultBuffer<ffi::F32> y) {
  if (ffi::Error e = check_gguf<Q8, true>(x, codes, scales, y); e.failure()) return e;
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1], nb = codes.dimensions()[0];
#if defined(SPECJAX_VNNI)
  const QuantRows xr = quantize_rows(x.typed_data(), M, K, false);  // (the int16 codes: the AVX2 q8_0 tile's)
#else
  const QuantRows xr = quantize_rows(x.typed_data(), M, K, Q8);
#endif
  const QuantRows* xrp = &xr;
  const uint8_t* qp = static_cast<const uint8_t*>(codes.untyped_data());
  const uint16_t* sp = scales.typed_data();
  float* out = y->typed_data();
  parallel_chunks(pool, (nb + kChunk - 1) / kChunk, [=](int64_t c) {
    blocks_gguf_i8<Q8>(*xrp, qp, sp, out, M, K, N, c * kChunk, std::min(nb, (c + 1) * kChunk));
  }, M);
  return ffi::Error::Success();
}

template <bool Q8>
ffi::Error RowsGgufBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                        ffi::Buffer<ffi::F16> scales, ffi::ResultBuffer<ffi::F32> y) {
  if (ffi::Error e = check_gguf<Q8, true>(x, codes, scales, y); e.failure()) return e;
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1], nb = codes.dimensions()[0];
  const Bf16Rows xr = round_rows_bf16(x.typed_data(), M, K);
  const Bf16Rows* xrp = &xr;
  const uint8_t* qp = static_cast<const uint8_t*>(codes.untyped_data());
  const uint16_t* sp = scales.typed_data();
  float* out = y->typed_data();
  parallel_chunks(pool, (nb + kChunk - 1) / kChunk, [=](int64_t c) {
    blocks_gguf_bf16<Q8>(*xrp, qp, sp, out, M, K, N, c * kChunk, std::min(nb, (c + 1) * kChunk));
  }, M);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- block attention (decode / verify)
// Attention of a block of T new tokens per row over the row's committed cache prefix (slots
// [0, lengths[b]) of layer `layer` of the stacked [L, B, Hkv, S, hd] cache) and over the block's
// own keys under its mask (a chain or a token tree). Each query row sees its keys as one list in
// position order (the prefix, then the block's visible tokens) and every step over that list is
// indexed by the key's place in it: scores, one max, exp, the sum in 8 lanes by index mod 8, the
// values summed in order. So a token's output is the same bits whether its earlier tokens are in
// the cache (a decode step) or in its own block (a verify step), and whatever the other rows are.

#if defined(SPECJAX_I8_VEC)
// e^x for x <= 0 (Cephes' single-precision polynomial after x = n ln 2 + r; about 1 ulp; exact 0
// below -87): every key's weight goes through this one vector routine, never a scalar tail.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                                 _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), big);
}

inline float hsum8(__m256 v) {  // lanes added in one fixed order
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
#endif

inline float exp_scalar(float x) { return x < -87.0f ? 0.0f : std::exp(x); }

#if defined(SPECJAX_I8_VEC)
// The scores of 8 keys from their 8-lane partial sums a[0..7]: lane j of the result is
// hsum8(a[j]), the same adds in the same order ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)),
// as two rounds of pairwise adds and one add of the 128-bit halves.
inline __m256 hsum8x8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

// One task per (request b, KV head, up to kAttnRows query rows): the rows are the (token, query
// head) pairs of the block that read that KV head (GQA: SmolLM2's 9 heads read 3), so the
// committed prefix's keys are scored 8 at a time for all of them and, with AVX-512, each pair of
// keys is built into a register once and each value read once for them all (a decode step's 3
// heads, a K = 1 verify's 6 rows); then each row adds its visible block tokens. A row's score
// for a key is the same bits in any of these loops (one fixed order of FMAs over hd, then
// hsum8), so the result does not depend on T, on the rows beside it or on which loop scored the key.
constexpr int kAttnRows = 6;  // (6 rows x 4 accumulators + 4 key pairs: 28 of the 32 zmm)
ffi::Error BlockAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kb,
                          ffi::Buffer<ffi::F32> vb, ffi::Buffer<ffi::F32> k_all, ffi::Buffer<ffi::F32> v_all,
                          ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                          int64_t layer) {
  auto qd = q.dimensions();
  auto kd = kb.dimensions();
  auto cd = k_all.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || cd.size() != 5 || kd[0] != qd[0] || kd[1] != qd[1] || qd[3] != kd[3] ||
      qd[2] % kd[2] != 0 || cd[1] != qd[0] || cd[2] != kd[2] || cd[4] != qd[3] || layer < 0 || layer >= cd[0] ||
      lengths.dimensions().size() != 1 || lengths.dimensions()[0] != qd[0] || mask.dimensions().size() != 3 ||
      !std::equal(cd.begin(), cd.end(), v_all.dimensions().begin(), v_all.dimensions().end()) ||
      !std::equal(kd.begin(), kd.end(), vb.dimensions().begin(), vb.dimensions().end()))
    return ffi::Error::InvalidArgument("block_attention: expected q [B, T, H, hd], k/v block [B, T, Hkv, hd], "
                                       "caches [L, B, Hkv, S, hd], lengths [B], mask [B, T, T]");
  const int64_t B = qd[0], T = qd[1], H = qd[2], hd = qd[3], Hkv = kd[2], G = H / Hkv, S = cd[3];
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float *qp = q.typed_data(), *kbp = kb.typed_data(), *vbp = vb.typed_data();
  const float *kc = k_all.typed_data() + layer * B * Hkv * S * hd, *vc = v_all.typed_data() + layer * B * Hkv * S * hd;
  const int32_t* lens = lengths.typed_data();
  const bool* mk = mask.typed_data();
  float* o = out->typed_data();
  // a task's query rows: up to kAttnRows of the (token t, head g of the KV head) pairs, t-major
  const int64_t R_all = G * T, NB = (R_all + kAttnRows - 1) / kAttnRows;
  parallel_chunks(pool, B * Hkv * NB, [=](int64_t task) {
    const int64_t b = task / (Hkv * NB), kh = (task / NB) % Hkv, r0 = (task % NB) * kAttnRows;
    const int R = static_cast<int>(std::min<int64_t>(kAttnRows, R_all - r0));
    int64_t tok[kAttnRows], head[kAttnRows];  // row r: token tok[r] of query head head[r]
    for (int r = 0; r < R; ++r) tok[r] = (r0 + r) / G, head[r] = kh * G + (r0 + r) % G;
    const int64_t len = std::min<int64_t>(std::max<int32_t>(lens[b], 0), S);
    const float* kpre = kc + (b * Hkv + kh) * S * hd;  // prefix slot j: kpre + j * hd
    const float* vpre = vc + (b * Hkv + kh) * S * hd;
    const int64_t stride = (len + T + 7) / 8 * 8;      // a row's scores (padded to whole 8s)
    std::unique_ptr<float[]> scores(new float[R * stride]);
    std::unique_ptr<int64_t[]> blk(new int64_t[T * T]), nblk(new int64_t[T]);  // each token's visible block tokens
    float invs[kAttnRows];  // 1 / each row's sum of weights
    for (int64_t t = 0; t < T; ++t) {
      nblk[t] = 0;
      for (int64_t j = 0; j < T; ++j)
        if (mk[(b * T + t) * T + j]) blk[t * T + nblk[t]++] = j;
    }
    // key i of token t's list: the prefix, then its visible block tokens in position order
    auto key = [&](int64_t t, int64_t i) { return i < len ? kpre + i * hd : kbp + ((b * T + blk[t * T + i - len]) * Hkv + kh) * hd; };
    auto val = [&](int64_t t, int64_t i) { return i < len ? vpre + i * hd : vbp + ((b * T + blk[t * T + i - len]) * Hkv + kh) * hd; };
    auto qrow = [&](int r) { return qp + ((b * T + tok[r]) * H + head[r]) * hd; };
    auto orow = [&](int r) { return o + ((b * T + tok[r]) * H + head[r]) * hd; };
    int64_t shared = 0;  // prefix keys scored for every row at once
#if defined(SPECJAX_I8_VEC)
    const bool vec = hd % 8 == 0;
    if (vec) {
      // every key's dot product is one chain of dependent FMAs over hd in 8 lanes; eight keys at
      // a time keep eight chains in flight, and their 2 KB stay in L1 while each row reads them
      for (; shared + 8 <= len; shared += 8) {
        const float* k0 = kpre + shared * hd;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
        // two keys a register (key 2j in lanes 0-7, 2j + 1 in 8-15), each pair built once for
        // all the task's rows: each lane's chain of FMAs is the one the 8-lane loop runs
        __m512 z[kAttnRows][4];
        _Pragma("GCC unroll 6") for (int r = 0; r < kAttnRows; ++r)
          for (int j = 0; j < 4; ++j) z[r][j] = _mm512_setzero_ps();
        // the cache streams from memory at long contexts: ask for the keys four groups ahead
        for (int64_t l = 0; l < 8 * hd; l += 16) __builtin_prefetch(k0 + 32 * hd + l, 0, 3);
        for (int64_t c = 0; c < hd; c += 8) {
          __m512 kp[4];
          for (int j = 0; j < 4; ++j)
            kp[j] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(k0 + 2 * j * hd + c)),
                                       _mm256_loadu_ps(k0 + (2 * j + 1) * hd + c), 1);
          _Pragma("GCC unroll 6") for (int r = 0; r < kAttnRows; ++r) {
            if (r < R) {
              const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(qrow(r) + c));
              for (int j = 0; j < 4; ++j) z[r][j] = _mm512_fmadd_ps(qv, kp[j], z[r][j]);
            }
          }
        }
        _Pragma("GCC unroll 6") for (int r = 0; r < kAttnRows; ++r) {
          if (r < R) {
            __m256 a[8];
            for (int j = 0; j < 4; ++j) {
              a[2 * j] = _mm512_castps512_ps256(z[r][j]);
              a[2 * j + 1] = _mm512_extractf32x8_ps(z[r][j], 1);
            }
            _mm256_storeu_ps(scores.get() + r * stride + shared, _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale)));
          }
        }
#else
        for (int r = 0; r < R; ++r) {
          const float* qr = qrow(r);
          __m256 a[8];
          for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
          for (int64_t c = 0; c < hd; c += 8) {
            const __m256 qv = _mm256_loadu_ps(qr + c);
            for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + j * hd + c), a[j]);
          }
          _mm256_storeu_ps(scores.get() + r * stride + shared, _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale)));
        }
#endif
      }
    }
#endif
    for (int r = 0; r < R; ++r) {
      const int64_t t = tok[r];
      const float* qr = qrow(r);
      float* sc = scores.get() + r * stride;
      const int64_t n = len + nblk[t], n8 = (n + 7) / 8 * 8;
      for (int64_t i = shared; i < n; ++i) {
        const float* kr = key(t, i);
        float d;
#if defined(SPECJAX_I8_VEC)
        if (vec) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t c = 0; c < hd; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + c), _mm256_loadu_ps(kr + c), acc);
          d = hsum8(acc);
        } else
#endif
        {
          d = 0.0f;
          for (int64_t c = 0; c < hd; ++c) d += qr[c] * kr[c];
        }
        sc[i] = d * scale;
      }
      float m = -3.0e38f;
      for (int64_t i = 0; i < n; ++i) m = std::max(m, sc[i]);
      for (int64_t i = n; i < n8; ++i) sc[i] = -1.0e30f;  // exp -> exactly 0
      float l;
#if defined(SPECJAX_I8_VEC)
      {
        __m256 lv = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(m);
        for (int64_t i = 0; i < n8; i += 8) {
          const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mv));
          _mm256_storeu_ps(sc + i, p);
          lv = _mm256_add_ps(lv, p);
        }
        l = hsum8(lv);
      }
#else
      {
        float lanes[8] = {};
        for (int64_t i = 0; i < n8; ++i) {
          sc[i] = exp_scalar(sc[i] - m);
          lanes[i % 8] += sc[i];
        }
        l = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      }
#endif
      const float inv = 1.0f / l;
      float* out_r = orow(r);
#if defined(SPECJAX_I8_VEC)
      if (hd == 64) {  // the sums in registers (the loop below keeps out_r in memory: it may alias v)
#if defined(__AVX512F__)
        invs[r] = inv;  // (the values after every row's weights: below)
#else
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; ++i) {
          const __m256 p = _mm256_set1_ps(sc[i]);
          const float* v = val(t, i);
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), acc[j]);
        }
        const __m256 iv = _mm256_set1_ps(inv);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out_r + 8 * j, _mm256_mul_ps(acc[j], iv));
#endif
        continue;
      }
#endif
      for (int64_t c = 0; c < hd; ++c) out_r[c] = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        const float p = sc[i];
        const float* v = val(t, i);
        for (int64_t c = 0; c < hd; ++c) out_r[c] += p * v[c];
      }
      for (int64_t c = 0; c < hd; ++c) out_r[c] *= inv;
    }
#if defined(SPECJAX_I8_VEC) && defined(__AVX512F__)
    if (hd == 64) {
      // the weighted values of all the task's rows: each prefix value is read once for them, and
      // every output lane is its own chain over the row's list in order (as in 8 lanes: the same bits)
      __m512 acc[kAttnRows][4];
      _Pragma("GCC unroll 6") for (int r = 0; r < kAttnRows; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t i = 0; i < len; ++i) {
        const float* v = vpre + i * hd;
        for (int l = 0; l < 4; ++l) __builtin_prefetch(v + 32 * hd + 16 * l, 0, 3);  // (32 values ahead; hd = 64 here)
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
        _Pragma("GCC unroll 6") for (int r = 0; r < kAttnRows; ++r) {
          if (r < R) {
            const __m512 p = _mm512_set1_ps(scores[r * stride + i]);
            acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
          }
        }
      }
      _Pragma("GCC unroll 6") for (int r = 0; r < kAttnRows; ++r) {
        if (r >= R) continue;
        const int64_t t = tok[r];
        for (int64_t i = len; i < len + nblk[t]; ++i) {  // the row's own block tokens
          const __m512 p = _mm512_set1_ps(scores[r * stride + i]);
          const float* v = val(t, i);
          for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * j), acc[r][j]);
        }
        const __m512 iv = _mm512_set1_ps(invs[r]);
        float* out_r = orow(r);
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out_r + 16 * j, _mm512_mul_ps(acc[r][j], iv));
      }
    }
#endif
  }, B * T);
  return ffi::Error::Success();
}

}  // namespace

// The exported handlers (rows_dot.py registers them, through its forwarders, under the
// specjax_* target names).
extern "C" void specjax_set_solo_rows(int64_t rows) { g_solo_rows.store(rows, std::memory_order_relaxed); }

#define SPECJAX_HANDLER(name) extern "C" XLA_FFI_Error* name(XLA_FFI_CallFrame* frame)
#define SPECJAX_GGUF_HANDLER(name, fn)                                                                   \
  SPECJAX_HANDLER(name) {                                                                                \
    ffi::Call c(frame);                                                                                  \
    if (!c.RunnableLayered({ffi::F32, ffi::ANY, ffi::F16}, {ffi::F32}, 1)) return c.error();              \
    return c.Result(fn(c.pool(), ffi::Buffer<ffi::F32>(c.arg(0)), ffi::AnyBuffer(c.arg(1)),              \
                       ffi::Buffer<ffi::F16>(c.arg(2)), ffi::ResultBuffer<ffi::F32>(c.ret(0))));          \
  }
SPECJAX_GGUF_HANDLER(SpecjaxRowsQ4_1, RowsGguf<false>)
SPECJAX_GGUF_HANDLER(SpecjaxRowsQ8_0, RowsGguf<true>)
SPECJAX_GGUF_HANDLER(SpecjaxRowsQ4_1I8, RowsGgufI8<false>)
SPECJAX_GGUF_HANDLER(SpecjaxRowsQ8_0I8, RowsGgufI8<true>)
SPECJAX_GGUF_HANDLER(SpecjaxRowsQ4_1Bf16, RowsGgufBf16<false>)
SPECJAX_GGUF_HANDLER(SpecjaxRowsQ8_0Bf16, RowsGgufBf16<true>)

SPECJAX_HANDLER(SpecjaxRowsPacked) {
  ffi::Call c(frame);
  if (!c.RunnableLayered({ffi::F32, ffi::F32}, {ffi::F32}, 1)) return c.error();
  return c.Result(RowsPacked(c.pool(), ffi::Buffer<ffi::F32>(c.arg(0)), ffi::Buffer<ffi::F32>(c.arg(1)),
                             ffi::ResultBuffer<ffi::F32>(c.ret(0))));
}

SPECJAX_HANDLER(SpecjaxBlockAttention) {
  ffi::Call c(frame);
  if (!c.Runnable({ffi::F32, ffi::F32, ffi::F32, ffi::F32, ffi::F32, ffi::S32, ffi::PRED, ffi::S32}, {ffi::F32}))
    return c.error();
  const ffi::Buffer<ffi::S32> li(c.arg(7));  // (an operand, not an attribute: a scan's loop counter)
  if (li.dimensions().size() != 0) return c.Result(ffi::Error::InvalidArgument("block_attention: layer must be a scalar"));
  const int64_t layer = *li.typed_data();
  using F = ffi::Buffer<ffi::F32>;
  return c.Result(BlockAttention(c.pool(), F(c.arg(0)), F(c.arg(1)), F(c.arg(2)), F(c.arg(3)), F(c.arg(4)),
                                 ffi::Buffer<ffi::S32>(c.arg(5)), ffi::Buffer<ffi::PRED>(c.arg(6)),
                                 ffi::ResultBuffer<ffi::F32>(c.ret(0)), layer));
}
