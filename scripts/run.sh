#!/usr/bin/env bash
# The main job: creates .venv if needed, then replays the bundled trace sample through the
# engine on the bundled stories260K model and prints the metrics table (JSON into out/).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(bash scripts/bootstrap.sh core | tail -n 1)"  # the main job needs no server, Ray or GPU packages
exec "$py" -m kvpage.cli replay "$@"
