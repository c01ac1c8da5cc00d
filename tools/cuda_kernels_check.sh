#!/usr/bin/env bash
# Compiles every variant of troupe's own GPU kernels with NVRTC and assembles them with ptxas
# for an H100/H200 (sm_90a) on a machine without a GPU, CUDA driver or toolkit
# (examples/cuda_kernels.rs; docs/gpu.md, "troupe's kernels through NVRTC without a GPU"). NVRTC
# 13.0, ptxas and the CUDA headers come from NVIDIA's PyPI wheels (about 130 MB fetched once, 160 MB
# unpacked in the cache folder), so the machine needs PyPI and nothing else.
#
#   bash tools/cuda_kernels_check.sh [--exe PATH] [-- ARGS...]
#
# Without `--exe` it builds and runs the example (`cargo run --features cuda --example
# cuda_kernels`, honouring CARGO_TARGET_DIR); with `--exe` it runs that built example.
# ARGS go to the example (`--arch 90`, `--out DIR`). TROUPE_NVRTC_CACHE picks the cache folder
# (default ~/.cache/troupe/nvrtc-13.0); a CUDA_PATH already set (a local toolkit, with its
# libnvrtc on LD_LIBRARY_PATH) is used instead of the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
exe=""
if [ "${1:-}" = "--exe" ]; then
    exe="${2:?--exe needs a path}"
    shift 2
fi
if [ "${1:-}" = "--" ]; then
    shift
fi

if [ -z "${CUDA_PATH:-}" ]; then
    cache="${TROUPE_NVRTC_CACHE:-$HOME/.cache/troupe/nvrtc-13.0}"
    root="$cache/nvidia/cu13"
    if [ ! -f "$root/include/cuda_bf16.h" ] || [ ! -f "$root/lib/libnvrtc.so.13" ] || [ ! -x "$root/bin/ptxas" ]; then
        mkdir -p "$cache/wheels"
        python3 -m pip download --quiet --no-deps --dest "$cache/wheels" \
            nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
            nvidia-cuda-nvcc==13.0.88
        # Only the headers, NVRTC's shared libraries and ptxas (zip files keep no execute bit);
        # the wheels go once unpacked.
        python3 - "$cache" <<'EOF'
import pathlib, sys, zipfile
cache = pathlib.Path(sys.argv[1])
for wheel in sorted((cache / "wheels").glob("*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            shared = "/lib/libnvrtc" in name and ".alt." not in name
            if "/include/" in name or shared or name.endswith("/bin/ptxas"):
                archive.extract(name, cache)
(cache / "nvidia/cu13/bin/ptxas").chmod(0o755)
EOF
        rm -rf "$cache/wheels"
    fi
    export CUDA_PATH="$root"
    export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

if [ -n "$exe" ]; then
    exec "$exe" "$@"
fi
exec cargo run --quiet --features cuda --example cuda_kernels -- "$@"
