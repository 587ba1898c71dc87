"""The serving engine's step event and the observers subscribed to it.

Each engine step produces one ``StepEvent`` (what was proposed, the K chosen, per-row drafts and
acceptances, the rows' results, timings) and the engine hands it to its observers in order: the
policy's feedback, the acceptance counts (what ``SpecStats`` and the simulator's measured
profile read), the step log, then those given to ``ServingEngine(observers=...)``. An observer
has two hooks because a step has two moments: ``on_step`` once the step's tokens are emitted and
before its finished requests leave (a policy must observe a request's last step before it is
told to forget the request), ``between_steps`` once they have left and their ``on_finish``
hooks ran (``engine.load()`` is then the next step's: work between steps, such as online
distillation's opportunistic update).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from specjax.goodput.acceptance import AcceptanceCounts
from specjax.goodput.selector import BatchView, DraftPrefillGate, Policy
from specjax.serving_types import Proposal, RowResult, Running
from specjax.tree import DraftTree

# The engine observers are handed (engine.loop.ServingEngine, which imports this module: named,
# not imported, here).
Engine = Any


@dataclasses.dataclass(frozen=True)
class StepEvent:
    t: float  # engine time at the step's end
    rows: Sequence[Running]  # the requests the step decoded, aligned with ``results``
    view: BatchView  # what the policy chose K from
    proposal: Proposal
    policy: Policy  # the policy that chose (with several drafts: the active draft's)
    k: int  # chosen by the policy
    k_step: int  # compiled block actually run (host drafts shrink it)
    tokens: int  # verify rows the step ran (a packed size, or bucket x (k_step + 1))
    results: Sequence[RowResult]
    emitted: Sequence[int]  # per row, tokens added to its output (EOS and max_new_tokens cut results')
    elapsed: float  # backend-reported (device or modelled) seconds
    wall: float  # the iteration up to its tokens emitted (== elapsed in the simulator)
    row_ops: tuple  # (op, bucket from, bucket to): cache resizes / clears the step also ran
    # one of the steps of a decode call as long as the backend runs (``wall``: the call's per step):
    # what a K costs once it runs on, without the ramp of short calls after a change of K
    full_call: bool = False
    # False for a decode call's steps after its first: the call is one timing (``wall`` is its
    # per step), which the policy's cost calibration takes once, not once per step
    first_of_call: bool = True
    # steps the device call that ran this one ran (1: a step alone); a call's own cost is shared by them
    call_len: int = 1
    # the step waited for a compilation, ran a stand-in or ran beside a background compile (a
    # lazily compiled job's first steps): its time is not what the step costs, so no policy
    # calibrates on it (its tokens and acceptance count as any step's)
    cold: bool = False

    @property
    def drafted(self) -> list[int]:
        return [r.drafted for r in self.results]

    @property
    def accepted(self) -> list[int]:
        return [r.accepted for r in self.results]


class Observer:
    """Subscribes to a ServingEngine's steps; either hook may be left as it is (nothing)."""

    def on_step(self, ev: StepEvent) -> None:
        """The step's outcome: its tokens are emitted, its finished requests have not left yet."""

    def between_steps(self, engine: Engine) -> None:
        """After the step's finished requests left (their on_finish hooks ran)."""


@dataclasses.dataclass
class StepRecord:
    """One engine step, for profiling, fidelity checks and plots."""

    t: float
    n: int
    bucket: int  # the live state's bucket the step ran at (>= the bucket of n until compacted)
    k: int  # chosen by the policy
    k_step: int  # compiled block actually run (host drafts shrink it)
    ctx_lens: list[int]
    elapsed: float  # backend-reported (device or modelled) seconds
    wall: float  # the iteration up to its tokens emitted, host work incl. (== elapsed in the simulator)
    generated: int
    drafted: int
    accepted: int
    row_ops: tuple = ()  # (op, bucket from, bucket to): cache resizes / clears the step also ran
    tokens: int = 0  # verify rows the step ran (a packed size, or bucket x (k_step + 1))
    cold: bool = False  # StepEvent.cold: its time is not the compiled step's


