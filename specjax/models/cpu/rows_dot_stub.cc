// Forwarding FFI handlers for the rows kernel (rows_dot.cc), registered under its target names.
//
// XLA:CPU looks an FFI target up when it compiles (or loads) a program that calls it, and the
// kernel's own build takes seconds of g++ (its vectorized loops). These forwarders include
// only the C API, build in a fraction of a second, and are what XLA sees: a program calling the
// kernel compiles while the kernel builds, and rows_dot.ensure() points each forwarder at the
// built handler (specjax_rows_stub_set) before any such program runs. Until then a call fails
// with an FFI error instead of running anything, and a registration query (the metadata
// extension) is answered as the kernel's handlers answer it: this API version, no traits.

#include "rows_dot_ffi.h"

namespace {

constexpr int kTargets = 8;
XLA_FFI_Handler* g_real[kTargets] = {};

XLA_FFI_Error* Pending(XLA_FFI_CallFrame* frame) {
  if (specjax_answer_metadata(frame)) return nullptr;
  XLA_FFI_Error_Create_Args args{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr,
                                 "specjax rows kernel called before it was loaded (rows_dot.ensure)",
                                 XLA_FFI_Error_Code_FAILED_PRECONDITION};
  return frame->api->XLA_FFI_Error_Create(&args);
}

template <int I>
XLA_FFI_Error* Forward(XLA_FFI_CallFrame* frame) {
  XLA_FFI_Handler* real = __atomic_load_n(&g_real[I], __ATOMIC_ACQUIRE);
  return real != nullptr ? real(frame) : Pending(frame);
}

}  // namespace

extern "C" {

// Points forwarder i at a built handler (once the kernel's library is loaded).
int specjax_rows_stub_set(int i, XLA_FFI_Handler* handler) {
  if (i < 0 || i >= kTargets) return 1;
  __atomic_store_n(&g_real[i], handler, __ATOMIC_RELEASE);
  return 0;
}

XLA_FFI_Error* specjax_rows_stub_0(XLA_FFI_CallFrame* f) { return Forward<0>(f); }
XLA_FFI_Error* specjax_rows_stub_1(XLA_FFI_CallFrame* f) { return Forward<1>(f); }
XLA_FFI_Error* specjax_rows_stub_2(XLA_FFI_CallFrame* f) { return Forward<2>(f); }
XLA_FFI_Error* specjax_rows_stub_3(XLA_FFI_CallFrame* f) { return Forward<3>(f); }
XLA_FFI_Error* specjax_rows_stub_4(XLA_FFI_CallFrame* f) { return Forward<4>(f); }
XLA_FFI_Error* specjax_rows_stub_5(XLA_FFI_CallFrame* f) { return Forward<5>(f); }
XLA_FFI_Error* specjax_rows_stub_6(XLA_FFI_CallFrame* f) { return Forward<6>(f); }
XLA_FFI_Error* specjax_rows_stub_7(XLA_FFI_CallFrame* f) { return Forward<7>(f); }

}  // extern "C"
