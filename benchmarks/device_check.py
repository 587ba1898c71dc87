"""The accelerator check: run this first whenever a GPU/TPU is at hand.

  python benchmarks/device_check.py --out /tmp/devcheck                    # everything (~15 min on an H100)
  python benchmarks/device_check.py --sections kernels,kernel_timing       # a part
  python benchmarks/device_check.py --sections kernels --kernel_variants auto,unsplit,one_tile  # grid configs
  python benchmarks/device_check.py --sections engine --engine_parts e2e --num_layers 8 \
      --dtype float32 --matmul_precision highest                          # token identity, exact numerics
  python benchmarks/device_check.py --tiny                                 # CPU smoke run (interpret mode)

On the GPU image (no pip index) install the package in place first, so that the named configs
resolve: ``python3 -m pip install --no-deps --no-build-isolation --no-index -e .``

Sections (each is independent; a failing one is reported and the others still run):
  env            jax version, backend, devices, a device copy bandwidth
  kernels        tree-attention kernel (compiled for this device) vs the plain-jnp reference
                 over a grid of row lengths (0, off the tile grid, full), tree shapes (chain, star,
                 random), GQA ratios and dtypes, under each --kernel_variants grid configuration
                 (tuning's split-KV / query-tile defaults, forced ones); max abs error against a
                 tolerance per dtype
  kernel_timing  kernel vs the jitted XLA reference over context x tree size x batch
                 (kernels_pallas/tree_attention/bench.py, the notebook's sweep), and vs the
                 --timing_variants configurations (default: the unsplit grid, and no split-KV)
  engine         a 7B-shaped Llama (llama2-7b shapes, random bf16 weights drawn on device):
                 the compiled K = 0 and K = 2 steps' cache-sized ops (no whole-cache transpose or
                 copy only in K = 0), step cost per K (xla and pallas attention) against the K = 0 step, and the
                 serving engine end to end (no-SD, prompt lookup, layer skip; xla and pallas),
                 every output compared token-for-token with the plain AR loop (specjax.reference_ar)
                 (asserted where numerics are exact: float32 at 'highest' precision, or the CPU)
  perf_model     SmartSpec's step-cost model profiled on this device (steps over batch x context x
                 K on the --model-shaped model) and its held-out fit
  probe          where the XLA path's time goes: one projection by activation rows, prefix
                 attention alone by block size and attn_chunk, K = 0 / K = 2 steps on
                 --probe_layers layers under each attn_chunk, chunked prefill by prompt length

Each section writes <section>.json and the whole run a Markdown report (report.md) under --out.
Random weights make acceptance meaningless: the engine section measures costs and losslessness,
not speedups.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from specjax.benchtime import median_seconds, prefill_fn, steady_step  # noqa: E402
from specjax.engine.spec import DrafterSpec  # noqa: E402
from specjax.goodput.acceptance import AcceptanceCounts  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "/tmp/specjax_device_check", "Folder for the JSON results and report.md.")
flags.DEFINE_list("sections", ["env", "kernels", "kernel_timing", "engine", "perf_model"], "Sections to run, in order.")
flags.DEFINE_bool("tiny", False, "Tiny shapes and the tiny-random model (a CPU smoke run of this script).")
flags.DEFINE_string("model", "llama2-7b", "Model config whose shapes the engine section uses (random weights).")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per request in the engine section.")
flags.DEFINE_integer("reps", 20, "Timed calls per point (median reported).")
flags.DEFINE_string("dtype", "bfloat16", "Weight dtype of the engine section's random model.")
flags.DEFINE_integer("num_layers", 0, "Override the model's layer count in the engine section (0 = as configured).")
flags.DEFINE_string("matmul_precision", "", "jax_default_matmul_precision for the whole run ('' = jax's default; "
                    "'highest' rules out TF32 when checking fp32 token identity).")
flags.DEFINE_integer("probe_layers", 4, "Layers of the model the probe section's whole-step timings use.")
flags.DEFINE_list("engine_parts", ["programs", "step_cost", "e2e"], "Parts of the engine section to run.")
flags.DEFINE_list("engine_runs", ["xla:prompt_lookup", "pallas:prompt_lookup", "xla:layer_skip", "xla:eagle",
                                  "xla:medusa"],
                  "attention:drafter pairs the end-to-end part runs (each as no-SD and K = 4; a device drafter, "
                  "layer skip, an EAGLE head or Medusa heads (randomly initialised: their drafts are verified, rarely "
                  "accepted), as K = 4).")

flags.DEFINE_list("kernel_variants", ["auto", "no_split", "split5_q16"],
                  "GPU kernel configurations the kernels section checks (names in KERNEL_VARIANTS).")
flags.DEFINE_enum("kernel_grid", "full", ["full", "quick"],
                  "kernels section: the full grid (80 cases x variants; ~3 min on a GPU) or 8 cases that cover "
                  "the shapes that once failed (fp32, 64 nodes, 7-8 query heads per KV head), chains, stars and MHA.")
flags.DEFINE_list("timing_contexts", ["1024", "4096", "16384"], "kernel_timing section: context lengths.")
flags.DEFINE_list("timing_tree_sizes", ["1", "8", "32", "64"], "kernel_timing section: tree sizes N.")
flags.DEFINE_list("timing_variants", ["unsplit", "no_split"],
                  "GPU kernel configurations kernel_timing times beside the default one (names in KERNEL_VARIANTS).")

REPORT: list[str] = []

# Tree-attention GPU kernel configurations (tree_attention keyword arguments; block_q above the
# packed query rows means one tile).
KERNEL_VARIANTS = {
    "auto": {},  # tuning's defaults: query tiles by dtype and shared memory, splits to fill the SMs
    "unsplit": dict(num_splits=1, block_q=512),  # the grid before split-KV and query tiles: (row, KV head)
    "no_split": dict(num_splits=1),  # query tiles only
    "one_tile": dict(block_q=512),  # split-KV only (fp32 64 nodes x 8 heads exceeds an H100's shared memory)
    "split5_q16": dict(num_splits=5, block_q=16),  # splits that do not divide the tiles, the smallest tile
}


def say(line: str = "") -> None:
    print(line, flush=True)
    REPORT.append(line)


# ---------------------------------------------------------------------------- env

def section_env(out):
    import jax

    from kernels_pallas.tree_attention import bench

    devs = jax.devices()
    info = dict(jax=jax.__version__, backend=jax.default_backend(), devices=[str(d) for d in devs],
                device_kind=devs[0].device_kind, python=sys.version.split()[0])
    info["copy_gbps"] = bench.copy_bandwidth(1 << (22 if FLAGS.tiny else 30))
    say(f"jax {info['jax']} on {info['backend']} ({info['device_kind']}, {len(devs)} device(s)), "
        f"Python {info['python']}; device copy bandwidth {info['copy_gbps']:.0f} GB/s (read + write)")
    return info


# ---------------------------------------------------------------------------- kernels vs reference

TOL = {"float32": 5e-3, "bfloat16": 4e-2}


def _random_parents(rng, n, kind):
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def section_kernels(out):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.tree_attention import gpu_config, mask_from_parents, tree_attention, tree_attention_reference

    on_cpu = jax.default_backend() == "cpu"
    gpu_kernel = jax.default_backend() != "tpu"  # the CPU runs the GPU kernel in interpret mode
    variants = {v: KERNEL_VARIANTS[v] for v in FLAGS.kernel_variants} if gpu_kernel else {"auto": {}}
    rng = np.random.default_rng(0)
    S = 256 if FLAGS.tiny else 2048
    hd = 32 if FLAGS.tiny else 128
    grid = []
    for dtype in ("float32", "bfloat16"):
        for (H, Hkv) in ((4, 4), (8, 2)) if FLAGS.tiny else ((32, 32), (32, 8), (28, 4), (8, 1)):
            for N, kind in ((1, "chain"), (5, "chain"), (8, "star"), (16, "random"), (64, "random")):
                grid.append((dtype, H, Hkv, N, kind))
    if FLAGS.kernel_grid == "quick" and not FLAGS.tiny:
        grid = [("float32", 28, 4, 64, "random"), ("float32", 8, 1, 64, "random"), ("float32", 32, 8, 64, "random"),
                ("bfloat16", 32, 8, 1, "chain"), ("bfloat16", 32, 8, 16, "random"), ("float32", 32, 32, 5, "chain"),
                ("bfloat16", 28, 4, 64, "random"), ("float32", 32, 8, 8, "star")]
    rows = []
    ok_all = True
    for dtype, H, Hkv, N, kind in grid:
        B = 4
        dt = jnp.dtype(dtype)
        lengths = np.array([0, 1, S // 2 + 7, S - N][:B], np.int32)  # empty, one, off the tile grid, full

        def r(*shape):
            return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)

        mask = np.stack([mask_from_parents(_random_parents(rng, N, kind)) for _ in range(B)])
        args = (r(B, N, H, hd), r(B, N, Hkv, hd), r(B, N, Hkv, hd), r(2, B, Hkv, S, hd), r(2, B, Hkv, S, hd))
        lens, m = jnp.asarray(lengths), jnp.asarray(mask)
        want = tree_attention_reference(args[0], args[1], args[2], args[3][1], args[4][1], lens, m)
        for variant, kw in variants.items():
            row = dict(dtype=dtype, heads=H, kv_heads=Hkv, N=N, tree=kind, slots=S, head_dim=hd, tol=TOL[dtype],
                       variant=variant)
            try:
                if gpu_kernel:
                    _, row["block_q"], row["num_splits"] = gpu_config((B, N, H, hd), Hkv, S, dt, interpret=on_cpu, **kw)
                got = tree_attention(*args, lens, m, layer=1, backend="gpu" if on_cpu else "auto",
                                     interpret=True if on_cpu else None, **kw)
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                row.update(max_abs_err=err, ok=bool(np.isfinite(err) and err <= TOL[dtype]))
            except Exception as e:  # one case that does not compile must not hide the others
                row.update(max_abs_err=float("nan"), ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            ok_all &= row["ok"]
            rows.append(row)
    say(f"tree-attention kernel vs reference: {sum(r['ok'] for r in rows)}/{len(rows)} cases within tolerance "
        f"(fp32 {TOL['float32']}, bf16 {TOL['bfloat16']}); rows of length 0, 1, S/2+7 and S-N; "
        f"{S} slots, head_dim {hd}, stacked 2-layer cache")
    for v in variants:
        sel = [r for r in rows if r["variant"] == v]
        say(f"- {v} ({KERNEL_VARIANTS.get(v) or 'defaults'}): {sum(r['ok'] for r in sel)}/{len(sel)}")
    say("| dtype | heads / KV heads | N | tree | variant | block_q / splits | max abs err | ok |")
    say("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tiles = f"{r['block_q']} / {r['num_splits']}" if "num_splits" in r else "-"
        say(f"| {r['dtype']} | {r['heads']}/{r['kv_heads']} | {r['N']} | {r['tree']} | {r['variant']} | {tiles} | "
            f"{r['max_abs_err']:.1e} | {'yes' if r['ok'] else '**NO** ' + r.get('error', '')} |")
    if not ok_all:
        raise AssertionError("some kernel cases exceed the tolerance (see the table)")
    return rows


def section_kernel_timing(out):
    import jax

    from kernels_pallas.tree_attention import bench

    variants = {v: KERNEL_VARIANTS[v] for v in FLAGS.timing_variants} if jax.default_backend() != "tpu" else {}
    size = dict(bench.SIZES["tiny"]) if FLAGS.tiny else dict(
        contexts=tuple(map(int, FLAGS.timing_contexts)), tree_sizes=tuple(map(int, FLAGS.timing_tree_sizes)), batches=(1, 8), heads=(32, 8), head_dim=128,
        reps=FLAGS.reps)
    copy = bench.copy_bandwidth(1 << (22 if FLAGS.tiny else 30))
    res = {}
    for label, heads in (("GQA 32/8", (32, 8)), ("MHA 32/32", (32, 32))) if not FLAGS.tiny else (("tiny", size["heads"]),):
        size["heads"] = heads
        rows = bench.sweep(**size, dtype="bfloat16", variants=variants)
        res[label] = rows
        also = "".join(f", {v} {KERNEL_VARIANTS[v]}" for v in variants)
        say(f"tree attention, bf16, {label} heads, head_dim {size['head_dim']}: kernel (tuning's defaults) vs "
            f"jitted XLA reference{also} (median of {size['reps']}); copy bandwidth {copy:.0f} GB/s")
        say(bench.markdown_table(rows, copy))
        if not FLAGS.tiny:
            bench.plot(rows, copy, os.path.join(out, f"kernel_timing_{label.split()[0]}.png"))
    return dict(copy_gbps=copy, sweeps=res)


# ---------------------------------------------------------------------------- engine on a 7B shape

def _step_ms(table, B, K, ctx, S, rng, reps) -> float:
    """Median ms of the table's greedy K-draft step for B rows held at ``ctx`` committed tokens."""
    return 1e3 * median_seconds(steady_step(table, B, K, ctx, S, rng), reps)


