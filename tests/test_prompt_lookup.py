"""Prompt-lookup drafter: indexed propose() vs a brute-force backward scan,
hand-written edge cases, config validation, and a timing print."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specjax.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from specjax.errors import SpecjaxError


def ref_propose(history, k, cfg):
    """Rescan the whole history backwards for each n; obviously right, O(len * n)."""
    m = min(k, cfg.max_draft)
    if m <= 0:
        return []
    L = len(history)
    for n in range(cfg.max_ngram, cfg.min_ngram - 1, -1):
        if L < n:
            continue
        suffix = history[L - n :]
        for end in range(L - 1, n - 1, -1):  # end < L excludes the suffix itself
            if history[end - n : end] == suffix:
                return history[end : end + m]
    return []


def ref_class(history, k, cfg):
    """The n-gram length ref_propose matched (None: no proposal)."""
    if min(k, cfg.max_draft) <= 0:
        return None
    L = len(history)
    for n in range(cfg.max_ngram, cfg.min_ngram - 1, -1):
        if L >= n and any(history[end - n : end] == history[L - n :] for end in range(L - 1, n - 1, -1)):
            return n
    return None


def _propose(d, row, k):
    out = d.propose(row, k)
    assert out.dtype == np.int32 and out.ndim == 1
    return out.tolist()


# ---------------------------------------------------------------- randomized vs reference


@pytest.mark.parametrize(
    "min_n,max_n,max_draft,alphabet",
    [(1, 3, 8, 3), (1, 1, 4, 2), (2, 4, 8, 4), (3, 3, 5, 2), (1, 5, 16, 6), (2, 2, 3, 10)],
)
def test_matches_bruteforce(min_n, max_n, max_draft, alphabet):
    cfg = PromptLookupConfig(max_ngram=max_n, min_ngram=min_n, max_draft=max_draft)
    rng = np.random.default_rng(hash((min_n, max_n, max_draft, alphabet)) % 2**32)
    d = PromptLookupDrafter(cfg)
    calls = mismatches = nonempty = 0
    for req in range(60):
        row = int(rng.integers(0, 4))  # rows get reused, so start() must reset state
        history = rng.integers(0, alphabet, size=int(rng.integers(0, 12))).tolist()
        d.start(row, np.asarray(history) if req % 2 else history)  # arrays and lists
        for _ in range(int(rng.integers(10, 40))):
            k = int(rng.integers(0, max_draft + 4))
            got, want = _propose(d, row, k), ref_propose(history, k, cfg)
            calls += 1
            mismatches += got != want or d.draft_class(row) != ref_class(history, k, cfg)
            nonempty += bool(got)
            chunk = rng.integers(0, alphabet, size=int(rng.integers(0, 6))).tolist()
            d.extend(row, chunk)
            history += chunk
        d.finish(row)
    assert calls >= 1000 and calls // 10 < nonempty < calls  # both outcomes exercised
    assert mismatches == 0


# ---------------------------------------------------------------- hand-written cases


def test_no_match_is_empty():
    d = PromptLookupDrafter()
    d.start(0, [1, 2, 3, 4])
    assert _propose(d, 0, 5) == []
    d.start(1, [])
    assert _propose(d, 1, 5) == []
    d.start(2, [7])  # a lone token is only its own suffix
    assert _propose(d, 2, 5) == []


def test_match_at_very_start():
    d = PromptLookupDrafter(PromptLookupConfig(max_ngram=2, min_ngram=1))
    d.start(0, [5, 6, 7, 8, 9, 5, 6])
    assert _propose(d, 0, 3) == [7, 8, 9]


def test_overlapping_repeats_run_into_suffix():
    d = PromptLookupDrafter(PromptLookupConfig(max_ngram=3, min_ngram=1, max_draft=8))
    d.start(0, [1, 2, 1, 2, 1, 2])
    # Latest earlier [2,1,2] ends at 4; the continuation is just the final token.
    assert _propose(d, 0, 8) == [1, 2]
    d.start(1, [9, 9, 9, 9])
    assert _propose(d, 1, 8) == [9]  # [9,9,9] ending at 3 is the latest non-suffix one


def test_longest_ngram_wins_over_more_recent_shorter():
    d = PromptLookupDrafter(PromptLookupConfig(max_ngram=2, min_ngram=1))
    d.start(0, [1, 2, 3, 9, 2, 4, 1, 2])
    assert _propose(d, 0, 1) == [3]  # bigram [1,2] at 0..2, not the later unigram 2 -> 4


def test_k_and_max_draft_caps():
    d = PromptLookupDrafter(PromptLookupConfig(max_ngram=1, min_ngram=1, max_draft=3))
    d.start(0, [1, 10, 11, 12, 13, 14, 1])
    assert _propose(d, 0, 2) == [10, 11]
    assert _propose(d, 0, 100) == [10, 11, 12]
    assert _propose(d, 0, 0) == []
    assert _propose(d, 0, -1) == []


def test_extend_updates_index_and_rows_are_independent():
    d = PromptLookupDrafter(PromptLookupConfig(max_ngram=2, min_ngram=1))
    d.start(0, [1, 2, 3])
    d.start(1, [4, 5, 6, 4])
    assert _propose(d, 0, 4) == []
    assert _propose(d, 1, 4) == [5, 6, 4]
    d.extend(0, [1])
    assert _propose(d, 0, 4) == [2, 3, 1]
    assert _propose(d, 1, 4) == [5, 6, 4]  # row 1 unaffected by row 0
    d.finish(0)
    d.finish(0)  # idempotent
    with pytest.raises(SpecjaxError):
        d.propose(0, 4)
    with pytest.raises(SpecjaxError):
        d.extend(7, [1])
    assert _propose(d, 1, 4) == [5, 6, 4]


@pytest.mark.parametrize(
    "kwargs",
    [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_ngram=0), dict(max_draft=0)],
)
def test_invalid_config(kwargs):
    with pytest.raises(SpecjaxError):
        PromptLookupConfig(**kwargs)


# ---------------------------------------------------------------- timing (printed, not asserted)


def test_timing_8k_history(capsys):
    cfg = PromptLookupConfig()
    rng = np.random.default_rng(0)
    d = PromptLookupDrafter(cfg)
    t0 = time.perf_counter()
    d.start(0, rng.integers(0, 50, size=8192))
    t_start = time.perf_counter() - t0
    steps, t_prop, t_ext = 2000, 0.0, 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        d.propose(0, 8)
        t1 = time.perf_counter()
        d.extend(0, [int(rng.integers(0, 50))])
        t_ext += time.perf_counter() - t1
        t_prop += t1 - t0
    with capsys.disabled():
        print(
            f"\nprompt lookup, 8k history, ngram {cfg.min_ngram}-{cfg.max_ngram}: "
            f"start {t_start * 1e3:.1f} ms, propose {t_prop / steps * 1e6:.1f} us, "
            f"extend(1 token) {t_ext / steps * 1e6:.1f} us"
        )
