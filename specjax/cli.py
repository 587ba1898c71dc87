"""Command-line flags shared by the launch scripts, and their translation into library arguments.

The scripts in ``launch/`` are leaves: each defines its own flags plus the groups here that it
shares with the others, and calls the library (the serving scripts build their engines through
``specjax.registry``; distill.py through ``specjax.distill``). Functions here read absl
``FLAGS``; they are only called after the flags are parsed.
"""

from __future__ import annotations

import os

from absl import flags

from specjax import buckets as bk, registry

FLAGS = flags.FLAGS


def define_model_flags(model: str = "smollm2-135m") -> None:
    """The target model and its dtype."""
    flags.DEFINE_string("model", model, "Model name (see configs/), a .gguf file or a HF safetensors dir.")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter/activation dtype.")


def define_drafter_flags(drafter: str = "none", several: list | None = None, num_spec_tokens: int = 4,
                         k_buckets: str = "0,1,2,4,8") -> None:
    """The drafter group every script offers: ``--drafter`` (one of registry.DRAFTERS), or with
    ``several`` (its default list) ``--drafters``, for a script that compares or profiles several;
    then K, the K buckets and every drafter's knobs (defaults of K and the buckets per script:
    serving compiles the small Ks SmartSpec chooses among)."""
    names = ", ".join(registry.SPEC_DRAFTERS)
    if several is None:
        flags.DEFINE_enum("drafter", drafter, list(registry.DRAFTERS), "Speculative drafter; none = plain "
                          "(autoregressive) decoding.")
    else:
        flags.DEFINE_list("drafters", several, f"Comma list of drafters, from {names}.")
    flags.DEFINE_integer("num_spec_tokens", num_spec_tokens, "K: draft tokens per speculative step (one of "
                         "--k_buckets; the fixed K of a fixed-K policy).")
    flags.DEFINE_string("k_buckets", k_buckets, "Comma list of precompiled K values (must include 0).")
    flags.DEFINE_string("draft_model", None, "draft_model drafter: model name, .gguf file or HF safetensors dir "
                        "(must share the target's vocabulary).")
    flags.DEFINE_integer("draft_layers", 8, "layer_skip drafter: draft with the target's first N layers "
                         "(1..num_layers-1).")
    flags.DEFINE_string("draft_checkpoint", None, "layer_skip / draft_model drafter: draft with the distilled draft "
                        "in this checkpoint directory (launch/distill.py or --online_distill; its draft.json names it).")
    flags.DEFINE_string("eagle_head", None, "eagle drafter: the feature head saved in this directory "
                        "(launch/distill.py --drafter eagle); default: the head shipped for the target under heads/ "
                        "(the embedded SmolLM2's), else a random-initialised one.")
    flags.DEFINE_integer("eagle_tree_width", 0, "eagle drafter: draft dynamic token trees (EAGLE-2) keeping this many "
                         "nodes per depth, K = the tree's node budget; 0: chains.")
    flags.DEFINE_integer("eagle_tree_depth", 4, "eagle drafter with --eagle_tree_width: the tree's depth.")
    flags.DEFINE_string("medusa_head", None, "medusa drafter: the heads saved in this directory "
                        "(launch/distill.py --drafter medusa); default: the heads shipped for the target under heads/, "
                        "else fresh ones (each the target's own head).")
    flags.DEFINE_bool("medusa_tree", True, "medusa drafter: draft the heads' token tree (K = its node budget; "
                      "--nomedusa_tree: chains, K = drafts per step).")
    flags.DEFINE_integer("pld_max_ngram", 3, "prompt_lookup drafter: longest suffix n-gram to match.")
    flags.DEFINE_integer("pld_min_ngram", 1, "prompt_lookup drafter: shortest suffix n-gram to match.")
    flags.DEFINE_integer("pld_max_draft", 0, "prompt_lookup (and hybrid fallback): at most this many draft "
                         "tokens per step; 0 = K.")
    flags.DEFINE_integer("suffix_max_depth", 64, "suffix/hybrid: suffix-tree depth cap.")
    flags.DEFINE_float("suffix_alpha", 1.0, "suffix/hybrid: max spec factor; draft budget = alpha * match length.")
    flags.DEFINE_float("suffix_min_prob", 0.1, "suffix/hybrid: drop draft nodes with estimated acceptance below this.")
    flags.DEFINE_bool("suffix_tree", True, "suffix/hybrid: draft token trees (--nosuffix_tree: single paths).")
    flags.DEFINE_float("suffix_tau", 1.0, "hybrid: use the suffix draft when its score > tau, else prompt lookup.")
    flags.DEFINE_integer("suffix_cache_requests", 100000, "suffix/hybrid: past outputs kept in the global tree "
                         "(-1 unlimited, 0 = no global tree).")
    flags.DEFINE_float("suffix_cache_mb", 1024.0, "suffix/hybrid: memory bound of the global tree (MiB).")
    flags.DEFINE_string("suffix_history_jsonl", None, "suffix/hybrid: JSONL of past outputs to preload the global "
                        "tree (each line has 'output_ids' (token ids) or 'output' (text)).")


