"""Static shape buckets: every jitted variant is keyed by padded sizes from these lists."""

from __future__ import annotations

from specjax.errors import SpecjaxError

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_PROMPT_BUCKET = 16
MIN_SLOT_BUCKET = 256


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
