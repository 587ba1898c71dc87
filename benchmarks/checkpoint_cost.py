#!/usr/bin/env python
"""What a distillation checkpoint costs the serving thread: an orbax save of a SmolLM2
self-draft's trainable params and AdamW state, waited for (``wait=True``: the final save of a
job) or written in the background (``wait=False``: the online loop's periodic saves).

  python benchmarks/checkpoint_cost.py --draft_layers 8

Prints, per mode, the seconds the caller was blocked for each of --reps saves, and the seconds
the background write then took to finish (waited for before the next save, untimed there).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("draft_layers", 8, "Layers of the self-draft.")
flags.DEFINE_integer("reps", 3, "Saves per mode.")


def main(argv):
    del argv
    import jax
    from absl import logging

    from specjax.distill import train as tr
    from specjax.distill.checkpoint import DistillCheckpoints, fingerprint
    from specjax.models.loader import load_model

    logging.set_verbosity(logging.WARNING)
    m = load_model("smollm2-135m")
    td = tr.TrainableDraft.of(m.cfg, m.params, FLAGS.draft_layers)
    state = tr.make_optimizer(tr.TrainConfig()).init(td.trainable)
    mb = sum(x.nbytes for x in jax.tree_util.tree_leaves((td.trainable, state))) / 2**20
    print(f"{td.draft.label}: {mb:.0f} MiB of params and optimizer state per checkpoint")
    with tempfile.TemporaryDirectory() as d:
        ck = DistillCheckpoints(d, fingerprint(m.cfg, td.draft.cfg, td.trainable), max_to_keep=2)
        for wait in (True, False, True, False):
            blocked, background = [], []
            for i in range(FLAGS.reps):
                t0 = time.perf_counter()
                ck.save_next(td.trainable, state, {"rep": i}, wait=wait)
                blocked.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ck.wait()
                background.append(time.perf_counter() - t0)
            print(f"wait={wait}: caller blocked {', '.join(f'{t:.2f}' for t in blocked)} s; background write "
                  f"{', '.join(f'{t:.2f}' for t in background)} s")


if __name__ == "__main__":
    app.run(main)
