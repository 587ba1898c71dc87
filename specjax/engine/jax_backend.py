"""The real backend of the serving engine: one live batch-bucket state on the device.

Requests own cache rows of a ``[B, S]`` state (B a batch bucket, S slots per row). Admission
prefills the new requests as a small batch and scatters their rows into free rows of the
live state (``insert_rows``); when the batch outgrows the bucket the state is regathered into
the next bucket, and it is compacted into a smaller bucket once the batch has fit it for
``shrink_patience`` steps (``LiveBucket``, the rule the simulator shares: a resize copies the
whole cache, so it must not oscillate). Freed rows get length 0 before the next step. The
allocations, resizes and clears a step runs are listed in ``take_row_ops`` for calibration.
Every executable (prefills, steps of every compiled K, inserts, resizes) comes from a
``StepTable`` and is compiled by ``warmup``; serving never compiles.

The backend is that state, the table and a drafter (``drafters.protocol.Drafter``): the drafter
proposes, gives each step its inputs and the compiled step that runs them, and names the steps a
warm-up compiles for it, so nothing here depends on the drafter's kind. K = 0 always runs the
chain step: plain decoding is one executable whatever the drafter.
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
from specjax.config import ModelConfig
from specjax.drafters.device import ModelDraft, check_pair
from specjax.drafters.kinds import as_drafter
from specjax.drafters.protocol import CHAIN, DecodeStep, StepInputs, StepJob, usable_k_buckets
from specjax.engine.live_bucket import LiveBucket
from specjax.engine.loop import Proposal, RowResult
from specjax.engine.options import BackendOptions, model_params
from specjax.engine import prefix_store
from specjax.engine.prefill_jobs import PrefillJob, PrefillQueue, make_jobs
from specjax.engine.scheduler import Running
from specjax.engine.table import StepTable, yield_to_serving
from specjax.device_arrays import check_same_avals, param_avals  # noqa: F401  (re-exported)
from specjax.errors import SpecjaxError, require
from specjax.sampling import SamplingArrays, SamplingParams


def _zeros_like_info(info):
    return jax.tree_util.tree_map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), getattr(s, "sharding", None)),
                                  info)


MAPS_PER_LAYER_EXE = 22  # measured: ~650 memory maps per SmolLM2 (30-layer) prefill/step executable, row ops included


_LATER: "weakref.WeakSet[JaxBackend]" = weakref.WeakSet()  # backends whose warm-up started a background thread


@atexit.register
def _stop_background() -> None:
    for be in list(_LATER):
        be.stop_later()


def _keeps_upkeep(job) -> bool:
    """Whether a warm-up step job keeps the drafter's plain-step upkeep (all but the decode calls
    for rows that never draft)."""
    return getattr(getattr(job, "kind", None), "upkeep", True)


def lazy_order(plan, first_bucket: int, later_ks=(), later_chunks=None, first_chunks=(), draft_mode=None) -> list:
    """A lazy warm-up's background order (JaxBackend.warmup): what a job whose first admission
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