def drafters_from_flags(allow_none: bool = True) -> list[str]:
    """The drafters the flags name (``--drafter`` or ``--drafters``), checked: known, listed once,
    and every drafter-specific flag given read by one of them (before the slow load)."""
    from specjax.engine.spec import DrafterSpec
    from specjax.errors import SpecjaxError

    if "drafters" in FLAGS:
        names = [d.strip() for d in FLAGS.drafters if d.strip()]
        if not names:
            raise SpecjaxError("--drafters is empty; give at least one of " + ", ".join(registry.SPEC_DRAFTERS))
        bad = [d for d in names if d not in registry.SPEC_DRAFTERS]
        if bad:
            raise SpecjaxError(f"unknown drafters {bad}; use {', '.join(registry.SPEC_DRAFTERS)}")
        if len(set(names)) != len(names):
            raise SpecjaxError(f"--drafters lists a drafter twice: {names}")
    else:
        names = [FLAGS.drafter]
    if not allow_none and "none" in names:
        raise SpecjaxError(f"--drafter none does not draft; use one of {', '.join(registry.SPEC_DRAFTERS)}")
    defaults = DrafterSpec()
    for field in sorted(frozenset().union(*(e.reads for e in registry.DRAFTERS.values()))):
        if FLAGS[field].value != getattr(defaults, field) and not any(field in registry.DRAFTERS[d].reads
                                                                       for d in names):
            readers = [d for d, e in registry.DRAFTERS.items() if field in e.reads]
            raise SpecjaxError(f"--{field} is only used with --drafter {', '.join(readers)}")
    return names


def drafter_spec_from_flags(name: str, k: int):
    """The DrafterSpec of drafter ``name`` proposing at most ``k`` drafts: the knobs it reads
    from the flags, the library defaults for the rest."""
    from specjax.engine.spec import DrafterSpec

    return DrafterSpec(name=name, k=k, **{f: FLAGS[f].value for f in registry.DRAFTERS[name].reads})


def rows_activation_settings(act: str, attention: str, rows_kernel: int) -> tuple[str, str, str]:
    """(ForwardOptions.rows_activations, EngineSpec.rows_activations_auto, ForwardOptions.attention)
    for ``--rows_activations`` / ``--attention_impl`` / ``--rows_kernel``. A rounding mode (int8,
    bfloat16) needs the rows kernel and the CPU attention: set now where the kernel is (> 0), left
    to EngineSpec.resolved where it is automatic (-1); ``auto`` is always left to it, and an
    explicit XLA or Pallas attention turns it into float32. SpecjaxError for a rounding mode named
    without the kernel or beside the Pallas attention."""
    from specjax.errors import SpecjaxError

    if act == "auto" and attention not in ("auto", "cpu"):
        act = "float32"
    rounding = act in ("int8", "bfloat16")
    if rounding and (rows_kernel == 0 or attention == "pallas"):
        raise SpecjaxError(f"--rows_activations {act} needs the rows kernel (--rows_kernel -1 or > 0) and the CPU "
                           "attention (--attention_impl auto, xla or cpu)")
    now = rounding and rows_kernel > 0
    auto = act if act == "auto" or (rounding and rows_kernel < 0) else ""
    return (act if now else "float32", auto, "cpu" if now else "xla" if attention == "auto" else attention)


