#!/usr/bin/env bash
# The test command: creates .venv with pinned dependencies if needed, then lint, type-check
# and the default test run (Hypothesis profile "ci"; GPU and slow tests excluded).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k cache` or
# `bash scripts/test.sh --hypothesis-profile=thorough`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(bash scripts/bootstrap.sh | tail -n 1)"
bin="$(dirname "$py")"
echo "== ruff check"; "$bin/ruff" check src backends tests conformance benches scripts docs/examples
echo "== ruff format --check"; "$bin/ruff" format --check src backends tests conformance benches scripts docs/examples
echo "== mypy (src/kvpage and the CPU plugins: pyproject.toml [tool.mypy] files)"; "$bin/mypy"
echo "== pytest (started $(date +%H:%M:%S); each line of dots ends with [tests done/total])"
export TRITON_INTERPRET=1 NUMBA_ENABLE_CUDASIM=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
start=$SECONDS
rc=0
"$py" -m pytest -m "not slow and not gpu" -n 2 --dist loadgroup \
  -o console_output_style=count --durations=10 "$@" || rc=$?
echo "== pytest took $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s (exit status $rc)"
exit "$rc"
