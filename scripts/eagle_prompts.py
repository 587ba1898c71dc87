"""The prompt file the shipped EAGLE head trained on (heads/*/README.md), from ../shared/data only.

  python scripts/eagle_prompts.py --shared ../shared --out prompts.jsonl

Training prompts: 240 GSM8K train questions and the 164 HumanEval prompts, shuffled (seed 0).
Then 8 held-out Spec-Bench questions (launch/distill.py keeps the file's last --eval_prompts
aside): the last question of writing, roleplay, reasoning, stem, humanities and qa, and two more
qa. None of Spec-Bench is trained on; launch/bench.py --per_category N measures its first N.
"""

from __future__ import annotations

import argparse
import json
import os
import random

CHAT = ["writing", "roleplay", "reasoning", "stem", "humanities", "qa"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
    ap.add_argument("--out", required=True)
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


if __name__ == "__main__":
    main()
