#!/usr/bin/env bash
# 从 llama-cpp-python 0.3.36 的源码包里内嵌的 llama.cpp 编译它自己的 HTTP 服务器 llama-server（第 11 章的对照组），
# 和它的量化器 llama-quantize（把 F32 GGUF 量化成 Q8_0，第 14 章的 llama.cpp Q8_0 一行）。
# 不在 make test 里；step11_serving/bench_serving.py 与 bench/decode_speed.py 用它们。2 核上约 5 分钟，只需要做一次。
#
#   bash bench/llama_server/build.sh            # 产物：$CACHE/llama-server/build/bin/llama-server 与 llama-quantize
#                                               # （llama-server 的路径最后一行打印）
#
# $CACHE 与模型缓存相同：$LLM_FROM_SCRATCH_CACHE，否则 ${XDG_CACHE_HOME:-~/.cache}/llm-from-scratch。
# 离线可用：pip 只取源码包（sdist），cmake 关掉会联网下载网页 UI 的选项；不需要 OpenSSL（只听 127.0.0.1 的 HTTP）。
set -euo pipefail
VERSION=0.3.36
CACHE="${LLM_FROM_SCRATCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-from-scratch}"
DIR="$CACHE/llama-server"
BIN="$DIR/build/bin/llama-server"
QUANTIZE="$DIR/build/bin/llama-quantize"
PYTHON="${PYTHON:-$(dirname "$0")/../../.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
JOBS="${JOBS:-$(nproc)}"

if [ -x "$BIN" ] && [ -x "$QUANTIZE" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$DIR"
SRC="$DIR/llama_cpp_python-$VERSION"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    "$PYTHON" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DIR" -q
    tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi
cmake -S "$SRC/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$DIR/cmake-configure.log"
cmake --build "$DIR/build" --target llama-server llama-quantize -j "$JOBS" > "$DIR/cmake-build.log"
"$BIN" --version 2>&1 | head -n 2 >&2 || true
echo "$BIN"
