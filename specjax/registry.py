"""Assembly: drafters, generators, backends and labels built from plain settings.

Every launch script builds what it runs through these functions, so a drafter, its knobs and its
validation exist once; the scripts only turn flags into arguments (``specjax.cli``). Nothing here
reads flags or touches the process (no absl, no printing).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from specjax import buckets as bk
from specjax.models.options import ForwardOptions

@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    """One drafter kind as the registry knows it: the only place that does.
    build(model, spec: engine.spec.DrafterSpec, draft=None) makes the drafter the backend runs, a
    drafters.protocol.Drafter (``draft``: an already loaded draft model). device: it drafts inside
    the compiled step (its own draft forward), so its step costs need a performance model of their
    own. reads: the DrafterSpec fields it uses (a setting given for a drafter that does not read it
    is refused). trains: distillation (launch/distill.py; --online_distill too, but for eagle) can train its draft.
    draft_ahead: it can draft ahead of the policy's choice (confidence policies, smartspec-conf)."""

    name: str
    build: Callable | None
    device: bool = False
    reads: frozenset = frozenset()
    trains: bool = False
    draft_ahead: bool = False


_PLD = frozenset({"pld_min_ngram", "pld_max_ngram", "pld_max_draft"})
_SUFFIX = frozenset({"suffix_max_depth", "suffix_alpha", "suffix_min_prob", "suffix_tree", "suffix_cache_requests",
                     "suffix_cache_mb", "suffix_history_jsonl"})


def _build_parts(model, spec, draft=None):
    return drafter_parts(model, spec.name, k=spec.k, **drafter_kwargs(spec, model, draft))["drafter"]


DRAFTERS: dict[str, DrafterEntry] = {}


def register_drafter(entry: DrafterEntry) -> None:
    """Add a drafter kind (a new kind needs its module and this one call, nothing else)."""
    DRAFTERS[entry.name] = entry


for _e in (DrafterEntry("none", None),
           DrafterEntry("prompt_lookup", _build_parts, reads=_PLD),
           DrafterEntry("draft_model", _build_parts, device=True, reads=frozenset({"draft_model", "draft_checkpoint"}),
                        trains=True, draft_ahead=True),
           DrafterEntry("layer_skip", _build_parts, device=True, reads=frozenset({"draft_layers", "draft_checkpoint"}),
                        trains=True, draft_ahead=True),
           DrafterEntry("eagle", _build_parts, device=True,
                        reads=frozenset({"eagle_head", "eagle_tree_width", "eagle_tree_depth"}), trains=True),
           DrafterEntry("medusa", _build_parts, device=True, reads=frozenset({"medusa_head", "medusa_tree"}),
                        trains=True),
           DrafterEntry("suffix", _build_parts, reads=_SUFFIX),
           DrafterEntry("suffix_path", _build_parts, reads=_SUFFIX - {"suffix_tree"}),
           DrafterEntry("hybrid", _build_parts, reads=_SUFFIX | _PLD | {"suffix_tau"}),
           DrafterEntry("hybrid_eagle", _build_parts, device=True,
                        reads=(_SUFFIX - {"suffix_tree"}) | {"suffix_tau", "eagle_head"})):
    register_drafter(_e)

# (views kept for callers; the table above is the source)
SUFFIX_DRAFTERS = ("suffix", "suffix_path", "hybrid", "hybrid_eagle")  # (the drafters with suffix trees)
SPEC_DRAFTERS = tuple(n for n in DRAFTERS if n != "none")
DEVICE_DRAFTERS = tuple(n for n, e in DRAFTERS.items() if e.device)
TRAINED_DRAFTERS = tuple(n for n, e in DRAFTERS.items() if e.trains)
AHEAD_DRAFTERS = tuple(n for n, e in DRAFTERS.items() if e.draft_ahead)


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


def prompt_lookup_config(k: int, min_ngram: int = 1, max_ngram: int = 3, max_draft: int = 0):
    """Validated before the model load (raises SpecjaxError on bad n-gram bounds). max_draft:
    at most this many drafts per step; 0 means K."""
    from specjax.drafters.prompt_lookup import PromptLookupConfig

    return PromptLookupConfig(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=min(max_draft or k, max(k, 1)))


def suffix_config(k: int, *, max_depth=64, alpha=1.0, min_prob=0.1, tree=True, cache_requests=100000,
                  cache_mb=1024.0):
    """Validated before the model load (raises SpecjaxError on bad knobs)."""
    from specjax.drafters.suffix import SuffixConfig

    return SuffixConfig(max_depth=max_depth, alpha=alpha, min_prob=min_prob, tree=tree, max_spec=max(k, 1),
                        max_cached_requests=cache_requests, max_cached_mb=cache_mb)


