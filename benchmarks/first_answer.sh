#!/bin/bash
# Time to the README main job's answer (until its first line is printed) and of the whole process
# (which then waits for a background compilation in progress, so that the next run finds it), from
# an empty executable cache (run 1) and then warm (runs 2-$RUNS, default 6), per drafter. Drafters:
# the arguments (default: every one; draft_model drafts with the target itself, SmolLM2 having no
# smaller same-tokenizer sibling in the package). FLAGS: more flags for every run (an A/B of a setting).
cd "$(dirname "$0")/.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate; }
unset PYTHONDONTWRITEBYTECODE  # (a user's Python keeps its bytecode; some sandboxes turn that off)
OUT=${TMPDIR:-/tmp}/specjax_first_answer; mkdir -p $OUT
DRAFTERS=${*:-none prompt_lookup suffix suffix_path hybrid layer_skip draft_model eagle}
for d in $DRAFTERS; do
  extra=(); [ $d = draft_model ] && extra=(--draft_model smollm2-135m)
  export SPECJAX_CACHE_DIR=$OUT/cache_$d; rm -rf $SPECJAX_CACHE_DIR
  for i in $(seq 1 ${RUNS:-6}); do
    s=$(date +%s.%N)
    python launch/generate.py --chat --prompt "What is the capital of France?" --drafter $d "${extra[@]}" $FLAGS 2>$OUT/err \
      | { IFS= read -r first; date +%s.%N > $OUT/answered; echo "$first"; cat; } > $OUT/out
    e=$(date +%s.%N)
    echo "$d run $i: answer $(echo "$(cat $OUT/answered) - $s" | bc) s, process $(echo "$e - $s" | bc) s; $(head -1 $OUT/out); $(grep -o 'compilation.*' $OUT/err | head -1)"
  done
done
