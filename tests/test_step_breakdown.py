"""benchmarks/step_breakdown.py's two readers, on made-up inputs: exclusive times of nested trace
events, and the rows kernel's calls named from optimized HLO text by weight format and shape."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("step_breakdown", os.path.join(ROOT, "benchmarks", "step_breakdown.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_exclusive_times_subtract_children_on_the_same_thread_only():
    sb = _module()
    ev = [{"name": "while", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
          {"name": "a", "ts": 10, "dur": 30, "pid": 1, "tid": 1},
          {"name": "b", "ts": 15, "dur": 5, "pid": 1, "tid": 1},  # inside a
          {"name": "a", "ts": 50, "dur": 20, "pid": 1, "tid": 1},
          {"name": "c", "ts": 20, "dur": 40, "pid": 1, "tid": 2}]  # another thread: nobody's child
    got = sb.exclusive_times(ev)
    assert got == {"while": 50, "a": 45, "b": 5, "c": 40}
    assert sb.exclusive_times.calls["a"] == 2


def test_custom_calls_are_named_by_format_and_shape(tmp_path):
    sb = _module()
    (tmp_path / "module_0001.jit_spec_decode.cpu_after_optimizations.txt").write_text(
        "  %fusion.3 = f32[1,576]{1,0} fusion(%p), kind=kLoop\n"
        "  %ffi_call.7 = f32[1,1536]{1,0} custom-call(%fusion.3, %codes, %scales, %i), "
        "custom_call_target=\"specjax_rows_q4_1\", api_version=API_VERSION_TYPED_FFI\n"
        "  %ffi_call.9 = f32[1,1,9,64]{3,2,1,0} custom-call(%q, %k), custom_call_target=\"specjax_block_attention\"\n")
    (tmp_path / "module_0002.jit_prefill.cpu_after_optimizations.txt").write_text(
        "  %ffi_call.1 = f32[8,576]{1,0} custom-call(%x), custom_call_target=\"specjax_rows_q8_0\"\n")
    labels = sb.custom_calls(str(tmp_path))
    assert labels == {"ffi_call.7": "rows kernel, q4_1 weight 576 x 1536", "ffi_call.9": "attention kernel"}
    assert sb.group_of("ffi_call.7", labels) == labels["ffi_call.7"]
    assert sb.group_of("while.3", labels).startswith("layer loop")
    assert sb.group_of("loop_fusion.12", labels) == "XLA fused element-wise ops"