def load_suffix_history(path: str, tokenizer) -> list[list[int]]:
    """Past outputs for the global suffix tree: JSONL lines with 'output_ids' or 'output' text."""
    from specjax.jobs import read_outputs

    return [tokenizer.encode(x) if isinstance(x, str) else x
            for x in read_outputs(path, flag="--suffix_history_jsonl")]


def drafter_parts(model, drafter: str, *, k: int, draft_model: str | None = None, draft_layers: int = 8,
                  pld_min_ngram: int = 1, pld_max_ngram: int = 3, pld_max_draft: int = 0, dtype: str = "float32",
                  draft=None, suffix=None, suffix_tau: float = 1.0, suffix_history=(),
                  draft_checkpoint: str | None = None, eagle_head: str | None = None,
                  medusa_head: str | None = None, medusa_tree: bool = True, eagle_tree: tuple = (0, 4)) -> dict:
    """The drafter of ``drafter`` (a registered name) on ``model`` as the keyword arguments of
    SpecGenerator / JaxBackend: ``{"drafter": a drafters.protocol.Drafter}`` (``{}`` for none). ``draft``: an
    already loaded draft LoadedModel (else ``draft_model`` is loaded here). Raises SpecjaxError on
    bad settings. ``suffix``: a SuffixConfig for the suffix/hybrid drafters; ``suffix_history``:
    past outputs (token lists) preloaded into the global suffix tree. ``draft_checkpoint``: a
    layer-skip draft's or draft model's distilled params, from that checkpoint directory
    (distill.checkpoint). ``eagle_head``: the eagle drafter's saved head (drafters.eagle.save_head;
    None: the shipped head, else a random-initialised one; ``eagle_tree``: (width, depth) of its
    dynamic trees, width 0: chains); ``medusa_head``: the medusa drafter's
    (drafters.medusa; None: the shipped heads, else fresh ones), drafting trees unless not
    ``medusa_tree``."""
    from specjax.drafters.device import DeviceDrafter, ModelDraft, layer_skip
    from specjax.drafters.host import host_drafter
    from specjax.drafters.prompt_lookup import PromptLookupDrafter
    from specjax.errors import SpecjaxError
    from specjax.models.loader import load_model

    cfg = model.cfg
    if drafter == "prompt_lookup":
        pld = PromptLookupDrafter(prompt_lookup_config(k, pld_min_ngram, pld_max_ngram, pld_max_draft))
        return {"drafter": host_drafter(pld)}
    if drafter == "hybrid_eagle":  # suffix chains where they score above tau, the EAGLE head elsewhere
        import dataclasses

        from specjax.drafters import eagle
        from specjax.drafters.head_hybrid import SuffixHeadDrafter
        from specjax.drafters.suffix import SuffixDrafter

        head = eagle.build(model, eagle_head)
        sd = SuffixDrafter(dataclasses.replace(suffix or suffix_config(k), tree=False), history=suffix_history)
        return {"drafter": SuffixHeadDrafter(sd, head.draft, head.params, tau=suffix_tau)}
    if drafter in SUFFIX_DRAFTERS:
        import dataclasses

        from specjax.drafters.suffix import HybridDrafter, SuffixDrafter

        scfg = suffix or suffix_config(k)
        if drafter == "suffix_path":
            scfg = dataclasses.replace(scfg, tree=False)
        sd = SuffixDrafter(scfg, history=suffix_history)
        if drafter == "hybrid":
            pld = PromptLookupDrafter(prompt_lookup_config(k, pld_min_ngram, pld_max_ngram, pld_max_draft))
            if suffix_tau < 0:
                raise SpecjaxError(f"--suffix_tau must be >= 0, got {suffix_tau}")
            sd = HybridDrafter(sd, pld, tau=suffix_tau)
        return {"drafter": host_drafter(sd)}
    if drafter == "layer_skip":
        if draft_checkpoint:  # (its draft.json says how many layers)
            from specjax.distill.checkpoint import load_draft

            td, trainable = load_draft(draft_checkpoint, cfg, model.params)
            return {"drafter": DeviceDrafter(td.draft, td.params(trainable))}
        if not 1 <= draft_layers <= cfg.num_layers - 1:
            raise SpecjaxError(f"--draft_layers must be in 1..{cfg.num_layers - 1} for {cfg.name} "
                               f"({cfg.num_layers} layers), got {draft_layers}")
        return {"drafter": DeviceDrafter(*layer_skip(cfg, model.params, draft_layers))}
    if drafter == "eagle":
        from specjax.drafters import eagle

        return {"drafter": eagle.build(model, eagle_head, *eagle_tree)}
    if drafter == "medusa":
        from specjax.drafters import medusa

        return {"drafter": medusa.build(model, medusa_head, medusa_tree)}
    if drafter == "draft_model":
        if draft is None:
            if not draft_model:
                raise SpecjaxError("--drafter draft_model needs --draft_model (a model name, .gguf file or HF dir)")
            draft = load_model(draft_model, dtype)
        dcfg = draft.cfg
        if dcfg.vocab_size != cfg.vocab_size:
            raise SpecjaxError(f"draft model {dcfg.name} has vocabulary size {dcfg.vocab_size} but the target "
                               f"{cfg.name} has {cfg.vocab_size}; draft and target must share a tokenizer")
        if draft_checkpoint:
            from specjax.distill.checkpoint import load_draft

            td, trainable = load_draft(draft_checkpoint, cfg, model.params, draft_model=draft)
            return {"drafter": DeviceDrafter(td.draft, td.params(trainable))}
        return {"drafter": DeviceDrafter(ModelDraft(dcfg), draft.params)}
    entry = DRAFTERS.get(drafter)
    if entry is None:
        raise SpecjaxError(f"unknown drafter {drafter!r}; use one of {', '.join(DRAFTERS)}")
    if entry.build is None:
        return {}
    # a kind registered elsewhere: its entry builds it, from its DrafterSpec (the knobs above are
    # the built-in kinds' own)
    from specjax.engine.spec import DrafterSpec

    return {"drafter": entry.build(model, DrafterSpec(name=drafter, k=k), draft)}


