"""Every compiled executable a generator or the serving engine may call, keyed by static shape.

``StepTable`` lowers and compiles on first request until ``warm`` is set; afterwards asking
for a shape that was not compiled raises (a timed loop must never stall on a compilation
unnoticed), unless the table is also ``lazy``: then a missing executable is compiled (or loaded
from the disk cache) on first use, and the seconds callers waited for that are counted
(``late_s``). A shape the background compiler (JaxBackend.warmup) is building is built once: a
caller that needs it waits for that build. ``ready`` says, without building anything, whether an
executable is in memory or on disk.
Besides prefill and the (chain / tree) spec steps it owns the row operations the continuous
batching engine needs to keep one batch-bucket state alive while requests come and go:

  insert_rows: scatter a freshly prefilled [Bp] state into rows of the running [B] state
  take_rows:   gather rows into a state of another bucket (grow or compact the batch)
  clear_rows:  zero the length of freed rows (a stale long row would make every step's
               chunked attention read its slots, and keep the next writes in range)

With a ``Layout`` (sharding.Layout: a mesh and the logical rules) every executable is lowered
for inputs carrying the layout's shardings (params as placed, per-row inputs over ``data``, the
state in the one cache sharding of its bucket) and returns its state pinned to that sharding,
row operations included (their static ``layout`` argument).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from functools import partial

import jax
import jax.numpy as jnp

from specjax import buckets as bk
from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.drafters.device import ModelDraft
from specjax.engine import exe_cache
from specjax.engine.compile_key import CompileKey
from specjax.engine.options import layered_prefill_runs
from specjax.models import llama
from specjax.models.options import DEFAULT_SCAN_UNROLL, ForwardOptions
from specjax.engine.step import (StepState, fresh_state, pin, prefill_embed_jit, prefill_finish_jit,
                                 prefill_layer_jit, spec_chunk_jit, spec_decode_jit, spec_draft_jit, spec_prefill_jit,
                                 spec_step_jit, spec_tree_step_jit)
from specjax.sharding import Layout, with_shardings
from specjax.errors import SpecjaxError
from specjax.sampling import SamplingArrays



def _set_rows(dst, src, rows, axis):
    idx = (slice(None),) * axis + (rows,)
    return dst.at[idx].set(src.astype(dst.dtype), mode="drop")


def _cache_set_rows(dst: kv.KVCache, src: kv.KVCache, rows) -> kv.KVCache:
    # every field of the cache's kind (a feature head's cache carries its feature too)
    return dataclasses.replace(dst, **{f.name: _set_rows(getattr(dst, f.name), getattr(src, f.name), rows,
                                                         kv.batch_axis(f.name)) for f in dataclasses.fields(dst)})


@partial(jax.jit, donate_argnames=("state",), static_argnames=("layout",))
def insert_rows(state: StepState, new: StepState, rows, layout: Layout | None = None) -> StepState:
    """rows[j]: destination row of new's row j (>= B drops it: a padding row of the prefill).
    A ``new`` without a draft cache (prefill with the draft disabled) leaves the draft rows as
    they are; the step re-derives draft lengths from the target's anyway."""
    dcache = state.dcache
    if dcache is not None and new.dcache is not None:
        dcache = _cache_set_rows(dcache, new.dcache, rows)
    return pin(layout, StepState(cache=_cache_set_rows(state.cache, new.cache, rows), dcache=dcache,
                                  prev=_set_rows(state.prev, new.prev, rows, 0),
                                  pending=_set_rows(state.pending, new.pending, rows, 0)))


def _cache_take(c: kv.KVCache, idx) -> kv.KVCache:
    src = jnp.maximum(idx, 0)
    return dataclasses.replace(c, **{f.name: getattr(c, f.name)[(slice(None),) * kv.batch_axis(f.name) + (src,)]
                                     for f in dataclasses.fields(c) if f.name != "lengths"},
                               lengths=jnp.where(idx >= 0, c.lengths[src], 0))


@partial(jax.jit, static_argnames=("layout",))
def take_rows(state: StepState, idx, layout: Layout | None = None) -> StepState:
    """New state whose row j is old row idx[j] (idx[j] = -1: an empty row of length 0)."""
    src = jnp.maximum(idx, 0)
    return pin(layout, StepState(cache=_cache_take(state.cache, idx),
                                  dcache=None if state.dcache is None else _cache_take(state.dcache, idx),
                                  prev=state.prev[src], pending=state.pending[src]))


