"""Write a repetitive, agent-like workload in Spec-Bench's question format (for launch/bench.py).

  python benchmarks/make_workload.py --out /tmp/repetitive.jsonl [--n_json 16 --n_code 8]
  python benchmarks/make_workload.py --out /tmp/mixed.jsonl --mix_specbench 3   # the mixed stream

Two task blocks, in this order (the order matters for the online-adaptation view: a suffix
drafter's global tree has only seen the first task when the second begins):

- ``json_extract``: GSM8K questions (../shared/data/gsm8k) wrapped in one long shared
  instruction template that asks for a fixed JSON schema (structured output, many prompts
  sharing a template: the AgenticSQL-style pattern of the SuffixDecoding paper);
- ``code_tests``: HumanEval functions (../shared/data/humaneval), each with the same request
  to write pytest tests for it (code whose shape repeats from task to task).

``--mix_specbench N``: the mixed stream instead: the repetitive prompts interleaved one for one
with open-ended Spec-Bench questions (the first N of each category, as many as there are
repetitive prompts), half repetitive, half not.
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data")

JSON_TEMPLATE = """You are a data extraction service. Read the math word problem and answer with one JSON object and nothing else.
Use exactly these keys, in this order:
{{"entities": [list of the people or objects named], "quantities": [list of every number in the problem], "unit": "the unit of the final answer", "operation": "the main arithmetic operation", "question": "the question being asked, copied verbatim"}}

Problem: {question}

JSON:"""

CODE_TEMPLATE = """Write three pytest test functions for the following Python function. Use plain assert statements and name the tests test_basic, test_edge_case and test_another_case.

{prompt}"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n_json", type=int, default=16)
    ap.add_argument("--n_code", type=int, default=8)
    ap.add_argument("--data_dir", default=DATA)
    ap.add_argument("--mix_specbench", type=int, default=0, help="interleave with N Spec-Bench questions per category")
    a = ap.parse_args()
    rows = []
    with open(os.path.join(a.data_dir, "gsm8k", "test_shared_200.jsonl"), encoding="utf-8") as f:
        for i, line in zip(range(a.n_json), f):
            q = json.loads(line)
            rows.append({"question_id": f"json-{q['test_idx']}", "category": "json_extract",
                         "turns": [JSON_TEMPLATE.format(question=q["question"])]})
    with open(os.path.join(a.data_dir, "humaneval", "HumanEval.jsonl"), encoding="utf-8") as f:
        for i, line in zip(range(a.n_code), f):
            q = json.loads(line)
            rows.append({"question_id": q["task_id"], "category": "code_tests",
                         "turns": [CODE_TEMPLATE.format(prompt=q["prompt"].strip())]})
    if a.mix_specbench > 0:
        seen, open_ended = {}, []
        with open(os.path.join(a.data_dir, "spec_bench", "question.jsonl"), encoding="utf-8") as f:
            for line in f:
                q = json.loads(line)
                if seen.get(q["category"], 0) < a.mix_specbench:
                    seen[q["category"]] = seen.get(q["category"], 0) + 1
                    open_ended.append(q)
        rows = [r for pair in zip(rows, open_ended) for r in pair]
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} prompts to {a.out}")


if __name__ == "__main__":
    main()