def build_spec_generator(model, drafter: str, *, k: int, k_buckets, fwd=None, draft_first: bool = False,
                         packed: bool = False, prefill_chunk: int = bk.DEFAULT_PREFILL_CHUNK,
                         prefix_cache_mb: float = bk.DEFAULT_PREFIX_CACHE_MB, **kw):
    """A SpecGenerator for ``drafter`` on ``model`` (a LoadedModel); ``kw`` as for drafter_parts
    (``draft_first`` / ``packed``: see backend_options)."""
    from specjax.errors import SpecjaxError
    from specjax.spec_generate import SpecGenerator

    if drafter == "none":
        raise SpecjaxError(f"unknown drafter {drafter!r}; use one of {', '.join(SPEC_DRAFTERS)}")
    parts = drafter_parts(model, drafter, k=k, **kw)
    fwd = fwd or ForwardOptions()
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

    if parts is None and drafter == "prompt_lookup" and profiling:
        parts = {"drafter": FixedLengthDrafter()}
    elif parts is None:
        parts = drafter_parts(model, drafter, k=max(k_buckets), **drafter_kw)
    fwd = fwd or ForwardOptions()
    return JaxBackend(model.cfg, model.params_for(fwd), k_buckets=k_buckets, batch_buckets=batch_buckets, slots=slots,
                      fwd=fwd, draft_first=draft_first, packed=packed, prefill_chunk=prefill_chunk,
                      teacher_topk=teacher_topk, layout=layout, prefix_cache_mb=prefix_cache_mb, **(parts if isinstance(parts, dict) else {"drafter": parts}))


def model_name(spec: str) -> str:
    """The name a model spec loads under (LoadedModel.cfg.name): a config name as is, a .gguf
    file or HF directory by its base name."""
    import os

    return os.path.basename(os.path.normpath(spec)) if (spec.endswith(".gguf") or os.path.isdir(spec)) else spec


def drafter_label(drafter: str, draft_layers: int = 8, draft_model: str | None = None) -> str:
    """A drafter with what tells its device drafts apart: the layer count of a layer-skip draft,
    the model of an independent draft model."""
    if drafter == "layer_skip":
        return f"layer_skip{draft_layers}"
    if drafter == "draft_model" and draft_model:
        return f"draft_model:{model_name(draft_model)}"
    return drafter


TARGET_ONLY = "prompt_lookup"  # the host drafter launch/profile.py times the target-only steps with


def perf_model_label(drafter: str, draft_layers: int = 8, draft_model: str | None = None, trees: str = "") -> str:
    """The performance model a drafter's steps are costed with. Host drafters (prompt lookup,
    suffix trees, hybrid) add nothing to the device step, so they share the target-only model,
    which launch/profile.py fits under the name TARGET_ONLY. ``trees``: a head's device trees
    (``tree_label``), whose steps cost what its chains' do not. hybrid_eagle's steps are the
    EAGLE head's chain steps (less the head's drafting where every row has a suffix chain, which
    the online cost calibration sees), so it is costed with eagle's model."""
    if drafter not in DEVICE_DRAFTERS:
        return TARGET_ONLY
    return ("eagle" if drafter == "hybrid_eagle" else drafter_label(drafter, draft_layers, draft_model)) + trees


