"""The XLA:CPU settings the test suite compiles with (tests/conftest.py puts SUITE_XLA_FLAGS in
$XLA_FLAGS, so the launch scripts the tests run get them too).

Most of the suite's CPU time is compiling small programs it runs a few times, and the tests check
tokens, not speed, so the suite compiles for compile time: LLVM at -O0; fusions through XLA's
elemental emitters instead of its MLIR fusion emitters; one LLVM module per program instead of
several compiled in parallel (the two pytest workers already fill both cores). Together they take
about 55% off compile time (test_eagle + test_tree_attention_kernels: 81 s -> 36 s on the AVX2
EPYC) and the suite from 18:02 to about 12 minutes there. None of them changes what a test
compares: XLA fixes each reduction's order itself, LLVM never reorders float arithmetic without
fast-math flags, and every comparison is between programs built the same way.

The few programs a test runs long enough for run time to dominate (the statistical tests'
simulations) compile as XLA:CPU does by default instead: ``jax.jit(..., compiler_options=
RUN_TIME_OPTIONS)`` (with the fusion emitters off one of them ran 2x slower)."""

SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                   "--xla_cpu_parallel_codegen_split_count=1")
RUN_TIME_OPTIONS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
