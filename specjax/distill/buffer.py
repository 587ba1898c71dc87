"""Distillation data from served requests, and the replay buffer the online loop trains from.

A ``Record`` is one finished request as the draft should learn it: the token sequence (prompt
and output) and, at each position whose next token the target verified, the target's top-k
there (``RequestOutput.teacher_ids`` / ``teacher_logits``, kept by the step itself). The
output indices where the draft was rejected (Algorithm 1's error index) come along.

``ReplayBuffer`` keeps the most recent records up to a budget of teacher rows (the oldest are
evicted first: the online loop follows the query distribution as it shifts) and cuts padded
training batches from them.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from specjax.errors import require


@dataclasses.dataclass(frozen=True)
class Record:
    tokens: np.ndarray  # [L] int32: prompt then output
    positions: np.ndarray  # [n] int32: the sequence positions whose logits predict the next token
    ids: np.ndarray  # [n, k] int32: the target's top-k token ids there
    logits: np.ndarray  # [n, k] float32: and its logits
    rejected: np.ndarray  # [m] int32: sequence positions where a draft was rejected

    @property
    def rows(self) -> int:
        return len(self.positions)

    @staticmethod
    def of(prompt, out) -> "Record | None":
        """The record of a finished RequestOutput from a backend with teacher_topk (None when it
        has no teacher rows: an error, or an answer of one token)."""
        if not out.teacher_ids or out.teacher_from is None:
            return None
        ids = np.concatenate(out.teacher_ids).astype(np.int32)
        logits = np.concatenate(out.teacher_logits).astype(np.float32)
        P = len(prompt)
        start = P + out.teacher_from - 1  # the position whose logits predicted output teacher_from
        tokens = np.asarray(list(prompt) + list(out.tokens), np.int32)
        return Record(tokens, np.arange(start, start + len(ids), dtype=np.int32), ids, logits,
                      np.asarray([P + i - 1 for i in out.rejected_at], np.int32))


class ReplayBuffer:
    """The newest records holding at most ``max_rows`` teacher rows in all."""

    def __init__(self, max_rows: int = 65536):
        require(max_rows > 0, f"the replay buffer needs room for at least one row, got {max_rows}")
        self.max_rows = max_rows
        self.records: collections.deque[Record] = collections.deque()
        self.rows = 0
        self.added = self.evicted = 0

    def __len__(self) -> int:
        return len(self.records)

    def add(self, rec: Record) -> None:
        self.records.append(rec)
        self.rows += rec.rows
        self.added += 1
        while self.rows > self.max_rows and len(self.records) > 1:
            old = self.records.popleft()
            self.rows -= old.rows
            self.evicted += 1

    def metadata(self) -> dict:
        """What a checkpoint keeps of the buffer (the records themselves are re-collected)."""
        return {"records": len(self.records), "rows": self.rows, "added": self.added, "evicted": self.evicted,
                "max_rows": self.max_rows}

    def batch(self, rng: np.random.Generator, n: int, length: int):
        """``n`` records drawn uniformly (with replacement), each cut to its last ``length``
        tokens and padded: (tokens [n, length] int32, ids [n, length, k], logits [n, length, k],
        mask [n, length] bool: where a teacher row is)."""
        require(len(self.records) > 0, "the replay buffer is empty")
        k = self.records[0].ids.shape[1]
        tokens = np.zeros((n, length), np.int32)
        ids = np.zeros((n, length, k), np.int32)
        logits = np.zeros((n, length, k), np.float32)
        mask = np.zeros((n, length), bool)
        for b, i in enumerate(rng.integers(0, len(self.records), n)):
            rec = self.records[int(i)]
            off = max(0, len(rec.tokens) - length)
            seq = rec.tokens[off:]
            tokens[b, :len(seq)] = seq
            keep = (rec.positions >= off) & (rec.positions < off + length)
            at = rec.positions[keep] - off
            ids[b, at], logits[b, at], mask[b, at] = rec.ids[keep], rec.logits[keep], True
        return tokens, ids, logits, mask