def engine_spec_from_flags(drafter: str | None = None, policy: str | None = None, mesh_ok: bool = False):
    """The EngineSpec the flags describe (unresolved: ``--rows_kernel -1`` is resolved with the
    loaded model, EngineSpec.resolved). ``drafter`` / ``policy``: one entry of a script's lists
    (default: --drafter, --policy). The drafter proposes at most a fixed-K policy's K, else the
    largest K bucket. ``mesh_ok``: the script serves a ``--mesh`` (the batch job); elsewhere one
    is refused rather than ignored. SpecjaxError on the first bad setting."""
    from specjax.engine.spec import EngineSpec, PolicySpec
    from specjax.errors import SpecjaxError
    from specjax.models.options import ForwardOptions

    name = drafter if drafter is not None else FLAGS.drafter
    has = lambda f: f in FLAGS  # noqa: E731 (the groups a script did not define keep the library defaults)
    pol = PolicySpec(policy if policy is not None else FLAGS.policy if has("policy") else "auto",
                     perf_models=FLAGS.perf_models if has("perf_models") else None,
                     threshold=FLAGS.confidence_threshold if has("confidence_threshold") else 0.5,
                     fallback_k=FLAGS.num_spec_tokens)
    ks = registry.number_list("k_buckets", FLAGS.k_buckets)
    kw = {}
    if has("batch_buckets"):
        kw.update(batch_buckets=registry.number_list("batch_buckets", FLAGS.batch_buckets), slots=FLAGS.slots)
    if has("prefill_chunk"):
        kw["prefill_chunk"] = FLAGS.prefill_chunk
    if has("prefix_cache_mb"):
        kw["prefix_cache_mb"] = FLAGS.prefix_cache_mb
    if has("rows_kernel"):
        if FLAGS.mesh and not mesh_ok:
            raise SpecjaxError("--mesh is served by launch/batch.py (the sharded engine); this script runs on one "
                               "device")
        act, auto_act, att = rows_activation_settings(FLAGS.rows_activations, FLAGS.attention_impl, FLAGS.rows_kernel)
        if FLAGS.scan_layers < -1:
            raise SpecjaxError(f"--scan_layers must be -1 (automatic), 0 (the per-layer list) or layers per loop "
                               f"iteration, got {FLAGS.scan_layers}")
        kw.update(fwd=ForwardOptions(attention=att, small_rows=FLAGS.small_rows, rows_kernel=max(FLAGS.rows_kernel, 0),
                                     scan_layers=max(FLAGS.scan_layers, 0), rows_activations=act),
                  rows_kernel_auto=FLAGS.rows_kernel < 0, rows_activations_auto=auto_act,
                  attention_auto=FLAGS.attention_impl == "auto", scan_auto=FLAGS.scan_layers < 0, mesh=FLAGS.mesh,
                  shard_draft=FLAGS.shard_draft)
    return EngineSpec(model=FLAGS.model, dtype=FLAGS.dtype if has("dtype") else "float32",
                      drafter=drafter_spec_from_flags(name, pol.fixed_k or max(ks)), k_buckets=tuple(ks), policy=pol,
                      **kw)


def sampling_from_flags():
    """SamplingParams from the flags."""
    from specjax.serve_job import sampling_of

    return sampling_of(request_defaults())


def define_forward_flags() -> None:
    """The compiled-forward settings (models.options.ForwardOptions)."""
    flags.DEFINE_enum("attention_impl", "auto", ["auto", "xla", "pallas", "cpu"],
                      "Decode/verify attention: auto (default: cpu where the rows kernel runs, else xla), plain XLA, "
                      "the Pallas tree-attention kernel (GPU/TPU; interpret mode on CPU, slow), or the CPU kernel "
                      "(with the rows kernel: a token's logits then have the same bits in a decode step as in a "
                      "verify block, and it decodes faster than XLA's; int8 activations use it); prefill always "
                      "uses XLA.")
    flags.DEFINE_integer("small_rows", 0, "Project 2..N activation rows as per-row matrix-vector products "
                         "instead of one GEMM (a CPU-specific setting; see benchmarks/projection_rows.py; 0 = off).")
    flags.DEFINE_integer("rows_kernel", -1, "Run decode and verify blocks of up to N activation rows on the CPU rows "
                         "kernel (weights read once for all rows, a GGUF's Q4_1/Q8_0 ones in their own blocks, "
                         "others as float32 copies; built with g++ on first use; see benchmarks/dot_paths.py "
                         "--rows_kernels). 0 = XLA's dot; -1 (default) = 32 where the model's weights are in "
                         "such blocks and the kernel builds for this CPU's AVX-512 or AVX2 + FMA, else 0.")
    flags.DEFINE_enum("rows_activations", "auto", ["auto", "float32", "int8", "bfloat16"],
                      "What the rows kernel multiplies a GGUF's Q4_1/Q8_0 weights with: auto (default: bfloat16 where "
                      "the CPU has AVX512_BF16, else float32), float32 (the float32 model exactly), int8 (each "
                      "activation row rounded per group of 32, as llama.cpp does; integer dot products, AVX-512 VNNI "
                      "where present) or bfloat16 (each activation rounded to bfloat16; "
                      "pairwise dot products, AVX512_BF16 where present). The last two run in decode, verify and "
                      "prefill blocks, with the CPU attention kernel in decode: faster, not the float32 model's "
                      "numbers; speculation under either, chains and token trees, gives its plain decoding's tokens.")
    flags.DEFINE_string("mesh", "", "Shard the engine over a DATAxMODEL mesh of this process's devices (e.g. 1x8: "
                        "tensor parallel over 8 devices; 2x4: two data-parallel halves of 4); empty = one device.")
    flags.DEFINE_bool("shard_draft", False, "With --mesh: shard an independent draft model like the target "
                      "(default: replicate it on every device).")
    flags.DEFINE_integer("scan_layers", -1, "Run the target's layers as a loop of N layers per iteration (compiles "
                         "in time independent of depth; 0: the per-layer list). With the rows kernel, decode and "
                         "verify blocks loop over its packed weights in place; without it, over stacked float32 "
                         "copies (slower steps on XLA:CPU). -1 (default): 5 where the rows kernel runs with the CPU "
                         "attention (a fifth of the list's compile time, steps as fast), else 0.")


