"""Assembly: drafters, generators, backends and labels built from plain settings.

Every launch script builds what it runs through these functions, so a drafter, its knobs and its
validation exist once; the scripts only turn flags into arguments (``specjax.cli``). Nothing here
reads flags or touches the process (no absl, no printing).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from specjax import buckets as bk
from specjax.models.options import ForwardOptions

# The drafter kinds: one table (drafters.table), shared by everything that asks about a kind.
from specjax.drafters.table import (DRAFTERS, TARGET_ONLY, DrafterEntry, entry, model_name, names,  # noqa: E402,F401
                                    register_drafter)

# (views of the table, for callers)
SPEC_DRAFTERS = names(build=True)
DEVICE_DRAFTERS = names(device=True)
TRAINED_DRAFTERS = names(trains=True)
HEAD_DRAFTERS = names(head=True)


def number_list(name: str, text: str, kind=int, minimum=None, positive: bool = False) -> list:
    """A flag's comma list of numbers, sorted and deduplicated; SpecjaxError on a malformed or
    empty list, a value below ``minimum`` or (``positive``) one that is not above 0."""
    from specjax.errors import SpecjaxError

    what = "integers" if kind is int else "numbers"
    try:
        xs = sorted({kind(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SpecjaxError(f"--{name} must be a comma list of {what}, got {text!r}") from None
    if not xs:
        raise SpecjaxError(f"--{name} is empty")
    if any(x != x or x in (float("inf"), float("-inf")) for x in xs):  # a NaN passes every range check below
        raise SpecjaxError(f"--{name} must be finite {what}, got {text!r}")
    if minimum is not None and xs[0] < minimum:
        raise SpecjaxError(f"--{name} must be {what} >= {minimum}, got {text!r}")
    if positive and xs[0] <= 0:
        raise SpecjaxError(f"--{name} must be positive {what}, got {text!r}")
    return xs


def build_drafter(model, spec, draft=None):
    """The Drafter of ``spec`` (an engine.spec.DrafterSpec) on ``model`` (a LoadedModel), built by
    its kind's entry (``draft``: an already loaded draft model); None for ``none``. Raises
    SpecjaxError on bad settings."""
    build = entry(spec.name).builder()
    return None if build is None else build(model, spec, draft)


def drafter_parts(model, drafter: str, *, k: int, draft=None, fwd=None, **knobs) -> dict:
    """The drafter ``drafter`` (a registered name) with DrafterSpec ``knobs`` on ``model`` as the
    keyword arguments of SpecGenerator / JaxBackend: ``{"drafter": a drafters.protocol.Drafter}``
    (``{}`` for none); ``fwd``: the engine's forward options (DrafterSpec.fwd)."""
    from specjax.engine.spec import DrafterSpec

    d = build_drafter(model, DrafterSpec(name=drafter, k=k, fwd=fwd, **knobs), draft)
    return {} if d is None else {"drafter": d}


def build_spec_generator(model, drafter: str, *, k: int, k_buckets, fwd=None, draft_first: bool = False,
                         packed: bool = False, prefill_chunk: int = bk.DEFAULT_PREFILL_CHUNK,
                         prefix_cache_mb: float = bk.DEFAULT_PREFIX_CACHE_MB, **kw):
    """A SpecGenerator for ``drafter`` on ``model`` (a LoadedModel); ``kw`` as for drafter_parts
    (``draft_first`` / ``packed``: see backend_options)."""
    from specjax.errors import SpecjaxError
    from specjax.spec_generate import SpecGenerator

    if drafter == "none":
        raise SpecjaxError(f"unknown drafter {drafter!r}; use one of {', '.join(SPEC_DRAFTERS)}")
    fwd = fwd or ForwardOptions()
    parts = drafter_parts(model, drafter, k=k, fwd=fwd, **kw)
    return SpecGenerator(model.cfg, model.params_for(fwd), eos_ids=model.tokenizer.eos_ids, k_buckets=k_buckets,
                         slot_buckets=bk.context_slot_buckets(model.cfg.max_position), batch_buckets=bk.DEFAULT_BATCH_BUCKETS,
                         fwd=fwd, draft_first=draft_first, packed=packed, prefill_chunk=prefill_chunk,
                         prefix_cache_mb=prefix_cache_mb, **parts)


def spec_shapes(gen, prompt_len: int, max_new_tokens: int, batch: int = 1) -> tuple[int, int, int]:
    """(batch bucket, prompt length, cache slots) a SpecGenerator runs these prompts at (used to
    compile exactly what a run needs ahead of time; the prefill chunks follow from the length)."""
    B = bk.pick(gen.batch_buckets, batch, "batch size")
    S = gen.slots_for([prompt_len], max_new_tokens)
    return B, prompt_len, S


