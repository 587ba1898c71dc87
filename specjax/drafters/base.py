"""The drafter protocol.

A drafter is either host-side (proposes tokens from the token history: prompt
lookup, suffix trees) or device-side (runs inside the jitted step: an independent
draft model, or the target's own first layers; see ``drafters.device``). Host drafters
implement ``start / extend / propose / finish`` per request (``propose_tree`` for token trees).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class HostDrafter(Protocol):
    def start(self, row: int, tokens: Sequence[int]) -> None: ...

    def extend(self, row: int, tokens: Sequence[int]) -> None: ...

    def propose(self, row: int, k: int) -> np.ndarray: ...

    def finish(self, row: int) -> None: ...


class NoDrafter:
    """Proposes nothing (K = 0 every step): the autoregressive baseline through the spec path."""

    def start(self, row, tokens):
        pass

    def extend(self, row, tokens):
        pass

    def propose(self, row, k):
        return np.zeros((0,), np.int32)

    def finish(self, row):
        pass
