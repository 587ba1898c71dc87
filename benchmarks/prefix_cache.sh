#!/usr/bin/env bash
# Prefix caching end to end: a batch job whose records share a long prefix
# (benchmarks/make_workload.py --shared_prefix), served by launch/batch.py without the prefix
# store (--prefix_cache_mb 0) and with it (the default budget), alternated ROUNDS times (default
# 2) for each drafter (none = AR; MBS=1024: only with it), everything compiled before serving (--compile ahead). Prints
# one Markdown row per run from the job summaries (serving seconds and tok/s, compilation
# excluded; the store's hits and prompt tokens reused) and checks that every run's outputs equal
# the first run's (greedy: they must, with or without the store, with or without a drafter).
#   bash benchmarks/prefix_cache.sh OUT_DIR JOB.jsonl [DRAFTERS] [MAX_NEW] [extra batch.py flags]
#   e.g. python benchmarks/make_workload.py --out /tmp/sp.jsonl --shared_prefix 64
#        bash benchmarks/prefix_cache.sh /tmp/pc /tmp/sp.jsonl none,suffix 32 --slots 2048
set -uo pipefail
cd "$(dirname "$0")/.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate; }
out="$1"; job="$2"; drafters="${3:-none}"; max_new="${4:-32}"; shift $(( $# < 4 ? $# : 4 ))
py="${PYTHON:-python}"
mkdir -p "$out"
echo "| run | drafter | prefix cache | serving s | serving tok/s | job s | prompt tokens reused | outputs equal the first run's |"
echo "|---|---|---|---|---|---|---|---|"
first=""
for r in $(seq 1 "${ROUNDS:-2}"); do
  for d in ${drafters//,/ }; do
    for mb in ${MBS:-0 1024}; do
      name="r${r}_${d}_mb${mb}"
      rm -f "$out/$name.jsonl"
      "$py" launch/batch.py --chat --input_jsonl "$job" --output_jsonl "$out/$name.jsonl" --drafter "$d" \
          --max_new_tokens "$max_new" --prefix_cache_mb "$mb" --compile ahead "$@" > "$out/$name.log" 2>&1
      rc=$?
      [ -z "$first" ] && first="$out/$name.jsonl"
      "$py" - "$out/$name.log" "$first" "$out/$name.jsonl" "$r" "$d" "$mb" "$rc" <<'PY'
import json, re, sys
log, first, mine, r, d, mb, rc = sys.argv[1:]
text = open(log).read()
m = re.search(r"(\d+) tokens in ([\d.]+) s serving = ([\d.]+) tok/s .*?; ([\d.]+) s for the job", text)
p = re.search(r"prefix cache: (\d+)/(\d+) prompts hit .*?, (\d+) of (\d+) prompt tokens reused", text)
def ids(path):
    with open(path) as f:
        return {o["id"]: o.get("output_ids") for o in map(json.loads, f)}
a, b = ids(first), ids(mine)
same = f"{sum(a.get(k) == v for k, v in b.items())}/{len(a)}"
reused = f"{p.group(3)} of {p.group(4)} ({p.group(1)}/{p.group(2)} hit)" if p else "-"
if m and rc == "0":
    print(f"| {r} | {d} | {'on' if mb != '0' else 'off'} | {m.group(2)} | {m.group(3)} | {m.group(4)} | {reused} | {same} |")
else:
    print(f"| {r} | {d} | {'on' if mb != '0' else 'off'} | failed (rc {rc}, see {log}) | | | | |")
PY
    done
  done
done
