"""Process-level runtime settings for launch scripts (never set by importing the library)."""

from __future__ import annotations

import os


def enable_compilation_cache(path: str | None = None) -> str:
    """Persist XLA executables across runs so a second launch skips compilation.

    Location: $SPECJAX_CACHE_DIR, else ~/.cache/specjax/jax.
    """
    import jax

    path = path or os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specjax", "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
