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

``--long N``: long prompts instead (1-4k SmolLM2 tokens, for prefill-bound end-to-end runs), N
of each of three kinds built from the same data:

- ``multi_turn``: a conversation transcript of GSM8K questions and their worked answers, then a
  new question to solve the same way;
- ``doc_qa``: a "document" of worked GSM8K solutions, then a question about one of them;
- ``code_edit``: a module of HumanEval functions with their solutions, then a request to return
  it with one function renamed everywhere (an edit that copies most of the prompt).

``--shared_prefix N``: a batch job (launch/batch.py records, ``{"id", "prompt"}``) of N GSM8K test
questions behind one shared few-shot block of worked GSM8K training solutions (``--prefix_chars``,
about 1.1k SmolLM2 tokens by default): the prefix-caching workload (one instruction block and
the same examples in front of every record). ``--distinct_first_line``: the same records, each
starting with a line of its own, so no prompt shares a prefill chunk with another (the control
a prefix-caching speedup is measured against: the same tokens to serve, nothing to reuse).

``--shared_prefix N --prefix_kind json``: the same job as structured extraction instead: one
shared instruction block asking for a fixed JSON schema (the question copied verbatim, the
problem's numbers, the calculations, the answer) with worked examples built from GSM8K training
problems (their numbers and ``<<a*b=c>>`` annotations), then one test problem each: an offline
extraction job with a long shared template (the AgenticSQL-style pattern of the SuffixDecoding paper).
``--prefix_kind code``: a code-rewriting job instead: one shared module (HumanEval functions with
their solutions, from the start of the set), then a request to rewrite one later HumanEval
function in the module's style with more descriptive names: SmolLM2's answers copy most of the
function (the kind of offline job where SuffixDecoding pays). ``--prefix_kind both``: a job with two
templates (fewshot and json), the two kinds' records interleaved.

``--conversations C --turns T``: a batch job of C conversations resent turn by turn, as a chat
client does: record (c, t) is conversation c's first t - 1 exchanges (GSM8K training questions
and their worked answers as the assistant's turns) and its t-th question; every turn repeats the
previous turn's prompt as its prefix.

``--spec_bench_train N``: training prompts for the head pipeline (``launch/distill.py --pipeline
data --prompt_files OUT``): every Spec-Bench first turn but the first N of each category (the ones
the benchmarks measure: ``--per_category`` takes the first), less any GSM8K test question of
``test_shared_200.jsonl``, as ``{"prompt", "category", "question_id"}`` records.

``--mix_specbench N``: the mixed stream instead: the repetitive prompts interleaved one for one
with open-ended Spec-Bench questions (the first N of each category, as many as there are
repetitive prompts), half repetitive, half not.
"""

from __future__ import annotations

import argparse
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data")

JSON_TEMPLATE = """You are a data extraction service. Read the math word problem and answer with one JSON object and nothing else.
Use exactly these keys, in this order:
{{"entities": [list of the people or objects named], "quantities": [list of every number in the problem], "unit": "the unit of the final answer", "operation": "the main arithmetic operation", "question": "the question being asked, copied verbatim"}}

Problem: {question}

JSON:"""

CODE_TEMPLATE = """Write three pytest test functions for the following Python function. Use plain assert statements and name the tests test_basic, test_edge_case and test_another_case.

{prompt}"""


def _write(path, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# Characters per prompt: SmolLM2's tokenizer averages ~3.5-4 characters per token on this text.
LONG_CHARS = (4000, 7000, 10000, 14000)


def long_prompts(data_dir: str, n: int) -> list[dict]:
    """n prompts of each long kind (see the module docstring), their sizes cycling through
    LONG_CHARS; deterministic (data order, no randomness)."""
    gsm = _jsonl(os.path.join(data_dir, "gsm8k", "train.jsonl"))
    tests = _jsonl(os.path.join(data_dir, "gsm8k", "test_shared_200.jsonl"))
    code = _jsonl(os.path.join(data_dir, "humaneval", "HumanEval.jsonl"))
    rows, g, c = [], 0, 0
    for i in range(n):
        size = LONG_CHARS[i % len(LONG_CHARS)]
        turns = []
        while sum(map(len, turns)) < size:
            turns.append(f"User: {gsm[g]['question']}\nAssistant: {gsm[g]['answer']}\n")
            g += 1
        q = tests[i % len(tests)]["question"]
        rows.append({"question_id": f"multi_turn-{i}", "category": "multi_turn",
                     "turns": ["Here is our conversation so far.\n\n" + "".join(turns)
                               + f"\nUser: {q}\nAnswer step by step, like before."]})
        doc = []
        while sum(map(len, doc)) < size:
            doc.append(f"Problem {len(doc) + 1}. {gsm[g]['question']}\nSolution: {gsm[g]['answer']}\n")
            g += 1
        k = len(doc) // 2
        rows.append({"question_id": f"doc_qa-{i}", "category": "doc_qa",
                     "turns": ["Read these worked solutions.\n\n" + "\n".join(doc)
                               + f"\nExplain the solution of problem {k + 1} again, step by step, and give its final answer."]})
        mod, names = [], []
        while sum(map(len, mod)) < size:
            mod.append(code[c]["prompt"] + code[c]["canonical_solution"])
            names.append(code[c]["entry_point"])
            c = (c + 1) % len(code)
        old = names[len(names) // 2]
        rows.append({"question_id": f"code_edit-{i}", "category": "code_edit",
                     "turns": ["\n\n".join(mod) + f"\n\nRename the function {old} to {old}_v2 everywhere in this "
                               "module and return the whole module."]})
    return rows


FEWSHOT_HEAD = "Solve each math word problem step by step, then give the final answer after ####. Examples:\n\n"


EXTRACT_HEAD = """You are a data extraction service. For each math word problem, answer with one JSON object and nothing else, with exactly these keys in this order:
{"question": the question being asked, copied verbatim; "numbers": every number in the problem, in order; "calculations": the calculations that solve it, one string each; "answer": the final answer as a number}
Examples:

"""


CODE_TASK = ("Rewrite the following new function in the same style as the module, with more descriptive variable "
             "names. Reply with only the code.")


def _extraction(g: dict) -> str:
    """The schema's JSON for a worked GSM8K problem (its numbers, its <<a*b=c>> annotations)."""
    q = g["question"]
    last = re.split(r"(?<=[.!?])\s+", q.strip())[-1]
    def num(x):
        return float(x) if "." in x else int(x)

    return json.dumps({"question": last, "numbers": [num(x) for x in re.findall(r"\d+(?:\.\d+)?", q.replace(",", ""))],
                       "calculations": re.findall(r"<<([^>]*)>>", g["answer"]),
                       "answer": num(g["answer"].split("####")[-1].strip().replace(",", ""))})


def shared_prefix_job(data_dir: str, n: int, prefix_chars: int, kind: str = "fewshot") -> list[dict]:
    """n batch-job records: the same block of worked training problems (``prefix_chars``
    characters or a little more; ``kind`` fewshot: solutions, json: extractions), then one test
    problem each (deterministic)."""
    if kind == "both":  # a job with two templates: the two blocks' records interleaved
        a, b = (shared_prefix_job(data_dir, (n + 1) // 2, prefix_chars, k) for k in ("fewshot", "json"))
        return [dict(r, id=f"{k}-{r['id']}") for pair in zip(a, b) for k, r in zip(("fewshot", "json"), pair)][:n]
    if kind == "code":  # the module from HumanEval's start, the records' functions from its end
        code = _jsonl(os.path.join(data_dir, "humaneval", "HumanEval.jsonl"))
        src = [(c["prompt"] + c["canonical_solution"]).strip() for c in code]
        module = []
        while sum(map(len, module)) < prefix_chars:
            module.append(src[len(module)])
        head = "Here is our project's module:\n\n```python\n" + "\n\n\n".join(module) + "\n```\n\n" + CODE_TASK
        return [{"id": code[-1 - i]["task_id"].replace("/", "_"), "prompt": f"{head}\n\n```python\n{src[-1 - i]}\n```"}
                for i in range(n)]
    gsm = _jsonl(os.path.join(data_dir, "gsm8k", "train.jsonl"))
    tests = _jsonl(os.path.join(data_dir, "gsm8k", "test_shared_200.jsonl"))
    shots = []
    while sum(map(len, shots)) < prefix_chars:
        g = gsm[len(shots)]
        shots.append(f"Question: {g['question']}\nAnswer: {g['answer']}\n\n" if kind == "fewshot"
                     else f"Problem: {g['question']}\nJSON: {_extraction(g)}\n\n")
    head, ask = (FEWSHOT_HEAD, "Question: {}\nAnswer:") if kind == "fewshot" else (EXTRACT_HEAD, "Problem: {}\nJSON:")
    return [{"id": f"gsm{i}", "prompt": head + "".join(shots) + ask.format(tests[i % len(tests)]["question"])}
            for i in range(n)]


def multi_turn_job(data_dir: str, conversations: int, turns: int) -> list[dict]:
    """conversations x turns batch-job records (see the module docstring), conversation by
    conversation, turn by turn (deterministic)."""
    gsm = _jsonl(os.path.join(data_dir, "gsm8k", "train.jsonl"))
    rows = []
    for c in range(conversations):
        qa = gsm[c * turns:(c + 1) * turns]
        for t in range(turns):
            past = "".join(f"User: {q['question']}\nAssistant: {q['answer']}\n\n" for q in qa[:t])
            rows.append({"id": f"c{c}t{t}", "prompt": "Our conversation so far:\n\n" + past
                         + f"User: {qa[t]['question']}\nAssistant:"})
    return rows


def spec_bench_train(data_dir: str, held_out: int) -> list[dict]:
    """Spec-Bench first turns less the first ``held_out`` of each category and GSM8K's shared test
    questions (see the module docstring), category by category, in file order within each."""
    from specjax.specbench import load_questions

    path = os.path.join(data_dir, "spec_bench", "question.jsonl")
    qs, _ = load_questions(path, None, 0)
    measured = {q["question_id"] for q in load_questions(path, None, held_out)[0]} if held_out else set()
    tests = {q["question"].strip() for q in _jsonl(os.path.join(data_dir, "gsm8k", "test_shared_200.jsonl"))}
    return [{"prompt": q["text"], "category": q["category"], "question_id": q["question_id"]} for q in qs
            if q["question_id"] not in measured and q["text"].strip() not in tests]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n_json", type=int, default=16)
    ap.add_argument("--n_code", type=int, default=8)
    ap.add_argument("--data_dir", default=DATA)
    ap.add_argument("--mix_specbench", type=int, default=0, help="interleave with N Spec-Bench questions per category")
    ap.add_argument("--long", type=int, default=0, help="write N long prompts of each kind instead")
    ap.add_argument("--shared_prefix", type=int, default=0, help="write a batch job of N records sharing a prefix")
    ap.add_argument("--prefix_chars", type=int, default=4400, help="the shared prefix's size (--shared_prefix)")
    ap.add_argument("--prefix_kind", choices=("fewshot", "json", "code", "both"), default="fewshot",
                    help="--shared_prefix's block: worked solutions, structured extractions, code rewriting, or fewshot and json interleaved")
    ap.add_argument("--distinct_first_line", action="store_true",
                    help="--shared_prefix: begin each record with a line of its own (nothing shared: the control)")
    ap.add_argument("--conversations", type=int, default=0, help="write a batch job of conversations resent turn by turn")
    ap.add_argument("--turns", type=int, default=8, help="turns per conversation (--conversations)")
    ap.add_argument("--spec_bench_train", type=int, default=-1,
                    help="write head-training prompts: Spec-Bench less the first N of each category")
    a = ap.parse_args()
    if a.spec_bench_train >= 0:
        rows = spec_bench_train(a.data_dir, a.spec_bench_train)
        _write(a.out, rows)
        print(f"wrote {len(rows)} training prompts (the first {a.spec_bench_train} of each category held out) to {a.out}")
        return
    if a.conversations:
        rows = multi_turn_job(a.data_dir, a.conversations, a.turns)
        _write(a.out, rows)
        print(f"wrote {len(rows)} records ({a.conversations} conversations x {a.turns} turns) to {a.out}")
        return
    if a.shared_prefix:
        rows = shared_prefix_job(a.data_dir, a.shared_prefix, a.prefix_chars, a.prefix_kind)
        if a.distinct_first_line:
            rows = [dict(r, prompt=f"Record {r['id']} of this batch.\n{r['prompt']}") for r in rows]
        _write(a.out, rows)
        kinds = [[r["prompt"] for r in rows if r["id"].startswith(k)] for k in ("fewshot", "json")] if a.prefix_kind == "both" \
            else [[r["prompt"] for r in rows]]
        print(f"wrote {len(rows)} records sharing {' and '.join(str(len(os.path.commonprefix(k))) for k in kinds)}-character "
              f"prefixes to {a.out}")
        return
    if a.long:
        rows = long_prompts(a.data_dir, a.long)
        _write(a.out, rows)
        print(f"wrote {len(rows)} long prompts to {a.out}")
        return
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
    _write(a.out, rows)
    print(f"wrote {len(rows)} prompts to {a.out}")


if __name__ == "__main__":
    main()
