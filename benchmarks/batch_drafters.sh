#!/usr/bin/env bash
# A batch job of 200 GSM8K questions through launch/batch.py, at each batch size given: specjax AR,
# then every drafter named under SmartSpec, then AR again (the two AR runs bracket the machine's
# drift; ratios are against their mean). A batch size B runs with batch buckets 1, 2, 4, ..., B
# (the engine's KV rows = B). Prints one Markdown table per batch size from the job summaries
# (serving tok/s, compilation excluded; serving CPU ms per token; mean K) and whether each run's
# outputs equal AR's (greedy: they must). With LLAMACPP_PYTHON set (a venv with llama-cpp-python,
# benchmarks/requirements-llamacpp-peer.txt), llama.cpp's batch mode then runs the same records at
# the same batch sizes (benchmarks/llamacpp_batch.py: prompts mixed into the decode calls, and
# alone), after every specjax run, never beside one.
#   bash benchmarks/batch_drafters.sh OUT_DIR [DRAFTERS] [BATCH_SIZES] [MAX_NEW] [extra batch.py flags]
#   e.g. bash benchmarks/batch_drafters.sh /tmp/bd prompt_lookup,suffix,suffix_path,hybrid,layer_skip 8,16 96
# eagle and draft_model need a profiled perf model for SmartSpec (launch/profile.py); without one
# their runs end with rc 2 and a one-line error in their log.
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
  "$py" launch/batch.py --chat --input_jsonl "$out/prompts.jsonl" --output_jsonl "$out/$name.jsonl" \
      --drafter "$drafter" --policy "$policy" --batch_buckets "$buckets" --max_new_tokens "$max_new" "$@" \
      > "$out/$name.log" 2>&1
  echo "$name: rc $? $(grep -h 'tok/s' "$out/$name.log" | head -1)"
}
rm -f "$out"/*.jsonl.* "$out"/ar*.jsonl "$out"/d_*.jsonl
for B in ${sizes//,/ }; do
  buckets=1; b=2; while [ "$b" -le "$B" ]; do buckets="$buckets,$b"; b=$((b * 2)); done
  [ "${buckets##*,}" = "$B" ] || buckets="$buckets,$B"
  run "ar1_b$B" none none "$buckets" "$@"
  for d in ${drafters//,/ }; do run "d_${d}_b$B" "$d" smartspec "$buckets" "$@"; done
  run "ar2_b$B" none none "$buckets" "$@"
done
"$py" - "$out" "$drafters" "$sizes" <<'PY'
import json, os, re, sys
out, drafters, sizes = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
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
    ar = (tps(f"ar1_b{B}") + tps(f"ar2_b{B}")) / 2
    ref = ids(f"ar1_b{B}")
    same_b = sum(first.get(k) == v for k, v in ref.items())
    print(f"\nbatch {B} (AR outputs equal batch {sizes[0]}'s AR: {same_b}/{len(first)})\n")
    print(f"| run | serving tok/s | vs AR (mean of the two AR runs, {ar:.1f}) | serving CPU ms/token | mean K | outputs equal AR's |")
    print("|---|---|---|---|---|---|")
    for name in [f"ar1_b{B}"] + [f"d_{d}_b{B}" for d in drafters] + [f"ar2_b{B}"]:
        got = ids(name)
        same = sum(got.get(k) == v for k, v in ref.items())
        print(f"| {name} | {tps(name):.1f} | {tps(name) / ar:.3f}x | {field(name, r'serving CPU ([0-9.]+) ms/token'):.2f} | "
              f"{field(name, r'mean K ([0-9.]+)'):.2f} | {same}/{len(ref)} |")
PY
if [ -n "${LLAMACPP_PYTHON:-}" ]; then
  echo
  "$py" benchmarks/llamacpp_batch.py --input_jsonl "$out/prompts.jsonl" --llamacpp_python "$LLAMACPP_PYTHON" \
      --batch_sizes "$sizes" --prefill mixed,alone --max_new_tokens "$max_new" --ar_jsonl "$out/ar1_b${sizes%%,*}.jsonl" \
      --json_out "$out/llamacpp_batch.json" 2> "$out/llamacpp_batch.log"
  echo "llama.cpp: rc $? (log $out/llamacpp_batch.log)"
fi