def define_distributed_flags() -> None:
    """Multi-process (multi-host) launch: each process a data-parallel replica of the engine on
    its own devices (its --mesh over jax.local_devices())."""
    flags.DEFINE_string("coordinator_address", "", "host:port of process 0, for jax.distributed.initialize "
                        "(with --num_processes > 1).")
    flags.DEFINE_integer("num_processes", 1, "Processes in the job (each a data-parallel replica).")
    flags.DEFINE_integer("process_id", 0, "This process's index, 0 .. --num_processes - 1.")


def init_distributed() -> tuple[int, int]:
    """jax.distributed.initialize from the flags when --num_processes > 1; returns (this process's
    index, the process count). Bad values are one-line errors."""
    from specjax.errors import SpecjaxError

    n, k = FLAGS.num_processes, FLAGS.process_id
    if n < 1 or not 0 <= k < n:
        raise SpecjaxError(f"--process_id must be in 0..{n - 1} and --num_processes >= 1, got {k} of {n}")
    if n == 1:
        return 0, 1
    if not FLAGS.coordinator_address or ":" not in FLAGS.coordinator_address:
        raise SpecjaxError("--num_processes > 1 needs --coordinator_address host:port (process 0's)")
    import jax

    jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address, num_processes=n, process_id=k)
    return jax.process_index(), jax.process_count()


def define_prefill_flags(prefix_cache_mb: float = 1024, why_off: str = "") -> None:
    """Prefill chunks and the prefix store (EngineSpec.prefill_chunk / prefix_cache_mb)."""
    flags.DEFINE_integer("prefill_chunk", bk.DEFAULT_PREFILL_CHUNK, "Prefill prompts in chunks of at most this many tokens (a power "
                         "of two >= 16); each chunk attends to the cached prefix and itself.")
    flags.DEFINE_float("prefix_cache_mb", prefix_cache_mb, "Prefix caching: MiB of prefilled prompt chunks kept for "
                       "later prompts that start with the same tokens (0: off; outputs are identical either way)"
                       + (f"; {why_off}" if why_off else "."))


def define_engine_flags(batch_buckets: str = "1,2,4,8", slots: int = 512) -> None:
    """The serving engine's geometry and prefill (EngineSpec; ServingEngine's prefill_budget)."""
    flags.DEFINE_string("batch_buckets", batch_buckets, "Batch buckets; the engine's KV rows = the largest.")
    flags.DEFINE_integer("slots", slots, "KV slots per request row (prompt + max_new_tokens + K + 1 must fit)"
                         + ("; 0: sized from a JSONL job's records (groups by the slot bucket they need, each served "
                            "with rows of that size), up to the model's context" if not slots else "."))
    define_prefill_flags()
    flags.DEFINE_integer("prefill_budget", 0, "Chunked prefill: about this many prompt tokens prefilled per engine "
                         "iteration while other requests decode (0: each prompt whole, at admission).")


def serving_from_flags() -> dict:
    """serve_job's keyword arguments from the engine and job flags."""
    return dict(prefill_budget=prefill_budget_from_flags(), compile_ahead=FLAGS.compile == "ahead")


def prefill_budget_from_flags() -> int | None:
    from specjax.errors import SpecjaxError

    if FLAGS.prefill_budget < 0:
        raise SpecjaxError(f"--prefill_budget must be >= 0, got {FLAGS.prefill_budget}")
    return FLAGS.prefill_budget or None


