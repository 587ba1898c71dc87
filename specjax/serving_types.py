"""The types the serving engine and its drafters share: a request, its output, the running state
of an admitted request, a proposal made before the policy chooses K, and one row's step result.

Both ``engine`` (the loop, the scheduler, the backend) and ``drafters`` (the protocol each kind
implements) import them from here, so neither package imports the other's internals for them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from specjax.sampling import SamplingParams


@dataclasses.dataclass
class Request:
    id: str
    prompt: Sequence[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    arrival: float = 0.0  # seconds after the start of the run
    ignore_eos: bool = False
    tag: str | None = None  # the client's label of the request (routing among several drafts)


@dataclasses.dataclass
class RequestOutput:
    id: str
    tokens: list[int]
    finish_reason: str  # "eos" | "length" | "error"
    prompt_len: int
    arrival: float
    admitted: float = float("nan")
    first_token: float = float("nan")
    finished: float = float("nan")
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    error: str | None = None
    last_token: float = float("nan")
    max_gap: float = 0.0  # the longest wait between two consecutive tokens (a streaming reader's worst stall)
    # Online distillation's teacher signal (a backend with teacher_topk): per output token from a
    # step (the first comes from the prefill and has none), the target's top-k token ids and
    # logits there, and the output indices where a draft was rejected (Algorithm 1's error index).
    teacher_ids: list = dataclasses.field(default_factory=list, repr=False)
    teacher_logits: list = dataclasses.field(default_factory=list, repr=False)
    teacher_from: int | None = None  # the output index of the first token with a teacher row
    rejected_at: list[int] = dataclasses.field(default_factory=list, repr=False)

    @property
    def latency(self) -> float:
        return self.finished - self.arrival

    def record_teacher(self, start: int, emitted: int, teacher: tuple, drafted: int, accepted: int) -> None:
        """Keep the teacher rows of the ``emitted`` tokens a step appended at output index ``start``."""
        if self.teacher_from is None:
            self.teacher_from = start
        ids, logits = teacher
        self.teacher_ids.append(ids[:emitted])
        self.teacher_logits.append(logits[:emitted])
        if accepted < drafted and accepted < emitted:
            self.rejected_at.append(start + accepted)


@dataclasses.dataclass
class Running:
    """A request that holds a KV row."""

    uid: int
    req: Request
    speculate: bool  # False: admitted with the draft disabled (prefill disabling)
    out: RequestOutput
    ctx_len: int = 0  # committed cache entries (the pending token is not in the cache yet)
    done: bool = False
    prefilling: bool = False  # its prompt is still being prefilled (chunked prefill): no steps yet


@dataclasses.dataclass
class Proposal:
    """What the backend knows before the policy picks K (see BatchView)."""

    draft_lens: list[int] | None = None
    drafts: list | None = None  # host drafters: the draft token arrays (for shadow verification)
    confidences: object = None
    true_accept: list[int] | None = None
    draft_scores: list | None = None  # tree drafters: per-node acceptance estimates (BatchView)
    draft_classes: list | None = None  # host drafters: the kind of match behind each proposal (BatchView)
    drafted_ahead: int = 0  # device draft forwards already run for this step (a draft call, Algorithm 3)
    draft_free: bool = False  # no device drafting this step whatever K (BatchView)


@dataclasses.dataclass
class RowResult:
    tokens: list[int]  # accepted drafts then the correction/bonus token
    drafted: int
    accepted: int
    # backends with a teacher_topk: the target's top-k (ids, logits) [len(tokens), k] behind
    # each of ``tokens`` (online distillation's teacher signal)
    teacher: tuple | None = None
