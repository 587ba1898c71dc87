"""The serving loop: continuous batching with a goodput-chosen proposal length each step.

One iteration (Algorithm 2 around a vLLM-style scheduler):
  1. requests whose arrival time has come join the FCFS waiting queue;
  2. the FCFS prefix that fits free KV rows is admitted and its prefill queued; with a draft
     model, the prefill gate may admit a request without its draft prefill when recent steps
     proposed nothing (prefill disabling). Queued prefills run in chunks (prefill_jobs): all of
     them at once by default (prefill first, as vLLM without chunked prefill), or, with a
     ``prefill_budget``, about that many prompt tokens per iteration while other requests are
     decoding (chunked prefill: a long prompt delays the running requests' next tokens by a
     chunk at a time, not by its whole prefill); a request decodes once its prompt is in;
  3. host drafters propose for every running request (free next to a forward pass);
  4. the policy picks K among the K values compiled for the bucket the live state will run the
     step at (``backend.step_bucket``: it may exceed the batch's bucket until compacted);
  5. the backend runs the draft+verify step (or, when the policy commits to more than one step
     of its K and the backend can run them without the host, K = 0 or a device drafter's, up to
     ``decode_steps`` of them in one call, told to the observers step by step; while requests
     wait for a row the call ends where the first row frees) and the accepted tokens are emitted; the step's
     ``StepEvent`` goes to the observers (``engine.observers``: the policy's feedback, the
     acceptance counts, the step log, then any given), finished requests leave and free their
     rows at once, and the observers' between-steps work runs.

With several device drafts (``drafts``: a DraftGroups, say distill.routing.MultiDraft) each
request belongs to one; a batch runs one draft's params, so admission takes the FCFS prefix of
requests of the running batch's draft, and once no row runs the queue's head picks the next
draft (swapped in between steps, nothing recompiled; its own policy tracks its acceptance).

The loop is backend- and clock-agnostic: ``JaxBackend`` + ``WallClock`` is the real engine,
``simulate.SimBackend`` + ``EventClock`` is the simulator, which therefore shares the
scheduler, the selector and every bookkeeping rule with the real engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from specjax.engine.observers import (BetweenSteps, CountAcceptance, Observer, PolicyFeedback, StepEvent, StepLog,
                                      StepRecord)
from specjax.engine.scheduler import Scheduler
from specjax.serving_types import Proposal, Request, RequestOutput, RowResult, Running  # noqa: F401  (re-exported)
from specjax.errors import SpecjaxError
from specjax.goodput.acceptance import AcceptanceCounts
from specjax.goodput.selector import BatchView, DraftPrefillGate, Policy


class WallClock:
    """Real time since the run started; waiting sleeps."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        dt = t - self.now()
        if dt > 0:
            time.sleep(dt)

    def advance(self, dt: float) -> None:
        pass  # real time passed while the work ran


