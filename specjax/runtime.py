"""Process-level runtime settings for launch scripts (never set by importing the library)."""

from __future__ import annotations

import os


def enable_compilation_cache(path: str | None = None) -> str:
    """Persist compiled executables across runs so a second launch neither compiles nor traces.

    Location: $SPECJAX_CACHE_DIR, else ~/.cache/specjax/jax. The executables every generator and
    the engine run (StepTable) are stored there by specjax's own cache (engine.exe_cache), keyed
    without tracing the model. jax's persistent cache is left off on purpose: an executable jax
    reloads from it cannot be serialized again (jaxlib 0.10), and the small jits outside the
    table compile in milliseconds.
    """
    from specjax.engine import exe_cache

    path = path or os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specjax", "jax")
    exe_cache.set_directory(os.path.join(path, "specjax-executables"))
    return path
