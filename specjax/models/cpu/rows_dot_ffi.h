// Shared by the rows kernel (rows_dot.cc) and its forwarders (rows_dot_stub.cc): the FFI C API
// and the answer to XLA's registration query, which both give in the same words.
#pragma once

#include "xla/ffi/api/c_api.h"

// True if `frame` is XLA's metadata query (then answered: the API version these headers are
// of, no traits); false for a call.
inline bool specjax_answer_metadata(XLA_FFI_CallFrame* frame) {
  XLA_FFI_Extension_Base* ext = frame->extension_start;
  if (ext == nullptr || ext->type != XLA_FFI_Extension_Metadata) return false;
  XLA_FFI_Metadata* md = reinterpret_cast<XLA_FFI_Metadata_Extension*>(ext)->metadata;
  md->api_version = XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  md->traits = 0;
  return true;
}
