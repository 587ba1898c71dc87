"""What a serving backend compiles, when, and in what order: the compile planner.

A warm-up (``CompilePlanner.warmup``, which ``JaxBackend.warmup`` is) lists every executable
serving may call for the prompts it expects: prefill chunks, the plain-decoding calls and the
drafter's steps (``Drafter.warm_steps``) per batch and K bucket, and the row operations (inserts,
resizes, clears, the prefix store's captures and restores). Eagerly it compiles them all now.
Lazily (``lazy``: the launch scripts' default) it compiles nothing now: serving compiles each
executable when it first reaches it (``StepTable``'s lazy mode, stand-ins included), and a
background thread builds the rest ahead in the order a job is likely to reach them
(``lazy_order``), leaving to later what a whole job may never reach (``reachable_plan``: smaller
buckets until the batch drains into them, K steps until the policy wants them). Until a K
bucket's steps are built it is not among ``k_options``; a bucket whose K = 0 step is not built is
not ``usable`` for compaction. ``check_map_budget`` refuses a plan whose executables would
exhaust the process's memory maps, and ``execute`` runs every executable once on empty rows.
The planner decides nothing about tokens: the executables are the same in every mode.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import time
import weakref
from typing import Sequence

import jax
import numpy as np

from specjax import buckets as bk
from specjax.drafters.protocol import CHAIN, DecodeStep, StepJob
from specjax.engine.table import yield_to_serving
from specjax.errors import SpecjaxError, require
from specjax.sampling import SamplingArrays


def zeros_like_info(info):
    """A state of zeros shaped (and placed) as ``info`` (a StepTable.state_info)."""
    return jax.tree_util.tree_map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), getattr(s, "sharding", None)),
                                  info)


MAPS_PER_LAYER_EXE = 22  # measured: ~650 memory maps per SmolLM2 (30-layer) prefill/step executable, row ops included


_LATER: "weakref.WeakSet[CompilePlanner]" = weakref.WeakSet()  # planners whose warm-up started a background thread


@atexit.register
def _stop_background() -> None:
    for be in list(_LATER):
        be.stop_later()


def _keeps_upkeep(job) -> bool:
    """Whether a warm-up step job keeps the drafter's plain-step upkeep (all but the decode calls
    for rows that never draft)."""
    return getattr(getattr(job, "kind", None), "upkeep", True)


def as_call(job, be):
    """A warm-up job as the backend runs it: under ``fused_steps`` a K > 0 chain step is the
    decode call of K (its single steps are calls of one step), else the job as it is."""
    if be.fused_steps and isinstance(job, StepJob) and job.kind is CHAIN and job.k > 0 and not job.tokens:
        return dataclasses.replace(job, kind=DecodeStep(be.decode_steps, be.cfg.vocab_size))
    return job


def lazy_order(plan, first_bucket: int, later_ks=(), later_chunks=None, first_chunks=(), draft_mode=None) -> list:
    """A lazy warm-up's background order (CompilePlanner.warmup): what a job whose first admission
    runs at ``first_bucket`` is likely to reach first. The K = 0 step and row operations of that
    bucket; the first admission's prefills in its other chunk sizes ``first_chunks`` (the serving
    thread compiles the first it reaches itself); the prefills of later admissions (smallest
    first: rows free one by one) in the chunk sizes ``later_chunks`` of the prompts they will
    admit (None: every size), and their inserts; the other buckets' K = 0 steps and row
    operations, largest first (the batch drains through them); then the K > 0 steps of
    ``later_ks``, the first bucket's first, smaller K
    first (until one is in, the policy runs without it; nothing waits); last, the remaining
    prefills (the first admission compiles what it needs when it runs). Other K > 0 steps (a
    fixed K's: the first step needs it) come first. ``draft_mode``: the draft-prefill mode
    requests are admitted with (a device drafter's: True, unless admission disables the draft);
    prefills and inserts of the other mode come last with the remaining prefills (a single
    answer never reaches them, and building them took cores from it)."""
    def rank(item):
        what, j = item
        if draft_mode is not None and ((what == "prefill" and j[3] != draft_mode)
                                       or (what == "row" and j[0] == "insert" and j[3] != draft_mode)):
            return (5, 0)
        if what == "prefill":
            if j[0] <= first_bucket and (j[1], j[4]) in first_chunks:
                return (0, 1)
            later = later_chunks is None or (j[1], j[4]) in later_chunks
            return (1, j[0]) if j[0] <= first_bucket and later else (5, 0)
        if what == "step":
            if not _keeps_upkeep(j):  # (reached once admission disables the draft: a single answer never is)
                return (5, 0)
            if j.k == 0 or j.k not in later_ks:
                return (0, 0) if j.B == first_bucket else (2, -j.B)
            return (3, j.k) if j.B == first_bucket else (4, -j.B, j.k)
        B = j[1]
        if j[0] == "insert" and B == first_bucket:
            return (0, 0) if j[2] == first_bucket else (1, j[2])
        return (0, 0) if B == first_bucket and j[0] == "clear" else (2, -B)

    return sorted(plan, key=rank)  # (stable: ties keep the warm-up's order)


def reachable_plan(plan, first_bucket: int, queue_chunks, demand_ks=()) -> tuple[list, dict[tuple[int, int], list]]:
    """A lazy warm-up's plan split for a job whose whole queue is known at the start (every
    record arrives at t = 0: serve_job): (what to build ahead, {(bucket, K): what to build once
    serving asks for it}). The first admission's bucket ``first_bucket`` is the largest the job
    runs at; the smaller ones are reached only as it drains, and often not at all (rows that
    finish together leave at once), so their steps and row operations, under (B, 0), wait for
    the live state to ask for them (``JaxBackend._usable``; it runs on in the larger bucket
    meanwhile: the same tokens). The steps of the K buckets ``demand_ks``, under (B, K), wait for
    the policy to want them (``JaxBackend.want``; SmartSpec on text where no draft pays never
    does). Dropped: growing resizes and prefill chunk sizes that no queued prompt runs
    (``queue_chunks``: bk.chunk_sizes of the queue), neither of which such a job reaches; if
    one ever is, serving compiles it on first use."""
    ahead, later = [], {}
    for item in plan:
        what, j = item
        if what == "prefill":
            if (j[1], j[4]) in queue_chunks:
                ahead.append(item)
            continue
        K = 0
        if what == "step":
            B, K = j.B, (j.k if j.k in demand_ks else 0)
        elif j[0] == "take":
            if j[2] > j[1]:
                continue
            B = j[2]
        elif j[0] == "segment":  # (at a prefill bucket: with the prefills)
            B = first_bucket
        else:  # insert into / clear the live bucket
            B = j[1]
        (ahead if (B, K) == (first_bucket, 0) else later.setdefault((B, K), [])).append(item)
    return ahead, later


def check_map_budget(n_heavy: int, num_layers: int) -> None:
    """Fail early, with the fix, instead of an LLVM abort: every XLA:CPU executable keeps its code
    in its own memory mappings (~22 per layer), and Linux caps a process at
    vm.max_map_count (65530 by default), which ~150 executables of a 30-layer model exhaust."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return  # not Linux: nothing to check
    need = n_heavy * MAPS_PER_LAYER_EXE * max(num_layers, 1)
    if used + need > 0.9 * limit:
        raise SpecjaxError(
            f"compiling {n_heavy} model executables needs about {need} memory maps but this process may use "
            f"{limit - used} more (vm.max_map_count={limit}); raise it (sudo sysctl -w vm.max_map_count=262144) or "
            "compile fewer variants (fewer --k_buckets / --batch_buckets, or one drafter per process)")


class CompilePlanner:
    """The compile plan of one backend (``be``, a JaxBackend: its table, drafter, geometry and
    options), its background thread and what that thread has built so far."""

    def __init__(self, be):
        self.be = be
        self._waiting: frozenset = frozenset()  # (bucket, K > 0) steps still compiling: not yet options
        self.later_planned = 0  # executables the last warm-up left to the background thread
        self.on_demand_planned = 0  # ... and to it once serving asks for them (reachable_plan)
        self._later: threading.Thread | None = None
        self._stop_later = threading.Event()
        self._later_gate = threading.Event()  # set once the background half of a warm-up may start
        self._later_after = 0  # ... after this many steps (warmup's later_after_steps)
        self._todo: list = []  # the background thread's work left, in order (warmup)
        self._on_demand: dict[tuple[int, int], list] = {}  # (bucket, K) -> work built once serving wants it
        self._demanded: dict[tuple[int, int], list] = {}  # ... wanted (want), not yet taken by the thread
        self._todo_cv = threading.Condition()
        self._steps_run = 0
        self._k0_jobs: dict[int, list] = {}  # bucket -> its K = 0 step jobs (the last warm-up's)
        self._usable_buckets: set[int] = set()  # buckets usable found built

    def steps_ran(self, n: int = 1) -> None:
        """Serving ran ``n`` more steps (a warm-up's ``later_after_steps`` gate counts them)."""
        self._steps_run += n
        if self._steps_run >= self._later_after:
            self._later_gate.set()

    def k_options(self, bucket: int) -> Sequence[int]:
        """The K buckets a step at ``bucket`` can run now: all of them, except those whose steps a
        warm-up left to the background (``later_ks``, ``lazy``) and that are not compiled yet
        (each joins once its executables are in)."""
        be = self.be
        waiting = self._waiting
        return tuple(k for k in be.k_buckets if (bucket, k) not in waiting) if waiting else be.k_buckets

    def k_coming(self, bucket: int) -> Sequence[int]:
        """The K buckets ``k_options`` leaves out at ``bucket`` for now: a warm-up's background
        thread is building them."""
        be = self.be
        return tuple(k for k in be.k_buckets if (bucket, k) in self._waiting)

    def usable(self, B: int) -> bool:
        """Whether the live state may shrink into bucket ``B`` now: yes, unless a lazy warm-up
        left B's K = 0 step unbuilt (neither in memory nor on disk), when shrinking would stall
        serving while it compiles; the rows run the same in the larger bucket meanwhile."""
        be = self.be
        if not be.table.lazy or B in self._usable_buckets:
            return True
        ok = all(be.table.ready(lambda j=j: j.compile(be, False)) for j in self._k0_jobs.get(B, ()))
        if ok:
            self._usable_buckets.add(B)
        else:
            self.want(B, 0)  # (a job's drain bucket: built now that the batch would compact into it)
        return ok

    def want(self, bucket: int, k: int) -> None:
        """Serving would run a step of K drafts (K = 0: compact the batch) at ``bucket``: if a
        lazy warm-up left its executables on demand (reachable_plan), the background thread
        builds them next."""
        if (bucket, k) in self._on_demand:
            with self._todo_cv:
                if (bucket, k) in self._on_demand:
                    self._demanded[(bucket, k)] = self._on_demand.pop((bucket, k))
                    self._todo_cv.notify()

    def warmup(self, prompt_lens: Sequence[int] = (16,), greedy_modes=(True,), progress: bool = False,
               execute: bool = False, batch_buckets: Sequence[int] | None = None,
               k_buckets: Sequence[int] | None = None, later_ks: Sequence[int] = (),
               later_after_steps: int = 0, lazy: bool = False, queue: Sequence[int] = (),
               whole_job: bool = False, demand_ks: bool = False) -> float:
        """Compile everything serving can call for prompts of these lengths; afterwards a missing
        shape raises instead of compiling. ``execute``: also run every prefill and step once on
        empty rows, so that first-execution costs (fresh buffers, untouched code pages) are not
        charged to the first requests served (the earlier sweeps, with a compile-only warm-up,
        found their first run consistently slow). ``batch_buckets`` / ``k_buckets``: compile only
        these (a static batch that never resizes needs no other). ``later_ks``: K buckets (> 0)
        whose steps compile in a background thread after this returns, smallest first; until one
        is in, ``k_options`` leaves it out, so a first answer waits only for the prefill, the
        K = 0 step and the rest of ``k_buckets`` (``stop_later`` ends the thread).
        ``later_after_steps``: the thread starts its work only once this many steps have run. A
        warm cache's loads hold the GIL (about 0.45 s each for SmolLM2's tree steps), so a short
        answer that never reaches that step count is not slowed by options it would not use.

        ``lazy``: compile nothing now. Serving compiles (or loads from the disk cache) each
        executable when it first reaches it, and the background thread compiles the rest ahead,
        in the order a job whose prompts have the lengths ``queue`` (in admission order) is likely
        to reach them (``lazy_order``),
        skipping what the disk cache holds (loaded on first use: a warm job loads only what it
        reaches; with a warm cache only ``later_ks``' steps are built ahead). K > 0 steps join ``k_options`` once compiled or on disk; the rest a caller
        waits for (``table.late_s``). ``whole_job``: ``queue`` holds every request served, all
        there from the start (a JSONL job): no bucket above the one they fill is built, the
        smaller ones a draining batch may compact into are built when it first wants to, and,
        ``demand_ks``, the ``later_ks`` steps when the policy first wants them (reachable_plan).
        The executables are the ones an eager warm-up compiles, so outputs do not change.
        Returns seconds."""
        be = self.be
        t0 = time.perf_counter()
        self.stop_later()  # (an earlier warm-up's steps it did not finish stay out of k_options)
        chunks = sorted(bk.chunk_sizes(prompt_lens, be.max_chunk))
        draft_modes = (True, False) if be.drafter.draft_prefill else (False,)
        bbs = sorted(batch_buckets) if batch_buckets else be.batch_buckets
        if lazy and whole_job:  # (no step runs more rows than the job holds)
            bbs = [B for B in bbs if B <= be.bucket(min(len(queue), be.num_rows))]
        kbs = sorted(k_buckets) if k_buckets is not None else be.k_buckets
        ahead = be.k_max if be.options.draft_first else 0  # the draft-ahead call's width
        steps, row_ops = [], []
        # prefill calls run at most prefill_rows requests: at the buckets of those
        pb = be.bucket(min(be.prefill_rows, be.num_rows))
        pbs = sorted({min(B, pb) for B in bbs})
        prefills = [(B, C, g, rd, first) for B in pbs for g in greedy_modes for C, first in chunks
                    for rd in draft_modes]
        for B in bbs:
            for g in greedy_modes:
                if be.decode_steps > 1:  # plain decoding: its calls, a single K = 0 step among them
                    steps.append(StepJob(DecodeStep(be.decode_steps, be.cfg.vocab_size), B, 0, g))
                    if be.drafter.plain_upkeep and False in draft_modes:  # (rows admitted without the draft)
                        steps.append(StepJob(DecodeStep(be.decode_steps, be.cfg.vocab_size, upkeep=False), B, 0, g))
                else:
                    steps.append(StepJob(CHAIN, B, 0, g, 0))
                steps += [StepJob(CHAIN, B, 0, g, t) for t in be.token_options(B, 0)]
                jobs = be.drafter.warm_steps(B, [K for K in kbs if K > 0], g, lambda K, B=B: be.token_options(B, K),
                                             ahead)
                steps += [as_call(j, be) for j in jobs]
            row_ops += [("insert", B, Bp, rd) for Bp in pbs if Bp <= B for rd in draft_modes]
            row_ops += [("take", B, B2) for B2 in bbs if B2 != B]
            row_ops.append(("clear", B))
        if be.prefix is not None:  # storing and restoring the chunk sizes these prompts run whole
            whole = {C for n in prompt_lens for s, C in bk.prefill_chunks(n, be.max_chunk) if s + C <= n}
            row_ops += [("segment", Bp, C, rd) for Bp in pbs for C in sorted(whole) for rd in draft_modes]
            if be.options.prefix_cache_outputs:  # taking a finished request's chunks from the live state
                row_ops += [j for j in (("segment", B, be.max_chunk, False) for B in bbs) if j not in row_ops]
        self._k0_jobs = {B: [j for j in steps if j.B == B and getattr(j, "k", None) == 0 and _keeps_upkeep(j)] for B in bbs}
        self._usable_buckets = set()
        check_map_budget(len(prefills) + sum(j.heavy for j in steps), be.cfg.num_layers)
        plan = [("prefill", j) for j in prefills] + [("step", j) for j in steps] + [("row", j) for j in row_ops]
        later = sorted({int(k) for k in later_ks} & set(kbs) - {0})
        if lazy or later:
            require(not execute and not be.options.draft_first,
                    "later_ks / lazy cannot be combined with execute or draft_first")
        on_demand: dict = {}
        if lazy:
            first = min(max(len(queue), 1), be.num_rows)  # the first admission's rows
            later_chunks = bk.chunk_sizes(queue[first:], be.max_chunk) if queue else None
            first_chunks = bk.chunk_sizes(queue[:first], be.max_chunk) if queue else ()
            reach = plan  # (built ahead, in lazy_order)
            if whole_job:  # what the job may not reach, on demand
                reach, on_demand = reachable_plan(plan, be.bucket(first), bk.chunk_sizes(queue, be.max_chunk),
                                                  later if demand_ks else ())
            now, deferred = [], lazy_order(reach, be.bucket(first), later, later_chunks, first_chunks,
                                           draft_mode=True if len(draft_modes) > 1 else None)
        elif later:
            now = [p for p in plan if not (p[0] == "step" and p[1].k in later)]
            deferred = [p for p in plan if p[0] == "step" and p[1].k in later]
        else:
            now, deferred = plan, []
        it = now
        if progress and now:
            from tqdm import tqdm

            it = tqdm(now, desc="compiling", unit="exe", disable=None)
        for what, j in it:
            self._build(what, j)
        be.table.warm = True
        be.table.lazy = lazy
        self._stop_later.clear()
        self._later_after, self._steps_run = later_after_steps, 0
        if later_after_steps <= 0:
            self._later_gate.set()
        else:
            self._later_gate.clear()
        # What is in memory (or, lazy, on disk: loaded on first use) is not built ahead. The steps
        # of later_ks wait for the gate (later_after_steps), then join the options once built (or
        # at once where on disk); lazy's other executables are built ahead from now on.
        todo = [p for p in deferred if not be.table.ready(lambda p=p: self._build(*p), disk=lazy)]
        loaded = [p for p in deferred if p not in todo and not be.table.ready(lambda p=p: self._build(*p), disk=False)]
        if lazy and loaded:
            # A warm cache (a job like this ran before): what it lacks was mostly not reached then,
            # and compiling it beside serving slowed a warm README batch job by a third; only K
            # steps are built ahead (until built they are no option), the rest on first use.
            # The first bucket's K = 0 step, on disk, loads beside the first prefill.
            # The prefix store's row operations too (an earlier job without the store leaves none).
            first_k0 = [p for p in loaded if p[0] == "step" and p[1] in self._k0_jobs.get(be.bucket(first), ())]
            todo = first_k0 + [p for p in todo if (p[0] == "step" and p[1].k in later)
                               or (p[0] == "row" and p[1][0] == "segment")]
        # work on demand: what is neither in memory nor on disk (row operations, then steps by K)
        on_demand = {key: sorted([p for p in items if not be.table.ready(lambda p=p: self._build(*p))],
                                 key=lambda p: (p[0] == "step", getattr(p[1], "k", 0)))
                     for key, items in on_demand.items()}
        self._on_demand = {key: items for key, items in on_demand.items() if items}
        self._demanded = {}
        planned = {(j.B, j.k) for what, j in plan if what == "step" and hasattr(j, "k")}
        waiting = {(j.B, j.k) for what, j in plan if what == "step" and getattr(j, "k", 0) in later
                   and not be.table.ready(lambda j=j: self._build("step", j), disk=False)}
        self._waiting = frozenset(p for p in self._waiting if p not in planned) | frozenset(waiting)
        self.later_planned = len(todo)
        self.on_demand_planned = sum(map(len, self._on_demand.values()))
        self._todo = todo
        if todo or waiting or self._on_demand:
            # a daemon: a process that never stops it (stop_later) is not kept alive by it; the
            # atexit hook lets an executable in progress finish first
            self._later = threading.Thread(target=self._compile_later, args=(later, waiting),
                                           name="specjax-compile-later", daemon=True)
            _LATER.add(self)
            self._later.start()
        if execute:
            self._execute_once(prefills, steps, row_ops)
        return time.perf_counter() - t0

    def _build(self, what: str, j, compile_if_missing: bool = False):
        """Compile (or load) one warm-up item: a prefill chunk, a StepJob or a row operation."""
        be = self.be
        S = be.slots
        if what == "prefill":
            return be.table.prefill(j[0], j[1], S, j[2], j[3], compile_if_missing, first=j[4])
        if what == "step":
            return j.compile(be, compile_if_missing)
        if j[0] == "insert":
            return be.table.insert(j[1], j[2], S, j[3])
        if j[0] == "take":
            return be.table.take(j[1], j[2], S)
        if j[0] == "segment":
            return be.table.segment_take(j[1], S, j[2], j[3]) and be.table.segment_put(j[1], S, j[2], j[3])
        return be.table.clear(j[1], S)

    def _compile_later(self, later, waiting) -> None:
        """The background half of a warm-up: work on demand once wanted (``want``; the smallest
        bucket first, dropped once the live state is smaller), else ``_todo`` in order; the steps
        of ``later`` K buckets only once the gate is open (later_after_steps), each (bucket, K)
        joining k_options once none of its executables is left to build."""
        be = self.be
        left: dict = {}
        for what, j in self._todo + [p for items in self._on_demand.values() for p in items]:
            if what == "step" and j.k in later:
                left[(j.B, j.k)] = left.get((j.B, j.k), 0) + 1

        def next_item():
            with self._todo_cv:
                while True:
                    if self._stop_later.is_set():
                        return None
                    while self._demanded:
                        key = min(self._demanded)
                        if be.live.B and be.live.B < key[0]:  # (compacted past it: never needed now)
                            del self._demanded[key]
                            continue
                        item = self._demanded[key].pop(0)
                        if not self._demanded[key]:
                            del self._demanded[key]
                        return item
                    if self._todo:
                        return self._todo.pop(0)
                    if not self._on_demand:
                        return None
                    self._todo_cv.wait()

        def through_gate() -> bool:
            self._later_gate.wait()
            # (a new set each time: readers never see one mid-update)
            # this warm-up's steps on disk join now (loaded on first use)
            self._waiting = frozenset(p for p in self._waiting if p not in waiting or left.get(p, 0))
            return not self._stop_later.is_set()

        gated = False
        be.table.background.on = True
        yield_to_serving()
        while True:
            if not gated and not self._todo and not self._demanded:  # (before waiting: the steps on disk join)
                if not through_gate():
                    return
                gated = True
            if (item := next_item()) is None:
                break
            what, j = item
            if what == "step" and j.k in later and not gated:
                if not through_gate():
                    return
                gated = True
            self._build(what, j, compile_if_missing=True)
            if what == "step" and j.k in later:
                left[(j.B, j.k)] -= 1
                if not left[(j.B, j.k)]:
                    self._waiting = self._waiting - {(j.B, j.k)}
        if not gated:
            through_gate()

    def stop_later(self) -> list[int]:
        """End a warm-up's background compilation after the executable in progress; returns the
        K buckets it did not finish at some batch bucket (they stay out of ``k_options`` there)."""
        if self._later is not None:
            with self._todo_cv:
                self._stop_later.set()
                self._todo_cv.notify()
            self._later_gate.set()
            self._later.join()
            self._later = None
        # (work on demand that was never asked for was not needed)
        return sorted({k for B, k in self._waiting if (B, k) not in self._on_demand and (B, 0) not in self._on_demand})

    def _execute_once(self, prefills, steps, row_ops) -> None:
        be = self.be
        S = be.slots
        fresh = {}  # (B, run_draft) -> a prefill output of that batch (for the inserts)
        for B, C, g, rd, first in sorted(prefills, key=lambda j: not j[4]):  # first chunks first
            exe = be.table.prefill(B, C, S, g, rd, first=first)
            args = (be.params, be.dparams, jax.device_put(np.zeros((B, C), np.int32)),
                    jax.device_put(np.ones(B, np.int32)), SamplingArrays.build([], B))
            if first:
                out = exe(*args)
            else:  # a later chunk continues (and consumes) the state an earlier chunk left
                out = exe(*args, fresh.pop((B, rd)))
            jax.block_until_ready(out)
            fresh[(B, rd)] = out
        for B in sorted({j[0] for j in prefills} | {j.B for j in steps} | {j[1] for j in row_ops}):
            state = zeros_like_info(be.table.state_info(B, S))
            samp = SamplingArrays.build([], B)
            for j in steps:
                if j.B == B:
                    state = j.run(be, state, samp)
            # The row operations too: their first run would otherwise land on a served request.
            for j in row_ops:
                if j[0] == "insert" and j[1] == B and (j[2], j[3]) in fresh:
                    rows = jax.device_put(np.full(j[2], B, np.int32))  # all out of range: dropped
                    state = be.table.insert(B, j[2], S, j[3])(state, fresh[(j[2], j[3])], rows)
                elif j[0] == "clear" and j[1] == B:
                    state = be.table.clear(B, S)(state, jax.device_put(np.zeros(B, bool)))
                elif j[0] == "take" and j[1] == B:
                    jax.block_until_ready(be.table.take(B, j[2], S)(state, jax.device_put(np.full(j[2], -1, np.int32))))
            jax.block_until_ready(state)
        be.reset()
