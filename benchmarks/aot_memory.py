#!/usr/bin/env python
"""Per-device memory of the sharded engine for 7B-70B configs, compiled ahead of time on fake devices.

  python benchmarks/aot_memory.py [--plans llama2-70b:1x8:8:4096,llama3-8b:1x2:8:8192] [--json_out f]

Each plan is ``config:DATAxMODEL:batch:slots``. For each, the engine's bucket set (a later
512-token prefill chunk and the chain steps of --ks) is compiled for abstract bf16 params placed
by the mesh (specjax.aot.plan; nothing is allocated), and the table gives one device's weights,
KV cache and temporaries (from a float32 compile: XLA:CPU keeps float32 copies of bf16 weights
among its temporaries, see specjax/aot.py), whether that fits --budget_gb, the largest number of
cached tokens that would, and the compile seconds of each variant.
"""

from __future__ import annotations

import json
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("plans", ["llama2-70b:1x8:8:4096", "llama3-70b:1x8:8:8192", "qwen2.5-72b:1x8:8:8192",
                            "llama2-13b:1x2:8:4096", "vicuna-33b:1x4:8:2048", "llama2-7b:1x1:8:4096",
                            "llama2-7b:1x2:8:4096", "llama3-8b:1x1:8:8192", "llama3-8b:1x2:8:8192",
                            "qwen2.5-7b:1x4:8:8192"], "config:DATAxMODEL:batch:slots, comma-separated.")
flags.DEFINE_list("ks", ["0", "4"], "Chain-step K buckets to compile.")
flags.DEFINE_integer("layers", 0, "Override every config's depth (0: the config's own; for quick runs).")
flags.DEFINE_float("budget_gb", 80.0, "Device memory budget (GB).")
flags.DEFINE_string("json_out", None, "Write the plans as JSON here.")
flags.DEFINE_bool("scan_compare", False, "Instead: compile each plan's bucket set with the per-layer list and with "
                  "the scanned layer stack (ForwardOptions.scan_layers) and print the seconds of each.")


def main(argv):
    del argv
    from specjax import aot, sharding as sh
    from specjax.config import get_model_config

    from specjax.models.options import ForwardOptions

    if FLAGS.scan_compare:
        print("| config | mesh | layers | bucket set | compile s, layer list | compile s, scanned stack |")
        print("|---|---|---|---|---|---|")
        for spec in FLAGS.plans:
            name, mesh, batch, slots = spec.split(":")
            data, model = (int(x) for x in mesh.split("x"))
            cfg = get_model_config(name)
            cfg = cfg.replace(num_layers=FLAGS.layers) if FLAGS.layers else cfg
            lay = sh.Layout(sh.make_mesh(data, model))
            ks = [int(k) for k in FLAGS.ks]
            t = {scan: aot.bucket_set_seconds(cfg, lay, int(batch), int(slots), ks, fwd=ForwardOptions(scan_layers=scan))
                 for scan in (False, True)}
            what = f"prefill 512 + K={','.join(FLAGS.ks)}, batch {batch}, {slots} slots"
            print(f"| {name} | {sh.describe_mesh(lay.mesh)} | {cfg.num_layers} | {what} | {sum(t[False].values()):.1f} | "
                  f"{sum(t[True].values()):.1f} |", flush=True)
        return
    rows = []
    print("| config | mesh | batch x slots | weights GB | KV GB | temp GB (f32) | total GB | fits | "
          "max cached tokens | KV KB/token | compile s (prefill, " + ", ".join(f"K={k}" for k in FLAGS.ks) + ") |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in FLAGS.plans:
        name, mesh, batch, slots = spec.split(":")
        data, model = (int(x) for x in mesh.split("x"))
        cfg = get_model_config(name)
        if FLAGS.layers:
            cfg = cfg.replace(num_layers=FLAGS.layers)
        r = aot.plan(cfg, sh.Layout(sh.make_mesh(data, model)), int(batch), int(slots), ks=[int(k) for k in FLAGS.ks],
                     budget=FLAGS.budget_gb * aot.GB)
        rows.append(r)
        comp = ", ".join(f"{v['compile_s']:.0f}" for v in r["variants"])
        print(f"| {name} | {r['mesh']} | {batch} x {slots} | {r['weights_gb']:.1f} | {r['kv_gb']:.1f} | "
              f"{r['temp_gb']:.2f} | {r['need_gb']:.1f} | {'yes' if r['fits'] else 'no'} | {r['max_tokens']:,} | "
              f"{r['kv_bytes_per_token'] / 1024:.0f} | {comp} |", flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    app.run(main)