class StepLog(Observer):
    """Appends each step's ``StepRecord`` to ``steps`` (``ServingEngine.steps``)."""

    def __init__(self, steps: list[StepRecord]):
        self.steps = steps

    def on_step(self, ev: StepEvent) -> None:
        self.steps.append(StepRecord(ev.t, len(ev.rows), ev.view.bucket, ev.k, ev.k_step, ev.view.ctx_lens,
                                     ev.elapsed, ev.wall, sum(ev.emitted), sum(ev.drafted), sum(ev.accepted),
                                     ev.row_ops, ev.tokens, ev.cold))


class CountAcceptance(Observer):
    """Adds each step to ``counts`` (``ServingEngine.counts``), host proposal lengths included."""

    def __init__(self, counts: AcceptanceCounts):
        self.counts = counts

    def on_step(self, ev: StepEvent) -> None:
        p = ev.proposal
        lens = p.draft_lens if p.drafts is not None else None  # (device drafts are always K long)
        self.counts.add(ev.drafted, ev.accepted, ev.k, sum(ev.emitted), lens)


class PolicyFeedback(Observer):
    """What the policy (and the draft prefill gate) learns from a step, in this order: whether
    some row could draft, the verified rows' acceptance, shadow-verified host drafts, the
    step's time."""

    def __init__(self, gate: DraftPrefillGate | None):
        self.gate = gate
        # host drafts a K = 0 step did not verify: uid -> [tree, node reached, depth matched, class,
        # node scores]
        self._shadow: dict[int, list] = {}

    def on_step(self, ev: StepEvent) -> None:
        lens = ev.proposal.draft_lens
        if self.gate:
            self.gate.record(ev.k, lens is None or any(d > 0 for d in lens))
        ev.policy.observe(ev.k, ev.drafted, ev.accepted, ev.view.request_ids)
        self._shadow_verify(ev)
        if ev.first_of_call:
            # A step that also ran row ops (a new request's state cleared or allocated: 1.4-17 ms at
            # batch 1 here) is no measure of its K's cost either: counted, it set a K = 1 EAGLE
            # step's calibration to 1.23x, as the first step of a request, and SmartSpec's choice with it.
            ev.policy.observe_time(ev.view, ev.k_step, ev.tokens, ev.wall, ev.full_call, cold=ev.cold or bool(ev.row_ops),
                                   call_len=ev.call_len)
        for r in ev.rows:
            if r.done:
                self._shadow.pop(r.uid, None)

    def _shadow_verify(self, ev: StepEvent) -> None:
        """Host drafts cost nothing to make, so their acceptance can be learnt even when the
        step verified none of them: a greedy verifier accepts a draft token iff it equals the
        token the target generates there, so a draft offered but not verified is compared with
        the tokens the following steps generate (for a token tree: the path those tokens walk
        down it). Without this, a moving average that once dropped to ~0 would keep K = 0
        forever (nothing new is ever observed). Exact for greedy requests; for sampled ones it
        is the acceptance of a greedy-matching verifier."""
        prop = ev.proposal
        if prop.drafts is None:
            return
        classes = prop.draft_classes or [None] * len(ev.rows)
        scores = prop.draft_scores or [None] * len(ev.rows)
        for r, d, res, cls, sc in zip(ev.rows, prop.drafts, ev.results, classes, scores):
            sh = self._shadow.get(r.uid)
            if sh is None:
                if res.drafted > 0 or not len(d):
                    continue  # verified for real (observed above), or nothing was drafted
                d = d if isinstance(d, DraftTree) else DraftTree.chain(d)
                sh = self._shadow[r.uid] = [d, -1, 0, cls, sc]  # (-1: the root)
            draft, node, m, cls, sc = sh
            for t in res.tokens:
                nxt = draft.child(node, int(t))
                if nxt is None:
                    break
                node, m = nxt, m + 1
            else:
                if np.any(draft.parents == node):  # still matching and the tree goes on: wait
                    sh[1], sh[2] = node, m
                    continue
            del self._shadow[r.uid]
            ev.policy.observe(len(draft), [len(draft)], [m], [r.uid], [cls], [sc])


class BetweenSteps(Observer):
    """A callable run between steps with the engine (``ServingEngine(on_step=...)``)."""

    def __init__(self, fn: Callable[[Engine], None]):
        self.fn = fn

    def between_steps(self, engine: Engine) -> None:
        self.fn(engine)
