#!/usr/bin/env bash
# One-shot GPU check of kvpage's attention backends (issue 5), in under 8 minutes on an H200:
#   1. prints the device and the software versions;
#   2. measures the device-to-device copy bandwidth;
#   3. runs the backend comparison (benches/gpu/backend_compare.py), one process per
#      backend with BENCH_S_PER_BACKEND seconds each, merged into one report;
#   4. runs the conformance suite on CUDA for torch, triton, cupy and numba in the time
#      left (short profile), then the plugin unit tests (cupy, numba, triton) on CUDA.
# Results land in OUTDIR: run_all.log, backend_compare.{json,md} (+ compare_<backend>/),
# conformance_<backend>.xml, plugin_tests.xml, summary.txt (exit status of every step).
#
# Usage: bash benches/gpu/run_all.sh OUTDIR [--dry-run]
#   --dry-run: everything on CPU with tiny shapes (torch backend; numba and triton under
#   their CPU simulators), to check the script itself without a GPU.
# Environment: PYTHON (default .venv/bin/python, else python3), TOTAL_S (default 450),
#   BENCH_S_PER_BACKEND (default 40), CONF_TIMEOUT_S (per backend, default 60),
#   CONF_BUDGET_SCALE (Hypothesis example scale, default 0.3).
set -uo pipefail
out="${1:?usage: run_all.sh OUTDIR [--dry-run]}"
dry=0
if [[ "${2:-}" == "--dry-run" ]]; then dry=1; fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [[ -z "$py" && -x .venv/bin/python ]]; then py=.venv/bin/python; fi
py="${py:-python3}"
total="${TOTAL_S:-450}"
conf_timeout="${CONF_TIMEOUT_S:-60}"
scale="${CONF_BUDGET_SCALE:-0.3}"
bench_s="${BENCH_S_PER_BACKEND:-40}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/run_all.log"
: > "$log"
: > "$out/summary.txt"
start=$(date +%s)
say() { echo "[run_all $(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
step() {  # step NAME CMD...: run, log, record the exit status
  local name="$1"; shift
  say "== $name"
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc" >> "$out/summary.txt"
  say "$name: exit $rc"
}

if [[ $dry == 1 ]]; then
  export NUMBA_ENABLE_CUDASIM=1 TRITON_INTERPRET=1
  device=cpu
  backends=(torch)
  compare_backends=(torch numba)
  conf_filter=(-k "write_kv or decode_matches")
else
  unset NUMBA_ENABLE_CUDASIM TRITON_INTERPRET
  device=cuda
  backends=(torch triton cupy numba)
  compare_backends=("${backends[@]}")
  conf_filter=()
fi

say "== device"
if [[ $dry == 0 ]] && command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv 2>&1 | tee -a "$log"
fi
step "versions" "$py" - "$device" <<'PY'
import importlib, sys
import torch
dev = sys.argv[1]
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
if dev == "cuda":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch")
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"cc {p.major}.{p.minor}", p.multi_processor_count, "SMs",
          round(p.total_memory / 2**30, 1), "GiB")
for m in ("triton", "cupy", "numba", "kvpage"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "(no version)"))
    except Exception as e:
        print(m, "NOT importable:", type(e).__name__, e)
PY

step "copy bandwidth" "$py" - "$device" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, str(Path("benches/gpu").resolve()))
import torch
from bench_cases import copy_bandwidth
dev = torch.device(sys.argv[1])
r = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (8 << 20))
print(f"device-to-device copy: {r['gbps']:.1f} GB/s (read+write), {r['bytes'] / 2**20:.0f} MiB")
PY

# the comparison first (its figures are the point of the run), one process per backend so
# that a crash or CUDA error of one backend cannot spoil the others; then merged
parts=()
for b in "${compare_backends[@]}"; do
  if [[ $dry == 1 ]]; then
    step "compare $b" "$py" benches/gpu/backend_compare.py --out "$out/compare_$b" --dry-run --backends "$b"
  else
    step "compare $b" timeout -s INT -k 15 $(( bench_s + 60 )) "$py" benches/gpu/backend_compare.py \
      --out "$out/compare_$b" --backends "$b" --budget-s "$bench_s"
  fi
  parts+=("$out/compare_$b")
done
step "merge comparison" "$py" benches/gpu/backend_compare.py --out "$out" --merge "${parts[@]}"

# conformance on the device, each backend in the time left (SIGINT first, so pytest still
# writes its report)
n=${#backends[@]}
for b in "${backends[@]}"; do
  left=$(( total - ($(date +%s) - start) - 30 ))
  t=$(( left / n )); n=$(( n - 1 ))
  if (( t > conf_timeout )); then t=$conf_timeout; fi
  if (( t < 20 )); then t=20; fi
  step "conformance $b" timeout -s INT -k 10 "$t" "$py" -m pytest conformance --device "$device" \
    --backend "$b" -m "not slow" -q -x --budget-scale "$scale" --timeout 120 \
    --junitxml "$out/conformance_$b.xml" "${conf_filter[@]}"
done
if [[ $dry == 0 ]]; then
  left=$(( total - ($(date +%s) - start) ))
  if (( left > 30 )); then
    step "plugin unit tests on cuda" timeout -s INT -k 10 $(( left - 10 )) "$py" -m pytest \
      tests/backends/test_cupy_backend.py tests/backends/test_numba_backend.py \
      tests/backends/test_triton_backend.py -q --junitxml "$out/plugin_tests.xml" -k \
      "(test_triton_backend and not compile) or (not test_triton_backend and not nvcc and not ptx and not compile_test)"
  else
    say "plugin unit tests on cuda: skipped (time budget spent)"
    echo "plugin unit tests on cuda: skipped (time)" >> "$out/summary.txt"
  fi
fi

say "done in $(( $(date +%s) - start ))s; summary:"
cat "$out/summary.txt" | tee -a "$log"
