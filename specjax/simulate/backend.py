"""``SimBackend``: the ``engine.loop.Backend`` protocol with modelled time and drawn acceptance.

Time: a prefill costs ``cost.prefill_time`` per prefill batch; a step costs
``cost.step_time(bucket, k_step, ctx_lens, n)`` (draft + target + host overhead), exactly what
the selector believes when the model is right, so fidelity errors come from the model alone.
Acceptance: before each step every request draws how many drafts it *would* accept from an
unbounded proposal, position j surviving with probability ``per_position[j]`` (measured on a
real run); a step of K drafts accepts ``min(that, drafts)``. The draw is made before the policy
chooses and handed to it as ``true_accept``, which only the oracle policy reads (the paper's
'optimal' predictor that knows the accepted lengths). Host drafters propose for a request
with a proposal length drawn from the lengths measured on a real run (prompt lookup and suffix
trees often find nothing, or less than K), or with probability ``propose_prob`` a full draft. A device tree drafter (``tree_paths``) draws
one of a real run's accepted paths per request and step instead, and proposes its nodes with
the scores its own ``TreeNodeRates`` learn, as the real drafter does.
Batch buckets, compiled K values, KV rows and slots mirror the real backend's, so the same
scheduler decisions (admission, padding to buckets) happen in both. The live state's bucket
follows the real backend's rule (``engine.live_bucket``: grow at once, compact after
``shrink_patience`` small steps), so a step is charged at the bucket it really runs at, and the
cache operations that rule implies (allocation, resize copies, clearing freed rows) are charged
what the profile measured for them (``cost.row_op_time``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specjax import buckets as bk
from specjax.engine.live_bucket import LiveBucket
from specjax.engine import prefix_store
from specjax.engine.prefill_jobs import PrefillQueue, make_jobs
from specjax.engine.prefix_store import PrefixStore
from specjax.engine.loop import EventClock, Proposal, RowResult, ServingEngine
from specjax.engine.scheduler import Request, RequestOutput, Running
from specjax.goodput.acceptance import AcceptanceCounts, TreeNodeRates
from specjax.goodput.perf_model import StepCostModel
from specjax.goodput.selector import DraftPrefillGate, Policy


@dataclasses.dataclass(frozen=True)
class AcceptanceProfile:
    """per_position[j] = P(draft j accepted | drafts < j accepted); positions past the list
    reuse its last value. Host drafters: with ``draft_len_dist`` (P(a proposal has n tokens),
    n = 0, 1, ..., when asked for the largest compiled K) the proposal length is drawn from it;
    otherwise a request gets a full-length draft with probability ``propose_prob``."""

    per_position: tuple[float, ...] = (0.7,)
    propose_prob: float = 1.0
    draft_len_cap: int | None = None  # host drafters: longest draft they ever return
    draft_len_dist: tuple[float, ...] | None = None
    # A device tree drafter (a head's best-first trees): the accepted node numbers of each tree
    # of ``tree_nodes`` nodes a real run verified; a step draws one per request, and a budget of
    # m nodes accepts the path's nodes <= m (the m-node tree is the first m nodes).
    tree_paths: tuple[tuple[int, ...], ...] | None = None
    tree_nodes: int = 0
    tree_forwards: int = 0  # draft forwards one of those trees cost (ModelDraft.tree_forwards; 0: unknown)

    def rate(self, j: int) -> float:
        return self.per_position[min(j, len(self.per_position) - 1)] if self.per_position else 0.0

    @staticmethod
    def measured(engines: Sequence[ServingEngine]) -> "AcceptanceProfile":
        """Pooled from real engine runs' counts: the conditional per-position rates (accepted /
        examined, which is what ``rate`` chains; accepted / drafted would count the positions
        after a rejection as rejections too) and, for host drafters, the proposal lengths."""
        c = AcceptanceCounts.merged(e.counts for e in engines)
        return AcceptanceProfile(per_position=tuple(c.conditional_acceptance) or (0.0,),
                                 propose_prob=c.propose_rate if c.offered else 1.0, draft_len_dist=c.draft_len_dist,
                                 **tree_paths_of(getattr(e.backend, "drafter", None) for e in engines))


def tree_paths_of(drafters) -> dict:
    """The AcceptanceProfile fields of the device trees these drafters verified (their
    ``paths``: nodes verified, accepted nodes): the paths of the largest trees; {} if none."""
    uniq = {id(d): d for d in drafters}  # (engines may share a drafter; a simulated backend has none)
    seen = [x for d in uniq.values() for x in getattr(d, "paths", ())]
    if not seen:
        return {}
    n = max(d for d, _ in seen)
    forwards = max((d.draft.tree_forwards() for d in uniq.values() if getattr(d, "paths", ())), default=0)
    return dict(tree_paths=tuple(p for d, p in seen if d == n), tree_nodes=n, tree_forwards=forwards)


class SimBackend:
    def __init__(self, cost: StepCostModel, accept: AcceptanceProfile, *, device_draft: bool,
                 k_buckets: Sequence[int] = (0, 1, 2, 3, 4, 5), batch_buckets: Sequence[int] = (1, 2, 4, 8),
                 slots: int = 512, seed: int = 0, shrink_patience: int = 8, packed: bool = False,
                 prefill_chunk: int = bk.DEFAULT_PREFILL_CHUNK, prefill_rows: int | None = None,
                 prefix_cache_mb: float = 0, kv_bytes_per_token: int = 0):
        """``prefill_rows``: requests per prefill call (BackendOptions.prefill_rows_on; None: the
        largest batch bucket, an accelerator's rule). ``prefix_cache_mb``: a prefix store of that
        budget (engine.prefix_store, the engine's rule; stored chunks cost ``kv_bytes_per_token``
        a token): chunks it holds are not prefilled, so not charged."""
        self.cost = cost
        self.packed = packed  # charge packed verify blocks (per-row draft counts) by their real tokens
        self.accept = accept
        self.device_draft = device_draft
        self.k_buckets = tuple(sorted(set(k_buckets)))
        self.k_max = self.k_buckets[-1]
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.num_rows = self.batch_buckets[-1]
        self.prefill_rows = prefill_rows or self.num_rows
        self.slots = slots
        self.max_chunk = bk.largest_chunk(prefill_chunk, slots)
        self.rng = np.random.default_rng(seed)
        self._would: dict[int, int] = {}
        self._lens: dict[int, int] = {}
        self.last_k_step = 0
        self.live = LiveBucket(self.batch_buckets, shrink_patience)
        self._running = 0  # rows held: decoding or being prefilled
        self._to_clear = False
        self.prefills = PrefillQueue()
        self.prefix = PrefixStore(int(prefix_cache_mb * 2 ** 20)) if prefix_cache_mb > 0 else None
        self.kv_bytes_per_token = int(kv_bytes_per_token)
        # a device tree drafter: its node rates (the scores SmartSpec sizes trees by) and each
        # request's drawn path for the coming step
        self.rates = TreeNodeRates() if accept.tree_paths else None
        self._paths: dict = {}
        self._pending_t = 0.0  # row-op time of admissions, charged with their first chunks
        self.row_ops: list[tuple[str, int, int]] = []

    def _row_op(self, t: tuple[int, int] | None) -> float:
        if t is None:
            return 0.0
        op = ("alloc", 0, t[1]) if t[0] == 0 else ("take", t[0], t[1])
        self.row_ops.append(op)
        return self.cost.row_op_time(*op)

    def take_row_ops(self) -> list[tuple[str, int, int]]:
        ops, self.row_ops = self.row_ops, []
        return ops

    def step_bucket(self, n: int) -> int:
        return self.live.peek(n)

    def bucket(self, n: int) -> int:
        return bk.pick(self.batch_buckets, n, "running requests")

    def k_options(self, bucket: int) -> Sequence[int]:
        return self.k_buckets

    def k_coming(self, bucket: int) -> Sequence[int]:
        return ()

    def want(self, bucket: int, k: int) -> None:
        pass  # (every K is compiled from the start)

    def start_prefill(self, rs: Sequence[Running]) -> None:
        self._pending_t += self._row_op(self.live.grow(self._running + len(rs)))
        self._running += len(rs)
        self.prefills.add(make_jobs(rs, self.device_draft, self.prefill_rows, self.max_chunk))

    def advance_prefill(self, budget: int | None = None) -> tuple[list[tuple[Running, int]], float]:
        """As JaxBackend.advance_prefill, each chunk charged as a prefill of its padded tokens."""
        t, self._pending_t = self._pending_t, 0.0

        def run_chunk(job, start, size):
            nonlocal t
            t += self.cost.prefill_time(self.bucket(len(job.rs)), size, draft=job.run_draft)
            n = [min(max(len(r.req.prompt) - start, 0), size) for r in job.rs]
            prefix_store.after_chunk(self.prefix, job, start, size, n, size * self.kv_bytes_per_token, lambda b: None)

        done = self.prefills.run(budget, run_chunk, self.bucket, lambda job: prefix_store.start_job(self.prefix, job))
        return [(r, 0) for job in done for r in job.rs], t

    def _draw_would_accept(self, cap: int) -> int:
        n = 0
        while n < cap and self.rng.random() < self.accept.rate(n):
            n += 1
        return n

    def propose(self, rs: Sequence[Running], k_max: int, threshold: float | None = None) -> Proposal:
        """``threshold`` is ignored: the simulator has no model of draft confidences, so a
        confidence policy estimates from its moving average here."""
        if self.rates is not None:  # (the oracle's true_accept is a chain's: none for trees)
            tp = self.accept.tree_paths
            self._paths = {r.uid: tp[int(self.rng.integers(len(tp)))] for r in rs}
            self._lens = {r.uid: (min(k_max, self.accept.tree_nodes) if r.speculate else 0) for r in rs}
            sc = self.rates.scores(min(k_max, self.accept.tree_nodes))
            return Proposal(draft_lens=[self._lens[r.uid] for r in rs],
                            draft_scores=[sc if self._lens[r.uid] else None for r in rs])
        self._would = {r.uid: self._draw_would_accept(k_max) for r in rs}
        if self.device_draft:
            self._lens = {r.uid: (k_max if r.speculate else 0) for r in rs}
            return Proposal(draft_lens=[self._lens[r.uid] for r in rs], true_accept=[self._would[r.uid] for r in rs])
        cap = k_max if self.accept.draft_len_cap is None else min(k_max, self.accept.draft_len_cap)
        dist = self.accept.draft_len_dist
        if dist is not None:
            self._lens = {r.uid: min(int(self.rng.choice(len(dist), p=dist)), cap) for r in rs}
        else:
            self._lens = {r.uid: (cap if self.rng.random() < self.accept.propose_prob else 0) for r in rs}
        return Proposal(draft_lens=[self._lens[r.uid] for r in rs], true_accept=[self._would[r.uid] for r in rs])

    def token_options(self, bucket: int, k: int) -> tuple[int, ...]:
        return bk.token_buckets(bucket, k, self.k_buckets) if self.packed else ()

    def step(self, rs: Sequence[Running], k: int, row_k: Sequence[int] | None = None
             ) -> tuple[list[RowResult], float]:
        """As JaxBackend.step: the block shrinks to the longest (per-request cut) draft, and a
        packed block is charged its real tokens (the linear model; the profiled table has no
        packed cells)."""
        drafted = {r.uid: min(self._lens.get(r.uid, 0), k if row_k is None else min(k, int(row_k[i])))
                   for i, r in enumerate(rs)}
        k_step = bk.proposal_bucket(self.k_buckets, max(drafted.values(), default=0))
        self.last_k_step = k_step
        n_tok = sum(d + 1 for d in drafted.values())
        B = self.live.peek(self._running)
        P = bk.token_bucket(B, k_step, self.k_buckets, n_tok) if (self.packed and k_step) else 0
        self.last_tokens = P or B * (k_step + 1)
        out = []
        for r in rs:
            d = drafted[r.uid]
            if self.rates is not None:
                on = [p for p in self._paths.get(r.uid, ()) if p <= d]
                a = len(on)
                if d:
                    self.rates.observe(d, on)
            else:
                a = min(self._would.get(r.uid, 0), d)
            out.append(RowResult([0] * (a + 1), d, a))
        shrink = self.live.before_step(self._running)
        t = self._row_op(shrink)
        if shrink:
            self._to_clear = False  # compacting keeps only the live rows
        if self._to_clear:
            self._to_clear = False
            self.row_ops.append(("clear", self.live.B, self.live.B))
            t += self.cost.row_op_time("clear", self.live.B, self.live.B)
        t += self.cost.step_time(self.live.B, k_step, [r.ctx_len for r in rs], len(rs), batched=P or None)
        return out, t

    def release(self, r: Running) -> None:
        self._running -= 1
        self._to_clear = True
        self._would.pop(r.uid, None)
        self._paths.pop(r.uid, None)
        self._lens.pop(r.uid, None)


def simulate(requests: Sequence[Request], policy: Policy, cost: StepCostModel, accept: AcceptanceProfile, *,
             device_draft: bool, k_buckets=(0, 1, 2, 3, 4, 5), batch_buckets=(1, 2, 4, 8), slots: int = 512,
             seed: int = 0, prefill_gate: DraftPrefillGate | None = None, packed: bool = False,
             prefill_budget: int | None = None, prefill_chunk: int = bk.DEFAULT_PREFILL_CHUNK,
             prefill_rows: int | None = None, prefix_cache_mb: float = 0,
             kv_bytes_per_token: int = 0) -> tuple[list[RequestOutput], ServingEngine]:
    """Serve ``requests`` on the event clock. Simulated requests never hit EOS: give each the
    output length it should have (``max_new_tokens``, ``ignore_eos=True``). ``prefill_budget``:
    chunked prefill, as ServingEngine; ``prefix_cache_mb`` / ``kv_bytes_per_token``: prefix caching,
    as SimBackend."""
    be = SimBackend(cost, accept, device_draft=device_draft, k_buckets=k_buckets, batch_buckets=batch_buckets,
                    slots=slots, seed=seed, packed=packed, prefill_chunk=prefill_chunk,
                    prefill_rows=prefill_rows, prefix_cache_mb=prefix_cache_mb, kv_bytes_per_token=kv_bytes_per_token)
    eng = ServingEngine(be, policy, clock=EventClock(), prefill_gate=prefill_gate, prefill_budget=prefill_budget)
    return eng.run(requests), eng
