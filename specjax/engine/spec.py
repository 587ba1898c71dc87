"""The frozen descriptions an engine is built from.

``DrafterSpec`` says which drafter proposes and with what knobs; ``specjax.registry`` turns it
(with a loaded model) into the drafter object the backend runs. Launch flags, the Python API and
checkpoints all produce these, so a drafter's settings and their validation exist once.
"""

from __future__ import annotations

import dataclasses

from specjax import buckets as bk
from specjax.errors import require
from specjax.models.options import DEFAULT_SCAN_UNROLL, ForwardOptions


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """name: a registered drafter kind (drafters.table.DRAFTERS). k: the most drafts (or tree
    nodes) one step may verify (the largest K bucket). The other fields are read only by the
    kinds that name them in their table entry's ``reads``."""

    name: str = "none"
    k: int = 4
    # device drafters
    draft_model: str | None = None  # draft_model: a model name, .gguf file or HF directory
    draft_layers: int = 8  # layer_skip: the target's first N layers
    draft_checkpoint: str | None = None  # a distilled draft's checkpoint directory
    eagle_head: str | None = None  # eagle: a saved head's directory (drafters.eagle.save_head); None: random init
    eagle_tree_width: int = 0  # eagle: dynamic trees keeping this many nodes per depth (0: chains)
    eagle_tree_depth: int = 4
    medusa_head: str | None = None  # medusa: a saved heads' directory (drafters.heads.save_head); None: shipped/fresh
    medusa_tree: bool = True  # medusa: token trees (else chains)
    # prompt lookup (and the hybrid's fallback)
    pld_min_ngram: int = 1
    pld_max_ngram: int = 3
    pld_max_draft: int = 0  # 0 = k
    # suffix trees (suffix, suffix_path, hybrid)
    suffix_max_depth: int = 64
    suffix_alpha: float = 1.0
    suffix_min_prob: float = 0.1
    suffix_tree: bool = True
    suffix_tau: float = 1.0
    suffix_cache_requests: int = 100000
    suffix_cache_mb: float = 1024.0
    suffix_history_jsonl: str | None = None
    # not a flag: the engine's forward options, which the registry hands to the kind (a layer-skip
    # or draft model then runs its own forward on the engine's rows kernel)
    fwd: ForwardOptions | None = None

    def __post_init__(self):
        require(self.k >= 0, f"the draft budget k must be >= 0, got {self.k}")

    def knobs(self) -> dict:
        """Every knob (the fields but ``name`` and ``k``) as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("name", "k", "fwd")}

    def check(self) -> None:
        """The drafter's own knobs, checked before any model is loaded (SpecjaxError on the
        first bad one). Only the knobs the drafter reads (its table entry's ``reads``)."""
        from specjax.drafters.table import entry
        from specjax.errors import SpecjaxError

        reads = entry(self.name).reads
        if "draft_model" in reads and not self.draft_model:
            raise SpecjaxError(f"drafter {self.name} needs --draft_model (a model name, .gguf file or HF dir)")
        if "draft_layers" in reads and self.draft_layers < 1:
            raise SpecjaxError(f"--draft_layers must be >= 1, got {self.draft_layers}")
        if reads & {"pld_min_ngram", "pld_max_ngram", "pld_max_draft"}:
            from specjax.drafters import prompt_lookup

            prompt_lookup.config_of(self)
        if "suffix_max_depth" in reads:
            from specjax.drafters import suffix

            suffix.config_of(self)
        if "suffix_tau" in reads and self.suffix_tau < 0:
            raise SpecjaxError(f"--suffix_tau must be >= 0, got {self.suffix_tau}")
        if "suffix_history_jsonl" in reads and self.suffix_history_jsonl:
            from specjax.jobs import read_outputs  # a bad history file is an error before the model load

            read_outputs(self.suffix_history_jsonl, flag="--suffix_history_jsonl")


POLICY_HELP = ("auto, smartspec, smartspec-req (per-request draft counts), smartspec-conf (confidence-based "
               "proposal, device drafters), none or an integer K")
GOODPUT_POLICIES = ("smartspec", "smartspec-req", "smartspec-conf")  # need a performance model


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """How many drafts each step verifies; the one place a policy name is parsed.

    name: ``auto`` (SmartSpec when a performance model of this compiled code exists, else fixed
    ``fallback_k``, said as a note), a goodput policy (GOODPUT_POLICIES; ``oracle`` too, for the
    simulator), ``none`` (K = 0) or an integer K. perf_models: the performance-model file (None:
    the shipped one); threshold: smartspec-conf's cut."""

    name: str = "auto"
    perf_models: str | None = None
    threshold: float = 0.5
    fallback_k: int = 4

    def __post_init__(self):
        from specjax.errors import SpecjaxError

        name = str(self.name).strip().lower()
        if name == "0":
            name = "none"
        object.__setattr__(self, "name", name)
        if name not in ("auto", "none", "oracle") + GOODPUT_POLICIES:
            try:
                require(int(name) > 0, f"--policy must be {POLICY_HELP}, got {self.name!r}")
            except ValueError:
                raise SpecjaxError(f"--policy must be {POLICY_HELP}, got {self.name!r}") from None
        if not 0.0 <= self.threshold < 1.0:  # (NaN fails too)
            raise SpecjaxError(f"--confidence_threshold must be in [0, 1), got {self.threshold}")
        if self.perf_models is not None:  # a file the user named is read as one now, never ignored later
            from specjax.goodput.perf_model import read_store

            read_store(self.perf_models, "--perf_models")

    @property
    def fixed_k(self) -> int | None:
        """The K of a fixed-K policy (0 for none), else None."""
        return 0 if self.name == "none" else int(self.name) if self.name.isdigit() else None

    @property
    def label(self) -> str:
        """How reports name it: no-SD, K=<k>, SmartSpec[-req|-conf], oracle (auto: SmartSpec once
        a performance model is found; registry.build_policy says when it falls back)."""
        if self.fixed_k is not None:
            return "no-SD" if self.fixed_k == 0 else f"K={self.fixed_k}"
        return {"auto": "SmartSpec", "smartspec": "SmartSpec", "smartspec-req": "SmartSpec-req",
                "smartspec-conf": "SmartSpec-conf"}.get(self.name, self.name)

    @property
    def goodput(self) -> bool:
        """A policy that needs a performance model (auto only when one exists)."""
        return self.fixed_k is None

    @property
    def draft_first(self) -> bool:
        """A device drafter drafts ahead of the choice (SmartSpec Algorithm 3): compile that path."""
        return self.name == "smartspec-conf"

    @property
    def packed(self) -> bool:
        """Per-request draft counts: verify blocks that cost their real tokens."""
        return self.name == "smartspec-req"


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built from, validated once (``__post_init__``; one-line
    SpecjaxErrors naming the flag). ``specjax.cli.engine_spec_from_flags`` makes one from the
    launch flags; ``specjax.registry`` builds the backend, generator and policy from it.

    model / dtype: the target (a config name, .gguf file or HF directory). drafter: DrafterSpec
    (name ``none``: plain decoding, compiled at K = 0 only). k_buckets: the compiled Ks;
    batch_buckets / slots: the engine's rows and KV slots per row (0: sized from a JSONL job's
    records, serve_job's slot classes); prefill_chunk: prompt chunks;
    prefix_cache_mb: the prefix store's budget (engine.prefix_store; 0: off).
    fwd: the compiled forward's settings, with ``rows_kernel_auto`` meaning "the rows kernel
    where the model's weights suit it", ``rows_activations_auto`` "these activations (int8 or
    bfloat16: fwd.rows_activations, with the CPU attention they need) if the rows kernel runs",
    "auto" meaning bfloat16 where the CPU multiplies it natively and the kernel reads the model's
    GGUF blocks (rows_dot.native_bf16), else float32, ``attention_auto`` "the CPU attention
    if the rows kernel runs, else XLA's" and ``scan_auto`` "the layers as a loop of
    ``DEFAULT_SCAN_UNROLL`` per iteration if the rows kernel runs with the CPU attention, else
    the per-layer list", resolved once the model is loaded (``resolved``).
    policy: PolicySpec. mesh: 'DATAxMODEL' ('' = one device); shard_draft: shard a draft model
    like the target."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    drafter: DrafterSpec = DrafterSpec()
    k_buckets: tuple = (0, 1, 2, 4, 8)
    batch_buckets: tuple = (1, 2, 4, 8)
    slots: int = 512
    prefill_chunk: int = bk.DEFAULT_PREFILL_CHUNK
    prefix_cache_mb: float = 1024  # (buckets.DEFAULT_PREFIX_CACHE_MB)
    fwd: ForwardOptions = ForwardOptions()
    rows_kernel_auto: bool = False
    rows_activations_auto: str = ""
    attention_auto: bool = False
    scan_auto: bool = False
    policy: PolicySpec = PolicySpec()
    mesh: str = ""
    shard_draft: bool = False

    def __post_init__(self):
        from specjax.errors import SpecjaxError

        require(self.dtype in ("float32", "bfloat16"), f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        ks = tuple(sorted(set(self.k_buckets)))
        if not ks or ks[0] != 0:
            raise SpecjaxError(f"--k_buckets must be non-negative and include 0 (plain decoding), got {list(ks)}")
        self.drafter.check()
        pol, speculates = self.policy, self.drafter.name != "none"
        if not speculates:
            ks = (0,)  # nothing to speculate with: plain decoding only
            if pol.name not in ("auto", "none"):
                raise SpecjaxError(f"--policy {pol.name} needs a drafter; --drafter none decodes without speculation "
                                   "(use --policy auto or none)")
        else:
            k = pol.fallback_k
            if k < 1:
                raise SpecjaxError(f"num_spec_tokens must be >= 1 with a drafter, got {k} (use --drafter none for "
                                   "plain decoding)")
            if k > ks[-1]:
                raise SpecjaxError(f"num_spec_tokens {k} is larger than the largest bucket in k_buckets "
                                   f"({ks[-1]}); add it to k_buckets")
            if k not in ks:
                raise SpecjaxError(f"num_spec_tokens {k} is not a bucket in k_buckets {list(ks)}; use one of them "
                                   "or add it")
            if pol.fixed_k is not None and pol.fixed_k not in ks:
                raise SpecjaxError(f"--policy K={pol.fixed_k} is not in --k_buckets {list(ks)}")
            if pol.name == "oracle":
                raise SpecjaxError("--policy oracle needs the true acceptance: the simulator only")
            if pol.draft_first and not self.drafts_ahead:
                from specjax.drafters.table import names

                raise SpecjaxError(f"--policy smartspec-conf (confidence-based proposal) needs a device drafter "
                                   f"that drafts ahead ({', '.join(names(draft_ahead=True))}), not {self.drafter.name}")
        object.__setattr__(self, "k_buckets", ks)
        bbs = tuple(sorted(set(self.batch_buckets)))
        if not bbs or bbs[0] < 1:
            raise SpecjaxError(f"--batch_buckets must be >= 1, got {list(bbs)}")
        object.__setattr__(self, "batch_buckets", bbs)
        if self.slots < 16 and self.slots != 0:
            raise SpecjaxError(f"--slots must be >= 16 (or 0: sized from the job), got {self.slots}")
        bk.check_prefill_chunk(self.prefill_chunk, "--prefill_chunk")
        if not self.prefix_cache_mb >= 0:
            raise SpecjaxError(f"--prefix_cache_mb must be >= 0 (0: no prefix cache), got {self.prefix_cache_mb}")
        if self.mesh:
            parts = self.mesh.lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise SpecjaxError(f"--mesh must be DATAxMODEL, e.g. 1x8, got {self.mesh!r}")
            if self.fwd.rows_kernel:
                raise SpecjaxError("--rows_kernel runs on one device; leave it at -1 or 0 with --mesh")
        if self.rows_kernel_auto and (self.fwd.rows_kernel or self.mesh):
            # (the kernel runs on one device: not on a mesh)
            object.__setattr__(self, "rows_kernel_auto", False)

    @property
    def device_draft(self) -> bool:
        from specjax.drafters.table import entry

        return entry(self.drafter.name).device

    @property
    def drafts_ahead(self) -> bool:
        """The drafter can draft ahead of the policy's choice (confidence policies)."""
        from specjax.drafters.table import entry

        return entry(self.drafter.name).draft_ahead

    def resolved(self, model) -> "EngineSpec":
        """This spec with its automatic settings (``--rows_kernel -1``, ``--rows_activations int8|bfloat16``,
        ``--attention_impl auto``, ``--scan_layers -1``) resolved for ``model`` (a LoadedModel): what runs."""
        if not self.auto:
            return self
        f = self.fwd
        rows = model.auto_rows_kernel() if self.rows_kernel_auto else f.rows_kernel
        act = self.rows_activations_auto if rows else ""
        if act == "auto":  # (the launch scripts' default: BENCHMARKS.md, "Arithmetic")
            from specjax.models.cpu import rows_dot

            native = getattr(model, "native_packs", None) is not None
            act = "bfloat16" if native and rows_dot.native_bf16() else "float32"
        act = act or f.rows_activations
        # On the rows kernel the CPU attention decodes faster than XLA's (which, in a loop over the
        # layers, copies the cache), and the loop compiles in a fifth of the list's time (BENCHMARKS.md)
        attention = "cpu" if act != "float32" or (self.attention_auto and rows) else f.attention
        scan = (DEFAULT_SCAN_UNROLL if rows and attention == "cpu" else 0) if self.scan_auto else f.scan_layers
        fwd = dataclasses.replace(f, rows_kernel=rows, rows_activations=act, attention=attention, scan_layers=scan)
        return dataclasses.replace(self, fwd=fwd, rows_kernel_auto=False, rows_activations_auto="", attention_auto=False,
                                   scan_auto=False)

    @property
    def auto(self) -> bool:
        """Whether a setting waits for the model (``resolved``)."""
        return self.rows_kernel_auto or bool(self.rows_activations_auto) or self.attention_auto or self.scan_auto

    def code_key(self) -> str:
        """What of this spec changes the compiled code a step runs (the performance model of
        one compiled engine does not describe another): the forward options, the dtype and the
        layout. Comma-separated name=value fields, so a mismatch can be named field by field."""
        require(not self.auto, "code_key needs a resolved spec (EngineSpec.resolved(model))")
        f = self.fwd
        fields = dict(dtype=self.dtype, attention=f.attention, attn_chunk=f.attn_chunk, small_rows=f.small_rows,
                      rows_kernel=f.rows_kernel, **({"rows_activations": f.rows_activations} if f.rows_low else {}), scan_layers=int(f.scan_layers), rope_once=int(f.rope_barrier()),
                      mesh=self.mesh or "1x1")
        if self.mesh and self.shard_draft and self.device_draft:
            fields["shard_draft"] = 1
        return ",".join(f"{k}={v}" for k, v in fields.items())
