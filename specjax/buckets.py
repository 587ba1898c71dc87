"""Static shape buckets: every jitted variant is keyed by padded sizes from these lists."""

from __future__ import annotations

from specjax.errors import SpecjaxError

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_PROMPT_BUCKET = 16
MIN_SLOT_BUCKET = 256
# Prompts are prefilled in chunks of at most this many tokens: one chunk's attention sees the
# cached prefix plus itself, so the cost grows with the prompt, never with a power-of-two pad
# of it (measured in benchmarks/prefill_speed.py). A chunk is also the prefix store's unit of
# reuse: 256 lets a shared 1.3k-token block be reused to within 256 tokens instead of 512, at the
# same prefill speed on a CPU (compute-bound at either size).
DEFAULT_PREFILL_CHUNK = 256
DEFAULT_PREFIX_CACHE_MB = 1024  # the prefix store's budget (engine.prefix_store), MiB
SPLIT_MIN = 128  # prefill_chunks: the smallest chunk a padded tail is split into


def pick(buckets, n: int, what: str) -> int:
    for b in sorted(buckets):
        if b >= n:
            return b
    raise SpecjaxError(f"{what} {n} exceeds the largest bucket {max(buckets)}")


def pow2_bucket(n: int, minimum: int, maximum: int | None = None) -> int:
    b = minimum
    while b < n:
        b *= 2
    if maximum is not None:
        b = min(b, maximum)
    return b


def prompt_bucket(n: int, max_len: int) -> int:
    return pow2_bucket(max(n, 1), MIN_PROMPT_BUCKET, max_len)


def prefill_chunks(n: int, max_chunk: int = DEFAULT_PREFILL_CHUNK) -> list[tuple[int, int]]:
    """How a prompt of ``n`` tokens is prefilled: ``(start, size)`` chunks, sizes among the
    powers of two from MIN_PROMPT_BUCKET to ``max_chunk``. Full chunks first; the tail takes the
    smallest size that holds it when that wastes at most a quarter of the chunk, else half of it
    and goes on. Chunks under SPLIT_MIN are never split: every chunk re-reads all the weights, so
    a small one costs about a weight read whatever its padding. Only the last chunk is padded."""
    check_prefill_chunk(max_chunk)
    out, start = [], 0
    n = max(int(n), 1)
    while n - start >= max_chunk:
        out.append((start, max_chunk))
        start += max_chunk
    while start < n:
        r = n - start
        c = pow2_bucket(r, MIN_PROMPT_BUCKET, max_chunk)
        if c - r > c // 4 and c // 2 >= SPLIT_MIN:
            c //= 2
        out.append((start, c))
        start += c
    return out


def check_prefill_chunk(c: int, name: str = "the prefill chunk") -> None:
    if c < MIN_PROMPT_BUCKET or c & (c - 1):
        raise SpecjaxError(f"{name} must be a power of two >= {MIN_PROMPT_BUCKET}, got {c}")


def largest_chunk(prefill_chunk: int, slots: int) -> int:
    """The largest prefill chunk a cache of ``slots`` runs: ``prefill_chunk``, never more than the
    cache holds."""
    check_prefill_chunk(prefill_chunk)
    return min(int(prefill_chunk), 1 << (int(slots).bit_length() - 1))


def prefill_tokens(n: int, max_chunk: int = DEFAULT_PREFILL_CHUNK) -> int:
    """Tokens a prefill of ``n`` prompt tokens runs, padding included (what it costs)."""
    return sum(c for _, c in prefill_chunks(n, max_chunk))


def chunk_sizes(prompt_lens, max_chunk: int = DEFAULT_PREFILL_CHUNK) -> set[tuple[int, bool]]:
    """The (chunk size, first chunk?) pairs the prefills of these prompt lengths run."""
    return {(c, s == 0) for n in prompt_lens for s, c in prefill_chunks(n, max_chunk)}


def slot_bucket(n: int, max_len: int) -> int:
    return pow2_bucket(max(n, 1), MIN_SLOT_BUCKET, max_len)


def context_slot_buckets(max_position: int) -> tuple[int, ...]:
    """Cache-size buckets (powers of two from MIN_SLOT_BUCKET) up to the full context."""
    out, s = [], MIN_SLOT_BUCKET
    while s < max_position:
        out.append(s)
        s *= 2
    return tuple(out) + (max_position,)


def proposal_bucket(k_options, longest: int) -> int:
    """The smallest compiled proposal size (K drafts, or draft nodes of a tree) that holds the
    longest proposal in a batch. A verify block costs more than a decode step even when its
    drafts are padding, so the backend, the simulator and the selector all run (and charge)
    this bucket, never a larger one."""
    for k in sorted(k_options):
        if k >= longest:
            return k
    raise SpecjaxError(f"a proposal of {longest} tokens exceeds the largest compiled size {max(k_options)}")


def token_buckets(batch: int, k: int, k_options) -> tuple[int, ...]:
    """Packed-token sizes compiled for a verify step of batch bucket ``batch`` and K = ``k``
    (per-request draft counts, llama.forward's ``pack``): the token count of a batch-level step
    at each smaller compiled K, ``batch * (j + 1)`` for 0 <= j < k (j = 0: as many tokens as
    rows, enough when some rows are free or idle). The unpacked block, ``batch * (k + 1)``, is
    the step itself. A batch of 1 has none (its one row's tokens are its K)."""
    if batch <= 1 or k <= 0:
        return ()
    return tuple(batch * (j + 1) for j in sorted(k_options) if 0 <= j < k)


def token_bucket(batch: int, k: int, k_options, n_tokens: int) -> int:
    """The smallest packed size for ``n_tokens`` real tokens in a (batch, k) step, or 0 when only
    the unpacked block holds them (the one rule of the backend and the selector)."""
    return next((t for t in token_buckets(batch, k, k_options) if t >= n_tokens), 0)