def warm_spec(gen, shapes, k: int, greedy: bool = True, execute: bool = False, later: Sequence[int] = (),
              later_after_steps: int = 0, lazy: bool = False) -> float:
    """Compile the (batch, slots) prefill chunks of these prompt lengths and the (batch, k, slots) steps for
    every bucket k <= K (a host drafter's step shrinks to the proposal) in ``shapes``
    (from spec_shapes) and nothing else; afterwards the generator refuses to compile (a missed
    shape raises instead of silently timing a compilation). ``execute``: also run each once, for
    benchmarks (a first execution is slow: fresh buffers, cold code pages; timing it would
    charge whichever run met it first). ``later``: these K buckets compile in the background instead
    (``gen.stop_later()`` ends that), so a first answer waits for no more than it starts with,
    from the ``later_after_steps``-th step on. ``lazy``: nothing compiles now; each executable
    compiles on first use and the rest ahead in the background (JaxBackend.warmup), the steps
    of ``later`` still from that step on. Returns seconds."""
    t0 = time.perf_counter()
    by_bs: dict = {}
    for B, n, S in shapes:
        by_bs.setdefault((B, S), set()).add(n)
    for (B, S), lens in sorted(by_bs.items()):
        gen.warm = False  # warmup() leaves it True; allow the next (B, S) group to compile
        kbs = [b for b in gen.k_buckets if b <= k]
        gen.warmup(prompt_lens=sorted(lens), greedy_modes=(greedy,), batch_buckets=[B], slot_buckets=[S],
                   k_buckets=kbs, execute=execute, later_ks=later, later_after_steps=later_after_steps, lazy=lazy)
    gen.warm = True
    return time.perf_counter() - t0


def format_spec_stats(stats) -> str:
    pos = ", ".join(f"{p:.2f}" for p in stats.per_position_acceptance)
    return (f"acceptance rate {stats.acceptance_rate:.3f} ({stats.accepted}/{stats.drafted} drafts); "
            f"mean accepted tokens per step {stats.mean_accepted_tokens:.2f} (bonus included; {stats.steps} steps); "
            f"per-position acceptance [{pos}]")


def make_backend(model, drafter: str, *, k_buckets, batch_buckets, slots, profiling=False, fwd=None,
                 draft_first: bool = False, packed: bool = False, prefill_chunk: int = bk.DEFAULT_PREFILL_CHUNK,
                 parts=None, teacher_topk: int = 0, layout=None, prefix_cache_mb: float = bk.DEFAULT_PREFIX_CACHE_MB,
                 **drafter_kw):
    """A serving-engine JaxBackend for ``drafter`` on ``model``; ``drafter_kw`` as for drafter_parts
    (``profiling``: prompt lookup replaced by host drafts of exactly K tokens; ``draft_first``:
    also compile a device drafter's draft-ahead path, for confidence policies; ``packed``: packed
    verify blocks, for per-request draft counts; see backend_options). ``parts``: the drafter
    given instead of built from the flags (a drafters.protocol.Drafter, or JaxBackend's drafter
    keywords such as {"draft", "draft_params"} of a distill.train.TrainableDraft); ``teacher_topk``:
    the steps keep the target's top-k (online distillation); ``layout``: shard the engine
    (sharding.Layout)."""
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.profiling import FixedLengthDrafter

    fwd = fwd or ForwardOptions()
    if parts is None and drafter == TARGET_ONLY and profiling:
        parts = {"drafter": FixedLengthDrafter()}
    elif parts is None:
        parts = drafter_parts(model, drafter, k=max(k_buckets), fwd=fwd, **drafter_kw)
    return JaxBackend(model.cfg, model.params_for(fwd), k_buckets=k_buckets, batch_buckets=batch_buckets, slots=slots,
                      fwd=fwd, draft_first=draft_first, packed=packed, prefill_chunk=prefill_chunk,
                      teacher_topk=teacher_topk, layout=layout, prefix_cache_mb=prefix_cache_mb, **(parts if isinstance(parts, dict) else {"drafter": parts}))


def perf_model_label(spec) -> str:
    """The performance model the steps of ``spec`` (a DrafterSpec) are costed with (its kind's
    entry: drafters.table). Host drafters (prompt lookup, suffix trees, hybrid) add nothing to the
    device step, so they share the target-only model, which launch/profile.py fits under the name
    TARGET_ONLY; a layer-skip draft is told apart by its layers, a draft model by its file, a
    head's device trees by their shape (their steps cost what its chains' do not); hybrid_eagle's
    steps are the EAGLE head's chain steps (less the head's drafting where every row has a suffix
    chain, which the online cost calibration sees), so it is costed with eagle's model."""
    return entry(spec.name).label(spec)


