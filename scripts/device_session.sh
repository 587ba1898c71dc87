#!/usr/bin/env bash
# One device session's checks in priority order, each part time-boxed so the whole stays inside a
# lent machine's 10-minute call (a timed-out part is reported; the later ones still run):
# correctness first (kernels vs reference incl. split-KV and query tiles; exact-numerics token
# identity of the engine with drafters and the eagle head on an 8-layer 7B shape), then costs
# (the EAGLE head on the full 7B shape; optionally the K = 0 step per K and kernel vs XLA timings).
#   bash scripts/device_session.sh OUT_DIR [SCALE]   (SCALE multiplies every time box; "tiny": a CPU smoke run)
# The whole takes under 10 minutes: one device call with timeout_s 600.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/specjax_device_session}"; scale="${2:-1}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
tiny=""; [ "$scale" = tiny ] && { tiny="--tiny"; scale=1; }
part() {  # part NAME SECONDS ARGS...
  local name=$1 secs=$(( $2 * scale )); shift 2
  local t0=$SECONDS
  timeout -k 5 "$secs" python3 benchmarks/device_check.py $tiny --out "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc $? in $(( SECONDS - t0 )) s (box $secs s)"
}
# Boxes sized from the 2026-11-26 H100/H200 sessions (BENCHMARKS.md): the quick kernel grid took 73 s;
# the exact-numerics engine spent 200 s on AR + prompt lookup without reaching the eagle head, so it
# now runs the head alone and first; each engine run's cold warm-up takes 100-190 s. The per-K step
# costs (STEPS=1) and kernel timings (TIMING=1) ran on both cards with the current code and are left
# out by default; the third part is the EAGLE head on the full 7B shape in bf16 through the kernel.
part exact8 240 --sections engine --engine_parts e2e --num_layers 8 --dtype float32 --matmul_precision highest \
    --max_new_tokens 32 --engine_runs xla:eagle
part kernels 85 --sections env,kernels --kernel_grid quick --kernel_variants auto,split5_q16
part eagle7b 220 --sections engine --engine_parts e2e --max_new_tokens 32 --engine_runs pallas:eagle
if [ "${STEPS:-0}" = 1 ]; then
  part steps7b 240 --sections engine --reps 10 --engine_parts programs,step_cost
fi
if [ "${TIMING:-0}" = 1 ]; then
  part timing 170 --sections kernel_timing --timing_variants no_split --reps 10 --timing_contexts 4096,16384 \
      --timing_tree_sizes 1,8,64
fi
