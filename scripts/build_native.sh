#!/usr/bin/env bash
# Build native llama.cpp speculative binaries from the vendored tree inside the llama-cpp-python
# sdist (the same llama.cpp commit specli runs on), for side-by-side benchmarks and the
# acceptance-parity test. Binaries land in the user cache, never in the repository.
#   usage: scripts/build_native.sh [VERSION]     (default: the installed llama-cpp-python)
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
cmake -S "$src/vendor/llama.cpp" -B "$out" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
  ${CMAKE_ARGS:-} >"$cache/build-$version.log" 2>&1
cmake --build "$out" -j"${JOBS:-2}" --target llama-speculative-simple llama-speculative llama-simple llama-lookup llama-lookup-create \
  >>"$cache/build-$version.log" 2>&1 || { echo "build failed: see $cache/build-$version.log" >&2; exit 1; }
echo "$out/bin"
