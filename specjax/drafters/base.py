"""Host drafters: proposers of tokens from each request's token history (prompt lookup,
suffix trees). They implement ``start / extend / propose / finish`` per request
(``propose_tree`` for token trees); the engine runs them through ``drafters.host``, one kind of
the engine's drafter protocol (``drafters.protocol.Drafter``).
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
