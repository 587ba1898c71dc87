"""The op kinds of the engine's chain step per K, from its compiled (or lowered) program: which
ops a K = 0 step runs that a K >= 1 step does not, and which ops touch a whole cache's worth of
elements (a copy or transpose of the cache is what made the H100's K = 0 step slow).

  python benchmarks/step_ops.py --model llama2-7b --num_layers 2 --batch 1,8 --ks 0,1,2
  python benchmarks/step_ops.py --model llama2-7b --num_layers 2 --dtype bfloat16 \\
      --target_config benchmarks/h100_target_config.pbtxt          # compiled for an H100, none needed

No weights are drawn (abstract params). ``--target_config`` compiles for a GPU that is not here
(XLA's deviceless AOT): it needs the CUDA plugin of this jaxlib's version installed
(``pip install jax-cuda13-plugin==<jaxlib> jax-cuda13-pjrt==<jaxlib>``), not a GPU; run with
JAX_PLATFORMS=cpu. Prints, per batch, the op kinds whose presence differs between the Ks (all
of them with --all) and the cache-sized ops of every K (specjax.engine.profiling.step_op_kinds).
"""

from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama2-7b", "Model config (shapes only).")
flags.DEFINE_integer("num_layers", 2, "Layers of the model to compile (0 = as configured).")
flags.DEFINE_list("ks", ["0", "1", "2"], "K values.")
flags.DEFINE_list("batch", ["1", "8"], "Batch buckets.")
flags.DEFINE_integer("slots", 2048, "Cache slots.")
flags.DEFINE_string("dtype", "float32", "Weight and cache dtype.")
flags.DEFINE_string("attention", "xla", "ForwardOptions.attention.")
flags.DEFINE_integer("attn_chunk", 256, "ForwardOptions.attn_chunk.")
flags.DEFINE_bool("lowered", False, "The program as lowered (before XLA's passes) instead of compiled.")
flags.DEFINE_bool("all", False, "Every op kind, not only those whose presence differs between the Ks.")
flags.DEFINE_string("target_config", None, "GpuTargetConfig text proto: compile for that GPU (deviceless).")
flags.DEFINE_string("dump", None, "Write each program's HLO text to <dump>_B<b>_K<k>.hlo.")


def main(argv):
    from specjax.config import get_model_config
    from specjax.engine import profiling
    from specjax.models.options import ForwardOptions

    cfg = get_model_config(FLAGS.model)
    if FLAGS.num_layers:
        cfg = cfg.replace(num_layers=FLAGS.num_layers)
    device = None
    if FLAGS.target_config:
        with open(FLAGS.target_config) as f:
            device = profiling.compile_only_device("cuda", f.read())
    # rope_once resolved for the target, as the engine there would (off on accelerators)
    fwd = ForwardOptions(attention=FLAGS.attention, attn_chunk=FLAGS.attn_chunk,
                         rope_once=None if device is None else False)
    ks = [int(k) for k in FLAGS.ks]
    where = device.device_kind if device is not None else "this machine's default backend"
    for B in map(int, FLAGS.batch):
        texts = profiling.step_programs(cfg, ks, batch=B, slots=FLAGS.slots, fwd=fwd, dtype=FLAGS.dtype,
                                        compiled=not FLAGS.lowered, device=device)
        if FLAGS.dump:
            for K, t in texts.items():
                with open(f"{FLAGS.dump}_B{B}_K{K}.hlo", "w") as f:
                    f.write(t)
        cache = B * cfg.num_kv_heads * FLAGS.slots * cfg.head_dim  # one layer's K (or V) of the batch
        kinds = {K: profiling.hlo_op_kinds(t) for K, t in texts.items()}
        plumbing = ("parameter", "get-tuple-element", "bitcast", "tuple")  # no work of their own
        big = {K: collections.Counter({op: n for op, n in profiling.hlo_op_kinds(t, cache).items()
                                       if op not in plumbing}) for K, t in texts.items()}
        what = "lowered" if FLAGS.lowered else f"compiled for {where}"
        print(f"\n{cfg.name} ({cfg.num_layers} layers), batch {B}, {FLAGS.slots} slots, {FLAGS.dtype}, "
              f"attention {FLAGS.attention} (attn_chunk {FLAGS.attn_chunk}), {what}")
        print("op kinds" + ("" if FLAGS.all else " present in some K only") + ":")
        print(profiling.op_kinds_table(kinds, only_differing=not FLAGS.all))
        print(f"ops with a result of >= {cache} elements (a layer's cache of the batch; weight-sized ones too):")
        print(profiling.op_kinds_table(big))


if __name__ == "__main__":
    app.run(main)
