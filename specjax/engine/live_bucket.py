"""Which batch bucket the engine's live KV state has, and when it changes.

The real backend keeps one ``[B, S]`` cache state for all running requests. It grows to the
bucket of the running batch as soon as admissions need more rows, and shrinks only after the
batch has fit a smaller bucket for ``patience`` consecutive steps: a resize copies the whole
cache (and on a fresh buffer pays its page faults), so it must not oscillate. Meanwhile a batch
of 1 may well run the batch-4 executable. The rule is pure bookkeeping so that the real backend
(which performs the copies) and the simulator (which charges them) make the same decisions, and
so that the policy plans with the bucket the step will actually run at. ``usable`` (the real
backend after a lazy warm-up) names the buckets it may shrink into now: one whose executables
are still compiling is skipped, the rows running on in the larger one meanwhile.
"""

from __future__ import annotations

from typing import Callable, Sequence

from specjax import buckets as bk


class LiveBucket:
    def __init__(self, batch_buckets: Sequence[int], patience: int = 8,
                 usable: Callable[[int], bool] | None = None):
        self.buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
        self.patience = int(patience)
        self.usable = usable or (lambda B: True)
        self.reset()

    def reset(self) -> None:
        self.B = 0  # no state yet
        self._small = 0  # consecutive steps whose batch fit a smaller bucket

    def fit(self, n: int) -> int:
        return bk.pick(self.buckets, n, "running requests")

    def grow(self, n_total: int) -> tuple[int, int] | None:
        """Before admitting: make room for ``n_total`` running requests. Returns (old, new)
        bucket when the state must be (re)allocated, else None."""
        need = self.fit(n_total)
        if need <= self.B:
            return None
        old, self.B = self.B, need
        self._small = 0
        return old, need

    def _target(self, n: int) -> int:
        """The smallest bucket of n requests the state may shrink into now (else its own)."""
        return next(b for b in self.buckets if b >= self.fit(n) and (b >= self.B or self.usable(b)))

    def _shrink_target(self, n: int) -> tuple[int, int]:
        """(target bucket, counter after this step) for a step of n running requests."""
        if self.B <= 1 or n == 0:
            return self.B, 0
        target = self._target(n)
        small = self._small + 1 if target < self.B else 0
        return (target, 0) if small >= self.patience else (self.B, small)

    def peek(self, n: int) -> int:
        """The bucket a step of ``n`` running requests will run at (no state change)."""
        return max(self._shrink_target(n)[0], self.fit(n)) if self.B else self.fit(n)

    def steps_left(self, n: int) -> int | None:
        """Steps of ``n`` requests, counting the one before_step just applied, after which the
        state compacts (a decode call runs no more, so that the compaction happens on time);
        None: it will not compact at ``n``."""
        return self.patience - self._small if self.B > 1 and n and self._target(n) < self.B else None

    def ran(self, n: int, steps: int) -> None:
        """A decode call ran ``steps`` more steps of ``n`` requests after its before_step: they
        count toward the patience too (a compaction they earn happens at the next before_step)."""
        if self.B > 1 and n and steps > 0 and self._target(n) < self.B:
            self._small = min(self._small + steps, self.patience - 1)

    def before_step(self, n: int) -> tuple[int, int] | None:
        """Apply the shrink rule for a step of ``n`` requests; (old, new) when it compacts."""
        target, self._small = self._shrink_target(n)
        if target == self.B:
            return None
        old, self.B = self.B, target
        return old, target