class EventClock:
    """Simulated time: advanced by the modelled duration of each operation."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def advance(self, dt: float) -> None:
        self.t += dt


class Backend(Protocol):
    device_draft: bool
    num_rows: int
    slots: int
    k_max: int

    def bucket(self, n: int) -> int: ...

    def step_bucket(self, n: int) -> int: ...  # the bucket the live state will run a step of n at

    def take_row_ops(self) -> list[tuple[str, int, int]]: ...  # cache copies/clears since the last call

    def k_options(self, bucket: int) -> Sequence[int]: ...

    def k_coming(self, bucket: int) -> Sequence[int]: ...  # K buckets a background warm-up still builds

    def want(self, bucket: int, k: int) -> None: ...  # the policy would run K there: build it now, if on demand

    def start_prefill(self, rs: Sequence[Running]) -> None: ...  # hold rows, queue the prefill chunks

    # run queued chunks (budget: prompt tokens, at least one chunk; None: all): (request, first token) done
    def advance_prefill(self, budget: int | None = None) -> tuple[list[tuple[Running, int]], float]: ...

    # threshold: a confidence policy's cut (Algorithm 3): a device drafter drafts before the choice
    def propose(self, rs: Sequence[Running], k_max: int, threshold: float | None = None) -> Proposal: ...

    # row_k: per-request draft counts <= k (the policy's per-request choice), aligned with rs
    def step(self, rs: Sequence[Running], k: int, row_k: Sequence[int] | None = None
             ) -> tuple[list[RowResult], float]: ...

    def token_options(self, bucket: int, k: int) -> Sequence[int]: ...  # packed verify sizes (may be empty)

    # Optional (a backend without it runs a call per step): ``decode_steps``, the most steps one
    # call runs; ``fused_steps``, whether K > 0 steps run in calls too; and ``decode(rs, steps,
    # left, eos_rows, eos_ids, stop_first, k) -> (per request its RowResult per step, seconds)``
    # running them, each request stopping where the engine would retire it and, with
    # ``stop_first``, the call with the first request that stops (JaxBackend.decode).

    def release(self, r: Running) -> None: ...


class DraftGroups(Protocol):
    """Several drafts for one backend: which serves a request, and making one the live draft."""

    def group(self, req: Request): ...  # a hashable key of the draft that serves ``req``

    def activate(self, group) -> Policy: ...  # swap that draft in; returns the policy tracking it


class ServingEngine:
    def __init__(self, backend: Backend, policy: Policy, *, eos_ids: Sequence[int] = (), clock=None,
                 prefill_gate: DraftPrefillGate | None = None, max_prefill_batch: int | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, prefill_budget: int | None = None,
                 on_step: Callable[["ServingEngine"], None] | None = None, drafts: DraftGroups | None = None,
                 observers: Sequence[Observer] = ()):
        self.backend = backend
        self.policy = policy
        self.eos = frozenset(int(e) for e in eos_ids)
        self.clock = clock if clock is not None else WallClock()
        self.gate = prefill_gate if (prefill_gate is not None and backend.device_draft) else None
        self.max_prefill_batch = max_prefill_batch
        if prefill_budget is not None and prefill_budget < 1:
            raise SpecjaxError(f"prefill_budget must be >= 1 token, got {prefill_budget}")
        self.prefill_budget = prefill_budget  # None: whole prompts at admission; else chunked prefill
        self.on_finish = on_finish
        self.should_stop = should_stop  # polled between iterations: True ends run() early (Ctrl-C)
        self.drafts = drafts
        self.active_group = None  # the draft the backend runs (with ``drafts``)
        self.sched = Scheduler(backend.num_rows, backend.slots, backend.k_max + 1)
        self.steps: list[StepRecord] = []
        self.prefill_s = 0.0
        # wall seconds the loop spent between its backend calls (proposals, the policy's choice,
        # emission, observers such as shadow verification, retiring): what a drafter costs a step
        # besides the device work, measured, not modelled (0 under a simulated clock; a device
        # draft-ahead proposal, Algorithm 3, counts here too)
        self.host_s = 0.0
        self._backend_s = 0.0  # backend seconds of the current iteration
        self._t0 = self.clock.now()
        self.counts = AcceptanceCounts()  # every step's, K = 0 included
        self._next_arrival: float | None = None  # of the next request not yet arrived (run)
        self._step_s: dict[int, float] = {}  # K -> wall seconds of its last step (one of a decode call's)
        self.draft_prefills = 0  # requests admitted with their device draft's prefill
        # each step's event goes to these in order; on_step: called between steps (self.load())
        self.observers: list[Observer] = [PolicyFeedback(self.gate), CountAcceptance(self.counts),
                                          StepLog(self.steps), *observers]
        if on_step is not None:
            self.observers.append(BetweenSteps(on_step))

    def _now(self) -> float:
        """Seconds since the current run started (arrival times are on this axis)."""
        return self.clock.now() - self._t0

    # ------------------------------------------------------------ bookkeeping

    def _emit(self, r: Running, tokens: Sequence[int]) -> None:
        out = r.out
        if tokens:
            now = self._now()
            if out.tokens:
                out.max_gap = max(out.max_gap, now - out.last_token)
            out.last_token = now
        for t in tokens:
            out.tokens.append(int(t))
            if len(out.tokens) == 1:
                out.first_token = now
            if not r.req.ignore_eos and int(t) in self.eos:
                out.finish_reason, r.done = "eos", True
                return
            if len(out.tokens) >= r.req.max_new_tokens:
                out.finish_reason, r.done = "length", True
                return

    def _retire(self, finished: list[RequestOutput]) -> None:
        for r in [r for r in self.sched.running if r.done]:
            r.out.finished = self._now()
            self.sched.release(r)
            self.backend.release(r)
            self.policy.finish(r.uid)
            finished.append(r.out)
            if self.on_finish:
                self.on_finish(r.out)

    # ------------------------------------------------------------ the loop

    def run(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Serve ``requests`` (arrival times in seconds from now) to completion; returns one
        output per request in input order (rejected requests carry ``error``; after a
        ``should_stop``, only the finished ones)."""
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        finished: list[RequestOutput] = []
        nxt = 0
        self._t0 = self.clock.now()
        while nxt < len(order) or not self.sched.idle:
            if self.should_stop is not None and self.should_stop():
                break  # unfinished requests get no output
            now = self._now()
            while nxt < len(order) and requests[order[nxt]].arrival <= now:
                req = requests[order[nxt]]
                nxt += 1
                try:
                    self.sched.submit(req)
                except SpecjaxError as e:
                    out = RequestOutput(req.id, [], "error", len(req.prompt), req.arrival, error=str(e))
                    out.finished = out.arrival
                    finished.append(out)
                    if self.on_finish:
                        self.on_finish(out)
            if self.sched.idle:
                if nxt < len(order):  # (the last arrivals may all have been rejected)
                    self.clock.wait_until(self._t0 + requests[order[nxt]].arrival)
                continue
            t_iter, self._backend_s = time.perf_counter(), 0.0
            self._admit()
            self._prefill()
            self._retire(finished)  # max_new_tokens == 1 (or EOS first) ends at prefill
            if any(not r.prefilling for r in self.sched.running):
                self._next_arrival = requests[order[nxt]].arrival if nxt < len(order) else None
                self._step()
                self._retire(finished)
                for o in self.observers:
                    o.between_steps(self)
            if isinstance(self.clock, WallClock):
                self.host_s += time.perf_counter() - t_iter - self._backend_s
        by_id: dict = {}
        for o in finished:
            by_id.setdefault(o.id, []).append(o)
        return [by_id[r.id].pop(0) for r in requests if by_id.get(r.id)]

    def load(self) -> tuple[int, int]:
        """(rows running, requests waiting for a row): the load SmartSpec's choice of K follows
        (a goodput policy speculates less as the batch grows) and what work between steps waits on."""
        return len(self.sched.running), len(self.sched.waiting)

    def _admit(self) -> None:
        if not self.sched.waiting or not self.sched.free_rows:
            return
        # No-SD serves with no draft model at all: its requests skip the draft prefill too.
        joins = None
        if self.drafts is not None:
            head = self.drafts.group(self.sched.waiting[0])
            if not self.sched.running and head != self.active_group:
                self.policy, self.active_group = self.drafts.activate(head), head
            joins = lambda req: self.drafts.group(req) == self.active_group  # noqa: E731
        speculate = self.policy.may_speculate
        if speculate and self.gate:  # (a device draft: each request admitted with it pays a draft prefill)
            speculate = self._draft_could_pay() and self.gate.speculate()
        rs = self.sched.admit(self._now(), speculate, self.max_prefill_batch, joins)
        self.draft_prefills += len(rs) if speculate and self.backend.device_draft else 0
        for r in rs:
            r.prefilling = True
        self.backend.start_prefill(rs)

    def _draft_could_pay(self) -> bool:
        """Whether drafting could pay (``Policy.could_pay``) anywhere a request admitted now runs:
        in the batch this admission makes, or alone once the others are done."""
        running, free = self.sched.running, self.sched.free_rows
        if self.max_prefill_batch is not None:
            free = min(free, self.max_prefill_batch)
        joining = [len(q.prompt) for q in itertools.islice(self.sched.waiting, free)]
        be = self.backend
        together = [r.ctx_len for r in running] + joining
        for lens, bucket in ((together, be.step_bucket(len(together))), (joining[:1], be.bucket(1))):
            view = BatchView(ctx_lens=lens, bucket=bucket, k_options=be.k_options(bucket), k_coming=be.k_coming(bucket),
                             **self._calls((*be.k_options(bucket), *be.k_coming(bucket))))
            if self.policy.could_pay(view):
                return True
        return False

    def _prefill(self) -> None:
        """Run queued prefill chunks: all of them when nothing decodes or without a budget, else
        about ``prefill_budget`` tokens' worth."""
        if not any(r.prefilling for r in self.sched.running):
            return
        decoding = any(not r.prefilling for r in self.sched.running)
        while True:  # with nothing decoding, on until one prompt is in
            done, elapsed = self.backend.advance_prefill(self.prefill_budget)
            self.clock.advance(elapsed)
            self._backend_s += elapsed
            self.prefill_s += elapsed
            for r, tok in done:
                r.prefilling = False
                self._emit(r, [tok])
            if done or decoding or self.prefill_budget is None:
                return

    def _observe(self, ev: StepEvent) -> None:
        for o in self.observers:
            o.on_step(ev)

    def _step(self) -> None:
        t0 = time.perf_counter()
        rs = [r for r in self.sched.running if not r.prefilling]
        be = self.backend
        be.take_row_ops()  # (the admissions' ops belong to the prefill)
        bucket = be.step_bucket(len(self.sched.running))  # rows being prefilled are held too
        opts = be.k_options(bucket)
        coming = be.k_coming(bucket)
        # (a policy that weighs the K buckets still to come sees drafts of their width: host drafts
        # are shadow-verified while K = 0 runs, so it learns whether one would pay before it is built)
        prop = be.propose(rs, max((*opts, *coming) if self.policy.plans_coming else opts),
                          self.policy.draft_threshold)
        view = BatchView(ctx_lens=[r.ctx_len for r in rs], bucket=bucket, k_options=opts,
                         request_ids=[r.uid for r in rs], draft_lens=prop.draft_lens,
                         confidences=prop.confidences, true_accept=prop.true_accept,
                         draft_scores=prop.draft_scores, draft_classes=prop.draft_classes,
                         drafted_ahead=prop.drafted_ahead, draft_free=prop.draft_free,
                         token_options={k: tuple(be.token_options(bucket, k)) for k in opts},
                         k_coming=coming, **self._calls((*opts, *coming), prop.drafted_ahead))
        k = self.policy.choose(view)
        if k not in opts:
            raise RuntimeError(f"policy {self.policy.name} chose K={k}, not a compiled option {list(opts)}")
        if self.policy.want_k in coming:
            be.want(bucket, self.policy.want_k)
        n = self._call_steps(k, rs, prop)
        if n > 1:
            return self._decode(rs, n, k, view, prop, t0)
        results, elapsed = be.step(rs, k, self.policy.row_drafts(view, k))
        self.clock.advance(elapsed)
        self._backend_s += elapsed
        emitted = [self._take(r, res) for r, res in zip(rs, results)]
        k_step = getattr(be, "last_k_step", k)
        tokens = getattr(be, "last_tokens", bucket * (k_step + 1))
        wall = time.perf_counter() - t0 if isinstance(self.clock, WallClock) else elapsed
        self._step_s[k_step] = wall
        self._observe(StepEvent(self._now(), rs, view, prop, self.policy, k, k_step, tokens, results, emitted,
                                elapsed, wall, tuple(be.take_row_ops()), cold=getattr(be, "last_cold", False)))

    def _calls(self, ks, drafted_ahead: int = 0) -> dict:
        """BatchView's ``call_ks`` / ``call_steps``: which of ``ks`` the backend runs in calls
        when a policy commits to them (K = 0 with decode calls; K > 0 too under ``fused_steps``,
        unless the drafts were made ahead: such a step runs alone, _call_steps)."""
        n = getattr(self.backend, "decode_steps", 1)
        fused = getattr(self.backend, "fused_steps", False) and not drafted_ahead
        return {"call_ks": tuple(k for k in ks if n > 1 and (k == 0 or fused)), "call_steps": n}

    def _call_steps(self, k: int, rs: Sequence[Running], prop: Proposal) -> int:
        """Steps of K = ``k`` to run in one backend call (``Backend.decode``): the policy's
        commitment (``Policy.call_steps``) up to the backend's ``decode_steps``, for K = 0 and,
        where the backend's steps need nothing from the host (``fused_steps``: a device drafter),
        K > 0; only while no request waits for a prefill or for a row that is free (they would
        wait for the whole call; requests waiting for a row to free, as in a batch job, get one as
        soon as single steps would give it: ``_decode`` then ends the call with the first row that
        stops), no more than the running rows have tokens left, and before the next arrival at
        the last call's wall time per step."""
        n = min(getattr(self.backend, "decode_steps", 1), self.policy.call_steps)
        if ((k != 0 and not getattr(self.backend, "fused_steps", False)) or n <= 1 or prop.drafted_ahead
                or (self.sched.waiting and self.sched.free_rows) or len(rs) < len(self.sched.running)):
            return 1
        n = min(n, max(r.req.max_new_tokens - len(r.out.tokens) for r in rs))
        if self._next_arrival is not None:
            if k not in self._step_s:
                return 1  # (one single step first, to know what a step costs)
            n = min(n, int((self._next_arrival - self._now()) / self._step_s[k]))
        return max(n, 1)

    def _decode(self, rs: Sequence[Running], n: int, k: int, view: BatchView, prop: Proposal, t0: float) -> None:
        """Up to ``n`` steps of K = ``k`` in one backend call, then told to the request outputs and
        the observers as the single steps they are: step j's event has the rows that ran it (its
        tokens and counts each, ``_take``), 1/steps of the call's time, and (j > 0) no new
        proposal, so every count and metric reads as for n single steps and shadow verification
        sees every token (the observers' ``between_steps`` runs once, after the call). While
        requests wait for a row, the call ends with the step at which the first row stops, so
        the next one is admitted where single steps would admit it."""
        be = self.backend
        left = [r.req.max_new_tokens - len(r.out.tokens) for r in rs]
        res, elapsed = be.decode(rs, n, left, [not r.req.ignore_eos for r in rs], self.eos, bool(self.sched.waiting),
                                 k)
        self.clock.advance(elapsed)
        self._backend_s += elapsed
        steps = max(map(len, res))
        wall = (time.perf_counter() - t0 if isinstance(self.clock, WallClock) else elapsed) / steps
        elapsed /= steps
        full = steps >= getattr(be, "decode_steps", 1)
        self._step_s[k] = wall
        ops = tuple(be.take_row_ops())
        for j in range(steps):
            idx = [i for i, t in enumerate(res) if len(t) > j]
            sub = [rs[i] for i in idx]
            if j:  # later steps: the rows still running, nothing newly proposed
                view = dataclasses.replace(view, ctx_lens=[r.ctx_len for r in sub], request_ids=[r.uid for r in sub],
                                           draft_lens=None, confidences=None, true_accept=None, draft_scores=None,
                                           draft_classes=None)
                prop = Proposal(drafts=None if prop.drafts is None else [[] for _ in sub])
            results = [res[i][j] for i in idx]
            emitted = [self._take(r, x) for r, x in zip(sub, results)]
            for i in idx:  # the device's stopping rule is _emit's: a row stops where it is done
                last = len(res[i]) == j + 1
                if rs[i].done != last and (rs[i].done or len(res[i]) < steps):
                    raise RuntimeError(f"the decode call and the engine disagree on where request {rs[i].req.id} stops")
            self._observe(StepEvent(self._now(), sub, view, prop, self.policy, k, k, be.last_tokens, results, emitted,
                                    elapsed, wall, ops if j == 0 else (), full_call=full, first_of_call=j == 0,
                                    call_len=steps,
                                    cold=getattr(be, "last_cold", False)))

    def _take(self, r: Running, res: RowResult) -> int:
        """A row's step result into its request (tokens, teacher signal, its own counts); returns
        how many tokens its output took."""
        r.ctx_len += len(res.tokens)
        before = len(r.out.tokens)
        self._emit(r, res.tokens)
        if res.teacher is not None:
            r.out.record_teacher(before, len(r.out.tokens) - before, res.teacher, res.drafted, res.accepted)
        r.out.steps += 1
        r.out.drafted += res.drafted
        r.out.accepted += res.accepted
        return len(r.out.tokens) - before


