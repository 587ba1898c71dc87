"""The prompt files the shipped EAGLE head trained on (heads/*/README.md), from ../shared/data only.

  python scripts/eagle_prompts.py --shared ../shared --out prompts.jsonl --answers_out answers.jsonl

``--out``: 240 GSM8K train questions and the 164 HumanEval prompts, shuffled (seed 0), for the
target to answer. ``--answers_out``: 3,000 GSM8K train questions with their reference answers
(calculator annotations removed) and the 164 HumanEval prompts with their canonical solutions,
shuffled (seed 1), for ``launch/distill.py --answer_field answer`` (teacher-forced, no
generation). Both end with the same 8 held-out Spec-Bench questions (launch/distill.py keeps the
file's last --eval_prompts aside; blank answers): the last question of writing, roleplay,
reasoning, stem, humanities and qa, and two more qa. None of Spec-Bench is trained on;
launch/bench.py --per_category N measures its first N.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

CHAT = ["writing", "roleplay", "reasoning", "stem", "humanities", "qa"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--answers_out")
    a = ap.parse_args()
    data = os.path.join(a.shared, "data")

    def lines(*p):
        with open(os.path.join(data, *p)) as f:
            return [json.loads(x) for x in f if x.strip()]

    rng = random.Random(0)
    gsm = [r["question"] for r in lines("gsm8k", "train.jsonl")]
    rng.shuffle(gsm)
    train = [("gsm8k", t) for t in gsm[:240]] + [("humaneval", "Complete this Python function:\n\n" + r["prompt"])
                                                 for r in lines("humaneval", "HumanEval.jsonl")]
    rng.shuffle(train)
    sb = lines("spec_bench", "question.jsonl")
    held = [[q for q in sb if q["category"] == c][-1] for c in CHAT] + [q for q in sb if q["category"] == "qa"][-3:-1]
    with open(a.out, "w") as f:
        for src, t in train:
            f.write(json.dumps({"prompt": t, "source": src}) + "\n")
        for q in held:
            f.write(json.dumps({"prompt": q["turns"][0], "source": "spec_bench/" + q["category"],
                                "question_id": q["question_id"]}) + "\n")
    print(f"{len(train)} training prompts, {len(held)} held out -> {a.out}")
    if a.answers_out:
        rng = random.Random(1)
        gsm = lines("gsm8k", "train.jsonl")
        rng.shuffle(gsm)
        items = [{"prompt": g["question"], "answer": re.sub(r"<<[^>]*>>", "", g["answer"]), "source": "gsm8k"}
                 for g in gsm[:3000]]
        items += [{"prompt": "Complete this Python function:\n\n" + h["prompt"],
                   "answer": h["prompt"] + h["canonical_solution"], "source": "humaneval"}
                  for h in lines("humaneval", "HumanEval.jsonl")]
        rng.shuffle(items)
        with open(a.answers_out, "w") as f:
            for it in items:
                f.write(json.dumps(it) + "\n")
            for q in held:
                f.write(json.dumps({"prompt": q["turns"][0], "source": "spec_bench/" + q["category"],
                                    "question_id": q["question_id"], "answer": ""}) + "\n")
        print(f"{len(items)} prompts with answers, {len(held)} held out -> {a.answers_out}")


if __name__ == "__main__":
    main()
