#!/bin/bash
# Cold and warm start of the README batch command (issue 31, Must-show 4): 20 Spec-Bench first
# turns (every 24th question, from $SPECJAX_SHARED_DIR, default ../shared), --drafter
# prompt_lookup, 64 new tokens, from an empty executable cache ($SPECJAX_CACHE_DIR) and then
# warm; the job's own summary lines, its whole-process wall time, and whether the cold and warm
# outputs are identical (greedy). Then the main job's first answer per drafter
# (benchmarks/first_answer.sh, RUNS runs each: run 1 cold, the rest warm).
#   bash benchmarks/cold_compile.sh [drafters for first_answer.sh]      (RUNS=3 by default)
cd "$(dirname "$0")/.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate; }
OUT=${TMPDIR:-/tmp}/specjax_cold_compile; mkdir -p $OUT
SHARED=${SPECJAX_SHARED_DIR:-../shared}
python - "$SHARED/data/spec_bench/question.jsonl" > $OUT/prompts.jsonl <<'PY' || exit 1
import json, sys
qs = [json.loads(line) for line in open(sys.argv[1])]
for q in qs[::24]:
    print(json.dumps({"id": str(q["question_id"]), "prompt": q["turns"][0]}))
PY
export SPECJAX_CACHE_DIR=$OUT/cache_batch; rm -rf $SPECJAX_CACHE_DIR
for run in cold warm; do
  rm -f $OUT/out_$run.jsonl
  s=$(date +%s.%N)
  python launch/batch.py --chat --input_jsonl $OUT/prompts.jsonl --output_jsonl $OUT/out_$run.jsonl \
      --drafter prompt_lookup --max_new_tokens 64 > /dev/null 2> $OUT/err_$run
  e=$(date +%s.%N)
  echo "batch job, $run cache: $(echo "$e - $s" | bc) s whole process; $(grep -h 'tokens in' $OUT/err_$run)"
  grep -h '^compilation:' $OUT/err_$run | sed 's/^/    /'
done
python - $OUT/out_cold.jsonl $OUT/out_warm.jsonl <<'PY'
import json, sys
a, b = ({d["id"]: d.get("output_ids", d.get("error")) for d in map(json.loads, open(p))} for p in sys.argv[1:])
print("batch job outputs, cold vs warm:", "identical" if a == b else "DIFFERENT", f"({len(a)} records)")
PY
RUNS=${RUNS:-3} bash benchmarks/first_answer.sh "$@"