def define_policy_flags(single: bool = True) -> None:
    """How many drafts each step verifies: SmartSpec's goodput choice or a fixed K (``single``:
    the --policy flag; a script running a list of policies defines its own list)."""
    from specjax.engine.spec import POLICY_HELP

    if single:
        flags.DEFINE_string("policy", "auto", POLICY_HELP + ": auto = SmartSpec when --perf_models has a model of "
                            "this model, drafter, hardware and compiled code, else fixed K = --num_spec_tokens.")
    flags.DEFINE_string("perf_models", None, "Performance models from launch/profile.py (default: the ones "
                        "shipped in configs/perf/).")
    flags.DEFINE_float("confidence_threshold", 0.5, "Policy smartspec-conf: a row keeps drafting while its last "
                       "draft's probability under the draft model exceeds this, in [0, 1).")


def policy_from_spec(spec, model):
    """(policy, label) of ``spec`` (resolved) for ``model``; an auto fallback to fixed K is said
    on stderr."""
    import sys

    pol, label, note = registry.build_policy(spec, model.cfg.name)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return pol, label


def prebuild_rows_kernel() -> None:
    """Build (or find in the cache) the CPU rows kernel in a thread now: a cold build is a few
    seconds of g++ in a process of its own, which then runs beside the model load and the first
    compilations instead of before them (rows_dot.ensure is locked: the first user waits for
    this build; a failure is reported by that user as before)."""
    import threading

    import jax

    if jax.default_backend() != "cpu":
        return
    from specjax.models.cpu import rows_dot

    if rows_dot.vectorized():
        threading.Thread(target=rows_dot.available, name="specjax-rows-kernel", daemon=True).start()


def prewarm_drafter(name: str) -> None:
    """Start what a drafter needs before its first use in a thread now, beside the model load:
    the suffix drafters' numba kernels (their import and first calls, about a second; a
    drafter's first draft waits for them, drafters.suffix.drafter). Not a daemon: numba compiles
    in C++ frames that a thread killed at interpreter exit cannot unwind (the process aborts), so
    a process that ends sooner waits for it (7 s with numba's disk cache cold, once per install)."""
    import threading

    if registry.entry(name).host_kernels:
        threading.Thread(target=registry.warm_host_kernels, args=(name,), name="specjax-host-kernels").start()


def load_target(spec, layout=None):
    """The target model of ``spec`` (said on stderr) and ``spec`` resolved for it."""
    import sys

    from specjax.models.loader import load_model

    if spec.rows_kernel_auto or spec.fwd.rows_kernel:
        prebuild_rows_kernel()
    prewarm_drafter(spec.drafter.name)
    model = load_model(spec.model, spec.dtype, layout=layout)  # (an HF directory: straight into the shards)
    run = spec.resolved(model)
    # (the arithmetic a step runs: --rows_activations auto decides it by this CPU)
    arith = f"; rows kernel, {run.fwd.rows_activations} activations" if run.fwd.rows_kernel else ""
    print(f"[loaded {model.cfg.name} ({model.cfg.num_params() / 1e6:.0f}M params, {spec.dtype}{arith}) in "
          f"{model.load_seconds:.1f} s]", file=sys.stderr)
    return model, run