def _step_programs(cfg, dtype, S, impls) -> list:
    """Cache- and weight-sized ops of the K = 0 and K = 2 steps as XLA compiled them for this device
    (engine.profiling.step_op_kinds on 2 layers): a K = 0 step with a whole-cache transpose or copy
    a K = 2 step lacks is what made the H100's XLA decode step 2.7-10.9x a K = 2 step (fixed by
    attention._two_positions; BENCHMARKS.md "The K = 0 step's program")."""
    import jax.numpy as jnp

    from specjax.engine.profiling import step_op_kinds
    from specjax.models.options import ForwardOptions

    pcfg = cfg.replace(num_layers=min(2, cfg.num_layers))
    rows = []
    say(f"compiled step programs, {pcfg.name} shapes on 2 layers, {S} slots: ops with a result of at least one "
        "layer's cache of the batch (weight-sized ones too), K = 0 vs K = 2")
    say("| attention | batch | K = 0 | K = 2 | whole-cache transposes/copies only in K = 0 |")
    say("|---|---|---|---|---|")
    for impl in impls:
        for B in (1,) if FLAGS.tiny else (1, 8):  # (the tiny smoke run keeps the default test suite short)
            big = step_op_kinds(pcfg, [0, 2], batch=B, slots=S, fwd=ForwardOptions(attention=impl),
                                dtype=jnp.dtype(dtype).name, min_elements=B * cfg.num_kv_heads * S * cfg.head_dim)
            big = {K: {op: n for op, n in c.items() if op not in ("parameter", "get-tuple-element", "bitcast", "tuple")}
                   for K, c in big.items()}
            extra = {op: n - big[2].get(op, 0) for op, n in big[0].items()
                     if op in ("transpose", "copy") and n > big[2].get(op, 0)}
            rows.append(dict(attention=impl, batch=B, k0=big[0], k2=big[2], k0_extra=extra))
            say(f"| {impl} | {B} | {big[0]} | {big[2]} | {extra or 'none'} |")
    return rows