def tree_label(d) -> str:
    """What a DrafterSpec's device trees add to its performance-model label ("" for chains)."""
    if d.name == "eagle" and d.eagle_tree_width:
        return f"_tree{d.eagle_tree_width}x{d.eagle_tree_depth}"
    return "_tree" if d.name == "medusa" and d.medusa_tree else ""


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
                         per_request_k=pol.packed, min_gain=0.0 if pol.name == "oracle" else MIN_GAIN)


def perf_key(spec, target_name: str) -> str:
    """The performance-model key of what ``spec`` (resolved) compiles for ``target_name`` on this
    hardware: host drafters share the target-only model; the code key names the executable."""
    from specjax.goodput.perf_model import hardware_key, model_key

    d = spec.drafter
    return model_key(target_name, perf_model_label(d.name, d.draft_layers, d.draft_model, tree_label(d)),
                     hardware_key(), spec.code_key())


def profile_command(spec) -> str:
    """The launch/profile.py command that profiles what ``spec`` compiles."""
    d, f = spec.drafter, spec.fwd
    label = perf_model_label(d.name, d.draft_layers, d.draft_model, tree_label(d))
    dev = DRAFTERS[d.name].device
    args = [f"--model {spec.model}", f"--drafters {d.name if dev else TARGET_ONLY}", f"--dtype {spec.dtype}",
            f"--rows_kernel {f.rows_kernel}", f"--attention_impl {f.attention}"]
    args += [f"--small_rows {f.small_rows}"] * bool(f.small_rows) + [f"--scan_layers {int(f.scan_layers)}"]
    args += ["--rows_activations int8"] * f.rows_int8
    args += [f"--draft_layers {d.draft_layers}"] * (label.startswith("layer_skip")) + \
        [f"--draft_model {d.draft_model}"] * (dev and bool(d.draft_model))
    if d.name == "eagle" and d.eagle_tree_width:  # (a head's trees cost what its chains do not)
        args += [f"--eagle_tree_width {d.eagle_tree_width}", f"--eagle_tree_depth {d.eagle_tree_depth}"]
    args += ["--nomedusa_tree"] * (d.name == "medusa" and not d.medusa_tree)
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


def drafter_kwargs(spec, model, draft=None, dtype: str = "float32") -> dict:
    """A DrafterSpec as drafter_parts' keyword arguments (``draft``: a loaded draft model, else
    one is loaded in ``dtype``)."""
    hist = spec.suffix_history_jsonl if "suffix_history_jsonl" in DRAFTERS[spec.name].reads else None
    return dict(draft_model=spec.draft_model, draft_layers=spec.draft_layers, pld_min_ngram=spec.pld_min_ngram,
                pld_max_ngram=spec.pld_max_ngram, pld_max_draft=spec.pld_max_draft, draft=draft, dtype=dtype,
                suffix=suffix_config(spec.k, max_depth=spec.suffix_max_depth, alpha=spec.suffix_alpha,
                                     min_prob=spec.suffix_min_prob, tree=spec.suffix_tree,
                                     cache_requests=spec.suffix_cache_requests, cache_mb=spec.suffix_cache_mb),
                suffix_tau=spec.suffix_tau, draft_checkpoint=spec.draft_checkpoint, eagle_head=spec.eagle_head,
                medusa_head=spec.medusa_head, medusa_tree=spec.medusa_tree,
                eagle_tree=(spec.eagle_tree_width, spec.eagle_tree_depth),
                suffix_history=load_suffix_history(hist, model.tokenizer) if hist else ())


def layout(spec):
    """The sharding.Layout of ``spec.mesh`` over this process's devices, or None (one device)."""
    if not spec.mesh:
        return None
    from specjax import sharding as sh

    data, n = (int(x) for x in spec.mesh.lower().split("x"))
    return sh.Layout(sh.make_mesh(data, n), shard_draft=spec.shard_draft)


def warm_host_kernels(name: str) -> bool:
    """Compile (or load from numba's disk cache) the host kernels drafter ``name`` calls, once per
    process (a cold cache: about 19 s for the suffix drafters' kernels; none for the others).
    A launch script starts it in a thread beside the model load (cli.prewarm_drafter); a job
    compiled ahead waits for it before serving (serve_job), so no request pays it. Returns
    whether the drafter has such kernels."""
    if name not in SUFFIX_DRAFTERS:
        return False
    from specjax.drafters.suffix.drafter import warm_kernels

    warm_kernels()
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
                        prefix_cache_mb=spec.prefix_cache_mb, **kw, **({} if kw.get("parts") else drafter_kwargs(spec.drafter, model, draft, spec.dtype)))
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
                                prefill_chunk=spec.prefill_chunk, prefix_cache_mb=spec.prefix_cache_mb,
                                **drafter_kwargs(spec.drafter, model, draft, spec.dtype))