def define_distill_flags(online: bool = True) -> None:
    """Training a self-draft toward the target (specjax.distill): the train step's flags, and with
    ``online`` the online loop's (Algorithm 1: --online_distill turns it on)."""
    if online:
        flags.DEFINE_string("online_distill", None, "Train the device draft (layer_skip or draft_model) while "
                            "serving (online speculative decoding), with orbax checkpoints in this directory; a run on a directory "
                            "that has them resumes from the latest (a draft from launch/distill.py included). An eagle / "
                            "medusa head is refined from the head in this directory (else the one it would serve) and "
                            "saved there when the job ends.")
        flags.DEFINE_integer("distill_every", 32, "Online distillation: finished requests between draft updates (I).")
        flags.DEFINE_integer("distill_steps", 2, "Online distillation: optimizer steps per update.")
        flags.DEFINE_integer("distill_checkpoint_every", 4, "Online distillation: updates between checkpoints.")
        flags.DEFINE_integer("distill_idle_rows", 0, "Online distillation: also update between engine steps while at "
                             "most this many rows run and no request waits (0: only every --distill_every).")
        flags.DEFINE_list("distill_tags", [], "Online distillation: a draft per request tag (a record's 'tag'; "
                          "others go to the first tag's draft), in DIR/<tag>.")
        flags.DEFINE_integer("distill_clusters", 0, "Online distillation: this many drafts, one per cluster of "
                             "prompts (a nearest-centroid classifier, trained by tagged records when "
                             "--distill_tags names the clusters), in DIR/cluster<i>.")
        flags.DEFINE_integer("distill_topk", 8, "Online distillation: the target's top-k logits the verify step "
                             "keeps per token (8 k bytes a token).")
    flags.DEFINE_enum("distill_divergence", "fkl", ["fkl", "rkl", "jsd", "tvd"], "Distillation loss (rkl and jsd "
                      "need the full teacher: offline only).")
    flags.DEFINE_float("distill_temperature", 1.0, "Distillation: softmax temperature of both distributions.")
    flags.DEFINE_float("distill_lr", 6e-4, "Distillation: peak AdamW learning rate (linear warm-up, cosine decay).")
    flags.DEFINE_enum("distill_compute_dtype", "auto", ["auto", "float32", "bfloat16"],
                      "Distillation: what the loss multiplies in, the params and optimizer staying float32 (auto: "
                      "bfloat16 on accelerators and AVX512_BF16 CPUs, float32 elsewhere).")
    flags.DEFINE_integer("distill_batch", 8, "Distillation: sequences per optimizer step.")
    flags.DEFINE_integer("distill_length", 64, "Distillation: tokens per training sequence (each record's last).")


def distill_configs_from_flags(total_steps: int = 100_000, full_teacher: bool = False):
    """(TrainConfig, OnlineConfig or None) from the distill flags; SpecjaxError on a bad value, or
    on a divergence that needs the target's whole distribution without ``full_teacher``."""
    from specjax.distill.online import OnlineConfig
    from specjax.distill.train import TrainConfig, default_compute_dtype
    from specjax.errors import SpecjaxError

    if not full_teacher and FLAGS.distill_divergence not in ("fkl", "tvd"):
        raise SpecjaxError(f"--distill_divergence {FLAGS.distill_divergence} needs the target's whole distribution; "
                           "a teacher that keeps its top k: use fkl or tvd")
    compute = FLAGS.distill_compute_dtype
    tc = TrainConfig(divergence=FLAGS.distill_divergence, temperature=FLAGS.distill_temperature, lr=FLAGS.distill_lr,
                     warmup_steps=min(10, total_steps - 1), total_steps=total_steps,
                     compute_dtype=default_compute_dtype() if compute == "auto" else compute)
    if "online_distill" not in FLAGS or not FLAGS.online_distill:
        return tc, None
    oc = OnlineConfig(every=FLAGS.distill_every, steps=FLAGS.distill_steps, batch=FLAGS.distill_batch,
                      length=FLAGS.distill_length, checkpoint_every=FLAGS.distill_checkpoint_every,
                      idle_rows=FLAGS.distill_idle_rows)
    return tc, oc


def check_online_distill_flags(drafter: str) -> None:
    """The online distillation flag checks that need no model."""
    from specjax.errors import SpecjaxError

    if not FLAGS.online_distill:
        return
    online = registry.TRAINED_DRAFTERS
    if drafter not in online:
        raise SpecjaxError(f"--online_distill trains a device draft: use --drafter "
                           f"{' or '.join(online)}, not {drafter}")
    if drafter in registry.HEAD_DRAFTERS and (FLAGS.distill_tags or FLAGS.distill_clusters):
        raise SpecjaxError(f"--online_distill refines one {drafter} head; --distill_tags / --distill_clusters route "
                           "requests between several drafts (layer_skip, draft_model)")
    if FLAGS.draft_checkpoint:
        raise SpecjaxError("--online_distill resumes from its own directory; --draft_checkpoint is for serving "
                           "a distilled draft without training it")
    if FLAGS.distill_topk < 1:
        raise SpecjaxError(f"--distill_topk must be >= 1, got {FLAGS.distill_topk}")
    if FLAGS.distill_clusters < 0 or (FLAGS.distill_clusters and len(FLAGS.distill_tags) > FLAGS.distill_clusters):
        raise SpecjaxError(f"--distill_clusters must be >= 0 and hold every --distill_tags, got "
                           f"{FLAGS.distill_clusters} for {len(FLAGS.distill_tags)} tags")
    if len(set(FLAGS.distill_tags)) != len(FLAGS.distill_tags) or any(
            not t.strip() or t in (".", "..") or "/" in t for t in FLAGS.distill_tags):
        raise SpecjaxError(f"--distill_tags must be distinct names usable as directory names, got {FLAGS.distill_tags}")
    distill_configs_from_flags()  # (online distillation keeps the target's top k)


