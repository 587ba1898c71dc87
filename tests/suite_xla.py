"""The XLA:CPU settings the test suite compiles with (tests/conftest.py puts SUITE_XLA_FLAGS in
$XLA_FLAGS, so the launch scripts the tests run get them too).

Most of the suite's CPU time is compiling small programs it runs a few times, and the tests check
tokens, not speed, so the suite compiles for compile time: LLVM at -O0; fusions through XLA's
elemental emitters instead of its MLIR fusion emitters; one LLVM module per program instead of
several compiled in parallel (the two pytest workers already fill both cores). Together they take
about 55% off compile time (test_eagle + test_tree_attention_kernels: 81 s -> 36 s on the AVX2
EPYC) and the suite from 18:02 to 10:05 there. None of them changes what a test
compares: XLA fixes each reduction's order itself, LLVM never reorders float arithmetic without
fast-math flags, and every comparison is between programs built the same way.

The few programs a test runs long enough for run time to dominate (the statistical tests'
simulations) compile as XLA:CPU does by default instead: ``jax.jit(..., compiler_options=
run_time_options())`` (with the fusion emitters off one of them ran 2x slower)."""

import os
import subprocess
import sys

SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                   "--xla_cpu_parallel_codegen_split_count=1")
RUN_TIME_OPTIONS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
_CHECKED = "SPECJAX_SUITE_XLA_FLAGS"  # (set once checked: the xdist workers inherit it)


def suite_flags() -> tuple[str, ...]:
    """SUITE_XLA_FLAGS if this jaxlib's XLA takes them all, else the -O0 flag alone: XLA aborts
    the process on a flag it does not know, and a later XLA may drop the emitter switch. Checked
    once per run, in a child process (about 2 s)."""
    if _CHECKED not in os.environ:
        env = dict(os.environ, XLA_FLAGS=" ".join(SUITE_XLA_FLAGS), JAX_PLATFORMS="cpu")
        ok = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                            capture_output=True).returncode == 0
        os.environ[_CHECKED] = " ".join(SUITE_XLA_FLAGS if ok else SUITE_XLA_FLAGS[:1])
    return tuple(os.environ[_CHECKED].split())


def run_time_options() -> dict:
    """RUN_TIME_OPTIONS, less the emitter switch where this XLA does not take it."""
    if "--xla_cpu_use_fusion_emitters=false" in suite_flags():
        return RUN_TIME_OPTIONS
    return {"xla_backend_optimization_level": 3}
