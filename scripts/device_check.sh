#!/usr/bin/env bash
# The one command to run whenever a GPU or TPU is at hand (see benchmarks/device_check.py):
# kernels against their references, kernel vs XLA timings, the engine on a 7B-shaped bf16 model
# with two drafters, SmartSpec's perf model profiled there; JSON and report.md under $1.
#   bash scripts/device_check.sh [OUT_DIR] [extra device_check.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/specjax_device_check}"
shift || true
python -m pip install --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
python benchmarks/device_check.py --out "$out" "$@"
echo "report: $out/report.md (paste it into BENCHMARKS.md under a dated 'Device check' section)"
