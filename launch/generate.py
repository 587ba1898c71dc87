"""Generate text with specjax: the autoregressive baseline or speculative decoding.

  python launch/generate.py --prompt "What is the capital of France?" --chat
  python launch/generate.py --prompt "..." --chat --drafter prompt_lookup --num_spec_tokens 4
  python launch/generate.py --prompt "..." --chat --drafter layer_skip --draft_layers 8
  python launch/generate.py --prompt "..." --drafter draft_model --draft_model /path/to/small_model
  python launch/generate.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat [--drafter ...]

Drafters (``--drafter``):
  none           the autoregressive ``Generator`` (default; unchanged behaviour)
  prompt_lookup  n-gram copy drafting on the host (``--pld_min_ngram`` / ``--pld_max_ngram``)
  draft_model    an independent draft model sharing the target's vocabulary (``--draft_model``)
  layer_skip     self-drafting with the target's first ``--draft_layers`` layers
  suffix         SuffixDecoding: suffix trees over the prompt, the live output and past outputs
                 (``--suffix_*`` knobs; ``--suffix_tree`` token trees vs ``--nosuffix_tree`` paths;
                 ``--suffix_history_jsonl`` preloads the global tree from past outputs)
  suffix_path    suffix with single-path drafts whatever ``--suffix_tree`` says (to compare both in one bench)
  hybrid         suffix when its score > ``--suffix_tau``, else prompt lookup

For suffix/hybrid, K (``--num_spec_tokens``) is the draft-node budget per step, e.g.
``--num_spec_tokens 16 --k_buckets 0,1,2,4,8,16``.

Speculative runs use ``SpecGenerator`` with ``--num_spec_tokens`` K drafts per step; K must be
one of ``--k_buckets`` (the precompiled K variants, which also size the cache headroom).

Compilation: with ``--prompt`` and a drafter, exactly the variants this one prompt needs
(one prefill and one K-step for its prompt/cache bucket) are compiled *before* generation, so
the reported tok/s excludes compilation (the compile time is printed separately). In JSONL mode
every variant is compiled lazily, the first time a batch needs it, so the summary's tok/s
includes compilation (as for the autoregressive path). The persistent XLA cache
(``$SPECJAX_CACHE_DIR``) makes later runs skip most of it.

Speculative metrics (vLLM-style, over row-steps): acceptance rate = accepted / drafted;
mean accepted tokens per step = tokens committed per verify step, bonus token included
(1.0 = no speedup possible); per-position acceptance = P(draft j accepted | drafted).

User mistakes print one line ("error: ...") and exit with status 2.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
DRAFTERS = ("none", "prompt_lookup", "draft_model", "layer_skip", "suffix", "suffix_path", "hybrid")
SUFFIX_DRAFTERS = ("suffix", "suffix_path", "hybrid")
SPEC_DRAFTERS = DRAFTERS[1:]


def define_spec_flags() -> None:
    """Flags shared with launch/bench.py (drafter choice and its knobs)."""
    flags.DEFINE_integer("num_spec_tokens", 4, "K: draft tokens per speculative step (must be one of --k_buckets).")
    flags.DEFINE_string("k_buckets", "0,1,2,4,8", "Comma list of precompiled K values (must include 0).")
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


def define_flags() -> None:
    flags.DEFINE_string("prompt", None, "Prompt text.")
    flags.DEFINE_string("input_jsonl", None, "JSONL input: one {'id', 'prompt', ...} object per line.")
    flags.DEFINE_string("output_jsonl", None, "JSONL output (appended; finished ids are skipped on resume).")
    flags.DEFINE_string("model", "smollm2-135m", "Model name (see configs/), a .gguf file or a HF safetensors dir.")
    flags.DEFINE_enum("attention_impl", "xla", ["xla", "pallas"],
                      "Attention for decode/verify blocks: xla, or the Pallas tree-attention kernel "
                      "(kernels_pallas/; GPU/TPU; on CPU it runs in interpret mode, for testing only).")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter/activation dtype.")
    flags.DEFINE_integer("max_new_tokens", 128, "Maximum tokens to generate per prompt.")
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
    flags.DEFINE_integer("top_k", 0, "Top-k cut-off; 0 = off.")
    flags.DEFINE_float("top_p", 1.0, "Top-p (nucleus) cut-off in (0, 1]; 1 = off.")
    flags.DEFINE_integer("seed", 0, "Random seed (per request; JSONL records may override).")
    flags.DEFINE_bool("chat", False, "Wrap prompts in the model's chat template.")
    flags.DEFINE_string("system", None, "System message for --chat.")
    flags.DEFINE_integer("batch_size", 8, "Prompts per batch in JSONL mode.")
    flags.DEFINE_bool("ignore_eos", False, "Keep generating past end-of-sequence tokens.")
    flags.DEFINE_enum("drafter", "none", list(DRAFTERS), "Speculative drafter; none = autoregressive decoding.")
    define_spec_flags()


# ---------------------------------------------------------------- speculative set-up (shared with bench.py)


def parse_k_buckets(text: str) -> tuple[int, ...]:
    from specjax.errors import SpecjaxError

    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecjaxError(f"--k_buckets must be a comma list of integers, got {text!r}") from None
    if not ks:
        raise SpecjaxError("--k_buckets is empty")
    if min(ks) < 0:
        raise SpecjaxError(f"--k_buckets must be >= 0, got {text!r}")
    if 0 not in ks:
        raise SpecjaxError(f"--k_buckets must include 0 (plain decoding), got {text!r}")
    return tuple(sorted(set(ks)))


def check_num_spec_tokens(k: int, k_buckets) -> None:
    from specjax.errors import SpecjaxError

    if k < 1:
        raise SpecjaxError(f"--num_spec_tokens must be >= 1 with a drafter, got {k} (use --drafter none for plain "
                           "decoding)")
    if k > max(k_buckets):
        raise SpecjaxError(f"--num_spec_tokens {k} is larger than the largest bucket in --k_buckets "
                           f"({max(k_buckets)}); add it to --k_buckets")
    if k not in k_buckets:
        raise SpecjaxError(f"--num_spec_tokens {k} is not a bucket in --k_buckets {list(k_buckets)}; "
                           "use one of them or add it")


def prompt_lookup_config(k: int, min_ngram: int, max_ngram: int, max_draft: int | None = None):
    """Validated before the model load (raises SpecjaxError on bad n-gram bounds). max_draft:
    None reads --pld_max_draft when flags are parsed; 0 means K."""
    from specjax.drafters.prompt_lookup import PromptLookupConfig

    if max_draft is None:
        max_draft = FLAGS.pld_max_draft if FLAGS.is_parsed() and "pld_max_draft" in FLAGS else 0
    return PromptLookupConfig(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=min(max_draft or k, max(k, 1)))


def suffix_config(k: int, *, max_depth=64, alpha=1.0, min_prob=0.1, tree=True, cache_requests=100000,
                  cache_mb=1024.0):
    """Validated before the model load (raises SpecjaxError on bad knobs)."""
    from specjax.drafters.suffix import SuffixConfig

    return SuffixConfig(max_depth=max_depth, alpha=alpha, min_prob=min_prob, tree=tree, max_spec=max(k, 1),
                        max_cached_requests=cache_requests, max_cached_mb=cache_mb)


def suffix_config_from_flags(k: int):
    return suffix_config(k, max_depth=FLAGS.suffix_max_depth, alpha=FLAGS.suffix_alpha,
                         min_prob=FLAGS.suffix_min_prob, tree=FLAGS.suffix_tree,
                         cache_requests=FLAGS.suffix_cache_requests, cache_mb=FLAGS.suffix_cache_mb)


def load_suffix_history(path: str, tokenizer) -> list[list[int]]:
    """Past outputs for the global suffix tree: JSONL lines with 'output_ids' or 'output' text."""
    from specjax.jsonl_io import read_outputs

    return [tokenizer.encode(x) if isinstance(x, str) else x
            for x in read_outputs(path, flag="--suffix_history_jsonl")]


def spec_slot_buckets(cfg) -> tuple[int, ...]:
    """Cache-size buckets up to the full context (SpecGenerator's default stops at 2048, which
    would silently cut the budget of long prompts)."""
    from specjax import buckets as bk

    out, s = [], bk.MIN_SLOT_BUCKET
    while s < cfg.max_position:
        out.append(s)
        s *= 2
    out.append(cfg.max_position)
    return tuple(out)


def drafter_parts(model, drafter: str, *, k: int, draft_model: str | None = None, draft_layers: int = 8,
                  pld_min_ngram: int = 1, pld_max_ngram: int = 3, dtype: str = "float32", draft=None, suffix=None,
                  suffix_tau: float = 1.0, suffix_history=()) -> dict:
    """The drafter of ``drafter`` on ``model`` as keyword arguments of SpecGenerator / JaxBackend:
    ``drafter`` (a host drafter) or ``draft`` (a DraftSpec) + ``draft_params``. ``draft``: an
    already loaded draft LoadedModel (else ``draft_model`` is loaded here). Raises SpecjaxError on
    bad settings. ``suffix``: a SuffixConfig for the suffix/hybrid drafters; ``suffix_history``:
    past outputs (token lists) preloaded into the global suffix tree."""
    from specjax.drafters.prompt_lookup import PromptLookupDrafter
    from specjax.engine.step import DraftSpec
    from specjax.errors import SpecjaxError
    from specjax.models.loader import load_model

    cfg = model.cfg
    if drafter == "prompt_lookup":
        return {"drafter": PromptLookupDrafter(prompt_lookup_config(k, pld_min_ngram, pld_max_ngram))}
    if drafter in SUFFIX_DRAFTERS:
        import dataclasses

        from specjax.drafters.suffix import HybridDrafter, SuffixDrafter

        scfg = suffix or suffix_config(k)
        if drafter == "suffix_path":
            scfg = dataclasses.replace(scfg, tree=False)
        sd = SuffixDrafter(scfg, history=suffix_history)
        if drafter == "hybrid":
            pld = PromptLookupDrafter(prompt_lookup_config(k, pld_min_ngram, pld_max_ngram))
            if suffix_tau < 0:
                raise SpecjaxError(f"--suffix_tau must be >= 0, got {suffix_tau}")
            sd = HybridDrafter(sd, pld, tau=suffix_tau)
        return {"drafter": sd}
    if drafter == "layer_skip":
        if not 1 <= draft_layers <= cfg.num_layers - 1:
            raise SpecjaxError(f"--draft_layers must be in 1..{cfg.num_layers - 1} for {cfg.name} "
                               f"({cfg.num_layers} layers), got {draft_layers}")
        return {"draft": DraftSpec(kind="model", cfg=cfg, num_layers=draft_layers)}
    if drafter == "draft_model":
        if draft is None:
            if not draft_model:
                raise SpecjaxError("--drafter draft_model needs --draft_model (a model name, .gguf file or HF dir)")
            draft = load_model(draft_model, dtype)
        dcfg = draft.cfg
        if dcfg.vocab_size != cfg.vocab_size:
            raise SpecjaxError(f"draft model {dcfg.name} has vocabulary size {dcfg.vocab_size} but the target "
                               f"{cfg.name} has {cfg.vocab_size}; draft and target must share a tokenizer")
        return {"draft": DraftSpec(kind="model", cfg=dcfg), "draft_params": draft.params}
    if drafter == "none":
        return {}
    raise SpecjaxError(f"unknown drafter {drafter!r}; use one of {', '.join(DRAFTERS)}")


def build_spec_generator(model, drafter: str, *, k: int, k_buckets, attention_impl: str = "xla", **kw):
    """A SpecGenerator for ``drafter`` on ``model`` (a LoadedModel); ``kw`` as for drafter_parts."""
    from specjax import buckets as bk
    from specjax.errors import SpecjaxError
    from specjax.spec_generate import SpecGenerator

    if drafter == "none":
        raise SpecjaxError(f"unknown drafter {drafter!r}; use one of {', '.join(SPEC_DRAFTERS)}")
    parts = drafter_parts(model, drafter, k=k, **kw)
    return SpecGenerator(model.cfg, model.params, eos_ids=model.tokenizer.eos_ids, k_buckets=k_buckets,
                         slot_buckets=spec_slot_buckets(model.cfg), batch_buckets=bk.DEFAULT_BATCH_BUCKETS,
                         attention_impl=attention_impl, **parts)


def spec_shapes(gen, prompt_len: int, max_new_tokens: int, batch: int = 1) -> tuple[int, int, int]:
    """(batch bucket, prompt bucket, cache slots) SpecGenerator uses for these prompts; mirrors
    SpecGenerator._generate_batch (used to compile exactly what a run needs ahead of time)."""
    from specjax import buckets as bk

    B = bk.pick(gen.batch_buckets, batch, "batch size")
    need = prompt_len + max_new_tokens + max(gen.k_buckets) + 1
    S = next((s for s in gen.slot_buckets if s >= need), gen.slot_buckets[-1])
    return B, bk.prompt_bucket(prompt_len, S), S


def warm_spec(gen, shapes, k: int, greedy: bool = True) -> float:
    """Compile the (batch, prompt bucket, slots) prefills and the (batch, k, slots) steps for
    every bucket k <= K (a host drafter's step shrinks to the proposal) in ``shapes``
    (from spec_shapes) and nothing else; afterwards the generator refuses to compile (a missed
    shape raises instead of silently timing a compilation). Returns seconds."""
    t0 = time.perf_counter()
    by_bs: dict = {}
    for B, Tp, S in shapes:
        by_bs.setdefault((B, S), set()).add(Tp)
    for (B, S), tps in sorted(by_bs.items()):
        gen.warm = False  # warmup() leaves it True; allow the next (B, S) group to compile
        gen.warmup(prompt_buckets=sorted(tps), greedy_modes=(greedy,), batch_buckets=[B], slot_buckets=[S],
                   k_buckets=[b for b in gen.k_buckets if b <= k])
    gen.warm = True
    return time.perf_counter() - t0


def format_spec_stats(stats) -> str:
    pos = ", ".join(f"{p:.2f}" for p in stats.per_position_acceptance)
    return (f"acceptance rate {stats.acceptance_rate:.3f} ({stats.accepted}/{stats.drafted} drafts); "
            f"mean accepted tokens per step {stats.mean_accepted_tokens:.2f} (bonus included; {stats.steps} steps); "
            f"per-position acceptance [{pos}]")


# ---------------------------------------------------------------- generation


def _encode(tok, text: str, chat: bool, system: str | None):
    return tok.encode_chat(text, system) if chat else tok.encode(text)


def _sampling(overrides=None):
    from specjax.sampling import SamplingParams

    o = overrides or {}
    return SamplingParams(temperature=float(o.get("temperature", FLAGS.temperature)),
                          top_k=int(o.get("top_k", FLAGS.top_k)), top_p=float(o.get("top_p", FLAGS.top_p)),
                          seed=int(o.get("seed", FLAGS.seed)))


def _spec_kw(stats):
    return {} if stats is None else {"num_spec_tokens": FLAGS.num_spec_tokens, "stats": stats}


def run_single(model, gen, stats=None) -> None:
    from specjax.generate import validate_request

    tok = model.tokenizer
    ids = _encode(tok, FLAGS.prompt, FLAGS.chat, FLAGS.system)
    samp = _sampling()
    compile_s = None
    if stats is not None:
        validate_request(ids, FLAGS.max_new_tokens, model.cfg)
        compile_s = warm_spec(gen, [spec_shapes(gen, len(ids), FLAGS.max_new_tokens)], FLAGS.num_spec_tokens,
                              greedy=samp.greedy)
    res = gen.generate([ids], samp, max_new_tokens=FLAGS.max_new_tokens, ignore_eos=FLAGS.ignore_eos,
                       **_spec_kw(stats))[0]
    print(tok.decode(res.tokens))
    n = len(res.tokens)
    dec = n / res.decode_s if res.decode_s > 0 else float("nan")
    head = (f"\n[{n} tokens ({res.finish_reason}); prompt {res.prompt_len} tokens: prefill {res.prefill_s * 1e3:.0f} ms "
            f"({res.prompt_len / max(res.prefill_s, 1e-9):.0f} tok/s); decode {dec:.1f} tok/s; ")
    if stats is None:
        print(head + "first calls include JIT compilation — see benchmarks/ar_speed.py for steady-state speed]",
              file=sys.stderr)
    else:
        print(head + f"compilation {compile_s:.1f} s before generation, excluded]", file=sys.stderr)
        print(f"[spec {FLAGS.drafter} K={FLAGS.num_spec_tokens}: {format_spec_stats(stats)}]", file=sys.stderr)


def run_jsonl(model, gen, stats=None) -> None:
    from tqdm import tqdm

    from specjax import jsonl_io
    from specjax.errors import SpecjaxError
    from specjax.generate import validate_request

    if not FLAGS.output_jsonl:
        raise SpecjaxError("--input_jsonl needs --output_jsonl")
    tok = model.tokenizer
    records = list(jsonl_io.read_records(FLAGS.input_jsonl))
    done = jsonl_io.done_ids(FLAGS.output_jsonl)
    todo = [r for r in records if r.id not in done]
    n_err = n_tok = 0
    t0 = time.perf_counter()
    with jsonl_io.ResumableWriter(FLAGS.output_jsonl) as out, tqdm(total=len(todo), unit="prompt",
                                                                     disable=None) as bar:
        batch: list = []

        def flush():
            nonlocal n_tok
            if not batch:
                return
            # Rows of one batch share max_new_tokens; group by it.
            groups: dict[int, list] = {}
            for item in batch:
                groups.setdefault(item[2], []).append(item)
            for mnt, items in groups.items():
                results = gen.generate([i[1] for i in items], [i[3] for i in items], max_new_tokens=mnt,
                                       ignore_eos=FLAGS.ignore_eos, **_spec_kw(stats))
                for (rec, _, _, _), res in zip(items, results):
                    n_tok += len(res.tokens)
                    out.write({"id": rec.id, "prompt": rec.prompt, "output": tok.decode(res.tokens),
                               "output_ids": [int(t) for t in res.tokens],
                               "num_prompt_tokens": res.prompt_len, "num_tokens": len(res.tokens),
                               "finish_reason": res.finish_reason})
                    bar.update(1)
            batch.clear()

        for rec in todo:
            try:
                if rec.error:
                    raise SpecjaxError(rec.error)
                ids = _encode(tok, rec.prompt, FLAGS.chat, FLAGS.system)
                mnt = int(rec.overrides.get("max_new_tokens", FLAGS.max_new_tokens))
                validate_request(ids, mnt, model.cfg)
                samp = _sampling(rec.overrides)
            except (SpecjaxError, ValueError, TypeError) as e:
                n_err += 1
                out.write({"id": rec.id, "error": str(e)})
                bar.update(1)
                continue
            batch.append((rec, ids, mnt, samp))
            if len(batch) >= FLAGS.batch_size:
                flush()
        flush()
    dt = time.perf_counter() - t0
    print(f"{len(todo)} records ({len(records) - len(todo)} already done, {n_err} errors); "
          f"{n_tok} tokens in {dt:.1f} s = {n_tok / max(dt, 1e-9):.1f} tok/s", file=sys.stderr)
    if stats is not None:
        print(f"spec {FLAGS.drafter} K={FLAGS.num_spec_tokens} (compilation included in the time above): "
              f"{format_spec_stats(stats)}", file=sys.stderr)


def suffix_kwargs(model, drafter: str, k: int) -> dict:
    """build_spec_generator's suffix arguments from the flags (empty for other drafters)."""
    if drafter not in SUFFIX_DRAFTERS:
        return {}
    hist = load_suffix_history(FLAGS.suffix_history_jsonl, model.tokenizer) if FLAGS.suffix_history_jsonl else ()
    return dict(suffix=suffix_config_from_flags(k), suffix_tau=FLAGS.suffix_tau, suffix_history=hist)


def _validate_spec_flags():
    """Spec flag checks that need no model (run before the slow load). Returns k_buckets."""
    from specjax.errors import SpecjaxError

    spec = FLAGS.drafter != "none"
    if FLAGS.draft_model and FLAGS.drafter != "draft_model":
        raise SpecjaxError("--draft_model is only used with --drafter draft_model")
    if FLAGS.drafter == "draft_model" and not FLAGS.draft_model:
        raise SpecjaxError("--drafter draft_model needs --draft_model (a model name, .gguf file or HF dir)")
    if not spec:
        return None
    k_buckets = parse_k_buckets(FLAGS.k_buckets)
    check_num_spec_tokens(FLAGS.num_spec_tokens, k_buckets)
    if FLAGS.drafter == "prompt_lookup":
        prompt_lookup_config(FLAGS.num_spec_tokens, FLAGS.pld_min_ngram, FLAGS.pld_max_ngram)
    if FLAGS.drafter in SUFFIX_DRAFTERS:
        suffix_config_from_flags(FLAGS.num_spec_tokens)
        if FLAGS.suffix_tau < 0:
            raise SpecjaxError(f"--suffix_tau must be >= 0, got {FLAGS.suffix_tau}")
        if FLAGS.drafter == "hybrid":
            prompt_lookup_config(FLAGS.num_spec_tokens, FLAGS.pld_min_ngram, FLAGS.pld_max_ngram)
    if FLAGS.suffix_history_jsonl and FLAGS.drafter not in SUFFIX_DRAFTERS:
        raise SpecjaxError("--suffix_history_jsonl is only used with --drafter suffix or hybrid")
    if FLAGS.drafter == "layer_skip" and FLAGS.draft_layers < 1:
        raise SpecjaxError(f"--draft_layers must be >= 1, got {FLAGS.draft_layers}")
    return k_buckets


def main(argv):
    from absl import logging

    from specjax.errors import SpecjaxError
    from specjax.runtime import enable_compilation_cache

    del argv
    logging.set_verbosity(logging.WARNING)
    enable_compilation_cache()
    try:
        from specjax.generate import Generator
        from specjax.models.loader import load_model

        if (FLAGS.prompt is None) == (FLAGS.input_jsonl is None):
            raise SpecjaxError("give exactly one of --prompt or --input_jsonl")
        if FLAGS.prompt is not None and not FLAGS.prompt.strip():
            raise SpecjaxError("empty prompt: --prompt must contain some text")
        _sampling()  # validate sampling flags before the (slow) model load
        if FLAGS.max_new_tokens < 1:
            raise SpecjaxError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
        if FLAGS.batch_size < 1:
            raise SpecjaxError(f"--batch_size must be >= 1, got {FLAGS.batch_size}")
        k_buckets = _validate_spec_flags()
        model = load_model(FLAGS.model, FLAGS.dtype)
        print(f"[loaded {model.cfg.name} ({model.cfg.num_params() / 1e6:.0f}M params, {FLAGS.dtype}) "
              f"in {model.load_seconds:.1f} s]", file=sys.stderr)
        stats = None
        if FLAGS.drafter == "none":
            gen = Generator(model.cfg, model.params, eos_ids=model.tokenizer.eos_ids,
                            attention_impl=FLAGS.attention_impl)
        else:
            from specjax.spec_generate import SpecStats

            gen = build_spec_generator(model, FLAGS.drafter, k=FLAGS.num_spec_tokens, k_buckets=k_buckets,
                                       draft_model=FLAGS.draft_model, draft_layers=FLAGS.draft_layers,
                                       pld_min_ngram=FLAGS.pld_min_ngram, pld_max_ngram=FLAGS.pld_max_ngram,
                                       dtype=FLAGS.dtype, attention_impl=FLAGS.attention_impl,
                                       **suffix_kwargs(model, FLAGS.drafter, FLAGS.num_spec_tokens))
            stats = SpecStats()
        if FLAGS.prompt is not None:
            run_single(model, gen, stats)
        else:
            run_jsonl(model, gen, stats)
    except SpecjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
