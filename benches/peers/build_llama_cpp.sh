#!/usr/bin/env bash
# Build llama.cpp's llama-server for benches/bench_peers.py (engine llamacpp) from the
# llama.cpp that the llama-cpp-python sdist vendors (vendor/llama.cpp), fetched from the
# package index with pip (no git clone; works from a pip cache or index mirror).
#
# Usage: bash benches/peers/build_llama_cpp.sh [WORK_DIR]   (default ~/.cache/kvpage-peers)
#   then: export KVPAGE_LLAMA_SERVER=WORK_DIR/build/llama.cpp/bin/llama-server
#
# Everything (sdist, sources, build tree) goes under WORK_DIR, outside the repository.
# Configure from a real directory, not a path through a symlink: the vendored
# vendor/llama.cpp/.git is a *file* ("gitdir: ../../.git/modules/vendor/llama.cpp", a
# path relative to where it lies) that llama.cpp's common/CMakeLists.txt reads, and
# issue 28 reports that CMake configured through a symlink breaks on it; the script
# resolves WORK_DIR with `realpath` first (see benches/peers/README.md for what was and
# was not reproduced here). Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36; another
# version must come with its LLAMA_CPP_PYTHON_SHA256), JOBS (default 2), PYTHON (default
# the repo's .venv python, else python3).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
WORK="${1:-$HOME/.cache/kvpage-peers}"
mkdir -p "$WORK"
WORK="$(realpath "$WORK")"  # no symlink in the path CMake sees (see above)
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# sha256 of llama_cpp_python-0.3.36.tar.gz as downloaded from PyPI on 2026-12-03
SHA256_0336="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
if [ "$VERSION" = "0.3.36" ]; then
  SHA256="${LLAMA_CPP_PYTHON_SHA256:-$SHA256_0336}"
else
  SHA256="${LLAMA_CPP_PYTHON_SHA256:?another version needs LLAMA_CPP_PYTHON_SHA256}"
fi
JOBS="${JOBS:-2}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
fi
echo "$SHA256  $SDIST" | sha256sum --check -

SRC="$WORK/llama_cpp_python-$VERSION"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
  tar -xzf "$SDIST" -C "$WORK"
fi
LLAMA="$SRC/vendor/llama.cpp"
BUILD="$WORK/build/llama.cpp"
start=$(date +%s)
cmake -S "$LLAMA" -B "$BUILD" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" --target llama-server -j "$JOBS"
end=$(date +%s)

SERVER="$BUILD/bin/llama-server"
test -x "$SERVER"
# the commit llama-cpp-python vendors (its .git/modules keeps the submodule's HEAD)
COMMIT="$(git -C "$LLAMA" rev-parse HEAD 2>/dev/null || cat "$SRC/.git/modules/vendor/llama.cpp/HEAD")"
echo "llama-cpp-python $VERSION vendors llama.cpp $COMMIT"
"$SERVER" --version 2>&1 | grep -E '^(version|built with)' || true
echo "build: $((end - start)) s (configure + llama-server, -j $JOBS)"
echo "gguf-py: $LLAMA/gguf-py"
echo "llama-server: $SERVER"