DEFAULT_QUESTIONS = os.path.join("..", "shared", "data", "spec_bench", "question.jsonl")


def define_prompt_flags(chat: bool = False) -> None:
    """How prompt text becomes tokens: the chat template or raw text."""
    flags.DEFINE_bool("chat", chat, "Wrap prompts in the model's chat template (--nochat: raw text).")
    flags.DEFINE_string("system", None, "System message for --chat.")


def define_question_flags(max_prompt_tokens: int) -> None:
    """Spec-Bench questions as prompts (bench, serve_sim, benchmarks): the file and the longest
    prompt kept (longer ones are skipped and counted)."""
    flags.DEFINE_string("question_file", DEFAULT_QUESTIONS, "Spec-Bench question.jsonl (a relative path is resolved "
                        "against the repo root; ../shared is beside a development checkout, not an install).")
    flags.DEFINE_integer("max_prompt_tokens", max_prompt_tokens, "Skip (and count) prompts longer than this many "
                         "tokens (chat-templated).")


def define_request_flags(chat: bool = False) -> None:
    """The prompt wrapping and the sampling of each request (JSONL records may
    override the sampling flags and max_new_tokens)."""
    define_prompt_flags(chat)
    define_sampling_flags()
    flags.DEFINE_bool("ignore_eos", False, "Keep generating past end-of-sequence tokens.")


def define_sampling_flags() -> None:
    """--temperature, --top_k, --top_p, --seed (sampling_from_flags reads them with --max_new_tokens)."""
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy (JSONL records may override).")
    flags.DEFINE_integer("top_k", 0, "Top-k cut-off; 0 = off (JSONL records may override).")
    flags.DEFINE_float("top_p", 1.0, "Top-p (nucleus) cut-off in (0, 1]; 1 = off (JSONL records may override).")
    flags.DEFINE_integer("seed", 0, "Random seed per request (JSONL records may override).")


def run_job(job, argv) -> None:
    """A launch script's main: quiet absl logging, the persistent XLA cache, the checks every
    script shares (``check_common_flags``), and a user mistake (SpecjaxError) printed as one
    ``error:`` line with exit status 2; Ctrl-C outside a job's serving loop (which handles it
    itself, specjax.jobs) is one line and status 130, SIGTERM there 143. ``job()`` returns the exit status (None = 0)."""
    import sys

    from absl import logging

    from specjax.errors import SpecjaxError
    from specjax.runtime import enable_compilation_cache

    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    logging.set_verbosity(logging.WARNING)
    import signal

    from specjax.jobs import Terminated, raise_terminated

    signal.signal(signal.SIGTERM, raise_terminated)  # (a job's serving loop handles it as Ctrl-C)
    try:
        check_common_flags()
        if enable_compilation_cache():
            prefetch_executables()
        code = job()
    except SpecjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Terminated:
        print("\nterminated (SIGTERM)", file=sys.stderr)
        sys.exit(143)
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C) before anything was generated", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)


def prefetch_executables() -> None:
    """Start loading the executables the last run of this command used first (exe_cache.prefetch),
    beside the model load. A command is the script and its flags' values, less its text and
    JSONL files (another prompt or job of the same command mostly runs the same programs)."""
    import sys

    # The programs' trees name classes from across the engine (its state, the drafters' caches):
    # their modules are imported here, before the loading thread starts. Imported first by that
    # thread's unpickling, they raced this thread's own imports of the same packages, and Python's
    # import-deadlock escape handed one side a half-built module (2 batch jobs in about 40 failed).
    import specjax.engine.jax_backend  # noqa: F401
    from specjax.engine import exe_cache

    def register():
        from specjax.models.cpu import rows_dot

        rows_dot.ensure_targets()

    skip = set(TEXT_FLAGS) | {name for name in FLAGS if name.endswith("_jsonl")}
    job = [os.path.basename(sys.argv[0])] + [f"{n}={FLAGS[n].value!r}" for n in sorted(FLAGS) if n not in skip]
    exe_cache.prefetch("\n".join(job), register)


# ---------------------------------------------------------------- JSONL jobs and shared checks

TEXT_FLAGS = ("prompt", "system")  # flags that reach the model as text: must be valid UTF-8


