"""Command-line flags shared by the launch scripts, and their translation into library arguments.

The scripts in ``launch/`` are leaves: each defines its own flags plus the groups here that it
shares with the others, and builds everything through ``specjax.registry``. Functions here read
absl ``FLAGS``; they are only called after the flags are parsed.
"""

from __future__ import annotations

from absl import flags

from specjax import registry

FLAGS = flags.FLAGS


def define_spec_flags(num_spec_tokens: int = 4, k_buckets: str = "0,1,2,4,8") -> None:
    """The drafter knobs every script that speculates offers (defaults of K and the K buckets
    per script: serving compiles the small Ks SmartSpec chooses among)."""
    flags.DEFINE_integer("num_spec_tokens", num_spec_tokens, "K: draft tokens per speculative step (one of "
                         "--k_buckets; the fixed K of a fixed-K policy).")
    flags.DEFINE_string("k_buckets", k_buckets, "Comma list of precompiled K values (must include 0).")
    flags.DEFINE_string("draft_model", None, "draft_model drafter: model name, .gguf file or HF safetensors dir "
                        "(must share the target's vocabulary).")
    flags.DEFINE_integer("draft_layers", 8, "layer_skip drafter: draft with the target's first N layers "
                         "(1..num_layers-1).")
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


def suffix_config_from_flags(k: int):
    return registry.suffix_config(k, max_depth=FLAGS.suffix_max_depth, alpha=FLAGS.suffix_alpha,
                                  min_prob=FLAGS.suffix_min_prob, tree=FLAGS.suffix_tree,
                                  cache_requests=FLAGS.suffix_cache_requests, cache_mb=FLAGS.suffix_cache_mb)


def prompt_lookup_config_from_flags(k: int):
    return registry.prompt_lookup_config(k, FLAGS.pld_min_ngram, FLAGS.pld_max_ngram, FLAGS.pld_max_draft)


def suffix_kwargs(model, drafter: str, k: int) -> dict:
    """build_spec_generator's suffix arguments from the flags (empty for other drafters)."""
    if drafter not in registry.SUFFIX_DRAFTERS:
        return {}
    hist = registry.load_suffix_history(FLAGS.suffix_history_jsonl, model.tokenizer) if FLAGS.suffix_history_jsonl else ()
    return dict(suffix=suffix_config_from_flags(k), suffix_tau=FLAGS.suffix_tau, suffix_history=hist)


def drafter_kwargs(model, drafter: str, k: int, draft=None) -> dict:
    """Every drafter knob from the flags, as keyword arguments of registry.drafter_parts /
    build_spec_generator (the flags a script did not define keep the library defaults)."""
    kw = dict(draft_model=FLAGS.draft_model, draft_layers=FLAGS.draft_layers, pld_min_ngram=FLAGS.pld_min_ngram,
              pld_max_ngram=FLAGS.pld_max_ngram, pld_max_draft=FLAGS.pld_max_draft, draft=draft)
    if "dtype" in FLAGS:
        kw["dtype"] = FLAGS.dtype
    kw.update(suffix_kwargs(model, drafter, k))
    return kw


def sampling_from_flags(overrides=None):
    """SamplingParams from the flags, with per-record overrides (a JSONL record's fields)."""
    from specjax.sampling import SamplingParams

    o = overrides or {}
    return SamplingParams(temperature=float(o.get("temperature", FLAGS.temperature)),
                          top_k=int(o.get("top_k", FLAGS.top_k)), top_p=float(o.get("top_p", FLAGS.top_p)),
                          seed=int(o.get("seed", FLAGS.seed)))