def summarize(outputs: Sequence[RequestOutput], steps: Sequence[StepRecord] = ()) -> dict:
    """Average latency and friends over served (non-error) requests: latency, time to first token,
    time per output token, each request's longest gap between tokens, throughput, acceptance."""
    ok = [o for o in outputs if o.error is None]
    lat = np.array([o.latency for o in ok]) if ok else np.zeros(0)
    toks = sum(len(o.tokens) for o in ok)
    span = (max(o.finished for o in ok) - min(o.arrival for o in ok)) if ok else 0.0
    ttft = np.array([o.first_token - o.arrival for o in ok])
    # time per output token after the first: what a streaming reader waits between tokens
    tpot = np.array([(o.finished - o.first_token) / (len(o.tokens) - 1) for o in ok if len(o.tokens) > 1])

    def pct(a, q):
        return float(np.percentile(a, q)) if len(a) else float("nan")

    return {
        "requests": len(outputs), "errors": len(outputs) - len(ok),
        "mean_latency_s": float(lat.mean()) if ok else float("nan"),
        "p50_latency_s": float(np.median(lat)) if ok else float("nan"),
        "p90_latency_s": float(np.percentile(lat, 90)) if ok else float("nan"),
        "mean_queue_s": float(np.mean([o.admitted - o.arrival for o in ok])) if ok else float("nan"),
        "p50_ttft_s": pct(ttft, 50), "p90_ttft_s": pct(ttft, 90),
        "p50_tpot_s": pct(tpot, 50), "p90_tpot_s": pct(tpot, 90),
        # per request, its longest wait between two tokens: p90 over requests, and the worst
        "p90_max_gap_s": pct(np.array([o.max_gap for o in ok]), 90),
        "max_gap_s": max((o.max_gap for o in ok), default=float("nan")),
        "tokens": toks, "throughput_tok_s": toks / span if span > 0 else float("nan"),
        "acceptance_rate": AcceptanceCounts.of_requests(ok).acceptance_rate,
        "mean_batch": float(np.mean([s.n for s in steps])) if steps else 0.0,
        "mean_k": float(np.mean([s.k for s in steps])) if steps else 0.0,
        "steps": len(steps),
    }