class JaxBackend:
    def __init__(self, cfg: ModelConfig, params, *, drafter=None, draft: ModelDraft | None = None, draft_params=None,
                 slots: int = 512, **options):
        """``drafter``: a protocol Drafter or a host drafter; ``draft`` + ``draft_params``: a
        device draft (drafters.kinds.as_drafter). ``options``: BackendOptions' fields."""
        opt = self.options = BackendOptions(**options)
        require(0 <= opt.teacher_topk <= cfg.vocab_size,
                f"teacher_topk must be in 0..{cfg.vocab_size}, got {opt.teacher_topk}")
        require(slots <= cfg.max_position, f"{slots} KV slots exceed the model's context ({cfg.max_position})")
        self.cfg = cfg
        self.drafter = as_drafter(drafter, draft, draft_params)
        d = self.drafter
        opt = self.options = dataclasses.replace(opt, k_buckets=usable_k_buckets(opt.k_buckets, d))
        check_pair(cfg, d.draft, d.params)
        require(not (opt.teacher_topk and not d.step.teacher),
                "a teacher signal (teacher_topk) comes from chain steps; this drafter proposes token trees")
        self.params = model_params(cfg, params, opt.fwd, d.params)
        dparams = d.params
        if opt.layout is not None:
            self.params, dparams = opt.layout.place(cfg, self.params, opt.fwd, max(opt.batch_buckets), slots,
                                                    getattr(d.draft, "cfg", None), dparams)
        self.layout = opt.layout
        self.dparams = dparams if dparams is not None else self.params
        self.device_draft = d.draft_prefill  # (the loop's Backend field: admission may skip the draft prefill)
        self.shrink_to_proposal = opt.shrink_to_proposal
        self.k_buckets = opt.k_buckets
        self.k_max = self.k_buckets[-1]
        self._waiting: frozenset = frozenset()  # (bucket, K > 0) steps still compiling: not yet options
        self.later_planned = 0  # executables the last warm-up left to the background thread
        self.on_demand_planned = 0  # ... and to it once serving asks for them (reachable_plan)
        self._prefill_waited = 0.0  # of table.late_s: waited during prefills (waited())
        self._later: threading.Thread | None = None
        self._stop_later = threading.Event()
        self._later_gate = threading.Event()  # set once the background half of a warm-up may start
        self._later_after = 0  # ... after this many steps (warmup's later_after_steps)
        self._todo: list = []  # the background thread's work left, in order (warmup)
        self._on_demand: dict[tuple[int, int], list] = {}  # (bucket, K) -> work built once serving wants it
        self._demanded: dict[tuple[int, int], list] = {}  # ... wanted (want), not yet taken by the thread
        self._todo_cv = threading.Condition()
        self._steps_run = 0
        self.batch_buckets = opt.batch_buckets
        self.num_rows = self.batch_buckets[-1]
        self.prefill_rows = opt.prefill_rows_on(jax.default_backend())  # requests per prefill call
        self.slots = slots
        # (lazy: the live state compacts only into a bucket whose K = 0 step is built, _usable)
        self.live = LiveBucket(self.batch_buckets, opt.shrink_patience, usable=self._usable)
        self._k0_jobs: dict[int, list] = {}  # bucket -> its K = 0 step jobs (the last warm-up's)
        self._usable_buckets: set[int] = set()  # buckets _usable found built
        self.max_chunk = bk.largest_chunk(opt.prefill_chunk, slots)  # prompts run in chunks of at most this
        self.table = StepTable(cfg, self.params, self.dparams, d.draft, opt.fwd, opt.teacher_topk, opt.layout,
                               layered_prefill=opt.prefill_by_layer_on(jax.default_backend()),
                               stand_ins=opt.stand_ins_on(jax.default_backend()))
        # the most K = 0 steps one call runs (the loop's Backend field; 1: a call per step)
        self.decode_steps = opt.plain_decode_steps()
        self._eos_mask = (None, None)  # (EOS ids, their [vocab] mask on the device)
        # prefilled prompt chunks kept for prompts that repeat them (kept across reset: a
        # generator's later calls reuse them too)
        self.prefix = (prefix_store.PrefixStore(int(opt.prefix_cache_mb * 2 ** 20)) if opt.prefix_cache_mb > 0
                       else None)
        require(not opt.prefix_cache_outputs or d.draft is None,
                "prefix_cache_outputs works with plain decoding and the host drafters: a device draft's cache "
                "is not kept by position during decoding")
        self.reset()

    # ------------------------------------------------------------ state

    def reset(self) -> None:
        """Forget every request (a new run); compiled executables are kept."""
        self.state = None
        self.B = 0
        self.rows: list[int | None] = []  # row -> uid
        self.row_of: dict[int, int] = {}
        self.samp_of: dict[int, SamplingParams] = {}
        self._to_clear: set[int] = set()
        self._samp = None
        self.drafter.reset()
        self._prepared = False  # the live state was resized / cleared for the coming step
        self.last_k_step = 0
        self.last_tokens = 0  # the last step's verify rows (packed size, or bucket x (k_step + 1))
        self.last_cold = False  # the last step call ran cold (StepTable.cold_since): its time is no cost
        self.resizes = 0
        self.live.reset()
        self._inputs: dict = {}  # step inputs already on the device, by value (see to_device)
        self.prefills = PrefillQueue()  # admitted prompts not yet (fully) prefilled
        # Row operations (op, bucket from, bucket to) done since the loop last asked, so that
        # calibration can tell the loop's own overhead from the cache copies it triggered.
        self.row_ops: list[tuple[str, int, int]] = []

    def bucket(self, n: int) -> int:
        return bk.pick(self.batch_buckets, n, "running requests")

    def take_row_ops(self) -> list[tuple[str, int, int]]:
        """The row operations since the last call (and forget them)."""
        ops, self.row_ops = self.row_ops, []
        return ops

    def share_prefix(self, store: prefix_store.PrefixStore) -> None:
        """Serve from ``store``, another backend's prefix store (same model and options), instead of
        this backend's own: a segment is one row's chunk, whatever the row's slot count or the
        batch's size, so the slot classes of a job (serve_job) reuse each other's prefixes."""
        require(self.prefix is not None, "this backend's prefix cache is off (prefix_cache_mb=0)")
        self.prefix = store

    def swap_draft_params(self, new) -> None:
        """Run the device draft on ``new`` from the next step on (online distillation). Same tree,
        shapes and dtypes as the compiled draft (a one-line error otherwise), so no executable
        recompiles; call it between steps. Requests in flight keep the draft cache their prompts
        were prefilled into with the old params: their drafts may be worse until they finish,
        while verification keeps every output exact. Tell the policy too (Policy.draft_changed)."""
        require(self.drafter.params is not None, "this backend has no device draft whose params could be swapped")
        check_same_avals(self.dparams, new, "new draft params")
        self.dparams = new
        if self.prefix is not None:
            self.prefix.clear(run_draft=True)  # (stored draft entries were computed with the old params)

    def step_bucket(self, n: int) -> int:
        """The bucket the next step of ``n`` running requests runs at (the live state may be
        larger than ``bucket(n)`` until it is compacted)."""
        return self.live.peek(n)

    def k_options(self, bucket: int) -> Sequence[int]:
        """The K buckets a step at ``bucket`` can run now: all of them, except those whose steps a
        warm-up left to the background (``later_ks``, ``lazy``) and that are not compiled yet
        (each joins once its executables are in)."""
        waiting = self._waiting
        return tuple(k for k in self.k_buckets if (bucket, k) not in waiting) if waiting else self.k_buckets

    def k_coming(self, bucket: int) -> Sequence[int]:
        """The K buckets ``k_options`` leaves out at ``bucket`` for now: a warm-up's background
        thread is building them."""
        return tuple(k for k in self.k_buckets if (bucket, k) in self._waiting)

    def _usable(self, B: int) -> bool:
        """Whether the live state may shrink into bucket ``B`` now: yes, unless a lazy warm-up
        left B's K = 0 step unbuilt (neither in memory nor on disk), when shrinking would stall
        serving while it compiles; the rows run the same in the larger bucket meanwhile."""
        if not self.table.lazy or B in self._usable_buckets:
            return True
        ok = all(self.table.ready(lambda j=j: j.compile(self, False)) for j in self._k0_jobs.get(B, ()))
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

    def _resize(self, B_new: int, keep_order: list[int]) -> None:
        """Regather rows ``keep_order`` (old row indices) into a fresh [B_new] state."""
        idx = np.full(B_new, -1, np.int32)
        idx[: len(keep_order)] = keep_order
        if self.state is None:
            self.state = _zeros_like_info(self.table.state_info(B_new, self.slots))
            self.row_ops.append(("alloc", 0, B_new))
        else:
            self.state = self.table.take(self.B, B_new, self.slots)(self.state, jax.device_put(idx))
            self.resizes += 1
            self.row_ops.append(("take", self.B, B_new))
        # Rows past keep_order come out empty (length 0); kept rows keep a pending clear.
        self._to_clear = {j for j, old in enumerate(keep_order) if old in self._to_clear}
        new_rows: list[int | None] = [None] * B_new
        for j, old in enumerate(keep_order):
            new_rows[j] = self.rows[old]
        self.rows = new_rows
        self.row_of = {u: j for j, u in enumerate(self.rows) if u is not None}
        self.B = B_new
        self._samp = None

    def _ensure_capacity(self, n_total: int) -> None:
        t = self.live.grow(n_total)
        if t:
            self._resize(t[1], list(range(self.B)))

    def _maybe_shrink(self, n_running: int) -> None:
        t = self.live.before_step(n_running)
        if t:
            self._resize(t[1], [j for j, u in enumerate(self.rows) if u is not None])

    def reserve(self, n_rows: int) -> None:
        """Allocate (or grow) the live state for ``n_rows`` requests now; profiling uses it to
        time prefills apart from the allocation."""
        self._ensure_capacity(n_rows)
        jax.block_until_ready(self.state)

    def resize_state(self, B_new: int) -> None:
        """Regather the live state into bucket ``B_new`` now, keeping its first rows (profiling
        times resizes with it; serving resizes only through the LiveBucket rule)."""
        require(B_new in self.batch_buckets and self.state is not None, f"cannot resize the state to {B_new}")
        require(sum(u is not None for u in self.rows[B_new:]) == 0, "resize would drop running requests")
        self.live.B = B_new
        self._resize(B_new, list(range(min(self.B, B_new))))
        jax.block_until_ready(self.state)

    def clear_state_rows(self, rows: Sequence[int]) -> None:
        """Zero the lengths of ``rows`` of the live state now (profiling)."""
        free = np.zeros(self.B, bool)
        free[list(rows)] = True
        self.state = self.table.clear(self.B, self.slots)(self.state, jax.device_put(free))
        jax.block_until_ready(self.state)

    def sampling(self):
        if self._samp is None:
            ps = [self.samp_of[u] if u is not None else SamplingParams() for u in self.rows]
            self._samp = SamplingArrays.build(ps, self.B)
        return self._samp

    def greedy(self) -> bool:
        return all(p.greedy for p in self.samp_of.values())

    # ------------------------------------------------------------ backend protocol

    def start_prefill(self, rs: Sequence[Running]) -> None:
        """Give each request a row now and queue its prefill (run by ``advance_prefill``). The row
        is held, inactive, until the prompt is in; a resize keeps it."""
        self._ensure_capacity(len(self.row_of) + len(rs))
        free = [j for j, u in enumerate(self.rows) if u is None]
        for r in rs:
            row = free.pop(0)
            self.rows[row] = r.uid
            self.row_of[r.uid] = row
            self.samp_of[r.uid] = r.req.sampling
        self._samp = None
        self.prefills.add(make_jobs(rs, self.drafter.draft_prefill, self.prefill_rows, self.max_chunk))

    def _restore_prefix(self, job: PrefillJob) -> None:
        """Start ``job`` after the chunks of its prompts the prefix store holds (looked up as the job
        starts, so the jobs queued before it have stored theirs): their segments written into a
        fresh prefill state, which the job's remaining chunks continue."""
        Bp = self.bucket(len(job.rs))
        paths = prefix_store.start_job(self.prefix, job)
        if not job.next:
            return
        state = _zeros_like_info(self.table.state_info(Bp, self.slots, job.run_draft))
        for b, path in enumerate(paths):
            for node in path:
                put = self.table.segment_put(Bp, self.slots, node.key[0], job.run_draft, compile_if_missing=True)
                state = put(state, node.segment, np.int32(b), np.int32(node.start))
        job.state = state

    def _store_prefix(self, job: PrefillJob, start: int, C: int, n_valid) -> None:
        """After a chunk: store it for each row that ran it whole (prefix_store.after_chunk)."""
        if self.prefix is None:
            return
        Bp = self.bucket(len(job.rs))
        # (built on first use, whatever the compile mode: a capture compiles in about 0.1 s where
        # one chunk it saves costs a prefill; skipping it had a warm lazy job store nothing)
        take = self.table.segment_take(Bp, self.slots, C, job.run_draft, compile_if_missing=True)
        prefix_store.after_chunk(self.prefix, job, start, C, n_valid,
                                 self.table.segment_bytes(Bp, self.slots, C, job.run_draft),
                                 lambda b: take(job.state, np.int32(b), np.int32(start)))

    def _store_output(self, r: Running) -> None:
        """A finished request's prompt + output chunks into the prefix store, from its row
        (prefix_store.after_output). Its row holds the KV of every token but the last output
        (sampled, never fed back); a stored segment is the row as a prefill of its chunk leaves
        it (length, last token, next token)."""
        seq = list(r.req.prompt) + list(r.out.tokens)
        kv_len = min(r.ctx_len, len(seq) - 1)
        C, row = self.max_chunk, self.row_of[r.uid]
        if self.state is None or kv_len < C:
            return
        take = self.table.segment_take(self.B, self.slots, C, False, compile_if_missing=True)

        def capture(start: int) -> dict:
            seg = take(self.state, np.int32(row), np.int32(start))
            end = start + C
            fix = {"prev": seq[end - 1], "pending": seq[end]}
            seg = {**seg, **{n: jax.device_put(np.asarray(v, seg[n].dtype), seg[n].sharding) for n, v in fix.items()}}
            lengths = seg["cache"]["lengths"]
            seg["cache"] = {**seg["cache"], "lengths": jax.device_put(np.asarray(end, lengths.dtype), lengths.sharding)}
            return seg

        prefix_store.after_output(self.prefix, seq, kv_len, C, self.table.segment_bytes(self.B, self.slots, C, False),
                                  capture)

    def advance_prefill(self, budget: int | None = None) -> tuple[list[tuple[Running, int]], float]:
        """Run queued prefill chunks (PrefillQueue.run: ``budget`` tokens, at least one chunk;
        None: all). Finished prompts are scattered into their rows of the live state. Returns
        (request, its first token) of each finished request, and the seconds it took."""
        t0 = time.perf_counter()
        w0 = self.table.late_s
        done = []
        for job in self.prefills.run(budget, self._run_chunk, self.bucket, self._restore_prefix):
            Bp = job.state.pending.shape[0]
            dst = np.full(Bp, self.B, np.int32)  # out of range: padding rows are dropped
            for b, r in enumerate(job.rs):
                dst[b] = self.row_of[r.uid]
                self._to_clear.discard(int(dst[b]))  # (the insert overwrites the row's length)
            ins = self.table.insert(self.B, Bp, self.slots, job.run_draft)
            self.state = ins(self.state, job.state, jax.device_put(dst))
            pend = np.asarray(job.state.pending)
            job.state = None
            for b, r in enumerate(job.rs):
                done.append((r, int(pend[b])))
                self.drafter.start(r.uid, list(r.req.prompt))
                self.drafter.extend(r.uid, [int(pend[b])])
        self._prefill_waited += self.table.late_s - w0
        return done, time.perf_counter() - t0

    def waited(self) -> tuple[float, float]:
        """Seconds callers waited for executables compiled (or loaded) when first reached after a
        warm-up: during prefills, and in all (StepTable.late_s)."""
        return self._prefill_waited, self.table.late_s

    def prefill(self, rs: Sequence[Running]) -> tuple[list[int], float]:
        """Prefill ``rs`` whole, now (with whatever else was queued): first tokens in order."""
        self.start_prefill(rs)
        done, t = self.advance_prefill(None)
        first = {r.uid: tok for r, tok in done}
        return [first[r.uid] for r in rs], t

    def _run_chunk(self, job: PrefillJob, start: int, C: int) -> None:
        """One prefill chunk of a job: its rows' prompt tokens [start, start + C)."""
        Bp = self.bucket(len(job.rs))
        lens = np.array([len(r.req.prompt) for r in job.rs] + [1] * (Bp - len(job.rs)), np.int32)
        n = np.clip(lens - start, 0, C).astype(np.int32)
        toks = np.zeros((Bp, C), np.int32)
        for b, r in enumerate(job.rs):
            toks[b, :n[b]] = r.req.prompt[start:start + n[b]]
        greedy = all(r.req.sampling.greedy for r in job.rs)
        samp = SamplingArrays.build([r.req.sampling for r in job.rs], Bp)
        exe = self.table.prefill(Bp, C, self.slots, greedy, job.run_draft, first=job.state is None)
        args = (self.params, self.dparams, jax.device_put(toks), jax.device_put(n), samp)
        job.state = exe(*args) if job.state is None else exe(*args, job.state)
        self._store_prefix(job, start, C, n)

    def prepare(self, rs: Sequence[Running]) -> None:
        """Resize / clear the live state for the coming step (once per step, before any call
        that reads row indices)."""
        if self._prepared:
            return
        self._prepared = True
        self._maybe_shrink(len(self.row_of))  # rows being prefilled are held too
        if self._to_clear:
            free = np.zeros(self.B, bool)
            free[list(self._to_clear)] = True
            self.state = self.table.clear(self.B, self.slots)(self.state, jax.device_put(free))
            self._to_clear.clear()
            self.row_ops.append(("clear", self.B, self.B))

    def propose(self, rs: Sequence[Running], k_max: int, threshold: float | None = None) -> Proposal:
        """``threshold``: a confidence policy's cut (Algorithm 3); a device drafter then drafts
        ahead of the choice, and the proposal carries every row's confidences."""
        return self.drafter.propose(self, rs, k_max, threshold)

    def run(self, exe, *args):
        """Run a compiled model executable on the live state; returns its output."""
        self.state, out = exe(self.params, self.dparams, self.state, *args)
        return out

    def token_options(self, bucket: int, k: int) -> tuple[int, ...]:
        """Packed-token sizes compiled for a (bucket, k) step (``packed`` backends; buckets.token_buckets)."""
        return bk.token_buckets(bucket, k, self.k_buckets) if self.options.packed else ()

    def step(self, rs: Sequence[Running], k: int, row_k: Sequence[int] | None = None
             ) -> tuple[list[RowResult], float]:
        """One step of K drafts per row; ``row_k`` (aligned with ``rs``): per-request draft counts
        <= K (the policy's per-request choice). A ``packed`` backend runs the block's real tokens
        only, in the smallest compiled packed size that holds them."""
        t0 = time.perf_counter()
        mark = self.table.cold_mark()
        active = self._begin(rs)
        B = self.B
        cap = {r.uid: k if row_k is None else min(k, int(row_k[i])) for i, r in enumerate(rs)}
        inp = self.drafter.step_inputs(self, rs, k, cap)
        t0 -= inp.seconds  # drafting done for this step before it
        if inp.k == 0 and self.decode_steps > 1:
            # The one K = 0 program of a backend with decode calls: a call of one step (no
            # second executable; the same tokens, spec_decode runs the K = 0 step inside).
            toks = self._decode_call(rs, active, 1, [1] * len(rs), [False] * len(rs), None, False)
            self.last_cold = self.table.cold_since(mark)
            return [RowResult(t, 0, 0) for t in toks], time.perf_counter() - t0
        if inp.k == 0:
            inp = StepInputs.plain(B)
        self.last_k_step = k_step = inp.k
        real = np.where(active, inp.num_draft + 1, 0)  # each active row's pending token and its drafts
        P = bk.token_bucket(B, k_step, self.k_buckets, int(real.sum())) if (self.options.packed and k_step > 0) else 0
        self.last_tokens = P or B * (k_step + 1)
        pack = None
        if P:
            idx = np.concatenate([row * (k_step + 1) + np.arange(real[row]) for row in range(B)]).astype(np.int32)
            pack = np.full(P, B * (k_step + 1), np.int32)  # out of range: padding
            pack[:len(idx)] = idx
            pack = self.to_device(pack)
        exe = inp.kind.exe(self.table, B, k_step, self.slots, self.greedy(), P)
        put = [self.to_device(a) if isinstance(a, np.ndarray) else a for a in inp.inputs]  # (device arrays pass)
        o = self.run(exe, *inp.kind.args(tuple(put), self.to_device(inp.num_draft), self.to_device(active),
                                         self.sampling(), pack))
        results = self._results(rs, o)
        self.last_cold = self.table.cold_since(mark)
        return results, time.perf_counter() - t0

    def _begin(self, rs: Sequence[Running]) -> np.ndarray:
        """What every step call does first (count it, resize / clear the state); the active rows."""
        self._steps_run += 1
        if self._steps_run >= self._later_after:
            self._later_gate.set()
        self.prepare(rs)
        self._prepared = False  # the next step prepares again
        active = np.zeros(self.B, bool)
        active[[self.row_of[r.uid] for r in rs]] = True
        return active

    def decode(self, rs: Sequence[Running], steps: int, left: Sequence[int], eos_rows: Sequence[bool],
               eos_ids: frozenset, stop_first: bool = False) -> tuple[list[list[int]], float]:
        """Up to ``steps`` (<= ``decode_steps``) plain decoding steps in one call and one transfer
        (step.spec_decode). Per request (aligned with ``rs``): at most ``left`` tokens, ending at
        the first of ``eos_ids`` where ``eos_rows``, so exactly what as many single steps would
        emit before the engine retires it; ``stop_first``: the call ends with the step at which the
        first request stops (a waiting request takes its row then). Returns each request's tokens
        and the seconds."""
        t0 = time.perf_counter()
        mark = self.table.cold_mark()
        toks = self._decode_call(rs, self._begin(rs), steps, left, eos_rows, eos_ids, stop_first)
        self.last_cold = self.table.cold_since(mark)
        return toks, time.perf_counter() - t0

    def _decode_call(self, rs, active, steps, left, eos_rows, eos_ids, stop_first) -> list[list[int]]:
        """decode's call on the rows ``active`` (already begun); ``eos_ids`` None: no row stops
        at an EOS (``eos_rows`` all False), whatever mask the device holds."""
        B = self.B
        shrink = self.live.steps_left(len(self.row_of))
        steps = steps if shrink is None else min(steps, shrink)
        rows = [self.row_of[r.uid] for r in rs]
        lf, er = np.zeros(B, np.int32), np.zeros(B, bool)
        lf[rows], er[rows] = left, eos_rows
        if self._eos_mask[1] is None or (eos_ids is not None and self._eos_mask[0] != eos_ids):
            eos_ids = eos_ids or frozenset()  # (None: no row stops at EOS; keep the mask there is)
            mask = np.zeros(self.cfg.vocab_size, bool)
            mask[[e for e in eos_ids if 0 <= e < self.cfg.vocab_size]] = True
            self._eos_mask = (eos_ids, jax.device_put(mask))
        kind = DecodeStep(self.decode_steps, self.cfg.vocab_size, upkeep=self._upkeep(rs))
        self.last_k_step, self.last_tokens = 0, B
        exe = kind.exe(self.table, B, 0, self.slots, self.greedy())
        inputs = (self.to_device(lf), self.to_device(er), self._eos_mask[1], self.to_device(np.array(steps, np.int32)),
                  self.to_device(np.array(bool(stop_first))))
        host = np.asarray(self.run(exe, *kind.args(inputs, None, self.to_device(active), self.sampling(), None)))
        ran = int(host[:, -1].max())
        self._steps_run += ran - 1  # (every step of the call counts: warmup's later_after_steps, compaction)
        self.live.ran(len(self.row_of), ran - 1)
        out = []
        for r, row in zip(rs, rows):
            new = host[row, :host[row, -1]].tolist()
            self.drafter.extend(r.uid, new)
            out.append(new)
        return out

    def _upkeep(self, rs: Sequence[Running]) -> bool:
        """Whether a decode call on ``rs`` keeps the drafter's plain-step upkeep: unless no row can
        ever draft (each admitted with the draft disabled, prefill disabling), when that work on
        every plain step would be spent for nothing (a batch job in which drafting does not pay
        ran 3.5-6% below AR with a head's)."""
        return not self.drafter.plain_upkeep or any(r.speculate for r in rs)

    def _results(self, rs: Sequence[Running], o) -> list[RowResult]:
        host = np.asarray(o.host)  # the step's results reach the host in one transfer
        w = o.tokens.shape[1]
        toks, n_acc, nd = host[:, :w], host[:, -2], host[:, -1]
        if o.path is not None:  # a tree step: each row's verified node count and accepted nodes
            rows = [self.row_of[r.uid] for r in rs]
            self.drafter.tree_verified([(int(nd[j]), host[j, w:w + n_acc[j]]) for j in rows if nd[j] > 0])
        ids = lg = None
        if o.teacher_ids is not None:
            ids, lg = np.asarray(o.teacher_ids), np.asarray(o.teacher_logits)
        out = []
        for r in rs:
            row = self.row_of[r.uid]
            m = n_acc[row] + 1
            new = [int(t) for t in toks[row, :m]]
            teacher = None if ids is None else (ids[row, :m], lg[row, :m])
            out.append(RowResult(new, int(nd[row]), int(n_acc[row]), teacher))
            self.drafter.extend(r.uid, new)
        return out

    def to_device(self, a: np.ndarray):
        """A step input on the device. Inputs repeat from step to step (no drafts, the same rows
        active), and a host-to-device copy costs tens of microseconds next to a millisecond step
        on small models, so recent inputs are kept by value."""
        key = (a.shape, a.dtype.str, a.tobytes())
        x = self._inputs.get(key)
        if x is None:
            if len(self._inputs) >= 64:
                self._inputs.clear()
            x = self._inputs[key] = jax.device_put(a)
        return x

    def release(self, r: Running) -> None:
        if self.options.prefix_cache_outputs and r.out.tokens:
            self._store_output(r)
        row = self.row_of.pop(r.uid)
        self.rows[row] = None
        self.samp_of.pop(r.uid, None)
        self._to_clear.add(row)
        self._samp = None
        self.drafter.finish(r.uid)

    # ------------------------------------------------------------ compilation

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
        t0 = time.perf_counter()
        self.stop_later()  # (an earlier warm-up's steps it did not finish stay out of k_options)
        chunks = sorted(bk.chunk_sizes(prompt_lens, self.max_chunk))
        draft_modes = (True, False) if self.drafter.draft_prefill else (False,)
        bbs = sorted(batch_buckets) if batch_buckets else self.batch_buckets
        if lazy and whole_job:  # (no step runs more rows than the job holds)
            bbs = [B for B in bbs if B <= self.bucket(min(len(queue), self.num_rows))]
        kbs = sorted(k_buckets) if k_buckets is not None else self.k_buckets
        ahead = self.k_max if self.options.draft_first else 0  # the draft-ahead call's width
        steps, row_ops = [], []
        # prefill calls run at most prefill_rows requests: at the buckets of those
        pb = self.bucket(min(self.prefill_rows, self.num_rows))
        pbs = sorted({min(B, pb) for B in bbs})
        prefills = [(B, C, g, rd, first) for B in pbs for g in greedy_modes for C, first in chunks
                    for rd in draft_modes]
        for B in bbs:
            for g in greedy_modes:
                if self.decode_steps > 1:  # plain decoding: its calls, a single K = 0 step among them
                    steps.append(StepJob(DecodeStep(self.decode_steps, self.cfg.vocab_size), B, 0, g))
                    if self.drafter.plain_upkeep and False in draft_modes:  # (rows admitted without the draft)
                        steps.append(StepJob(DecodeStep(self.decode_steps, self.cfg.vocab_size, upkeep=False), B, 0, g))
                else:
                    steps.append(StepJob(CHAIN, B, 0, g, 0))
                steps += [StepJob(CHAIN, B, 0, g, t) for t in self.token_options(B, 0)]
                steps += self.drafter.warm_steps(B, [K for K in kbs if K > 0], g, lambda K, B=B: self.token_options(B, K),
                                                 ahead)
            row_ops += [("insert", B, Bp, rd) for Bp in pbs if Bp <= B for rd in draft_modes]
            row_ops += [("take", B, B2) for B2 in bbs if B2 != B]
            row_ops.append(("clear", B))
        if self.prefix is not None:  # storing and restoring the chunk sizes these prompts run whole
            whole = {C for n in prompt_lens for s, C in bk.prefill_chunks(n, self.max_chunk) if s + C <= n}
            row_ops += [("segment", Bp, C, rd) for Bp in pbs for C in sorted(whole) for rd in draft_modes]
            if self.options.prefix_cache_outputs:  # taking a finished request's chunks from the live state
                row_ops += [j for j in (("segment", B, self.max_chunk, False) for B in bbs) if j not in row_ops]
        self._k0_jobs = {B: [j for j in steps if j.B == B and getattr(j, "k", None) == 0 and _keeps_upkeep(j)] for B in bbs}
        self._usable_buckets = set()
        check_map_budget(len(prefills) + sum(j.heavy for j in steps), self.cfg.num_layers)
        plan = [("prefill", j) for j in prefills] + [("step", j) for j in steps] + [("row", j) for j in row_ops]
        later = sorted({int(k) for k in later_ks} & set(kbs) - {0})
        if lazy or later:
            require(not execute and not self.options.draft_first,
                    "later_ks / lazy cannot be combined with execute or draft_first")
        on_demand: dict = {}
        if lazy:
            first = min(max(len(queue), 1), self.num_rows)  # the first admission's rows
            later_chunks = bk.chunk_sizes(queue[first:], self.max_chunk) if queue else None
            first_chunks = bk.chunk_sizes(queue[:first], self.max_chunk) if queue else ()
            reach = plan  # (built ahead, in lazy_order)
            if whole_job:  # what the job may not reach, on demand
                reach, on_demand = reachable_plan(plan, self.bucket(first), bk.chunk_sizes(queue, self.max_chunk),
                                                  later if demand_ks else ())
            now, deferred = [], lazy_order(reach, self.bucket(first), later, later_chunks, first_chunks,
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
        self.table.warm = True
        self.table.lazy = lazy
        self._stop_later.clear()
        self._later_after, self._steps_run = later_after_steps, 0
        if later_after_steps <= 0:
            self._later_gate.set()
        else:
            self._later_gate.clear()
        # What is in memory (or, lazy, on disk: loaded on first use) is not built ahead. The steps
        # of later_ks wait for the gate (later_after_steps), then join the options once built (or
        # at once where on disk); lazy's other executables are built ahead from now on.
        todo = [p for p in deferred if not self.table.ready(lambda p=p: self._build(*p), disk=lazy)]
        loaded = [p for p in deferred if p not in todo and not self.table.ready(lambda p=p: self._build(*p), disk=False)]
        if lazy and loaded:
            # A warm cache (a job like this ran before): what it lacks was mostly not reached then,
            # and compiling it beside serving slowed a warm README batch job by a third; only K
            # steps are built ahead (until built they are no option), the rest on first use.
            # The first bucket's K = 0 step, on disk, loads beside the first prefill.
            # The prefix store's row operations too (an earlier job without the store leaves none).
            first_k0 = [p for p in loaded if p[0] == "step" and p[1] in self._k0_jobs.get(self.bucket(first), ())]
            todo = first_k0 + [p for p in todo if (p[0] == "step" and p[1].k in later)
                               or (p[0] == "row" and p[1][0] == "segment")]
        # work on demand: what is neither in memory nor on disk (row operations, then steps by K)
        on_demand = {key: sorted([p for p in items if not self.table.ready(lambda p=p: self._build(*p))],
                                 key=lambda p: (p[0] == "step", getattr(p[1], "k", 0)))
                     for key, items in on_demand.items()}
        self._on_demand = {key: items for key, items in on_demand.items() if items}
        self._demanded = {}
        planned = {(j.B, j.k) for what, j in plan if what == "step" and hasattr(j, "k")}
        waiting = {(j.B, j.k) for what, j in plan if what == "step" and getattr(j, "k", 0) in later
                   and not self.table.ready(lambda j=j: self._build("step", j), disk=False)}
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
        S = self.slots
        if what == "prefill":
            return self.table.prefill(j[0], j[1], S, j[2], j[3], compile_if_missing, first=j[4])
        if what == "step":
            return j.compile(self, compile_if_missing)
        if j[0] == "insert":
            return self.table.insert(j[1], j[2], S, j[3])
        if j[0] == "take":
            return self.table.take(j[1], j[2], S)
        if j[0] == "segment":
            return self.table.segment_take(j[1], S, j[2], j[3]) and self.table.segment_put(j[1], S, j[2], j[3])
        return self.table.clear(j[1], S)

    def _compile_later(self, later, waiting) -> None:
        """The background half of a warm-up: work on demand once wanted (``want``; the smallest
        bucket first, dropped once the live state is smaller), else ``_todo`` in order; the steps
        of ``later`` K buckets only once the gate is open (later_after_steps), each (bucket, K)
        joining k_options once none of its executables is left to build."""
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
                        if self.live.B and self.live.B < key[0]:  # (compacted past it: never needed now)
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
        self.table.background.on = True
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
        S = self.slots
        fresh = {}  # (B, run_draft) -> a prefill output of that batch (for the inserts)
        for B, C, g, rd, first in sorted(prefills, key=lambda j: not j[4]):  # first chunks first
            exe = self.table.prefill(B, C, S, g, rd, first=first)
            args = (self.params, self.dparams, jax.device_put(np.zeros((B, C), np.int32)),
                    jax.device_put(np.ones(B, np.int32)), SamplingArrays.build([], B))
            if first:
                out = exe(*args)
            else:  # a later chunk continues (and consumes) the state an earlier chunk left
                out = exe(*args, fresh.pop((B, rd)))
            jax.block_until_ready(out)
            fresh[(B, rd)] = out
        for B in sorted({j[0] for j in prefills} | {j.B for j in steps} | {j[1] for j in row_ops}):
            state = _zeros_like_info(self.table.state_info(B, S))
            samp = SamplingArrays.build([], B)
            for j in steps:
                if j.B == B:
                    state = j.run(self, state, samp)
            # The row operations too: their first run would otherwise land on a served request.
            for j in row_ops:
                if j[0] == "insert" and j[1] == B and (j[2], j[3]) in fresh:
                    rows = jax.device_put(np.full(j[2], B, np.int32))  # all out of range: dropped
                    state = self.table.insert(B, j[2], S, j[3])(state, fresh[(j[2], j[3])], rows)
                elif j[0] == "clear" and j[1] == B:
                    state = self.table.clear(B, S)(state, jax.device_put(np.zeros(B, bool)))
                elif j[0] == "take" and j[1] == B:
                    jax.block_until_ready(self.table.take(B, j[2], S)(state, jax.device_put(np.full(j[2], -1, np.int32))))
            jax.block_until_ready(state)
        self.reset()