def validate_spec_flags(drafters) -> tuple[int, ...] | None:
    """The drafter flag checks that need no model (run before the slow load) for every drafter
    in ``drafters`` ('none' = plain decoding). Returns the parsed K buckets (None without a
    speculative drafter). Raises SpecjaxError on the first problem."""
    from specjax.errors import SpecjaxError

    drafters = [d for d in drafters if d != "none"]
    bad = [d for d in drafters if d not in registry.SPEC_DRAFTERS]
    if bad:
        raise SpecjaxError(f"unknown drafters {bad}; use {', '.join(registry.SPEC_DRAFTERS)}")
    if FLAGS.draft_model and "draft_model" not in drafters:
        raise SpecjaxError("--draft_model is only used with --drafter draft_model")
    if "draft_model" in drafters and not FLAGS.draft_model:
        raise SpecjaxError("drafter draft_model needs --draft_model (a model name, .gguf file or HF dir)")
    suffix = set(drafters) & set(registry.SUFFIX_DRAFTERS)
    if FLAGS.suffix_history_jsonl and not suffix:
        raise SpecjaxError("--suffix_history_jsonl is only used with --drafter suffix, suffix_path or hybrid")
    if not drafters:
        return None
    k_buckets = registry.parse_k_buckets(FLAGS.k_buckets)
    registry.check_num_spec_tokens(FLAGS.num_spec_tokens, k_buckets)
    if "prompt_lookup" in drafters or "hybrid" in drafters:
        prompt_lookup_config_from_flags(FLAGS.num_spec_tokens)
    if suffix:
        suffix_config_from_flags(FLAGS.num_spec_tokens)
        if FLAGS.suffix_tau < 0:
            raise SpecjaxError(f"--suffix_tau must be >= 0, got {FLAGS.suffix_tau}")
    if "layer_skip" in drafters and FLAGS.draft_layers < 1:
        raise SpecjaxError(f"--draft_layers must be >= 1, got {FLAGS.draft_layers}")
    return k_buckets


def define_forward_flags() -> None:
    """The compiled-forward settings (models.options.ForwardOptions)."""
    flags.DEFINE_enum("attention_impl", "xla", ["xla", "pallas"],
                      "Decode/verify attention: plain XLA, or the Pallas tree-attention kernel (GPU/TPU; "
                      "interpret mode on CPU, slow; prefill always uses XLA).")
    flags.DEFINE_integer("small_rows", 0, "Project 2..N activation rows as per-row matrix-vector products "
                         "instead of one GEMM (a CPU-specific setting; see benchmarks/projection_rows.py; 0 = off).")


def forward_options_from_flags():
    from specjax.models.options import ForwardOptions

    return ForwardOptions(attention=FLAGS.attention_impl, small_rows=FLAGS.small_rows)


def define_policy_flags() -> None:
    """How many drafts each step verifies: SmartSpec's goodput choice or a fixed K."""
    flags.DEFINE_string("policy", "auto", registry.POLICY_HELP + ": auto = SmartSpec when --perf_models has a "
                        "model for this model, drafter and hardware, else fixed K = --num_spec_tokens.")
    flags.DEFINE_string("perf_models", None, "Performance models from launch/profile.py (default: the ones "
                        "shipped in configs/perf/).")


def policy_from_flags(model, drafter: str, policy: str | None = None):
    """(policy, label) from --policy (or ``policy``, one entry of a script's policy list); an auto
    fallback to fixed K is said on stderr."""
    import sys

    pol, label, note = registry.make_policy(policy if policy is not None else FLAGS.policy, model.cfg.name, drafter,
                                            draft_layers=FLAGS.draft_layers,
                                            fallback_k=FLAGS.num_spec_tokens, perf_models=FLAGS.perf_models)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return pol, label


def define_request_flags(chat: bool = False) -> None:
    """The target model, the prompt wrapping and the sampling of each request (JSONL records may
    override the sampling flags and max_new_tokens)."""
    flags.DEFINE_string("model", "smollm2-135m", "Model name (see configs/), a .gguf file or a HF safetensors dir.")
    flags.DEFINE_bool("chat", chat, "Wrap prompts in the model's chat template (--nochat: raw text).")
    flags.DEFINE_string("system", None, "System message for --chat.")
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy (JSONL records may override).")
    flags.DEFINE_integer("top_k", 0, "Top-k cut-off; 0 = off (JSONL records may override).")
    flags.DEFINE_float("top_p", 1.0, "Top-p (nucleus) cut-off in (0, 1]; 1 = off (JSONL records may override).")
    flags.DEFINE_integer("seed", 0, "Random seed per request (JSONL records may override).")
    flags.DEFINE_bool("ignore_eos", False, "Keep generating past end-of-sequence tokens.")


def run_job(job, argv) -> None:
    """A launch script's main: quiet absl logging, the persistent XLA cache, and a user mistake
    (SpecjaxError) printed as one ``error:`` line with exit status 2. ``job()`` returns the exit
    status (None = 0)."""
    import sys

    from absl import logging

    from specjax.errors import SpecjaxError
    from specjax.runtime import enable_compilation_cache

    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    logging.set_verbosity(logging.WARNING)
    try:
        enable_compilation_cache()
        code = job()
    except SpecjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)

