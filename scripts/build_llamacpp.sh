#!/usr/bin/env bash
# Build llama.cpp's speculative examples and server from the source vendored in the PyPI sdist of llama-cpp-python
# (no network but the package index; cmake; tens of minutes on 2 cores), once per machine, for audit.execute's
# llama.cpp engines and benchmarks/engines_speed.py. Not part of the README set-up: tests that need the binaries say
# why they skip when they are absent.
#   LLAMACPP_PYTHON_VERSION=0.3.36   the sdist (its vendor/llama.cpp is the source)
#   JOBS=2                           parallel compile jobs
# Output: $SPECRESEARCH_CACHE/llamacpp/<version>/bin/{llama-speculative,llama-speculative-simple,llama-server,...}
# and .../gguf-py (llama.cpp's GGUF writer, for the drafts audit.execute writes).
set -euo pipefail
VERSION="${LLAMACPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECRESEARCH_CACHE:-$HOME/.cache/specresearch}"
HOME_DIR="$CACHE/llamacpp/$VERSION"
BIN="$HOME_DIR/bin"
TARGETS=(llama-speculative llama-speculative-simple llama-server llama-cli llama-simple llama-bench)
if [ -x "$BIN/llama-speculative" ] && [ -x "$BIN/llama-server" ]; then
  echo "llama.cpp (llama-cpp-python $VERSION) is built in $BIN"; exit 0
fi
mkdir -p "$HOME_DIR"
SDIST="$HOME_DIR/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "[llama.cpp] downloading the sdist of llama-cpp-python $VERSION" >&2
  python3 -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$VERSION" \
    -d "$HOME_DIR" 2>/dev/null || python3 -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$HOME_DIR"
fi
SRC="$HOME_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || tar xzf "$SDIST" -C "$HOME_DIR"
echo "[llama.cpp] configuring $SRC" >&2
cmake -S "$SRC" -B "$HOME_DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF > "$HOME_DIR/configure.log" 2>&1
echo "[llama.cpp] building ${TARGETS[*]} with ${JOBS:-2} jobs (tens of minutes; log: $HOME_DIR/build.log)" >&2
cmake --build "$HOME_DIR/build" --config Release -j "${JOBS:-2}" --target "${TARGETS[@]}" > "$HOME_DIR/build.log" 2>&1
mkdir -p "$BIN"
for target in "${TARGETS[@]}"; do cp "$HOME_DIR/build/bin/$target" "$BIN/"; done
ln -sfn "$SRC/gguf-py" "$HOME_DIR/gguf-py"
echo "llama.cpp (llama-cpp-python $VERSION) is built in $BIN"
