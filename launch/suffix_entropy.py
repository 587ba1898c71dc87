"""Judge whether SuffixDecoding suits a workload: the weighted mean node entropy of its outputs.

  python launch/suffix_entropy.py --input_jsonl outputs.jsonl [--limit 100] [--model smollm2-135m]

Reads sample outputs (JSONL; each line has 'output_ids' (token ids) or 'output' (text,
tokenized with --model's tokenizer), e.g. the output file of launch/generate.py), builds a
suffix tree from the first --limit of them and prints the entropy (bits; see
specjax/drafters/suffix/entropy.py for what is counted). Lower is more predictable:
structured, templated outputs sit well below open-ended chat.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("input_jsonl", None, "Sample outputs, one JSON object per line.")
flags.DEFINE_integer("limit", 100, "Use the first N outputs (0 = all).")
flags.DEFINE_integer("max_depth", 64, "Suffix-tree depth cap.")
flags.DEFINE_string("model", "smollm2-135m", "Tokenizer source for lines that carry text only.")
flags.DEFINE_string("field", None, "Read this text field instead of 'output_ids'/'output'.")


def main(argv):
    del argv
    from specjax.drafters.suffix.entropy import empirical_entropy
    from specjax.errors import SpecjaxError
    from specjax.jobs import read_outputs

    try:
        if not FLAGS.input_jsonl:
            raise SpecjaxError("--input_jsonl is required")
        if FLAGS.limit < 0 or FLAGS.max_depth < 1:
            raise SpecjaxError("--limit must be >= 0 and --max_depth >= 1")
        items = read_outputs(FLAGS.input_jsonl, flag="--input_jsonl", limit=FLAGS.limit, field=FLAGS.field)
        if not items:
            raise SpecjaxError(f"{FLAGS.input_jsonl} has no outputs")
        if any(isinstance(x, str) for x in items):
            from specjax.models.loader import load_model

            tok = load_model(FLAGS.model).tokenizer
            items = [tok.encode(x) if isinstance(x, str) else x for x in items]
        r = empirical_entropy(items, FLAGS.max_depth)
    except SpecjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{r['sequences']} outputs, {r['tokens']} tokens, {r['nodes']} tree nodes with >= 2 continuations")
    print(f"empirical entropy (weighted mean over nodes): {r['mean_entropy_bits']:.3f} bits")


if __name__ == "__main__":
    app.run(main)
