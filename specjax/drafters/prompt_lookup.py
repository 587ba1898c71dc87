"""Prompt-lookup (n-gram) drafting on the host.

Drafts by copying: find the most recent earlier place where the history's last
n tokens occurred and propose what followed them there. Runs every decoding
step for every row, so lookups go through a per-row index instead of rescanning
the history: for each n, a dict from n-gram to the end (exclusive) of its latest
occurrence strictly before the current end of history.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specjax.errors import require

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class PromptLookupConfig:
    max_ngram: int = 3  # try the longest suffix n-gram first
    min_ngram: int = 1
    max_draft: int = 8  # upper bound on proposed tokens (caller may ask fewer)

    def __post_init__(self):
        require(
            1 <= self.min_ngram <= self.max_ngram,
            f"prompt lookup needs 1 <= min_ngram <= max_ngram, got "
            f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}",
        )
        require(self.max_draft >= 1, f"prompt lookup max_draft must be >= 1, got {self.max_draft}")


class _Row:
    __slots__ = ("history", "index", "last_n")

    def __init__(self, ns: range):
        self.history: list[int] = []
        self.last_n: int | None = None  # the n-gram length behind the last proposal (None: no match)
        # index[j][gram] = end of the latest occurrence of gram (n = ns[j]) with end < len(history).
        self.index: list[dict[tuple, int]] = [{} for _ in ns]


def _as_ints(tokens: Sequence[int]) -> list[int]:
    # Plain ints hash/compare fastest and keep numpy scalars out of the dict keys.
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False).ravel().tolist()
    return [int(t) for t in tokens]


class PromptLookupDrafter:
    """Per-row n-gram drafter; rows are batch slots reused across requests."""

    def __init__(self, config: PromptLookupConfig = PromptLookupConfig()):
        self.config = config
        self._ns = range(config.min_ngram, config.max_ngram + 1)
        self._rows: dict[int, _Row] = {}

    def start(self, row: int, tokens: Sequence[int]) -> None:
        """Begin a request in batch row `row` with its prompt tokens (the history)."""
        self._rows[row] = _Row(self._ns)
        self.extend(row, tokens)

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """Append newly accepted/generated tokens to the row's history."""
        state = self._get(row)
        h, index, ns = state.history, state.index, self._ns
        for tok in _as_ints(tokens):
            # Appending pushes the current end back by one, so the n-grams ending
            # there stop being "the suffix" and become lookup targets. Indexing
            # them only now keeps the suffix itself out of the index.
            end = len(h)
            for j, n in enumerate(ns):
                if end < n:
                    break  # ns ascend, so longer grams don't fit either
                index[j][tuple(h[end - n : end])] = end  # later ends overwrite: most recent wins
            h.append(tok)

    def propose(self, row: int, k: int) -> np.ndarray:
        """Up to min(k, max_draft) int32 draft tokens continuing the row's history (maybe empty).

        Longest suffix n-gram with an earlier occurrence wins; the draft is what
        followed its most recent earlier occurrence, possibly running into the
        suffix itself, up to the end of history."""
        state = self._get(row)
        m = min(k, self.config.max_draft)
        h = state.history
        state.last_n = None
        if m <= 0:
            return _EMPTY.copy()
        for j in range(len(self._ns) - 1, -1, -1):
            n = self._ns[j]
            if len(h) < n:
                continue
            end = state.index[j].get(tuple(h[-n:]))
            if end is not None:  # end < len(h), so the continuation is non-empty
                state.last_n = n
                return np.array(h[end : end + m], dtype=np.int32)
        return _EMPTY.copy()

    def draft_class(self, row: int) -> int | None:
        """The n-gram length the row's last proposal matched: its acceptance depends on it far
        more than on the request (on Spec-Bench with SmolLM2, a first draft token is accepted
        0.19 of the time after a 1-gram match and 0.73 after a 3-gram one), so the goodput
        policy keeps an acceptance rate per class."""
        return self._get(row).last_n

    def finish(self, row: int) -> None:
        """Drop the row's state; a no-op for a row that is not active."""
        self._rows.pop(row, None)

    def _get(self, row: int) -> _Row:
        state = self._rows.get(row)
        require(state is not None, f"prompt lookup row {row} has no active request (call start first)")
        return state


def config(k: int, min_ngram: int = 1, max_ngram: int = 3, max_draft: int = 0) -> PromptLookupConfig:
    """Validated before the model load (SpecjaxError on bad n-gram bounds). max_draft: at most
    this many drafts per step; 0 means K."""
    return PromptLookupConfig(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=min(max_draft or k, max(k, 1)))


def config_of(spec) -> PromptLookupConfig:
    """A DrafterSpec's prompt-lookup settings."""
    return config(spec.k, spec.pld_min_ngram, spec.pld_max_ngram, spec.pld_max_draft)


def build(model, spec, draft=None):
    """The ``prompt_lookup`` kind from its DrafterSpec (drafters.table)."""
    from specjax.drafters.host import host_drafter

    return host_drafter(PromptLookupDrafter(config_of(spec)))
