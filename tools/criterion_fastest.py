#!/usr/bin/env python3
"""Tokens per second of troupe's criterion benchmarks, read from criterion's saved samples.

Usage: criterion_fastest.py [TARGET_CRITERION_DIR]   (default: target/criterion)

Run after `cargo bench --bench model -- small` and
`cargo bench --bench adapters -- "lora_train_step|mixed32x64_forward/"`. For each benchmark that
`tools/peer_bench.py` also measures, prints two figures:
- the fastest sample, the estimator `peer_bench.py` reports (the fastest of its repetitions);
- criterion's mean.
Also prints the mixed-adapter forward's time at K = 2, 4, 8 adapters relative to K = 1, from the
means, and, after `cargo bench --bench gemm`, each GEMM shape's and the FMA loop's GFLOP/s, fastest
sample and mean (what `peer_bench.py --gemm` reports for PyTorch is its fastest). Reads only the
files criterion writes (each benchmark's latest run, `new/`); measures nothing itself.
"""
import json
import os
import sys

# The benchmarks peer_bench.py also measures; the tokens a pass handles are the throughput each
# declares to criterion.
BENCHES = [
    "prefill_small/b1x128",
    "prefill_small/b16x128",
    "decode_small/b1",
    "decode_small/b16",
    "lora_train_step/b8x128",
]


def load(root, bench, name):
    with open(os.path.join(root, bench, "new", name)) as f:
        return json.load(f)


def fastest_and_mean_ns(root, bench):
    """The fastest sample's and criterion's mean time per iteration, in nanoseconds."""
    sample = load(root, bench, "sample.json")
    fastest = min(t / n for t, n in zip(sample["times"], sample["iters"]))
    return fastest, load(root, bench, "estimates.json")["mean"]["point_estimate"]


def tokens_per_pass(root, bench):
    """The elements (tokens) one iteration handles, as the benchmark declared them to criterion."""
    return load(root, bench, "benchmark.json")["throughput"]["Elements"]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "target/criterion"
    if not os.path.isdir(root):
        sys.exit(f"error: {root}: no criterion results (run the benches first)")
    for bench in BENCHES:
        if not os.path.exists(os.path.join(root, bench, "new", "sample.json")):
            print(f"{bench:26s} not run")
            continue
        tokens = tokens_per_pass(root, bench)
        fastest_ns, mean_ns = fastest_and_mean_ns(root, bench)
        print(f"{bench:26s} fastest {tokens / fastest_ns * 1e9:8.1f} tok/s"
              f"   mean {tokens / mean_ns * 1e9:8.1f} tok/s")
    def mean_of(bench):
        path = os.path.join(root, bench, "new", "estimates.json")
        return load(root, bench, "estimates.json")["mean"]["point_estimate"] if os.path.exists(path) else None

    k1 = mean_of("mixed32x64_forward/one_pass/K1")
    for k in (2, 4, 8):
        kt = mean_of(f"mixed32x64_forward/one_pass/K{k}")
        if k1 and kt:
            print(f"mixed32x64 K{k} / K1 time (means) {kt / k1:.3f}")

    groups = [g for g in os.listdir(root) if g == "fma_peak" or g.startswith("gemm")]
    for group in sorted(groups, key=lambda g: (g != "fma_peak", len(g), g)):
        for dirpath, _dirs, files in sorted(os.walk(os.path.join(root, group))):
            if os.path.basename(dirpath) != "new" or "benchmark.json" not in files:
                continue
            bench = os.path.relpath(os.path.dirname(dirpath), root)
            meta = load(root, bench, "benchmark.json")
            flop = (meta.get("throughput") or {}).get("Elements")
            if not flop:
                continue
            fastest_ns, mean_ns = fastest_and_mean_ns(root, bench)
            print(f"{bench:40s} fastest {flop / fastest_ns:6.1f} GFLOP/s   mean {flop / mean_ns:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
