"""Is a head short of data or of capacity? Its estimated tokens per verify step (greedy chains of
``--k``, ``distill.head_pipeline.shard_estimate``, the training run's held-out estimate) on a data
set's held-out shard and on training shards it trained on, side by side.

  python benchmarks/head_fit.py --head /work/runs/eagle-run8 --data_dir /work/runs/sb-data,/work/runs/chat-data5 \\
      --train_shards 0,1

A head that does much better on its training text than on held-out text has learned the text:
more (and more varied) data would buy acceptance. One about as good on both fits the training
text no better than new text: it is short of capacity (or of what its features carry), and more
data of the kind alone buys little. Each line: the data set, the shard, sequences, top-1
agreement of draft 1, estimated tokens per step.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("head", None, "A saved head's directory (a pipeline run's checkpoint_dir, or a shipped "
                        "head).")
    flags.DEFINE_enum("kind", "eagle", ["eagle", "medusa"], "The head's kind.")
    flags.DEFINE_list("data_dir", [], "Pipeline data sets (launch/distill.py --pipeline data) of the head's features.")
    flags.DEFINE_list("train_shards", ["0"], "Training shards of each data set to measure (their numbers).")
    flags.DEFINE_string("model", "smollm2-135m", "The target.")
    flags.DEFINE_integer("k", 3, "Drafts per chain.")
    flags.DEFINE_integer("distill_length", 256, "Window length (as the run trained).")
    flags.DEFINE_integer("window_context", 64, "Context positions of a window after the first (as the run trained).")


def main(argv):
    del argv
    from specjax import registry
    from specjax.distill.head_data import DataSet
    from specjax.distill.head_pipeline import RunConfig, shard_estimate
    from specjax.drafters import heads
    from specjax.errors import SpecjaxError
    from specjax.models.loader import load_model

    try:
        if not FLAGS.head or not FLAGS.data_dir:
            raise SpecjaxError("--head and --data_dir are required")
        model = load_model(FLAGS.model)
        kind = registry.entry(FLAGS.kind).head_kind()
        draft, dparams = heads.load_head(kind, FLAGS.head, model.cfg, model.params)
        rc = RunConfig(checkpoint_dir="", window=FLAGS.distill_length, context=FLAGS.window_context, k=FLAGS.k)
        print(f"{FLAGS.head} ({kind.title}, {model.cfg.name}), greedy chains of K = {FLAGS.k}")
        print("| data set | shard | sequences | top-1 agreement | est. tokens per step |")
        print("|---|---|---|---|---|")
        for d in FLAGS.data_dir:
            ds = DataSet.open(d)
            shards = [("held out", ds.eval)] + [(f"train {int(i)}", ds.train[int(i)]) for i in FLAGS.train_shards]
            for name, shard in shards:
                top1, est = shard_estimate(kind, draft, dparams, shard, rc)
                print(f"| {os.path.basename(d.rstrip('/'))} | {name} | {len(shard)} | {top1:.3f} | {est:.3f} |",
                      flush=True)
    except (SpecjaxError, IndexError) as e:
        sys.exit(f"error: {e}".splitlines()[0])


if __name__ == "__main__":
    define_flags()
    app.run(main)
