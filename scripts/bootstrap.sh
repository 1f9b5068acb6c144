#!/usr/bin/env bash
# Create .venv (if missing or stale) with the pinned dependencies (requirements/lock.txt)
# and kvpage installed editable. Prints the venv's python path on the last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVPAGE_VENV:-$root/.venv}"
deps_want="$(sha256sum < "$root/requirements/lock.txt" | cut -d' ' -f1)"
proj_want="$(sha256sum < "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.kvpage-deps" 2>/dev/null)" != "$deps_want" ]; then
  echo "kvpage: installing pinned dependencies into $venv (requirements/lock.txt) ..." >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements/lock.txt" >&2
  echo "$deps_want" > "$venv/.kvpage-deps"
fi
if [ "$(cat "$venv/.kvpage-proj" 2>/dev/null)" != "$proj_want" ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$root" >&2
  echo "$proj_want" > "$venv/.kvpage-proj"
fi
echo "$venv/bin/python"
