"""The real backend of the serving engine: one live batch-bucket state on the device.

Requests own cache rows of a ``[B, S]`` state (B a batch bucket, S slots per row). Admission
prefills the new requests as a small batch and scatters their rows into free rows of the
live state (``insert_rows``); when the batch outgrows the bucket the state is regathered into
the next bucket, and it is compacted into a smaller bucket once the batch has fit it for
``shrink_patience`` steps (``LiveBucket``, the rule the simulator shares: a resize copies the
whole cache, so it must not oscillate). Freed rows get length 0 before the next step. The
allocations, resizes and clears a step runs are listed in ``take_row_ops`` for calibration.
Every executable (prefills, steps of every compiled K, inserts, resizes) comes from a
``StepTable``; what is compiled when is the compile planner's (``engine.compile_plan``).

The backend is that state, the table and a drafter (``drafters.protocol.Drafter``): the drafter
proposes, gives each step its inputs and the compiled step that runs them, and names the steps a
warm-up compiles for it, so nothing here depends on the drafter's kind. A K = 0 step runs as a
decode call (``step.spec_decode``: up to ``decode_steps`` plain steps in one executable, as
many as no decision separates) or, where a call per step is wanted, as the chain step with no
drafts; either way plain decoding is the same executables whatever the drafter. A drafter
whose chain steps need nothing from the host (``Drafter.fuses``: drafted on the device) runs
its K > 0 steps the same way (``fused_steps``): a decode call of K, of one step when a decision
is due after it, so one executable per K serves single steps and runs of them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from specjax import buckets as bk
from specjax.config import ModelConfig
from specjax.drafters.device import ModelDraft, check_pair
from specjax.drafters.kinds import as_drafter
from specjax.drafters.protocol import CHAIN, DecodeStep, StepInputs, usable_k_buckets
from specjax.engine.compile_plan import CompilePlanner, zeros_like_info
from specjax.engine.live_bucket import LiveBucket
from specjax.engine.loop import Proposal, RowResult
from specjax.engine.options import BackendOptions, model_params
from specjax.engine import prefix_store
from specjax.engine.prefill_jobs import PrefillJob, PrefillQueue, make_jobs
from specjax.engine.scheduler import Running
from specjax.engine.table import StepTable
from specjax.device_arrays import check_same_avals, param_avals  # noqa: F401  (re-exported)
from specjax.errors import require
from specjax.sampling import SamplingArrays, SamplingParams


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
        self._prefill_waited = 0.0  # of table.late_s: waited during prefills (waited())
        self.batch_buckets = opt.batch_buckets
        self.num_rows = self.batch_buckets[-1]
        self.prefill_rows = opt.prefill_rows_on(jax.default_backend())  # requests per prefill call
        self.slots = slots
        # what to compile, when, in what order (lazy: the live state compacts only into a bucket
        # whose K = 0 step is built, CompilePlanner.usable)
        self.planner = CompilePlanner(self)
        self.live = LiveBucket(self.batch_buckets, opt.shrink_patience, usable=self.planner.usable)
        self.max_chunk = bk.largest_chunk(opt.prefill_chunk, slots)  # prompts run in chunks of at most this
        self.table = StepTable(cfg, self.params, self.dparams, d.draft, opt.fwd, opt.teacher_topk, opt.layout,
                               layered_prefill=opt.prefill_by_layer_on(jax.default_backend()),
                               stand_ins=opt.stand_ins_on(jax.default_backend()))
        # the most steps one call runs (the loop's Backend field; 1: a call per step)
        self.decode_steps = opt.plain_decode_steps()
        # K > 0 chain steps run as decode calls of K (the loop's Backend field: runs of them in one
        # call): a drafter that needs nothing from the host between steps, decode calls on, no
        # packed blocks (a packed step's rows come from the host)
        self.fused_steps = d.fuses and self.decode_steps > 1 and not opt.packed
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

    def _resize(self, B_new: int, keep_order: list[int]) -> None:
        """Regather rows ``keep_order`` (old row indices) into a fresh [B_new] state."""
        idx = np.full(B_new, -1, np.int32)
        idx[: len(keep_order)] = keep_order
        if self.state is None:
            self.state = zeros_like_info(self.table.state_info(B_new, self.slots))
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
        state = zeros_like_info(self.table.state_info(Bp, self.slots, job.run_draft))
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
        if (inp.k == 0 and self.decode_steps > 1) or (self.fused_steps and inp.kind is CHAIN):
            # The one program of each K on a backend with decode calls: a call of one step (no
            # second executable; spec_decode runs the same chain step inside). Its row budget
            # leaves the block whole (the engine cuts the tokens as after any step).
            res = self._decode_call(rs, active, 1, [inp.k + 1] * len(rs), [False] * len(rs), None, False, inp.k,
                                    inp.num_draft)
            self.last_cold = self.table.cold_since(mark)
            return [r[0] for r in res], time.perf_counter() - t0
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
        self.planner.steps_ran()
        self.prepare(rs)
        self._prepared = False  # the next step prepares again
        active = np.zeros(self.B, bool)
        active[[self.row_of[r.uid] for r in rs]] = True
        return active

    def decode(self, rs: Sequence[Running], steps: int, left: Sequence[int], eos_rows: Sequence[bool],
               eos_ids: frozenset, stop_first: bool = False, k: int = 0) -> tuple[list[list[RowResult]], float]:
        """Up to ``steps`` (<= ``decode_steps``) steps of K = ``k`` drafts (K > 0: ``fused_steps``)
        in one call and one transfer (step.spec_decode). Per request (aligned with ``rs``): at
        most ``left`` tokens, ending at the first of ``eos_ids`` where ``eos_rows``, so exactly the
        steps as many single steps would run before the engine retires it; ``stop_first``: the
        call ends with the step at which the first request stops (a waiting request takes its
        row then). Returns each request's results, one per step it ran, and the seconds."""
        t0 = time.perf_counter()
        mark = self.table.cold_mark()
        active = self._begin(rs)
        num_draft = np.zeros(self.B, np.int32)
        if k:
            num_draft[[self.row_of[r.uid] for r in rs if r.speculate]] = k
        res = self._decode_call(rs, active, steps, left, eos_rows, eos_ids, stop_first, k, num_draft)
        self.last_cold = self.table.cold_since(mark)
        return res, time.perf_counter() - t0

    def _decode_call(self, rs, active, steps, left, eos_rows, eos_ids, stop_first, k,
                     num_draft) -> list[list[RowResult]]:
        """decode's call on the rows ``active`` (already begun), ``num_draft`` [B] drafts per row
        (K > 0); ``eos_ids`` None: no row stops at an EOS (``eos_rows`` all False), whatever mask
        the device holds."""
        B, n = self.B, self.decode_steps
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
        kind = DecodeStep(n, self.cfg.vocab_size, upkeep=k > 0 or self._upkeep(rs))
        self.last_k_step, self.last_tokens = k, B * (k + 1)
        exe = kind.exe(self.table, B, k, self.slots, self.greedy())
        inputs = (self.to_device(lf), self.to_device(er), self._eos_mask[1], self.to_device(np.array(steps, np.int32)),
                  self.to_device(np.array(bool(stop_first))))
        host = np.asarray(self.run(exe, *kind.args(inputs, self.to_device(num_draft), self.to_device(active),
                                                   self.sampling(), None)))
        toks = host[:, :n * (k + 1)].reshape(B, n, k + 1)
        acc, ran = host[:, n * (k + 1):n * (k + 2)], host[:, -1]
        self.planner.steps_ran(int(ran.max()) - 1)  # (every step of the call counts: warmup's later_after_steps, compaction)
        self.live.ran(len(self.row_of), int(ran.max()) - 1)
        out = []
        for r, row in zip(rs, rows):
            res = [RowResult(toks[row, j, :acc[row, j] + 1].tolist(), int(num_draft[row]), int(acc[row, j]))
                   for j in range(ran[row])]
            self.drafter.extend(r.uid, [t for x in res for t in x.tokens])
            out.append(res)
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

    # ------------------------------------------------------------ compilation (engine.compile_plan)

    def warmup(self, *args, **kw) -> float:
        """Compile what serving can call (CompilePlanner.warmup, its arguments)."""
        return self.planner.warmup(*args, **kw)

    def k_options(self, bucket: int) -> Sequence[int]:
        """The K buckets a step at ``bucket`` can run now (CompilePlanner.k_options)."""
        return self.planner.k_options(bucket)

    def k_coming(self, bucket: int) -> Sequence[int]:
        """The K buckets a warm-up's background thread is still building (CompilePlanner.k_coming)."""
        return self.planner.k_coming(bucket)

    def want(self, bucket: int, k: int) -> None:
        """Serving would run K drafts at ``bucket``: build them next if on demand (CompilePlanner.want)."""
        self.planner.want(bucket, k)

    def stop_later(self) -> list[int]:
        """End the background compilation (CompilePlanner.stop_later)."""
        return self.planner.stop_later()