def _row_fields(c: kv.KVCache, row) -> dict:
    # a cache's per-row fields besides its entries (lengths; a feature head's carried feature),
    # as a prefill leaves them (it defers nothing: a fresh prefill state's empty window stays)
    return {f.name: getattr(c, f.name)[row] for f in dataclasses.fields(c)
            if f.name not in ("k", "v") + kv.DEFERRED_FIELDS}


@partial(jax.jit, static_argnames=("size", "layout"))
def take_segment(state: StepState, row, start, *, size: int, layout: Layout | None = None) -> dict:
    """Row ``row``'s cache entries at slots [start, start + size), target and draft ([L, Hkv, size,
    hd] each; during a prefill the draft's entries sit at the target's positions), and the rest
    of its row as the chunk left it: a prefix-store segment (engine.prefix_store)."""
    def part(c):
        if c is None:
            return None
        k, v = (jax.lax.dynamic_slice_in_dim(a[:, row], start, size, axis=2) for a in (c.k, c.v))
        return {"k": k, "v": v, **_row_fields(c, row)}

    seg = {"cache": part(state.cache), "dcache": part(state.dcache), "prev": state.prev[row],
           "pending": state.pending[row]}
    return seg if layout is None else jax.lax.with_sharding_constraint(seg, layout.segment(seg))


@partial(jax.jit, donate_argnames=("state",), static_argnames=("layout",))
def put_segment(state: StepState, seg: dict, row, start, layout: Layout | None = None) -> StepState:
    """Write a segment back into row ``row`` at slots [start, start + size): the row is then what
    the chunk left it (take_segment's inverse)."""
    def part(c, s):
        if c is None:
            return None
        k, v = (jax.lax.dynamic_update_slice(a, s[n][:, None].astype(a.dtype), (0, row, 0, start, 0))
                for n, a in (("k", c.k), ("v", c.v)))
        return dataclasses.replace(c, k=k, v=v, **{n: getattr(c, n).at[row].set(x) for n, x in s.items()
                                                    if n not in ("k", "v")})

    return pin(layout, StepState(cache=part(state.cache, seg["cache"]), dcache=part(state.dcache, seg["dcache"]),
                                  prev=state.prev.at[row].set(seg["prev"]),
                                  pending=state.pending.at[row].set(seg["pending"])))


@partial(jax.jit, donate_argnames=("state",), static_argnames=("layout",))
def clear_rows(state: StepState, free, layout: Layout | None = None) -> StepState:
    def clr(c):
        return None if c is None else kv.set_lengths(c, jnp.where(free, 0, c.lengths))

    return pin(layout, dataclasses.replace(state, cache=clr(state.cache), dcache=clr(state.dcache)))


class LayeredPrefill:
    """A prefill chunk as 2 + L (+ the draft model's L') calls (step.prefill_embed,
    step.prefill_layer once per layer, step.prefill_finish), called like the one-program
    executable: ``(params, dparams, tokens, n_valid, samp[, state])`` -> state (a later chunk's
    ``state`` donated)."""

    def __init__(self, embed, layers, finish, features: tuple[int, ...], index, draft_layers=()):
        self.embed, self.layers, self.finish, self.features = embed, layers, finish, features
        self.draft_layers = draft_layers  # a draft model's layer programs (step.layered_draft)
        self._index = index  # the layer indices on the device (the table's, made once)

    def __call__(self, params, dparams, tokens, n_valid, samp, state: StepState | None = None) -> StepState:
        x, dx, fresh = self.embed(params, dparams, tokens)
        state = fresh if state is None else state
        cache, taken = state.cache, {}
        for i, exe in enumerate(self.layers):
            if i in self.features:
                taken[i] = x
            x, cache = exe(llama.layer_params(params, i), x, cache, self._index[i])
        if len(self.layers) in self.features:  # (the last layer's output)
            taken[len(self.layers)] = x
        dcache = state.dcache
        for i, exe in enumerate(self.draft_layers):
            dx, dcache = exe(llama.layer_params(dparams, i), dx, dcache, self._index[i])
        return self.finish(params, dparams, tokens, n_valid, samp, x,
                           dataclasses.replace(state, cache=cache, dcache=dcache), tuple(taken[i] for i in self.features))


