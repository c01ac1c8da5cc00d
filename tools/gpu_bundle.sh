#!/usr/bin/env bash
# Builds, on a machine with a Rust toolchain (no GPU or CUDA toolkit needed), what checking troupe
# on a GPU machine needs, all with `--features cuda`: the `troupe` binary, the `model`, `adapters`,
# `gemm` and `sampling` benchmark executables and the integration-test executable `it`, stripped into one
# xz archive for `tools/gpu_check.sh` (docs/gpu.md, "Checking a build on a GPU machine").
#
#   bash tools/gpu_bundle.sh [--autotune] [--no-nvrtc] [ARCHIVE]     # default gpu-bundle.tar.xz (about 35 MB without --autotune)
#
# `--autotune` adds `troupe-autotune`, troupe built with `--features autotune` (burn's autotuned
# kernels), which `tools/gpu_check.sh` then runs beside the plain build. `CARGO_TARGET_DIR` is
# honoured (a separate one keeps the CPU build's artifacts).
#
# Before packing, every variant of troupe's own kernels is compiled by NVRTC for sm_90a
# (`tools/cuda_kernels_check.sh`, NVRTC from PyPI), and no archive is written if one fails:
# a kernel NVRTC refuses would fail on the GPU. `--no-nvrtc` skips that (no PyPI at hand).
set -euo pipefail
cd "$(dirname "$0")/.."
autotune=false
nvrtc=true
while [ $# -gt 0 ]; do
    case "$1" in
        --autotune) autotune=true; shift ;;
        --no-nvrtc) nvrtc=false; shift ;;
        *) break ;;
    esac
done
archive="${1:-gpu-bundle.tar.xz}"
case "$archive" in
    *.tar.xz) ;;
    *) echo "error: the archive's name must end in .tar.xz: $archive" >&2; exit 2 ;;
esac
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT

# Each cargo command's executables, as `NAME PATH` lines, from its JSON messages (the features
# come with the arguments).
executables() {
    cargo "$@" --message-format=json-render-diagnostics | python3 -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        print(message["target"]["name"], message["executable"])
'
}

# One cargo command for them all, so that the dependencies are built once: with the benchmarks
# and the tests in the build, cargo unifies the dev-dependencies' features into every crate's,
# and a `cargo build` of the binary alone would build burn and cubecl a second time.
targets=(--bin troupe --bench model --bench adapters --bench gemm --bench sampling --test it --example cuda_kernels)
names="troupe model adapters gemm sampling it"
if $autotune; then
    # First, and copied at once: the plain build below writes the same path.
    path="$(executables build --release --features autotune --bin troupe --bench adapters | awk '$1 == "troupe" { print $2 }' | head -n 1)"
    cp "$path" "$stage/troupe-autotune"
    strip "$stage/troupe-autotune"
    names="$names troupe-autotune"
fi
executables build --release --features cuda "${targets[@]}" >"$stage/list"
if $nvrtc; then
    bash tools/cuda_kernels_check.sh --exe "$(awk '$1 == "cuda_kernels" { print $2 }' "$stage/list" | head -n 1)"
fi
for name in troupe model adapters gemm sampling it; do
    path="$(awk -v n="$name" '$1 == n { print $2 }' "$stage/list" | head -n 1)"
    if [ -z "$path" ]; then
        echo "error: cargo built no executable named $name" >&2
        exit 1
    fi
    cp "$path" "$stage/$name"
    strip "$stage/$name"
done
rm "$stage/list"
# shellcheck disable=SC2086
tar -C "$stage" -cf - $names | xz -T0 -9 >"$archive.tmp"
mv "$archive.tmp" "$archive"
echo "$archive: $(du -h "$archive" | cut -f1)"
