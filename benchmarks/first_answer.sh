#!/bin/bash
# whole-process time to the README main job's answer, cold and warm compilation cache
cd "$(dirname "$0")/.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate; }
OUT=${TMPDIR:-/tmp}/specjax_first_answer; mkdir -p $OUT
for d in none suffix; do
  export SPECJAX_CACHE_DIR=$OUT/cache_$d; rm -rf $SPECJAX_CACHE_DIR
  for i in 1 2 3 4 5 6; do
    s=$(date +%s.%N)
    python launch/generate.py --chat --prompt "What is the capital of France?" --drafter $d > $OUT/out 2>$OUT/err
    e=$(date +%s.%N)
    echo "$d run $i: $(echo "$e - $s" | bc) s; $(head -1 $OUT/out); $(grep -o 'compilation.*' $OUT/err | head -1)"
  done
done