_STAND_IN_OPS = ("decode", "step", "verify", "tree")  # (the steps whose blocks the rows kernel takes whole)
STAND_IN_UNROLL = DEFAULT_SCAN_UNROLL  # layers per loop iteration of a stand-in (ForwardOptions.scan_layers)


def _layer_groups(layers) -> list[int]:
    """For each layer, the first layer whose params have the same structure, shapes and dtypes
    (one compiled layer program per group; a GGUF may store some layers in other blocks)."""
    first: dict = {}
    out = []
    for i, lp in enumerate(layers):
        leaves, tree = jax.tree_util.tree_flatten(lp)
        sig = (tree, tuple((a.shape, jnp.dtype(a.dtype)) for a in leaves))
        out.append(first.setdefault(sig, i))
    return out


# the nice value of threads that compile ahead (yield_to_serving); $SPECJAX_BACKGROUND_NICE sets
# another (the test suite's 0: its two worker processes keep both cores busy, so a thread at 19
# that a test joins would wait behind the other worker)
BACKGROUND_NICE = int(os.environ.get("SPECJAX_BACKGROUND_NICE", "19"))


def yield_to_serving(nice: int | None = None) -> None:
    """Lower the calling thread's CPU priority (on Linux a thread's nice value is its own, and the
    threads it starts inherit it): a compilation ahead of need then runs on cycles serving leaves
    idle instead of taking a core from it (on 2 cores a background compile slowed a batch job's
    serving by about a third). A thread that serving waits for is not starved: the waiting
    thread leaves its core idle. ``nice``: another value than ``BACKGROUND_NICE``. Elsewhere, or
    where refused: nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE if nice is None else nice)
    except (AttributeError, OSError):
        pass


class StepTable:
    def __init__(self, cfg: ModelConfig, params, dparams, draft: ModelDraft | None = None,
                 fwd: ForwardOptions = ForwardOptions(), teacher_topk: int = 0, layout: Layout | None = None,
                 layered_prefill: bool = False, stand_ins: bool = False):
        """``layered_prefill``: prefill chunks as one program per part (LayeredPrefill: a cold
        start compiles one layer instead of L per chunk size); one device, the list form of the
        layers and XLA attention in prefill only (params placed on several devices without a
        layout keep the one-program prefill, whose output shardings the steps are compiled for).
        ``stand_ins``: once the table is lazy (JaxBackend.warmup's lazy mode: compile on first use
        and the rest in the background), a step a caller would wait to compile runs first as its
        stand-in (``stand_in``) while the step itself compiles behind it."""
        if layered_prefill and not layered_prefill_runs(fwd, layout):
            raise ValueError("a layered prefill runs on one device with the per-layer list and XLA attention")
        if stand_ins and not (fwd.rows_kernel and not fwd.scan_layers and layout is None):
            raise ValueError("stand-in steps are the rows kernel's scanned twins: one device, the per-layer list")
        self.stand_ins = stand_ins
        self._behind: dict = {}  # key -> the thread compiling it behind its stand-in
        self.cfg = cfg
        self.layout = layout
        self.teacher_topk = teacher_topk  # chain steps also return the target's top-k (CompileKey.teacher)
        self.params = params
        self.dparams = dparams
        self.draft = draft
        self.fwd = fwd
        self._exe: dict = {}
        self._info: dict = {}
        self._building: dict = {}  # key -> threading.Event, set when its build ends
        self._lock = threading.Lock()
        self._probe = threading.local()  # .on: _get only says whether it could load (ready)
        self.background = threading.local()  # .on: this thread compiles ahead (its builds are not waits)
        self.lazy = False  # warm + lazy: a missing shape compiles on first use instead of raising
        self.late_s = 0.0  # seconds callers of a warm table waited for a compilation (lazy, or in flight)
        self.late = 0  # ... that many executables
        self.late_cpu_s = 0.0  # ... and the CPU seconds the waiting threads spent compiling
        self.ahead_s = 0.0  # seconds the background compiler spent building (JaxBackend.warmup)
        self.ahead = 0  # ... that many executables
        self.ahead_cpu_s = 0.0  # ... and the CPU seconds its threads spent (not serving's: serve_job)
        self.stood_in = 0  # serving calls answered with a stand-in (stand_in)
        self.builds_begun = 0  # background builds begun, and ended (cold_mark: was one running?)
        self.builds_ended = 0
        self._one_device = all(len(getattr(x, "sharding", None).device_set) == 1
                               for x in jax.tree_util.tree_leaves((params, dparams)) if hasattr(x, "sharding"))
        self.warm = False
        self.layered_prefill = layered_prefill and self._one_device
        self._layered_calls: dict = {}  # prefill key -> its LayeredPrefill
        self._layer_index = None  # the layer indices on the device, made once
        # each layer's first layer of the same param shapes (one layer program per group)
        self._layer_groups = _layer_groups(params["layers"]) if self.layered_prefill else None
        # ... and a draft model's (step.layered_draft: a head's prefill stays in finish)
        self._draft_groups = (_layer_groups(dparams["layers"]) if self.layered_prefill and draft is not None
                              and draft.prefill_as_layers else None)
        # compiled executables on disk (beside jax's cache, when that is on); single-device only
        self.disk_cache = exe_cache.default() if self._one_device and layout is None else None

    def _sds(self, shape, dtype, per_row: bool = True):
        """An abstract input; with a layout, per-row ([B, ...]) inputs are placed over ``data``,
        the rest replicated."""
        if self.layout is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        sh = self.layout.rows(shape) if per_row else self.layout.replicated()
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    def _abstract_samp(self, B):
        return jax.tree_util.tree_map(lambda a: self._sds((B,), a.dtype), SamplingArrays.build([], B))

    def key(self, op: str, B: int, S: int, greedy_only: bool, run_draft: bool = True, k: int = 0,
            prompt: int = 0, width: int = 0, tokens: int = 0, steps: int = 0) -> CompileKey:
        """The compile key of one of this table's model executables (a verify step's drafts come
        from a draft call, and a tree step's from the host unless the draft drafts trees itself
        (Medusa), so their keys have no drafter)."""
        trees = self.draft is not None and self.draft.drafts_trees
        draft = self.draft if (run_draft and op != "verify" and (op != "tree" or trees)) else None
        teacher = self.teacher_topk if op in ("step", "verify") else 0
        return CompileKey(op, self.cfg, B, S, bool(greedy_only), draft, self.fwd, k, prompt, width, tokens, teacher,
                          self.layout, steps, draft.features if draft is not None else ())

    def _compile(self, key, fn, args, more_static=None):
        """``fn`` lowered for ``args`` and compiled, or loaded from the on-disk executable cache
        (exe_cache: a warm run skips tracing the model). Model executables take ``key`` as their
        static argument; the row operations the layout (and ``more_static``)."""
        static = {"key": key} if isinstance(key, CompileKey) else {} if self.layout is None else {"layout": self.layout}
        static.update(more_static or {})
        if isinstance(key, CompileKey) and key.fwd.rows_kernel:
            # The kernel's FFI target names are registered (its forwarders) before a program that
            # may call them is compiled or loaded from disk (a loaded one traces nothing that
            # would), and the kernel is built before such a program is returned: its tracing,
            # lowering and compilation run beside a cold build.
            from specjax.models.cpu import rows_dot

            return exe_cache.compile_cached(self.disk_cache, key, fn, tuple(args), ready=rows_dot.ensure,
                                            register=rows_dot.ensure_targets, lowering=rows_dot.deferred,
                                            remember=not (self.stand_ins and key.fwd.scan_layers), **static)
        return exe_cache.compile_cached(self.disk_cache, key, fn, tuple(args), **static)

    def stand_in(self, key):
        """The stand-in of ``key`` under ``stand_ins``, or None: for a decode, chain, verify or
        tree step, the same step with the layers as one loop over the rows kernel's stacks
        (ForwardOptions.scan_layers, ``STAND_IN_UNROLL`` layers per iteration). It computes the same
        bits (tests/test_rows_dot.py) and its program compiles in a fraction of the unrolled one's
        time (a 30-layer decode forward: 1.4 s instead of 6.6), at the same speed under the CPU
        attention but about 2x slower under XLA's at one prefix chunk of slots (the cache copied
        per layer, BENCHMARKS.md): a cold start answers with it until the step is built. Only in
        the lazy mode, whose callers accept a first result sooner over a steady speed from the
        first step (--compile ahead, benchmarks: no stand-ins)."""
        if not (self.stand_ins and self.lazy and isinstance(key, CompileKey) and key.op in _STAND_IN_OPS
                and not key.fwd.scan_layers):
            return None
        return dataclasses.replace(key, fwd=dataclasses.replace(key.fwd, scan_layers=STAND_IN_UNROLL))

    def _on_disk(self, key, spec) -> bool:
        return self.disk_cache is not None and self.disk_cache.has(self.disk_cache.entry(key, spec()[1]))

    def _build_behind(self, key, spec, what: str) -> None:
        """Compile ``key`` in a thread of its own (once; not a daemon: a process that answered
        with the stand-in stores the step on its way out, for the next run to load)."""
        def run():
            self.background.on = True
            yield_to_serving()
            try:
                self._get(key, spec, what, compile_if_missing=True)
            except Exception:  # (the stand-in keeps serving; a later build of the step says why)
                pass

        with self._lock:
            if key in self._behind:
                return
            t = self._behind[key] = threading.Thread(target=run, name="specjax-compile-behind")
        t.start()

    def wait_behind(self) -> None:
        """Wait for the steps compiling behind their stand-ins (from then on calls run them)."""
        for t in list(self._behind.values()):
            t.join()

    def _get(self, key, spec, what: str, compile_if_missing: bool = False):
        """The executable of ``key``: ``spec()`` = (jitted function, abstract arguments), built
        (compiled or loaded from disk) if missing, once whichever threads ask; under ``ready``
        only whether it is in memory (itself or its stand-in) or on disk. With stand-ins, a
        caller that would wait for a step's compilation gets its stand-in (``stand_in``, itself
        compiled or loaded if need be) while the step compiles behind it."""
        exe = self._exe.get(key)
        if exe is not None and not getattr(self._probe, "on", False):
            return exe  # (the per-step path: nothing else to look at)
        twin = self.stand_in(key)
        if getattr(self._probe, "on", False):
            return exe is not None or (twin is not None and twin in self._exe) or (self._probe.disk and
                                                                                  self._on_disk(key, spec))
        if self.warm and not (compile_if_missing or self.lazy):
            raise SpecjaxError(f"no precompiled {what}; add it to the warm-up buckets")
        if twin is not None and getattr(self.background, "on", False):
            if twin not in self._exe and not self._on_disk(key, spec):  # (the stand-in first: a caller may soon wait)
                self._get(twin, spec, what + " (stand-in)", compile_if_missing=True)
        elif twin is not None and (twin in self._exe or key in self._building or not self._on_disk(key, spec)):
            stand = self._get(twin, spec, what + " (stand-in)", compile_if_missing=True)
            self._build_behind(key, spec, what)
            self.stood_in += 1
            return stand
        waits = self.warm and not getattr(self.background, "on", False)  # a serving caller stalls here
        t0, c0 = time.perf_counter(), time.thread_time()
        while True:
            with self._lock:
                exe = self._exe.get(key)
                ev = self._building.get(key)
                mine = exe is None and ev is None
                if mine:
                    ev = self._building[key] = threading.Event()
                    self.builds_begun += not waits
            if exe is not None:
                break
            if not mine:
                ev.wait()  # another thread builds it; if that build failed, the loop builds it here
                continue
            try:
                exe = self._exe[key] = self._compile(key, *spec())
            finally:
                with self._lock:
                    del self._building[key]
                    self.builds_ended += not waits
                ev.set()
            break
        if waits:
            self.late_s += time.perf_counter() - t0
            self.late_cpu_s += time.thread_time() - c0
            self.late += 1
        elif getattr(self.background, "on", False) and mine:
            self.ahead_s += time.perf_counter() - t0
            self.ahead_cpu_s += time.thread_time() - c0
            self.ahead += 1
        return exe

    def cold_mark(self) -> tuple[int, int, int, int]:
        """Counters ``cold_since`` compares: (serving waits, stand-in answers, background builds
        begun); and builds ended, the fourth (read at the start: was one running then?)."""
        return self.late, self.stood_in, self.builds_begun, self.builds_ended

    def cold_since(self, mark) -> bool:
        """Whether a call made since ``cold_mark()`` ran cold: it waited for a compilation, ran a
        stand-in, or a background build ran beside it (on a CPU it takes cores from the call).
        Such a call's time is not what the step costs once built (its timing is not a cost
        observation: engine.observers.PolicyFeedback)."""
        late, stood, begun, ended = mark
        return self.late != late or self.stood_in != stood or self.builds_begun != ended

    def ready(self, build_call, disk: bool = True) -> bool:
        """Whether ``build_call()`` (a call of one of this table's methods) would find its
        executable in memory or (``disk``) in the disk cache, without building or loading it."""
        self._probe.on, self._probe.disk = True, disk
        try:
            return bool(build_call())
        finally:
            self._probe.on = False

    def __len__(self) -> int:
        return len(self._exe)

    def release(self) -> None:
        """Forget every compiled executable (and stop refusing to compile): XLA:CPU keeps each one's
        code in memory maps of its own, which a process runs out of after a few hundred."""
        self._exe.clear()
        self._layered_calls.clear()
        self.warm = False

    def prefill(self, B: int, C: int, S: int, greedy_only: bool, run_draft: bool = True,
                compile_if_missing: bool = False, first: bool = True):
        """A prefill chunk of C tokens per row: a prompt's first (fresh caches) or a later one
        (the state the earlier chunks left, donated); see step.spec_prefill."""
        key = self.key("prefill" if first else "chunk", B, S, greedy_only, run_draft, prompt=C)
        if self.layered_prefill:
            return self._layered(key, compile_if_missing)

        def spec():
            toks = self._sds((B, C), jnp.int32)
            nv = self._sds((B,), jnp.int32)
            if first:
                return spec_prefill_jit, (self.params, self.dparams, toks, nv, self._abstract_samp(B))
            return spec_chunk_jit, (self.params, self.dparams, toks, nv, self._abstract_samp(B),
                                    self.state_info(B, S, run_draft))

        return self._get(key, spec, key.describe(), compile_if_missing)

    def _layered(self, key: CompileKey, compile_if_missing: bool):
        """The LayeredPrefill of a prefill key (under ``ready``: whether all its programs are)."""
        probe = getattr(self._probe, "on", False)
        if not probe and key in self._layered_calls:  # (a prefill chunk's hot path)
            return self._layered_calls[key]
        B, C, S = key.batch, key.prompt, key.slots
        toks = self._sds((B, C), jnp.int32)
        x = self._sds((B, C, self.cfg.hidden_size), self.params["embed"].dtype)
        state = self.state_info(B, S, key.draft is not None)

        def get(part, fn, *args):
            k = dataclasses.replace(key, part=part)
            return self._get(k, lambda: (fn, args), k.describe(), compile_if_missing)

        embed = get("embed", prefill_embed_jit, self.params, self.dparams, toks)
        layers, groups = self.params["layers"], self._layer_groups
        index = self._sds((), jnp.int32, per_row=False)
        programs = {g: get(f"layer {g}", prefill_layer_jit, llama.layer_params(self.params, g), x, state.cache, index)
                    for g in sorted(set(groups))}
        dprograms, dgroups = {}, ()
        if key.draft is not None and self._draft_groups:  # a draft model's layers: calls too
            # (its own config and forward options, as ModelDraft.prefill runs them)
            dgroups = self._draft_groups
            dx = self._sds((B, C, key.draft.cfg.hidden_size), self.dparams["embed"].dtype)

            def dget(g):
                k = dataclasses.replace(key, cfg=key.draft.cfg, fwd=key.draft.fwd, part=f"draft layer {g}")
                return self._get(k, lambda: (prefill_layer_jit, (llama.layer_params(self.dparams, g), dx, state.dcache,
                                                                 index)), k.describe(),
                                 compile_if_missing)

            dprograms = {g: dget(g) for g in sorted(set(dgroups))}
        finish = get("finish", prefill_finish_jit, self.params, self.dparams, toks, self._sds((B,), jnp.int32),
                     self._abstract_samp(B), x, state, (x,) * len(key.features))
        if probe:
            return bool(embed and finish and all(programs.values()) and all(dprograms.values()))
        if self._layer_index is None:  # (made once: eager device arrays cost milliseconds each on a busy CPU)
            n = max(len(layers), len(self._draft_groups or ()))
            self._layer_index = [jnp.asarray(i, jnp.int32) for i in range(n)]
        call = self._layered_calls[key] = LayeredPrefill(embed, [programs[g] for g in groups], finish, key.features,
                                                         self._layer_index, [dprograms[g] for g in dgroups])
        return call

    def state_info(self, B: int, S: int, run_draft: bool = True):
        """Abstract StepState of a [B]-row state with S slots (the fresh caches' shapes; the model is
        not traced)."""
        key = ("state_info", B, S, bool(run_draft) and self.draft is not None)
        if key not in self._info and self.layout is not None:
            ck = self.key("prefill", B, S, True, key[3], prompt=bk.MIN_PROMPT_BUCKET)
            info = jax.eval_shape(partial(fresh_state, B=B, key=ck), self.params, self.dparams)
            self._info[key] = with_shardings(info, self.layout.state(info))
        if key not in self._info and not self._one_device:
            # Sharded params: the state's shardings are what the compiled prefill produces (an
            # abstract shape alone would pin the compiled steps to one device). The mesh-aware
            # state layout (cache sharding rules in the compile key) replaces this.
            self._info[key] = self.prefill(B, bk.MIN_PROMPT_BUCKET, S, True, run_draft, compile_if_missing=True).out_info
        if key not in self._info:
            ck = self.key("prefill", B, S, True, key[3], prompt=bk.MIN_PROMPT_BUCKET)
            self._info[key] = jax.eval_shape(partial(fresh_state, B=B, key=ck), self.params, self.dparams)
        return self._info[key]

    def step(self, B: int, K: int, S: int, greedy_only: bool, tokens: int = 0, compile_if_missing: bool = False):
        """The chain step with K drafts per row; ``tokens`` > 0: its real tokens packed into that
        many rows (per-row draft counts, see llama.forward)."""
        key = self.key("step", B, S, greedy_only, k=K, tokens=tokens)

        def spec():
            dt = self._sds((B, max(K, 1)), jnp.int32)
            nd = self._sds((B,), jnp.int32)
            act = self._sds((B,), jnp.bool_)
            pack = self._sds((tokens,), jnp.int32, per_row=False) if tokens else None
            return spec_step_jit, (self.params, self.dparams, self.state_info(B, S), dt, nd, act,
                                   self._abstract_samp(B), None, pack)

        return self._get(key, spec, key.describe(), compile_if_missing)

    def decode(self, B: int, n: int, S: int, greedy_only: bool, compile_if_missing: bool = False,
               upkeep: bool = True, k: int = 0):
        """Up to n steps of K = ``k`` drafts in one call (step.spec_decode: the chain step in a
        loop; K > 0 drafts with the device draft); ``upkeep`` False (K = 0 only): without the
        device drafter (a feature head's K = 0 upkeep left out, the draft cache passed through as
        it is)."""
        key = self.key("decode", B, S, greedy_only, run_draft=upkeep or k > 0, k=k, steps=n)

        def spec():
            rows = self._sds((B,), jnp.int32)
            flags = self._sds((B,), jnp.bool_)
            return spec_decode_jit, (self.params, self.dparams, self.state_info(B, S), flags, rows, rows,
                                     flags, self._sds((self.cfg.vocab_size,), jnp.bool_, per_row=False),
                                     self._abstract_samp(B), self._sds((), jnp.int32, per_row=False),
                                     self._sds((), jnp.bool_, per_row=False))

        return self._get(key, spec, key.describe(), compile_if_missing)

    def draft_call(self, B: int, P: int, S: int, greedy_only: bool, compile_if_missing: bool = False):
        """A device drafter's confidence-cut proposal of up to P drafts (Algorithm 3)."""
        key = self.key("draft", B, S, greedy_only, k=P)

        def spec():
            act = self._sds((B,), jnp.bool_)
            thr = self._sds((), jnp.float32, per_row=False)
            return spec_draft_jit, (self.params, self.dparams, self.state_info(B, S), act,
                                    self._abstract_samp(B), thr)

        return self._get(key, spec, key.describe(), compile_if_missing)

    def verify(self, B: int, K: int, P: int, S: int, greedy_only: bool, tokens: int = 0,
               compile_if_missing: bool = False):
        """The chain step verifying K of the P drafts a draft call left on the device."""
        key = self.key("verify", B, S, greedy_only, k=K, width=P, tokens=tokens)

        def spec():
            dt = self._sds((B, P), jnp.int32)
            nd = self._sds((B,), jnp.int32)
            act = self._sds((B,), jnp.bool_)
            q = None if greedy_only else self._sds((B, P, self.cfg.vocab_size), jnp.float32)
            pack = self._sds((tokens,), jnp.int32, per_row=False) if tokens else None
            return spec_step_jit, (self.params, self.dparams, self.state_info(B, S), dt, nd, act,
                                   self._abstract_samp(B), q, pack)

        return self._get(key, spec, key.describe(), compile_if_missing)

    def tree_step(self, B: int, K: int, S: int, greedy_only: bool, tokens: int = 0, compile_if_missing: bool = False):
        key = self.key("tree", B, S, greedy_only, k=K, tokens=tokens)

        def spec():
            ints = self._sds((B, K + 1), jnp.int32)
            pack = self._sds((tokens,), jnp.int32, per_row=False) if tokens else None
            return spec_tree_step_jit, (self.params, self.dparams, self.state_info(B, S), ints, ints,
                                        self._sds((B, K + 1), jnp.bool_), self._sds((B,), jnp.bool_),
                                        self._abstract_samp(B), pack)

        return self._get(key, spec, key.describe(), compile_if_missing)

    def insert(self, B: int, Bp: int, S: int, run_draft: bool = True):
        run_draft = bool(run_draft) and self.draft is not None

        key = ("insert", B, Bp, S, run_draft)

        def spec():
            rows = self._sds((Bp,), jnp.int32, per_row=False)
            return insert_rows, (self.state_info(B, S), self.state_info(Bp, S, run_draft), rows)

        return self._get(key, spec, f"row insert of {Bp} into batch {B}")

    def segment_take(self, B: int, S: int, C: int, run_draft: bool, compile_if_missing: bool = False):
        """take_segment of a C-token chunk from a [B]-row prefill state."""
        run_draft = bool(run_draft) and self.draft is not None
        key = ("segment_take", B, S, C, run_draft)

        def spec():
            i = self._sds((), jnp.int32, per_row=False)
            return take_segment, (self.state_info(B, S, run_draft), i, i), {"size": C}

        return self._get(key, spec, f"prefix segment capture of {C} tokens from batch {B}", compile_if_missing)

    def segment_info(self, B: int, S: int, C: int, run_draft: bool):
        """Abstract segment of a C-token chunk of a [B]-row prefill state (take_segment's output)."""
        run_draft = bool(run_draft) and self.draft is not None
        key = ("segment_info", B, S, C, run_draft)
        if key not in self._info:
            i = self._sds((), jnp.int32, per_row=False)
            seg = jax.eval_shape(partial(take_segment, size=C), self.state_info(B, S, run_draft), i, i)
            self._info[key] = seg if self.layout is None else with_shardings(seg, self.layout.segment(seg))
        return self._info[key]

    def segment_bytes(self, B: int, S: int, C: int, run_draft: bool) -> int:
        """Bytes one stored segment of a C-token chunk holds (its share of a prefix store's budget)."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self.segment_info(B, S, C, run_draft)))

    def segment_put(self, B: int, S: int, C: int, run_draft: bool, compile_if_missing: bool = False):
        """put_segment of a C-token chunk into a [B]-row prefill state (the state donated)."""
        run_draft = bool(run_draft) and self.draft is not None
        key = ("segment_put", B, S, C, run_draft)

        def spec():
            i = self._sds((), jnp.int32, per_row=False)
            return put_segment, (self.state_info(B, S, run_draft), self.segment_info(B, S, C, run_draft), i, i)

        return self._get(key, spec, f"prefix segment restore of {C} tokens into batch {B}", compile_if_missing)

    def take(self, B_from: int, B_to: int, S: int):
        key = ("take", B_from, B_to, S)

        def spec():
            return take_rows, (self.state_info(B_from, S),
                               self._sds((B_to,), jnp.int32, per_row=False))

        return self._get(key, spec, f"batch resize {B_from} -> {B_to}")

    def clear(self, B: int, S: int):
        key = ("clear", B, S)

        def spec():
            return clear_rows, (self.state_info(B, S), self._sds((B,), jnp.bool_, per_row=False))

        return self._get(key, spec, f"row clear for batch {B}")
