"""CPU-only kernels (XLA FFI custom calls built on first use)."""