def section_engine(out):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import registry
    from specjax.config import get_model_config
    from specjax.engine.loop import ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.engine.table import StepTable
    from specjax.reference_ar import reference_generate
    from specjax.goodput.selector import FixedK
    from specjax.models import llama
    from specjax.models.loader import LoadedModel
    from specjax.models.options import ForwardOptions

    from specjax.runtime import enable_compilation_cache

    # identical executables (the engine's batch-8 steps and prefill are the step-cost table's) compile once
    enable_compilation_cache(os.path.join(tempfile.gettempdir(), "specjax_device_check_xla"))
    cfg = get_model_config("tiny-random" if FLAGS.tiny else FLAGS.model)
    if FLAGS.num_layers:
        cfg = cfg.replace(num_layers=FLAGS.num_layers, name=f"{cfg.name}-{FLAGS.num_layers}L")
    dtype = jnp.float32 if FLAGS.tiny else jnp.dtype(FLAGS.dtype)
    t0 = time.perf_counter()
    params = llama.init_random_params(cfg, seed=0, dtype=dtype, on_device=True)
    jax.block_until_ready(params)
    gb = sum(x.nbytes for x in jax.tree_util.tree_leaves(params)) / 1e9
    say(f"{cfg.name} shapes, random {jnp.dtype(dtype).name} weights ({gb:.1f} GB) drawn on device in "
        f"{time.perf_counter() - t0:.1f} s")
    result = {"model": cfg.name, "weights_gb": gb}
    S = 512 if FLAGS.tiny else 2048
    impls = ("xla",) if FLAGS.tiny else ("xla", "pallas")
    ks = (0, 2, 4, 8)
    ctx = 200 if FLAGS.tiny else 1024
    rng = np.random.default_rng(0)

    # --- the step's compiled program per K (2 layers of the model): the ops of a whole cache's size
    if "programs" in FLAGS.engine_parts:
        result["programs"] = _step_programs(cfg, dtype, S, impls)

    # --- step cost per K at a fixed context, against the K = 0 step of the same table
    cost = []
    for impl in impls if "step_cost" in FLAGS.engine_parts else ():
        table = StepTable(cfg, params, params, None, ForwardOptions(attention=impl))
        for B in (1, 8):
            base = None
            for K in ks:
                ms = _step_ms(table, B, K, ctx, S, rng, FLAGS.reps)
                base = ms if K == 0 else base
                cost.append(dict(attention=impl, batch=B, K=K, context=ctx, ms=ms, vs_k0=ms / base))
    result["step_cost"] = cost
    say(f"verify step cost, {cfg.name} shapes, context {ctx}, {S} slots, greedy (median of {FLAGS.reps}); "
        "ratio = this step / the K = 0 step of the same attention path and batch")
    say("| attention | batch | K | step ms | vs K=0 | tokens/s at full acceptance |")
    say("|---|---|---|---|---|---|")
    for c in cost:
        say(f"| {c['attention']} | {c['batch']} | {c['K']} | {c['ms']:.2f} | {c['vs_k0']:.2f} | "
            f"{1e3 * c['batch'] * (c['K'] + 1) / c['ms']:.0f} |")

    if "e2e" not in FLAGS.engine_parts:
        return result
    table = None  # free the step-cost states before the engine allocates its own
    gc.collect()

    # --- the engine end to end, outputs checked against the plain AR reference loop
    n_req = 8
    lengths = [60, 90, 120, 150] * 2 if FLAGS.tiny else [300, 500, 700, 900, 400, 600, 800, 1000]
    prompts = []
    for L in lengths:  # a repeated random segment: something for prompt lookup to find
        seg = rng.integers(3, cfg.vocab_size, 50).tolist()
        prompts.append((seg * (L // 50 + 1))[:L])
    new = FLAGS.max_new_tokens
    ref = reference_generate(cfg, params, prompts, max_new_tokens=new, ignore_eos=True, batch_buckets=(n_req,))
    t = time.perf_counter()  # (the first call compiled)
    ref = reference_generate(cfg, params, prompts, max_new_tokens=new, ignore_eos=True, batch_buckets=(n_req,))
    ar_s = time.perf_counter() - t
    ref_tokens = [r.tokens for r in ref]
    say(f"reference AR loop (specjax.reference_ar, batch {n_req}, prompts {lengths}, {new} new tokens each): {ar_s:.2f} s, "
        f"{n_req * new / ar_s:.0f} tok/s")
    runs = []
    draft_layers = max(1, cfg.num_layers // 4)
    configs = [tuple(r.split(":")) for r in FLAGS.engine_runs if r.split(":")[0] in impls]
    model = LoadedModel(cfg, params, tokenizer=None)
    for impl, drafter in configs:
        entry = registry.DRAFTERS[drafter]
        kw = {"draft_layers": draft_layers} if "draft_layers" in entry.reads else {}
        be = registry.make_backend(model, drafter, k_buckets=(0, 4), batch_buckets=(n_req,), slots=S,
                                   fwd=ForwardOptions(attention=impl), **kw)
        t = time.perf_counter()
        be.warmup(prompt_lens=lengths, execute=True)
        warm_s = time.perf_counter() - t
        for k in (0, 4):
            name = "no-SD" if k == 0 else registry.perf_model_label(DrafterSpec(name=drafter, draft_layers=draft_layers))
            if k == 0 and entry.device:
                continue  # no-SD is the same step as the host backend's
            be.reset()
            eng = ServingEngine(be, FixedK(k))
            reqs = [Request(str(i), p, max_new_tokens=new, ignore_eos=True) for i, p in enumerate(prompts)]
            t = time.perf_counter()
            outs = eng.run(reqs)
            wall = time.perf_counter() - t
            same = [o.tokens == r for o, r in zip(outs, ref_tokens)]
            # where each request first leaves the reference's tokens (None: never)
            first_diff = [next((i for i, (a, b) in enumerate(zip(o.tokens, r)) if a != b), None)
                          for o, r in zip(outs, ref_tokens)]
            counts = AcceptanceCounts.of_requests(outs)
            steps = len(eng.steps)
            runs.append(dict(attention=impl, policy=name, wall_s=wall, tok_s=n_req * new / wall, steps=steps,
                             drafted=counts.drafted, accepted=counts.accepted, identical=all(same), warmup_s=warm_s,
                             first_diff=first_diff))
            say(f"  {impl} {name}: {wall:.2f} s, identical {all(same)}, first differing token per request {first_diff}")
        be = eng = None
        gc.collect()
    result["engine"] = runs
    result["generator_s"] = ar_s
    base = {r["attention"]: r["wall_s"] for r in runs if r["policy"] == "no-SD"}
    base.setdefault("xla", ar_s)
    say(f"serving engine, {n_req} requests at t = 0, batch bucket {n_req}, {new} new tokens each, greedy; "
        "identical = every request's tokens equal the reference loop's")
    say("| attention | policy | wall s | tok/s | vs engine no-SD (xla) | vs reference AR | steps | accepted/drafted | "
        "identical | warm-up s |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        acc = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
        say(f"| {r['attention']} | {r['policy']} | {r['wall_s']:.2f} | {r['tok_s']:.0f} | "
            f"{base['xla'] / r['wall_s']:.2f}x | {ar_s / r['wall_s']:.2f}x | {r['steps']} | {acc} | "
            f"{'yes' if r['identical'] else '**NO**'} | {r['warmup_s']:.0f} |")
    # Token identity is the lossless check only where every path rounds alike: float32 at
    # 'highest' matmul precision (or the CPU). In bf16 a different attention kernel or verify-block
    # shape rounds differently and near-tied logits flip (measured on an H100: even K = 0 through
    # the Pallas kernel leaves the XLA AR loop's tokens after 2-40 tokens), so there the first
    # differing token is reported, not asserted.
    exact = jax.default_backend() == "cpu" or (dtype == jnp.float32 and FLAGS.matmul_precision == "highest")
    result["identity_asserted"] = exact
    if exact and not all(r["identical"] for r in runs):
        raise AssertionError("an engine run's tokens differ from the reference AR loop's (lossless check failed)")
    return result


# ---------------------------------------------------------------------------- probe

def section_probe(out):
    """Where the XLA path's time goes on this device (the K = 0 step was 2.7-11x a K = 2 step on an
    H100): one projection by activation rows, prefix attention alone by block size, whole steps
    under each attention setting, and chunked prefill by prompt length."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import buckets as bk
    from specjax.config import get_model_config
    from specjax.engine.table import StepTable
    from specjax.models import llama
    from specjax.models.attention import block_attention
    from specjax.models.options import ForwardOptions

    cfg = get_model_config("tiny-random" if FLAGS.tiny else FLAGS.model)
    dtype = jnp.float32 if FLAGS.tiny else jnp.dtype(FLAGS.dtype)
    rng = np.random.default_rng(0)
    result = {}
    reps = FLAGS.reps

    # (a) one projection [M, d] @ [d, ffn] by activation rows M
    d, f = cfg.hidden_size, cfg.intermediate_size
    w = jax.device_put(jnp.asarray(rng.standard_normal((d, f)) * 0.02, dtype))
    dot = jax.jit(lambda x, w: x @ w)
    rows = []
    say(f"(a) one projection [M, {d}] @ [{d}, {f}] ({jnp.dtype(dtype).name}, {w.nbytes / 1e6:.0f} MB), median of {reps}")
    say("| M | ms | GB/s of weights |")
    say("|---|---|---|")
    for M in (1, 2, 3, 4, 5, 8, 9, 16, 24, 32, 64):
        x = jax.device_put(jnp.asarray(rng.standard_normal((M, d)), dtype))
        ms = 1e3 * median_seconds(lambda: jax.block_until_ready(dot(x, w)), reps)
        rows.append(dict(M=M, ms=ms, gbps=w.nbytes / ms / 1e6))
        say(f"| {M} | {ms:.3f} | {w.nbytes / ms / 1e6:.0f} |")
    result["dense"] = rows

    # (b) prefix attention alone (one layer's cache), by block size T, batch and attn_chunk
    S, ctx = (512, 200) if FLAGS.tiny else (2048, 1024)
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    att = []
    say(f"(b) attention of a T-token block over a {ctx}-token prefix ({S} slots, {H}/{Hkv} heads, hd {hd})")
    say("| batch | T | attn_chunk | ms |")
    say("|---|---|---|---|")
    for B in (1, 8):
        kc = jax.device_put(jnp.asarray(rng.standard_normal((1, B, Hkv, S, hd)), dtype))
        vc = jax.device_put(jnp.asarray(rng.standard_normal((1, B, Hkv, S, hd)), dtype))
        lens = jax.device_put(np.full(B, ctx, np.int32))
        for T in (1, 3, 5):
            q = jax.device_put(jnp.asarray(rng.standard_normal((B, T, H, hd)), dtype))
            kb = jax.device_put(jnp.asarray(rng.standard_normal((B, T, Hkv, hd)), dtype))
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
            for chunk in (256, 0):
                fn = jax.jit(lambda q, kb, kc, vc, lens, mask, chunk=chunk: block_attention(
                    q, kb, kb, kc, vc, 0, lens, mask, fwd=ForwardOptions(attn_chunk=chunk)))
                ms = 1e3 * median_seconds(lambda: jax.block_until_ready(fn(q, kb, kc, vc, lens, mask)), reps)
                att.append(dict(batch=B, T=T, attn_chunk=chunk, ms=ms))
                say(f"| {B} | {T} | {chunk} | {ms:.3f} |")
    result["attention"] = att

    # (c) whole steps on a few layers of the model, K = 0 and 2, under each attention setting
    pcfg = cfg if FLAGS.tiny else cfg.replace(num_layers=FLAGS.probe_layers, name=f"{cfg.name}-{FLAGS.probe_layers}L")
    params = llama.init_random_params(pcfg, seed=0, dtype=dtype, on_device=True)
    steps = []
    say(f"(c) whole steps, {pcfg.name}, context {ctx}, {S} slots, greedy")
    say("| options | batch | K=0 ms | K=2 ms | K=0 / K=2 |")
    say("|---|---|---|---|---|")
    for fwd in (ForwardOptions(), ForwardOptions(attn_chunk=0), ForwardOptions(attn_chunk=1024 if not FLAGS.tiny else 256)):
        table = StepTable(pcfg, params, params, None, fwd)
        for B in (1, 8):
            ms = {K: _step_ms(table, B, K, ctx, S, rng, reps) for K in (0, 2)}
            tag = f"attn_chunk={fwd.attn_chunk}"
            steps.append(dict(options=tag, batch=B, k0_ms=ms[0], k2_ms=ms[2]))
            say(f"| {tag} | {B} | {ms[0]:.2f} | {ms[2]:.2f} | {ms[0] / ms[2]:.2f} |")
        table = None
        gc.collect()
    result["steps"] = steps
    params = None
    gc.collect()

    # (d) chunked prefill by prompt length on the whole model (one row)
    params = llama.init_random_params(cfg, seed=0, dtype=dtype, on_device=True)
    flop_tok = 2 * sum(x.size for x in jax.tree_util.tree_leaves(params))
    lengths = (128, 512) if FLAGS.tiny else (512, 2048, 8192)
    S = 1024 if FLAGS.tiny else 8192
    table = StepTable(cfg, params, params, None, ForwardOptions())
    pre = []
    say(f"(d) chunked prefill (chunks of <= {bk.DEFAULT_PREFILL_CHUNK}), {cfg.name}, one row, {S} slots; "
        "TFLOP/s counts the weight FLOPs only")
    say("| prompt tokens | chunks | s | tok/s | TFLOP/s |")
    say("|---|---|---|---|---|")
    for n in lengths:
        chunks = bk.prefill_chunks(n)
        s = median_seconds(prefill_fn(table, 1, n, S, rng), max(3, reps // 4))
        pre.append(dict(tokens=n, chunks=len(chunks), s=s, tok_s=n / s, tflops=flop_tok * n / s / 1e12))
        say(f"| {n} | {len(chunks)} | {s:.3f} | {n / s:.0f} | {flop_tok * n / s / 1e12:.0f} |")
    result["prefill"] = pre
    return result


def section_perf_model(out):
    """SmartSpec's step-cost model (seed 000 Eq. 7) profiled on this device: the engine's real steps
    of a --model-shaped random-weight model over batch x context x K cells (engine.profiling, the
    same code as launch/profile.py), fitted on 3/4 of the cells and scored on the held-out rest."""
    import jax.numpy as jnp

    from specjax import registry
    from specjax.config import get_model_config
    from specjax.engine.profiling import fit_profile, profile_prefills, profile_steps
    from specjax.goodput.perf_model import StepCostModel
    from specjax.models import llama
    from specjax.models.loader import LoadedModel

    cfg = get_model_config("tiny-random" if FLAGS.tiny else FLAGS.model)
    if FLAGS.num_layers:
        cfg = cfg.replace(num_layers=FLAGS.num_layers, name=f"{cfg.name}-{FLAGS.num_layers}L")
    dtype = jnp.float32 if FLAGS.tiny else jnp.dtype(FLAGS.dtype)
    params = llama.init_random_params(cfg, seed=0, dtype=dtype, on_device=True)
    batches, contexts, ks = ((1, 4), (32, 96), (0, 2, 4)) if FLAGS.tiny else ((1, 8), (256, 1536), (0, 2, 4, 8))
    be = registry.make_backend(LoadedModel(cfg, params, tokenizer=None), "prompt_lookup", profiling=True, k_buckets=ks,
                               batch_buckets=batches, slots=256 if FLAGS.tiny else 2048)
    t0 = time.perf_counter()
    be.warmup(prompt_lens=sorted(set(contexts)), execute=True)
    say(f"{cfg.name}: compiled the bucket set in {time.perf_counter() - t0:.0f} s; profiling B {batches} x "
        f"context {contexts} x K {ks}")
    steps = profile_steps(be, batches, contexts, ks, reps=max(2, FLAGS.reps // 4))
    pre = profile_prefills(be, batches, contexts, reps=2)
    model, report = fit_profile(steps, [], pre, StepCostModel(target=None, context_mode="padded"))
    t = model.target
    say("| held-out R^2 (steps) | held-out R^2 (cell medians) | mean abs rel. error (held out) | prefill R^2 |")
    say("|---|---|---|---|")
    say(f"| {report['r2_held_out']:.3f} | {report['r2_held_out_cell_medians']:.3f} | "
        f"{report['mean_abs_rel_err_held_out']:.3f} | {report.get('prefill_r2', float('nan')):.3f} |")
    say(f"target cost: {t}")
    return {"model": cfg.name, "report": report, "target": str(t), "steps": steps, "prefills": pre}


SECTIONS = {"env": section_env, "kernels": section_kernels, "kernel_timing": section_kernel_timing,
            "engine": section_engine, "probe": section_probe, "perf_model": section_perf_model}


def main(argv):
    del argv
    os.makedirs(FLAGS.out, exist_ok=True)
    if FLAGS.matmul_precision:
        import jax

        jax.config.update("jax_default_matmul_precision", FLAGS.matmul_precision)
    unknown = [s for s in FLAGS.sections if s not in SECTIONS]
    if unknown:
        raise app.UsageError(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    unknown = [v for v in FLAGS.kernel_variants + FLAGS.timing_variants if v not in KERNEL_VARIANTS]
    if unknown:
        raise app.UsageError(f"unknown kernel variants {unknown}; choose from {list(KERNEL_VARIANTS)}")
    failed = []
    for name in FLAGS.sections:
        say(f"\n## {name}\n")
        t = time.perf_counter()
        try:
            res = SECTIONS[name](FLAGS.out)
            status = "ok"
        except Exception as e:  # report and go on: one broken section must not hide the others
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
            say(f"**{name} FAILED**: {type(e).__name__}: {str(e)[:2000]}")
            status = "failed"
            failed.append(name)
        say(f"({name}: {status} in {time.perf_counter() - t:.0f} s)")
        with open(os.path.join(FLAGS.out, f"{name}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(FLAGS.out, "report.md"), "w") as f:
            f.write("\n".join(REPORT) + "\n")
    if failed:
        print(f"device check: sections failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