def chain_of(spec):
    """``spec`` (a DrafterSpec of a kind that drafts trees) drafting chains instead (its entry's
    ``chain``), or None when it already drafts chains or its kind has no such switch."""
    changes = dict(entry(spec.name).chain)
    if not changes or all(getattr(spec, k) == v for k, v in changes.items()):
        return None
    return dataclasses.replace(spec, **changes)


def default_perf_models() -> str:
    """The performance models shipped with the package (configs/perf/perf_models.json)."""
    from importlib import resources

    return str(resources.files("specjax.configs").joinpath("perf", "perf_models.json"))


# The estimated gain over K = 0 a named SmartSpec policy needs before it speculates
# (GoodputPolicy.min_gain; the oracle's estimates are exact, so it takes any gain). In a 200-request
# batch job on a 2-core CPU, suffix chose K > 0 on steps it estimated a few percent ahead and
# served 0.95x AR; K = 0's cost moves by 10-30% from call to call (its calibration is the median
# of the last 16 calls').
MIN_GAIN = 0.1
# Observations the priors count as until real ones replace them: alpha's (MovingAverage.prior_weight)
# and the cost model's own prediction (CostCalibration.prior_weight). A batch-1 verify step reads an
# alpha of 0 or 1, and EAGLE's first drafts of a chat answer are accepted less often (0.17 over its
# first 3 steps, 0.36-0.40 later); one K = 1 step's time read 1.24x the model. As the whole
# estimate, either turned the drafter off, and nothing was measured again to correct it.
PRIOR_WEIGHT = 8


def policy_for(name: str, cost=None, k_buckets=None, window: int = 16, threshold: float = 0.5):
    """The policy object of an explicit name (parsed by engine.spec.PolicySpec): 'none' (K = 0),
    'smartspec' (goodput, moving average), 'smartspec-req' (per-request draft counts),
    'smartspec-conf' (goodput, confidence-based proposal with cut ``threshold``), 'oracle'
    (goodput with the simulator's true acceptance) or an integer K (one of ``k_buckets``)."""
    from specjax.engine.spec import PolicySpec
    from specjax.errors import SpecjaxError
    from specjax.goodput import FixedK, GoodputPolicy

    pol = PolicySpec(name, threshold=threshold)
    if pol.fixed_k is not None:
        if k_buckets is not None and pol.fixed_k not in k_buckets:
            raise SpecjaxError(f"policy K={pol.fixed_k} is not in --k_buckets {list(k_buckets)}")
        return FixedK(pol.fixed_k)
    if pol.name == "auto":
        raise SpecjaxError("policy auto is resolved by registry.build_policy (it needs the engine spec)")
    estimator = {"smartspec-conf": "confidence", "oracle": "oracle"}.get(pol.name, "moving_average")
    # Alphas per request (each falls back to the global one until it has its own observations):
    # one average over every request follows a batch-1 stream's prompt-to-prompt swings too
    # slowly. smartspec-req also sets draft counts per request.
    return GoodputPolicy(cost, estimator, window=window, threshold=pol.threshold, per_request=pol.name != "oracle",
                         per_request_k=pol.packed, min_gain=0.0 if pol.name == "oracle" else MIN_GAIN,
                         prior_weight=0 if pol.name == "oracle" else PRIOR_WEIGHT, hold_requests=pol.name != "oracle")


def perf_key(spec, target_name: str) -> str:
    """The performance-model key of what ``spec`` (resolved) compiles for ``target_name`` on this
    hardware: host drafters share the target-only model; the code key names the executable."""
    from specjax.goodput.perf_model import hardware_key, model_key

    return model_key(target_name, perf_model_label(spec.drafter), hardware_key(), spec.code_key())


def profile_command(spec) -> str:
    """The launch/profile.py command that profiles what ``spec`` compiles: its forward options and,
    for a device drafter, the knobs of its kind that differ from their defaults."""
    from specjax.engine.spec import DrafterSpec

    d, f = spec.drafter, spec.fwd
    dev = entry(d.name).device
    args = [f"--model {spec.model}", f"--drafters {d.name if dev else TARGET_ONLY}", f"--dtype {spec.dtype}",
            f"--rows_kernel {f.rows_kernel}", f"--attention_impl {f.attention}"]
    args += [f"--small_rows {f.small_rows}"] * bool(f.small_rows) + [f"--scan_layers {int(f.scan_layers)}"]
    args += [f"--rows_activations {f.rows_activations}"]
    default = DrafterSpec(name=d.name)
    for knob in sorted(entry(d.name).reads) if dev else ():
        v = getattr(d, knob)
        if v != getattr(default, knob):
            args.append(f"--{'' if v else 'no'}{knob}" if isinstance(v, bool) else f"--{knob} {v}")
    return "python launch/profile.py " + " ".join(args)