def check_common_flags() -> None:
    """Checks every script gets before anything slow: no float flag is NaN or infinite (a NaN
    passes every comparison a range check makes, e.g. a NaN request rate hung serve_sim), and
    text flags are valid UTF-8 (undecodable command-line bytes arrive as lone surrogates)."""
    import math

    from specjax.errors import SpecjaxError

    for name in list(FLAGS):
        value = FLAGS[name].value
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecjaxError(f"--{name} must be a finite number, got {value}")
    for name in TEXT_FLAGS:
        if name in FLAGS and FLAGS[name].value is not None:
            try:
                FLAGS[name].value.encode("utf-8")
            except UnicodeEncodeError:
                raise SpecjaxError(f"--{name} is not valid UTF-8 text") from None


def check_range(name: str, lo=None, hi=None, *, lo_open: bool = False) -> None:
    """--name within [lo, hi] ((lo, hi] with lo_open); SpecjaxError otherwise."""
    from specjax.errors import SpecjaxError

    v = FLAGS[name].value
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        if hi is None:
            rule = f"{'>' if lo_open else '>='} {lo}"
        elif lo is None:
            rule = f"<= {hi}"
        else:
            rule = f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise SpecjaxError(f"--{name} must be {rule}, got {v}")


def define_job_flags() -> None:
    """The files of a JSONL job (specjax.jobs)."""
    flags.DEFINE_string("input_jsonl", None, "JSONL input: one {'id', 'prompt', ...} object per line.")
    flags.DEFINE_string("output_jsonl", None, "JSONL output (appended; ids already in it are skipped on resume; "
                        "locked while the job runs).")
    flags.DEFINE_enum("compile", "lazy", ["lazy", "ahead"], "Compile (or load) each executable when serving first "
                      "reaches it, the rest in the background beside serving (lazy: the first results come soonest), "
                      "or every one before serving, each run once on empty rows (ahead: serving runs at its steady speed from the "
                      "first step, as throughput benchmarks need; generate.py's --prompt then speculates from its "
                      "first step).")


def request_defaults() -> dict:
    """The checked request fields from the flags (--max_new_tokens and the sampling flags): what
    a JSONL record does not set. A bad flag is an error naming it."""
    from specjax.errors import SpecjaxError
    from specjax.results import REQUEST_FIELDS, request_fields

    raw = {k: FLAGS[k].value for k in REQUEST_FIELDS}
    try:
        return request_fields(raw, raw)
    except SpecjaxError as e:
        raise SpecjaxError(f"--{e}") from None  # every schema message starts with the field name


def open_job(**kw):
    """The job of --input_jsonl / --output_jsonl, opened before the model is loaded: the input read
    and checked, the output locked, repaired and scanned (specjax.jobs.Job)."""
    from specjax.errors import SpecjaxError
    from specjax.jobs import Job

    if not FLAGS.input_jsonl:
        raise SpecjaxError("--input_jsonl is required")
    if not FLAGS.output_jsonl:
        raise SpecjaxError("--output_jsonl is required")
    return Job(FLAGS.input_jsonl, FLAGS.output_jsonl, request_defaults(), **kw)


def run_jsonl_job(serve) -> int:
    """The JSONL job of the flags, served by ``serve(job) -> exit status`` (the batch job and
    generate.py's JSONL mode): this process's share of the records (--num_processes), the output
    locked, repaired and scanned before the model load (a second job on it, or an unwritable path,
    is a one-line error at once), the replicas' parts merged once every one is done."""
    import sys

    replica = init_distributed()  # (this process, processes): each serves its share of the records
    with open_job(replica=replica) as job:
        if not job.todo:
            job.notes()
            print(job.summary() + " (nothing to serve)", file=sys.stderr)
            code = 0
        else:
            code = serve(job)
    if code == 0:
        merge_job_replicas(replica)
    return code


def merge_job_replicas(replica: tuple[int, int]) -> None:
    """After replica (k, n) of --output_jsonl is done: merge the parts into --output_jsonl if every
    replica is done (jobs.merge_replicas), and say which."""
    import sys

    from specjax.jobs import merge_replicas, replica_path

    k, n = replica
    if n == 1:
        return
    merged = merge_replicas(FLAGS.input_jsonl, FLAGS.output_jsonl, n, request_defaults())
    if merged is None:
        print(f"[replica {k} of {n} done ({replica_path(FLAGS.output_jsonl, replica)}); the last replica to "
              f"finish writes {FLAGS.output_jsonl}]", file=sys.stderr)
    else:
        print(f"[merged {merged} records of {n} replicas into {FLAGS.output_jsonl}]", file=sys.stderr)

