"""Process-level runtime settings for launch scripts (never set by importing the library)."""

from __future__ import annotations


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Persist compiled executables across runs so a second launch neither compiles nor traces,
    and a GGUF model's prepared arrays so that it loads without preparing them (models.prepared,
    in ``<path>/models``).

    Location: ``<path>/executables``, path defaulting to $SPECJAX_CACHE_DIR, else
    ~/.cache/specjax. The executables every generator and the engine run (StepTable) are stored
    there by specjax's own cache (engine.exe_cache), keyed without tracing the model and verified
    when read back (specjax.ondisk). A location that cannot be created or written: one warning,
    and the run goes on without the cache (returns None). jax's persistent cache stays off, and
    a user's setting of it is turned off with a warning: an executable jax reloads from it cannot
    be serialized again (jaxlib 0.10), and its entries are not verified (jax recompiles a
    truncated or flipped one, but runs whatever executable a swapped file holds: it crashed the
    run here, and with matching shapes it would compute the wrong function).
    """
    import jax

    from specjax import ondisk
    from specjax.engine import exe_cache
    from specjax.models import prepared

    if jax.config.jax_compilation_cache_dir:
        ondisk.warn_once("jax-cache", "jax's persistent compilation cache (%s) is turned off: specjax cannot "
                         "verify its entries; specjax's own verified cache keeps the executables",
                         jax.config.jax_compilation_cache_dir)
        jax.config.update("jax_compilation_cache_dir", None)
    where = ondisk.cache_dir("executables", root=path)
    exe_cache.set_directory(where)
    prepared.set_directory(ondisk.cache_dir("models", root=path) if where else None)
    return where
