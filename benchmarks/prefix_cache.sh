#!/usr/bin/env bash
# Prefix caching end to end, run as the README tells a user to run a batch job (default flags:
# lazy compilation, the store on): a job whose records share a long prefix
# (benchmarks/make_workload.py --shared_prefix) against the same records with nothing shared
# (--distinct_first_line: the same tokens to serve, nothing to reuse), and the shared job with the
# store off (--prefix_cache_mb 0), in turn, ROUNDS times (default 1) for each drafter (none = AR).
# Prints one Markdown row per run from the job summaries (serving seconds and tok/s, compilation
# excluded; the store's hits and prompt tokens reused) and checks that every shared run's outputs
# equal the first shared run's (greedy: they must, with or without the store or a drafter).
# Each drafter starts with an empty executable cache of its own, filled by a first, untimed run of
# the shared job, so every timed arm runs as a user's second job does (lazy mode, loading what it
# reaches): a cold first arm would pay the compilations the later arms load.
#   bash benchmarks/prefix_cache.sh OUT_DIR SHARED.jsonl DISTINCT.jsonl [DRAFTERS] [MAX_NEW] [extra batch.py flags]
#   e.g. python benchmarks/make_workload.py --out /tmp/sp.jsonl --shared_prefix 16 --prefix_chars 3400
#        python benchmarks/make_workload.py --out /tmp/dp.jsonl --shared_prefix 16 --prefix_chars 3400 --distinct_first_line
#        bash benchmarks/prefix_cache.sh /tmp/pc /tmp/sp.jsonl /tmp/dp.jsonl none,suffix,eagle 32
set -uo pipefail
cd "$(dirname "$0")/.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate; }
out="$1"; shared="$2"; distinct="$3"; drafters="${4:-none}"; max_new="${5:-32}"; shift $(( $# < 5 ? $# : 5 ))
py="${PYTHON:-python}"
mkdir -p "$out"
echo "| run | drafter | records | prefix cache | serving s | serving tok/s | job s | prompt tokens reused | outputs equal the first shared run's |"
echo "|---|---|---|---|---|---|---|---|---|"
first=""
for r in $(seq 1 "${ROUNDS:-1}"); do
  for d in ${drafters//,/ }; do
    if [ "$r" = 1 ]; then
      rm -rf "$out/cache_$d" "$out/warmup_$d.jsonl"
      SPECJAX_CACHE_DIR="$out/cache_$d" "$py" launch/batch.py --chat --input_jsonl "$shared" \
          --output_jsonl "$out/warmup_$d.jsonl" --drafter "$d" --max_new_tokens "$max_new" "$@" > "$out/warmup_$d.log" 2>&1
    fi
    for arm in shared distinct shared_off; do
      job="$shared"; mb=""; [ "$arm" = distinct ] && job="$distinct"; [ "$arm" = shared_off ] && mb="--prefix_cache_mb 0"
      name="r${r}_${d}_${arm}"
      rm -f "$out/$name.jsonl"
      SPECJAX_CACHE_DIR="$out/cache_$d" "$py" launch/batch.py --chat --input_jsonl "$job" --output_jsonl "$out/$name.jsonl" \
          --drafter "$d" --max_new_tokens "$max_new" $mb "$@" > "$out/$name.log" 2>&1
      rc=$?
      [ -z "$first" ] && [ "$arm" = shared ] && first="$out/$name.jsonl"
      "$py" - "$out/$name.log" "$first" "$out/$name.jsonl" "$r" "$d" "$arm" "$rc" <<'PY'
import json, re, sys
log, first, mine, r, d, arm, rc = sys.argv[1:]
text = open(log).read()
m = re.search(r"(\d+) tokens in ([\d.]+) s serving = ([\d.]+) tok/s .*?; ([\d.]+) s for the job", text)
p = re.search(r"prefix cache: (\d+)/(\d+) prompts hit .*?, (\d+) of (\d+) prompt tokens reused", text)
def ids(path):
    with open(path) as f:
        return {o["id"]: o.get("output_ids") for o in map(json.loads, f)}
same = "-"
if arm != "distinct":
    a, b = ids(first), ids(mine)
    same = f"{sum(a.get(k) == v for k, v in b.items())}/{len(a)}"
reused = f"{p.group(3)} of {p.group(4)} ({p.group(1)}/{p.group(2)} hit)" if p else "-"
records = "nothing shared" if arm == "distinct" else "shared prefix"
store = "off" if arm == "shared_off" else "on"
if m and rc == "0":
    print(f"| {r} | {d} | {records} | {store} | {m.group(2)} | {m.group(3)} | {m.group(4)} | {reused} | {same} |")
else:
    print(f"| {r} | {d} | {records} | {store} | failed (rc {rc}, see {log}) | | | | |")
PY
    done
  done
done
