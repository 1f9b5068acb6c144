#!/usr/bin/env bash
# Create .venv (if missing or stale) with pinned dependencies and kvpage installed
# editable. Prints the venv's python path on the last line.
#   bash scripts/bootstrap.sh        # everything: requirements/lock.txt (tests, CI)
#   bash scripts/bootstrap.sh core   # the main job only: requirements/core.txt (a subset of
#                                    # lock.txt with the same pins: no Ray, triton, cupy,
#                                    # server or test tools); a full venv satisfies it too
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVPAGE_VENV:-$root/.venv}"
mode="${1:-all}"
case "$mode" in
  all) lock="$root/requirements/lock.txt"; stamp="$venv/.kvpage-deps" ;;
  core) lock="$root/requirements/core.txt"; stamp="$venv/.kvpage-core" ;;
  *) echo "bootstrap.sh: expected 'all' or 'core', got '$mode'" >&2; exit 2 ;;
esac
full_want="$(sha256sum < "$root/requirements/lock.txt" | cut -d' ' -f1)"
deps_want="$(sha256sum < "$lock" | cut -d' ' -f1)"
proj_want="$(sha256sum < "$root/pyproject.toml" | cut -d' ' -f1)"
have_full="$(cat "$venv/.kvpage-deps" 2>/dev/null || true)"
if [ ! -x "$venv/bin/python" ] || { [ "$(cat "$stamp" 2>/dev/null)" != "$deps_want" ] && [ "$have_full" != "$full_want" ]; }; then
  what="$( [ "$mode" = core ] && echo "the main job's" || echo "all")"
  echo "kvpage: installing $what pinned dependencies into $venv (${lock#"$root"/}) ..." >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$lock" >&2
  echo "$deps_want" > "$stamp"
fi
if [ "$(cat "$venv/.kvpage-proj" 2>/dev/null)" != "$proj_want" ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$root" >&2
  echo "$proj_want" > "$venv/.kvpage-proj"
fi
echo "$venv/bin/python"
