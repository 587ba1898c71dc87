"""How prompt lookup's acceptance depends on the n-gram length of its match (the draft class
the goodput policy learns alpha for), replayed over a launch/bench.py run's AR outputs.

  python benchmarks/pld_match_acceptance.py --bench_json /tmp/b/host8.json --k 2

At every position of each prompt's greedy AR output, the drafter (history = chat-templated
prompt + output so far) proposes K tokens; a proposal counts as accepted up to its first token
that differs from the output (what a greedy verifier accepts). No model is run.
"""

from __future__ import annotations

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("bench_json", None, "A launch/bench.py --json_out file (its AR outputs are replayed).")
flags.DEFINE_string("question_file", "../shared/data/spec_bench/question.jsonl", "The run's Spec-Bench questions.")
flags.DEFINE_string("model", "smollm2-135m", "The run's model (for its tokenizer and chat template).")
flags.DEFINE_integer("k", 2, "Drafts per proposal.")
flags.DEFINE_integer("max_ngram", 3, "Prompt lookup's longest n-gram.")
flags.DEFINE_integer("min_ngram", 1, "Prompt lookup's shortest n-gram.")


def main(argv):
    del argv
    from specjax.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
    from specjax.models.loader import load_model
    from specjax.specbench import load_questions

    tok = load_model(FLAGS.model).tokenizer
    with open(FLAGS.bench_json) as f:
        run = json.load(f)
    qs, _ = load_questions(FLAGS.question_file, None, 0)
    text = {(q["category"], q["question_id"]): q["text"] for q in qs}
    cfg = PromptLookupConfig(max_ngram=FLAGS.max_ngram, min_ngram=FLAGS.min_ngram, max_draft=FLAGS.k)
    by_n = collections.defaultdict(lambda: [0] * (FLAGS.k + 1))  # n -> [proposals, >= 1 accepted, ...]
    for p in run["prompts"]:
        out = p["ar"]["output_ids"]
        dr = PromptLookupDrafter(cfg)
        dr.start(0, tok.encode_chat(text[(p["category"], p["question_id"])]))
        for i in range(len(out) - FLAGS.k):
            prop = dr.propose(0, FLAGS.k)
            if len(prop):
                a = 0
                while a < len(prop) and int(prop[a]) == out[i + a]:
                    a += 1
                row = by_n[dr.draft_class(0)]
                row[0] += 1
                for j in range(1, a + 1):
                    row[j] += 1
            dr.extend(0, [out[i]])
    print(f"| n-gram match | proposals | " + " | ".join(f"P(first {j} accepted)" for j in range(1, FLAGS.k + 1)) + " |")
    print("|---|---|" + "---|" * FLAGS.k)
    for n in sorted(by_n):
        row = by_n[n]
        print(f"| {n} | {row[0]} | " + " | ".join(f"{row[j] / row[0]:.2f}" for j in range(1, FLAGS.k + 1)) + " |")


if __name__ == "__main__":
    flags.mark_flag_as_required("bench_json")
    app.run(main)
