#!/usr/bin/env bash
# A batch job of 200 GSM8K questions through launch/batch.py: specjax AR, then every drafter named
# under SmartSpec, then AR again (the two AR runs bracket the machine's drift; ratios are against
# their mean). Prints one Markdown row per run from the job summary (serving tok/s, compile
# excluded), and whether each drafter's outputs equal AR's (greedy: they must).
#   bash benchmarks/batch_drafters.sh OUT_DIR [DRAFTERS] [BATCH_BUCKETS] [MAX_NEW] [extra batch.py flags]
#   e.g. bash benchmarks/batch_drafters.sh /tmp/bd prompt_lookup,suffix,hybrid,layer_skip 1,2,4,8 96
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/specjax_batch_drafters}"; drafters="${2:-prompt_lookup,suffix,hybrid,layer_skip}"
buckets="${3:-1,2,4,8}"; max_new="${4:-96}"; shift $(( $# < 4 ? $# : 4 ))
data="${SPECJAX_SHARED_DIR:-../shared}/data/gsm8k/test_shared_200.jsonl"
mkdir -p "$out"
python - "$data" "$out/prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as g:
    for i, line in enumerate(f):
        g.write(json.dumps({"id": f"gsm{i}", "prompt": json.loads(line)["question"]}) + "\n")
PY
run() {  # run NAME DRAFTER POLICY [extra flags]
  local name=$1 drafter=$2 policy=$3; shift 3
  python launch/batch.py --chat --input_jsonl "$out/prompts.jsonl" --output_jsonl "$out/$name.jsonl" \
      --drafter "$drafter" --policy "$policy" --batch_buckets "$buckets" --max_new_tokens "$max_new" "$@" \
      > "$out/$name.log" 2>&1
  echo "$name: rc $? $(grep -h 'tok/s' "$out/$name.log" | head -1)"
}
rm -f "$out"/*.jsonl.* "$out"/ar*.jsonl "$out"/d_*.jsonl
run ar1 none none "${@:5}"
for d in ${drafters//,/ }; do run "d_$d" "$d" smartspec "${@:5}"; done
run ar2 none none "${@:5}"
python - "$out" "$drafters" <<'PY'
import json, re, sys
out, drafters = sys.argv[1], sys.argv[2].split(",")
def tps(name):
    m = re.search(r"= ([0-9.]+) tok/s", open(f"{out}/{name}.log").read())
    return float(m.group(1)) if m else float("nan")
def ids(name):
    return {r["id"]: r.get("output_ids") for r in map(json.loads, open(f"{out}/{name}.jsonl"))}
ar = (tps("ar1") + tps("ar2")) / 2
ref = ids("ar1")
print(f"| run | serving tok/s | vs AR (mean of the two AR runs, {ar:.1f}) | outputs equal AR's |")
print("|---|---|---|---|")
for name in ["ar1"] + [f"d_{d}" for d in drafters] + ["ar2"]:
    got = ids(name)
    same = sum(got.get(k) == v for k, v in ref.items())
    print(f"| {name} | {tps(name):.1f} | {tps(name) / ar:.3f}x | {same}/{len(ref)} |")
PY
