#!/usr/bin/env bash
# Build native llama.cpp speculative binaries from the vendored tree inside the llama-cpp-python
# sdist (the same llama.cpp commit specli runs on), for side-by-side benchmarks and the
# acceptance-parity test. Binaries land in the user cache, never in the repository.
#   usage: scripts/build_native.sh [VERSION]     (default: the installed llama-cpp-python)
#   SPECLI_NATIVE_SERVER=1 also builds llama-server (for scripts/bench_serve.py)
set -euo pipefail
py=${PYTHON:-python3}
version=${1:-$("$py" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')}
cache=${SPECLI_NATIVE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specli/native}
src="$cache/llama_cpp_python-$version"
out="$cache/llama.cpp-$version"
mkdir -p "$cache"
if [ ! -d "$src" ]; then
  "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$cache"
  tar -xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
fi
# CMAKE_ARGS as pip passes it to llama-cpp-python (quoted words allowed), e.g. a CUDA build:
#   CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" scripts/build_native.sh
mapfile -t extra < <("$py" -c 'import os, shlex, sys
sys.stdout.write("".join(a + "\n" for a in shlex.split(os.environ.get("CMAKE_ARGS", ""))))')
cmake -S "$src/vendor/llama.cpp" -B "$out" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER="$([ "${SPECLI_NATIVE_SERVER:-0}" = 1 ] && echo ON || echo OFF)" \
  "${extra[@]}" >"$cache/build-$version.log" 2>&1
targets="llama-speculative-simple llama-speculative llama-simple llama-lookup llama-lookup-create"
[ "${SPECLI_NATIVE_SERVER:-0}" = 1 ] && targets="$targets llama-server"
# shellcheck disable=SC2086
cmake --build "$out" -j"${JOBS:-2}" --target $targets \
  >>"$cache/build-$version.log" 2>&1 || { echo "build failed: see $cache/build-$version.log" >&2; exit 1; }
echo "$out/bin"
