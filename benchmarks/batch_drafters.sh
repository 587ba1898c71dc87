#!/usr/bin/env bash
# A batch job of 200 GSM8K questions through launch/batch.py, at each batch size given: specjax AR,
# then every drafter named under SmartSpec, then AR again (the two AR runs bracket the machine's
# drift; ratios are against their mean). ROUNDS=R (default 1) repeats AR + the drafters R times
# before the last AR: each drafter run is compared with the AR runs just before and after it, and
# the table gives each round's ratio and their mean (two runs of one command on this machine
# differ by more than the 2% a drafter may cost, so one pair decides nothing). A batch size B runs with batch buckets 1, 2, 4, ..., B
# (the engine's KV rows = B). Prints one Markdown table per batch size from the job summaries
# (serving tok/s, compilation excluded; serving CPU ms per token; mean K) and whether each run's
# outputs equal AR's (greedy: they must). With LLAMACPP_PYTHON set (a venv with llama-cpp-python,
# benchmarks/requirements-llamacpp-peer.txt), llama.cpp's batch mode then runs the same records at
# the same batch sizes (benchmarks/llamacpp_batch.py: prompts mixed into the decode calls, and
# alone), after every specjax run, never beside one.
#   bash benchmarks/batch_drafters.sh OUT_DIR [DRAFTERS] [BATCH_SIZES] [MAX_NEW] [extra batch.py flags]
#   e.g. bash benchmarks/batch_drafters.sh /tmp/bd prompt_lookup,suffix,suffix_path,hybrid,layer_skip 8,16 96
# draft_model drafts with DRAFT_MODEL (default smollm2-135m: SmolLM2 has no smaller same-tokenizer
# sibling in the package). eagle and draft_model need a profiled perf model for SmartSpec (launch/profile.py; eagle's for
# SmolLM2 on the rows kernel is shipped); without one their runs end with rc 2 and a one-line
# error in their log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/specjax_batch_drafters}"; drafters="${2:-prompt_lookup,suffix,suffix_path,hybrid,layer_skip}"
sizes="${3:-8}"; max_new="${4:-96}"; shift $(( $# < 4 ? $# : 4 ))
py="${PYTHON:-python}"
data="${SPECJAX_SHARED_DIR:-../shared}/data/gsm8k/test_shared_200.jsonl"
mkdir -p "$out"
"$py" - "$data" "$out/prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as g:
    for i, line in enumerate(f):
        g.write(json.dumps({"id": f"gsm{i}", "prompt": json.loads(line)["question"]}) + "\n")
PY
run() {  # run NAME DRAFTER POLICY BUCKETS [extra flags]
  local name=$1 drafter=$2 policy=$3 buckets=$4; shift 4
  local extra=(); [ "$drafter" = draft_model ] && extra=(--draft_model "${DRAFT_MODEL:-smollm2-135m}")
  "$py" launch/batch.py --chat --input_jsonl "$out/prompts.jsonl" --output_jsonl "$out/$name.jsonl" \
      --drafter "$drafter" --policy "$policy" --batch_buckets "$buckets" --max_new_tokens "$max_new" "${extra[@]}" "$@" \
      > "$out/$name.log" 2>&1
  echo "$name: rc $? $(grep -h 'tok/s' "$out/$name.log" | head -1)"
}
rm -f "$out"/*.jsonl.* "$out"/ar*.jsonl "$out"/d_*.jsonl
for B in ${sizes//,/ }; do
  buckets=1; b=2; while [ "$b" -le "$B" ]; do buckets="$buckets,$b"; b=$((b * 2)); done
  [ "${buckets##*,}" = "$B" ] || buckets="$buckets,$B"
  for r in $(seq 1 "${ROUNDS:-1}"); do
    run "ar${r}_b$B" none none "$buckets" "$@"
    for d in ${drafters//,/ }; do run "d_${d}_r${r}_b$B" "$d" smartspec "$buckets" "$@"; done
  done
  run "ar$(( ${ROUNDS:-1} + 1 ))_b$B" none none "$buckets" "$@"
done
"$py" - "$out" "$drafters" "$sizes" "${ROUNDS:-1}" <<'PY'
import json, os, re, sys
out, drafters, sizes, rounds = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), int(sys.argv[4])
def field(name, pat):
    try:
        m = re.search(pat, open(f"{out}/{name}.log").read())
    except OSError:
        m = None
    return float(m.group(1)) if m else float("nan")
def ids(name):
    if not os.path.exists(f"{out}/{name}.jsonl"):
        return {}
    return {r["id"]: r.get("output_ids") for r in map(json.loads, open(f"{out}/{name}.jsonl"))}
first = ids(f"ar1_b{sizes[0]}")
for B in sizes:
    tps = lambda n: field(n, r"= ([0-9.]+) tok/s")
    ars = [tps(f"ar{r}_b{B}") for r in range(1, rounds + 2)]
    ref = ids(f"ar1_b{B}")
    same_b = sum(first.get(k) == v for k, v in ref.items())
    print(f"\nbatch {B} (AR outputs equal batch {sizes[0]}'s AR: {same_b}/{len(first)}); AR runs: "
          + ", ".join(f"{a:.1f}" for a in ars) + " tok/s\n")
    print("| drafter | serving tok/s per round | vs AR per round (the AR runs before and after it) | mean ratio | "
          "serving CPU ms/token | mean K | outputs equal AR's |")
    print("|---|---|---|---|---|---|---|")
    for d in ["AR"] + drafters:
        names = ([f"ar{r}_b{B}" for r in range(1, rounds + 2)] if d == "AR"
                 else [f"d_{d}_r{r}_b{B}" for r in range(1, rounds + 1)])
        ratios = [] if d == "AR" else [tps(n) / ((ars[r] + ars[r + 1]) / 2) for r, n in enumerate(names)]
        same = min(sum(ids(n).get(k) == v for k, v in ref.items()) for n in names)
        cpu = ", ".join(f"{field(n, r'serving CPU ([0-9.]+) ms/token'):.2f}" for n in names)
        mk = ", ".join(f"{field(n, r'mean K ([0-9.]+)'):.2f}" for n in names)
        mean = f"{sum(ratios) / len(ratios):.3f}x" if ratios else ""
        print(f"| {d} | {', '.join(f'{tps(n):.1f}' for n in names)} | {', '.join(f'{x:.3f}x' for x in ratios)} | "
              f"{mean} | {cpu} | {mk} | {same}/{len(ref)} |")
PY
if [ -n "${LLAMACPP_PYTHON:-}" ]; then
  echo
  "$py" benchmarks/llamacpp_batch.py --input_jsonl "$out/prompts.jsonl" --llamacpp_python "$LLAMACPP_PYTHON" \
      --batch_sizes "$sizes" --prefill mixed,alone --max_new_tokens "$max_new" --ar_jsonl "$out/ar1_b${sizes%%,*}.jsonl" \
      --json_out "$out/llamacpp_batch.json" 2> "$out/llamacpp_batch.log"
  echo "llama.cpp: rc $? (log $out/llamacpp_batch.log)"
fi
