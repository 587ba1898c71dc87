"""The synthetic Markov target P and draft Q (logits tables prev -> next over V tokens) shared
by the statistical losslessness tests of chain and tree verification."""

from __future__ import annotations

import numpy as np

V = 6
X0 = 2  # the row's last token before generation (the first block's "pending")


def _tables():
    rng = np.random.default_rng(1234)
    P = (1.0 * rng.standard_normal((V, V))).astype(np.float32)
    Q = (1.3 * rng.standard_normal((V, V))).astype(np.float32)
    # Make the draft deliberately imperfect but related on a few rows (realistic acceptance mix).
    Q[::2] = 0.5 * Q[::2] + 0.5 * P[::2]
    return P, Q


P_TABLE, Q_TABLE = _tables()
