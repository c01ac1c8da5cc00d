#!/usr/bin/env bash
# Checks troupe on a GPU machine from an archive `tools/gpu_bundle.sh` built elsewhere, with no
# Rust toolchain there: first the tests of troupe's GPU code under CUDA, then the GPU figures
# (`tools/gpu_figures.py`, given the arguments after `--`). Run from the repository's root.
#
#   bash tools/gpu_check.sh ARCHIVE OUT [--no-tests] [--tests 'FILTER ...'] [-- FIGURES' ARGS]
#
# OUT receives `tests.log` (the tests' output) and `figures.json` and `figures.log` (when
# figures' arguments are given; with none, no figures run). The tests run first, so a GPU
# machine lent for a short while answers the correctness questions before the timings. The
# exit status is the tests' (or the figures', when the tests passed or did not run).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: bash tools/gpu_check.sh ARCHIVE OUT [--no-tests] [--tests 'FILTER ...'] [-- FIGURES' ARGS]" >&2
    exit 2
fi
archive="$1"
out="$2"
shift 2
# The modules whose tests run troupe's GPU kernels, their gradients, bf16 and the update's pass.
tests="fused_ops:: flash_attention:: mixed_precision:: adapters_isolation:: prefix_sharing:: generation:: device_sampling:: base_model::"
figures=()
while [ $# -gt 0 ]; do
    case "$1" in
        --no-tests) tests=""; shift ;;
        --tests) tests="${2:?--tests needs its filters}"; shift 2 ;;
        --) shift; figures=("$@"); break ;;
        *) echo "error: unknown argument $1 (the figures' arguments go after --)" >&2; exit 2 ;;
    esac
done
if [ ! -f "$archive" ]; then
    echo "error: no archive at $archive (tools/gpu_bundle.sh builds it)" >&2
    exit 2
fi
mkdir -p "$out"
bin="$(mktemp -d)"
trap 'rm -rf "$bin"' EXIT
xz -dc "$archive" | tar -C "$bin" -xf - || { echo "error: $archive is not an archive of gpu_bundle.sh" >&2; exit 2; }

status=0
if [ -n "$tests" ]; then
    # The test executable finds the fixtures through CARGO_MANIFEST_DIR, as under `cargo test`.
    # shellcheck disable=SC2086
    CARGO_MANIFEST_DIR="$PWD" TROUPE_TEST_DEVICE="${TROUPE_TEST_DEVICE:-cuda}" \
        "$bin/it" --test-threads 1 $tests 2>&1 | tee "$out/tests.log"
    status=${PIPESTATUS[0]}
fi
if [ ${#figures[@]} -gt 0 ]; then
    # An archive built with `gpu_bundle.sh --autotune` also times troupe with burn's autotune.
    if [ -x "$bin/troupe-autotune" ]; then
        figures=(--troupe-autotune "$bin/troupe-autotune" "${figures[@]}")
    fi
    PYTHONUNBUFFERED=1 python3 tools/gpu_figures.py --device cuda --troupe "$bin/troupe" --benches "$bin" \
        --out "$out/figures.json" "${figures[@]}" 2>&1 | tee "$out/figures.log"
    figures_status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] && status=$figures_status
fi
exit "$status"