def build_policy(spec, target_name: str):
    """(policy object, label, note or None) for ``spec`` (an EngineSpec resolved for its model,
    whose cfg.name is ``target_name``). A goodput policy costs steps with the performance model
    of exactly this compiled code (``perf_key``): ``smartspec*`` without one is an error naming
    what differs and the profile command; ``auto`` falls back to fixed K = the spec's fallback K
    and says why in ``note``."""
    from specjax.errors import SpecjaxError
    from specjax.goodput.perf_model import code_mismatch, load_model as load_perf

    pol = spec.policy
    if spec.drafter.name == "none" or pol.fixed_k == 0:
        return policy_for("none"), "no-SD", None
    if pol.fixed_k is not None:
        return policy_for(pol.name), pol.label, None
    path = pol.perf_models or default_perf_models()
    key = perf_key(spec, target_name)
    try:
        cost = load_perf(path, key)
    except SpecjaxError as e:
        import os

        diff = code_mismatch(path, key)
        why = (str(e) if not os.path.exists(path) else f"no performance model for {key!r} in {path}"
               + (f" (it has one for other compiled code: {diff})" if diff else ""))
        todo = f"profile this configuration: {profile_command(spec)}"
        if pol.name != "auto":
            raise SpecjaxError(f"--policy {pol.name}: {why}; {todo}") from None
        k = pol.fallback_k
        return policy_for(str(k)), f"K={k} (auto)", f"{why}; using fixed K={k} instead of SmartSpec ({todo})"
    if pol.name == "smartspec-conf":
        return policy_for(pol.name, cost, threshold=pol.threshold), f"SmartSpec-conf (T={pol.threshold:g})", None
    return policy_for("smartspec" if pol.name == "auto" else pol.name, cost), pol.label, None


def layout(spec):
    """The sharding.Layout of ``spec.mesh`` over this process's devices, or None (one device)."""
    if not spec.mesh:
        return None
    from specjax import sharding as sh

    data, n = (int(x) for x in spec.mesh.lower().split("x"))
    return sh.Layout(sh.make_mesh(data, n), shard_draft=spec.shard_draft)


def warm_host_kernels(name: str) -> bool:
    """Compile (or load from numba's disk cache) the host kernels drafter ``name`` calls (its
    entry's ``host_kernels``), once per process (a cold cache: about 19 s for the suffix drafters'
    kernels; none for the others). A launch script starts it in a thread beside the model load
    (cli.prewarm_drafter); a job compiled ahead waits for it before serving (serve_job), so no
    request pays it. Returns whether the drafter has such kernels."""
    warm = entry(name).host_kernels
    if warm is None:
        return False
    from specjax.drafters.table import resolve

    resolve(warm)()
    return True


def build_backend(spec, model, *, draft=None, **kw):
    """The serving engine's JaxBackend for ``spec`` (resolved) on ``model``; ``kw`` as for
    make_backend (profiling, parts, teacher_topk, layout: the one the model was loaded with;
    draft_first / packed: what several policies on one backend need, else the spec's policy's);
    ``draft``: a loaded draft model."""
    kw.setdefault("layout", layout(spec))
    kw.setdefault("draft_first", spec.policy.draft_first)
    kw.setdefault("packed", spec.policy.packed)
    be = make_backend(model, spec.drafter.name, k_buckets=spec.k_buckets, batch_buckets=spec.batch_buckets,
                      slots=spec.slots, fwd=spec.fwd, prefill_chunk=spec.prefill_chunk,
                      prefix_cache_mb=spec.prefix_cache_mb, draft=draft, **spec.drafter.knobs(), **kw)
    from specjax.drafters.protocol import check_k

    # (K buckets above the most drafts the drafter's steps take are not compiled: usable_k_buckets)
    pol = spec.policy
    check_k(pol.fallback_k if pol.fixed_k is None else pol.fixed_k, be.drafter,
            "num_spec_tokens" if pol.fixed_k is None else "--policy K")
    return be


def build_generator(spec, model, draft=None):
    """The batch generator for ``spec`` (resolved) on ``model``: a SpecGenerator with the spec's
    drafter, or the autoregressive Generator for drafter none."""
    if spec.drafter.name == "none":
        from specjax.generate import Generator

        return Generator(model.cfg, model.params_for(spec.fwd), eos_ids=model.tokenizer.eos_ids, fwd=spec.fwd,
                         prefill_chunk=spec.prefill_chunk, prefix_cache_mb=spec.prefix_cache_mb)
    return build_spec_generator(model, spec.drafter.name, k=spec.drafter.k, k_buckets=spec.k_buckets, fwd=spec.fwd,
                                draft_first=spec.policy.draft_first, packed=spec.policy.packed,
                                prefill_chunk=spec.prefill_chunk, prefix_cache_mb=spec.prefix_cache_mb, draft=draft,
                                **spec.drafter.knobs())
