"""The benchmark readers in tools/: tokens per second come from what each criterion benchmark
declared (its throughput) and the time criterion saved, on a criterion tree written here."""

import json
import os
import subprocess
import sys

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")
sys.path.insert(0, TOOLS)

import criterion_fastest  # noqa: E402
import gpu_figures  # noqa: E402


def write_bench(root, bench, tokens, times_ns, iters, mean_ns):
    new = os.path.join(root, bench, "new")
    os.makedirs(new)
    with open(os.path.join(new, "benchmark.json"), "w") as f:
        json.dump({"throughput": {"Elements": tokens}}, f)
    with open(os.path.join(new, "sample.json"), "w") as f:
        json.dump({"times": times_ns, "iters": iters}, f)
    with open(os.path.join(new, "estimates.json"), "w") as f:
        json.dump({"mean": {"point_estimate": mean_ns}}, f)


def test_tokens_per_second_reads_the_declared_throughput(tmp_path):
    # 2048 tokens a pass; fastest sample 4e6 ns over 2 iterations = 2e6 ns a pass -> 1.024e6 tok/s.
    write_bench(tmp_path, "prefill_qwen3-0.6b/b16x128", 2048, [9e6, 4e6], [3, 2], 2.5e6)
    got = gpu_figures.tokens_per_second(str(tmp_path), {"prefill_qwen3-0.6b/b16x128": "prefill_b16"})
    assert abs(got["prefill_b16"] - 2048 / 2e6 * 1e9) < 1e-6


def test_criterion_fastest_prints_fastest_and_mean(tmp_path):
    write_bench(tmp_path, "decode_small/b1", 64, [1e6, 3e6], [1, 2], 1.25e6)
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "criterion_fastest.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("decode_small/b1 "))
    # fastest 1e6 ns a pass: 64000 tok/s; mean 1.25e6 ns: 51200 tok/s.
    assert "fastest  64000.0 tok/s" in line and "mean  51200.0 tok/s" in line, line
    assert "prefill_small/b1x128" in out and "not run" in out


def test_gpu_figures_draw_reads_each_settings_fastest_sample_and_skips_the_cpu(monkeypatch, tmp_path):
    commands = []
    monkeypatch.setattr(gpu_figures, "run", lambda cmd, env=None, log=None: commands.append((cmd, env)) or "")
    for i, name in enumerate(gpu_figures.DRAW_SETTINGS):
        # fastest sample (i + 1) * 2e6 ns over 2 iterations: (i + 1) * 1000 us a draw.
        write_bench(tmp_path, f"device_draw_64x151936/{name}", 64, [9e9, (i + 1) * 2e6], [1, 2], 5e6)
    args = gpu_figures.argparse.Namespace(device="cuda", quick=False, bench_seconds=0.3, target_dir="t",
                                          benches="/b")
    got = gpu_figures.device_draw(args, str(tmp_path))
    assert got == {f"{name}_us": (i + 1) * 1e3 for i, name in enumerate(gpu_figures.DRAW_SETTINGS)}
    cmd, env = commands[0]
    assert cmd[:2] == ["/b/sampling", "--bench"] and "^device_draw_64x151936/" in cmd
    assert cmd[cmd.index("--measurement-time") + 1] == "0.3" and env["TROUPE_DEVICE"] == "cuda"
    args.device = "cpu"
    assert gpu_figures.device_draw(args, str(tmp_path)) is None and len(commands) == 1


def test_gpu_figures_runs_only_the_attention_kernels_asked_for(monkeypatch):
    kernels = []
    def run(cmd, env=None, log=None):
        kernels.append((env or {}).get("TROUPE_ATTENTION"))

    monkeypatch.setattr(gpu_figures, "run", run)
    monkeypatch.setattr(gpu_figures, "tokens_per_second", lambda root, names: {key: 1.0 for key in names.values()})
    monkeypatch.setattr(gpu_figures.criterion_fastest, "load", lambda *a: {"mean": {"point_estimate": 2.0}})
    args = gpu_figures.argparse.Namespace(device="cpu", dtype="f32", quick=True, bench_seconds=None, target_dir="t",
                                          benches=None, attention_kernels="materialized")
    out = gpu_figures.troupe_kernels(args, "crit", "small")
    # One model run (materialized) and one adapters run; no flash figures.
    assert kernels == ["materialized", "materialized"] and "attention_flash" not in out
    kernels.clear()
    args.attention_kernels = "materialized,flash"
    out = gpu_figures.troupe_kernels(args, "crit", "small")
    assert kernels == ["materialized", "flash", "materialized"] and out["attention_flash_over_materialized"]


def test_gpu_figures_burn_kernels_runs_the_model_once_more_with_burns_composites(monkeypatch):
    runs = []
    def run(cmd, env=None, log=None):
        runs.append((cmd[2] if len(cmd) > 2 else cmd[0], (env or {}).get("TROUPE_GPU_KERNELS")))

    monkeypatch.setattr(gpu_figures, "run", run)
    speed = iter([2.0, 1.0, 3.0])
    monkeypatch.setattr(gpu_figures, "tokens_per_second",
                        lambda root, names: {key: s for key, s in zip(names.values(), [next(speed)] * len(names))})
    monkeypatch.setattr(gpu_figures.criterion_fastest, "load", lambda *a: {"mean": {"point_estimate": 2.0}})
    args = gpu_figures.argparse.Namespace(device="cpu", dtype="f32", quick=True, bench_seconds=None, target_dir="t",
                                          benches=None, attention_kernels="materialized", burn_kernels=True)
    out = gpu_figures.troupe_kernels(args, "crit", "small")
    # The model with troupe's kernels, then with burn's, then the adapters with troupe's.
    assert [kernels for _, kernels in runs] == ["troupe", "burn", "troupe"]
    assert out["decode_tok_s_b1"] == 2.0 and out["burn_kernels"]["decode_tok_s_b1"] == 1.0
    assert out["troupe_kernels_over_burn"]["decode_tok_s_b1"] == 2.0


def test_gpu_figures_refuses_attention_kernels_without_materialized(tmp_path):
    got = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_figures.py"), "--device", "cpu",
                          "--attention-kernels", "flash", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True)
    assert got.returncode != 0 and "--attention-kernels flash" in got.stderr, got.stderr


def test_gpu_figures_kernel_profile_run_passes_the_flag_and_reads_kernels_json(monkeypatch, tmp_path):
    seen = []

    def run_peak(cmd, device, env=None, log=None):
        seen.append(cmd)
        out_dir = next(c.split("=", 1)[1] for c in cmd if c.startswith("run.out_dir="))
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"seconds": 2.0, "extra": {}}) + "\n")
        with open(os.path.join(out_dir, "kernels.json"), "w") as f:
            json.dump({"iterations": 1, "phases": {"decode": {"k": {"launches": 3, "timed": 3, "seconds": 1e-3}}}}, f)
        return "", 100.0

    monkeypatch.setattr(gpu_figures, "run_peak", run_peak)
    args = gpu_figures.argparse.Namespace(device="cpu", dtype="f32", reward_python="python3", iterations=1,
                                          groups=1, group_size=2, new_tokens=8, troupe="troupe")
    plain = gpu_figures.troupe_iteration(args, "m", str(tmp_path), "a")
    profiled = gpu_figures.troupe_iteration(args, "m", str(tmp_path), "b", flags=("--profile-kernels",))
    assert "--profile-kernels" not in seen[0] and plain["kernels"] is None
    assert "--profile-kernels" in seen[1]
    assert profiled["kernels"]["phases"]["decode"]["k"]["launches"] == 3


def test_gpu_figures_iteration_reads_each_phases_device_memory(monkeypatch, tmp_path):
    def run_peak(cmd, device, env=None, log=None):
        out_dir = next(c.split("=", 1)[1] for c in cmd if c.startswith("run.out_dir="))
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            for extra in ({"memory_mib_decode": 300.0, "memory_mib_backward": 900.0, "memory_reserved_mib": 2000.0},
                          {}):
                f.write(json.dumps({"seconds": 2.0, "extra": extra}) + "\n")
        return "", 100.0

    monkeypatch.setattr(gpu_figures, "run_peak", run_peak)
    args = gpu_figures.argparse.Namespace(device="cpu", dtype="f32", reward_python="python3", iterations=2,
                                          groups=1, group_size=2, new_tokens=8, troupe="troupe")
    got = gpu_figures.troupe_iteration(args, "m", str(tmp_path), "a")
    assert got["phase_memory_mib"] == [{"decode": 300.0, "backward": 900.0, "reserved": 2000.0}, {}]


def fake_troupe(tmp_path):
    """An executable standing in for the troupe binary, which the stubbed runs never start."""
    troupe = tmp_path / "troupe"
    troupe.write_text("#!/bin/sh\n")
    troupe.chmod(0o755)
    return troupe


def run_figures_iterations(monkeypatch, tmp_path, flags, seconds):
    """`gpu_figures.py --skip-kernels --skip-memory FLAGS` with troupe's and TRL's runs stubbed:
    each troupe run lasts `seconds(extra, env)`; returns the runs' (extra, env) and the preset's
    iteration figures."""
    runs = []

    def troupe_iteration(args, model_dir, work, rep, extra=None, flags=(), troupe=None, env=None):
        runs.append((extra, env))
        return {"s_per_iteration": seconds(extra, env), "update_gflop_per_s": [None]}

    monkeypatch.setattr(gpu_figures, "troupe_iteration", troupe_iteration)
    monkeypatch.setattr(gpu_figures, "trl_iteration", lambda args, model_dir: {"s_per_step": 1.0})
    monkeypatch.setattr(gpu_figures, "gemm_tflops", lambda args: {"tflops": 1.0})
    monkeypatch.setattr(gpu_figures, "run", lambda *a, **k: "")
    monkeypatch.setattr(gpu_figures, "machine", lambda *a: {})
    troupe = fake_troupe(tmp_path)
    out = tmp_path / "figures.json"
    monkeypatch.setattr(sys, "argv", ["gpu_figures.py", "--device", "cpu", "--troupe", str(troupe), "--reps", "1",
                                      "--skip-kernels", "--skip-memory", *flags, "--out", str(out)])
    gpu_figures.main()
    return runs, json.load(open(out))["iteration_qwen3-0.6b"]


def test_gpu_figures_width_steps_rerun_the_iteration_with_each_padding(monkeypatch, tmp_path):
    runs, got = run_figures_iterations(monkeypatch, tmp_path, ["--width-steps", "1,64"],
                                       lambda extra, env: 4.0 if env else 2.0)
    assert [env for _, env in runs] == [None, {"TROUPE_WIDTH_STEP": "1"}, {"TROUPE_WIDTH_STEP": "64"}]
    assert got["troupe_width_step_64_s_over_troupe_s_per_iteration"] == [2.0]


def test_gpu_figures_copied_prompts_rerun_the_iteration_with_the_rows_own_copies(monkeypatch, tmp_path):
    runs, got = run_figures_iterations(monkeypatch, tmp_path, ["--copied-prompts"],
                                       lambda extra, env: 3.0 if extra else 2.0)
    assert [extra for extra, _ in runs] == [None, {"runtime.prompt_cache": "copied"}]
    assert got["troupe_copied_prompts_s_over_troupe_s_per_iteration"] == [1.5]


def test_gpu_figures_f32_kv_cache_reruns_the_iteration_with_the_cache_in_f32(monkeypatch, tmp_path):
    runs, got = run_figures_iterations(monkeypatch, tmp_path, ["--f32-kv-cache"],
                                       lambda extra, env: 2.5 if extra else 2.0)
    assert [extra for extra, _ in runs] == [None, {"runtime.kv_cache": "f32"}]
    assert got["troupe_f32_kv_cache_s_over_troupe_s_per_iteration"] == [1.25]


def test_gpu_figures_frozen_products_read_each_routines_benchmarks_and_the_peers_rates(monkeypatch, tmp_path):
    # 2 * 2048 * 256 * 128 FLOP a pass; fastest 1e6 ns -> 0.134 TFLOP/s; double-cmma refused the
    # forward (no benchmark written) and launched the input's gradient.
    flop = 2 * 2048 * 256 * 128
    write_bench(tmp_path, "frozen_tiny_t2048/fwd_qkv_256x128/auto", flop, [2e6], [2], 1e6)
    write_bench(tmp_path, "frozen_tiny_t2048/bwd_qkv_256x128/auto", flop, [4e6], [2], 2e6)
    write_bench(tmp_path, "frozen_tiny_t2048/bwd_qkv_256x128/double-cmma", flop, [2e6], [2], 1e6)
    commands = []

    def run(cmd, env=None, log=None):
        commands.append((cmd, env))
        if "tools/peer_bench.py" in cmd:
            return json.dumps({"gemm_gflop_s_t2048_qkv_256x128": 200.0, "gemm_gflop_s_t2048_bwd_qkv_256x128": 100.0})
        return ""

    monkeypatch.setattr(gpu_figures, "run", run)
    args = gpu_figures.argparse.Namespace(device="cuda", dtype="bf16", target_dir="t", gemm_rows="2048", quick=False,
                                          bench_seconds=None, benches=None, python="py", threads=2)
    ours, torch = gpu_figures.frozen_products(args, str(tmp_path), "m", "tiny", ["auto", "double-cmma"])
    assert abs(ours["t2048_fwd_qkv_256x128"]["auto"] - flop / 1e6 / 1e3) < 1e-9
    assert set(ours["t2048_bwd_qkv_256x128"]) == {"auto", "double-cmma"}
    assert "double-cmma" not in ours["t2048_fwd_qkv_256x128"]
    assert torch == {"t2048_fwd_qkv_256x128": 0.2, "t2048_bwd_qkv_256x128": 0.1}
    bench_cmd, env = commands[0]
    assert env["TROUPE_GEMM_KERNELS"] == "auto,double-cmma" and env["TROUPE_GEMM_ROWS"] == "2048"
    assert bench_cmd[-5] == "^(frozen_tiny_t2048)/[^/]+/(auto|double\\-cmma)$", bench_cmd
    assert "--gemm-backward" in commands[1][0]


def test_gpu_figures_update_products_seconds_count_each_layer_and_fall_back_to_auto():
    tflops = {"t2048_fwd_o_128x128": {"auto": 1.0, "fast": 2.0},
              "t2048_bwd_o_128x128": {"auto": 1.0},
              "t2048_fwd_lm_head_1024x128": {"auto": 1.0, "fast": 4.0},
              "t64_fwd_o_128x128": {"auto": 0.001}}
    flop = lambda out, inner: 2 * 2048 * out * inner / 1e12
    auto = gpu_figures.update_products_seconds(tflops, 3, "auto")
    assert abs(auto - (3 * flop(128, 128) * 2 + flop(1024, 128))) < 1e-15
    fast = gpu_figures.update_products_seconds(tflops, 3, "fast")
    # `fast` did not launch the input's gradient: counted at auto's time; the 64-row product is not counted.
    assert abs(fast - (3 * flop(128, 128) / 2 + 3 * flop(128, 128) + flop(1024, 128) / 4)) < 1e-15


def test_gpu_figures_matmul_best_reruns_the_iteration_with_the_fastest_routine(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_figures, "known_matmul_kernels", lambda troupe: ["auto", "double-cmma", "simple-unit"])
    monkeypatch.setattr(gpu_figures, "layers_of", lambda model_dir: 2)
    monkeypatch.setattr(gpu_figures, "frozen_products", lambda args, criterion_dir, model_dir, preset, kernels: (
        {"t2048_fwd_o_128x128": {"auto": 1.0, "double-cmma": 3.0, "simple-unit": 0.5}}, {"t2048_fwd_o_128x128": 2.0}))
    runs, got = run_figures_iterations(monkeypatch, tmp_path, ["--gemm", "--gemm-kernels", "auto,double-cmma,simple-unit",
                                                               "--matmul", "best"],
                                       lambda extra, env: 1.0 if env else 2.0)
    assert [env for _, env in runs] == [None, {"TROUPE_MATMUL": "double-cmma"}]
    assert got["troupe_matmul_best"]["kernel"] == "double-cmma"
    assert got["troupe_matmul_best_s_over_troupe_s_per_iteration"] == [0.5]


def test_gpu_figures_refuses_width_steps_that_are_not_positive_counts(tmp_path):
    got = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_figures.py"), "--device", "cpu",
                          "--width-steps", "8,x", "--out", str(tmp_path / "f.json")],
                         capture_output=True, text=True)
    assert got.returncode != 0 and "--width-steps 8,x" in got.stderr, got.stderr


def test_gpu_figures_draw_sets_troupes_draw_beside_transformers_sampling(monkeypatch, tmp_path):
    peers = []

    def run(cmd, env=None, log=None):
        if "tools/peer_bench.py" in cmd:
            peers.append(cmd)
            return json.dumps({"top_p_0.95_us": 300.0, "greedy_us": 20.0}) + "\n"
        return ""

    monkeypatch.setattr(gpu_figures, "run", run)
    monkeypatch.setattr(gpu_figures, "device_draw", lambda args, root: {"top_p_0.95_us": 100.0, "greedy_us": 40.0})
    monkeypatch.setattr(gpu_figures, "machine", lambda *a: {})
    troupe = fake_troupe(tmp_path)
    out = tmp_path / "figures.json"
    monkeypatch.setattr(sys, "argv", ["gpu_figures.py", "--device", "cuda", "--troupe", str(troupe), "--reps", "2",
                                      "--skip-kernels", "--skip-iteration", "--skip-memory", "--draw",
                                      "--out", str(out)])
    gpu_figures.main()
    got = json.load(open(out))["device_draw_64x151936"]
    assert len(peers) == 2 and "--draw" in peers[0] and peers[0][peers[0].index("--device") + 1] == "cuda"
    assert got["ratio"] == [{"top_p_0.95_us": 3.0, "greedy_us": 0.5}] * 2
    assert got["troupe"][0]["top_p_0.95_us"] == 100.0 and got["transformers"][1]["greedy_us"] == 20.0


def run_figures_rewards(monkeypatch, tmp_path, flags):
    """`gpu_figures.py --skip-kernels --skip-memory --reps 1 --iterations 2 FLAGS` with the troupe
    and TRL processes stubbed at `run_peak`: troupe's run writes a metrics.jsonl whose first
    iteration had half its groups tied and second none, TRL's prints its JSON line. Returns the
    troupe and TRL commands and the figures written."""
    troupe_cmds, trl_cmds = [], []

    def run_peak(cmd, device, env=None, log=None):
        if "tools/trl_grpo_peer.py" in cmd:
            trl_cmds.append(cmd)
            return "{'train_runtime': 1.0}\n" + json.dumps(
                {"s_per_step": 1.5, "step_s": [2.0, 1.5], "frac_reward_zero_std": [0.25, 0.0]}) + "\n", 50.0
        troupe_cmds.append(cmd)
        out_dir = next(c.split("=", 1)[1] for c in cmd if c.startswith("run.out_dir="))
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            for zero_std in (0.5, 0.0):
                f.write(json.dumps({"seconds": 3.0, "extra": {"frac_reward_zero_std": zero_std}}) + "\n")
        return "", 100.0

    monkeypatch.setattr(gpu_figures, "run_peak", run_peak)
    monkeypatch.setattr(gpu_figures, "run", lambda *a, **k: "")
    monkeypatch.setattr(gpu_figures, "gemm_tflops", lambda args: {"tflops": 1.0})
    monkeypatch.setattr(gpu_figures, "machine", lambda *a: {})
    troupe = fake_troupe(tmp_path)
    out = tmp_path / "figures.json"
    monkeypatch.setattr(sys, "argv", ["gpu_figures.py", "--device", "cpu", "--troupe", str(troupe), "--reps", "1",
                                      "--iterations", "2", "--skip-kernels", "--skip-memory", *flags,
                                      "--out", str(out)])
    gpu_figures.main()
    return troupe_cmds, trl_cmds, json.load(open(out))


def reward_set(cmd):
    return next(c for c in cmd if c.startswith("rewards.functions="))


def test_gpu_figures_iteration_defaults_to_the_noise_reward_on_both_sides(monkeypatch, tmp_path):
    troupe_cmds, trl_cmds, got = run_figures_rewards(monkeypatch, tmp_path, [])
    assert len(troupe_cmds) == 1 and len(trl_cmds) == 1
    assert "python/examples/noise_reward.py" in reward_set(troupe_cmds[0])
    assert "length_reward.py" not in " ".join(troupe_cmds[0])
    assert trl_cmds[0][trl_cmds[0].index("--reward") + 1] == "noise"
    assert got["reward"] == "noise"


def test_gpu_figures_reward_length_gives_both_sides_the_length_reward(monkeypatch, tmp_path):
    troupe_cmds, trl_cmds, got = run_figures_rewards(monkeypatch, tmp_path, ["--reward", "length"])
    assert "python/examples/length_reward.py" in reward_set(troupe_cmds[0])
    assert "noise_reward.py" not in " ".join(troupe_cmds[0])
    assert trl_cmds[0][trl_cmds[0].index("--reward") + 1] == "length"
    assert got["reward"] == "length"


def test_gpu_figures_iteration_records_each_sides_frac_reward_zero_std(monkeypatch, tmp_path):
    _, _, got = run_figures_rewards(monkeypatch, tmp_path, [])
    iteration = got["iteration_qwen3-0.6b"]
    # troupe's per iteration from metrics.jsonl's `extra`, TRL's per step from its JSON line.
    assert iteration["troupe"][0]["frac_reward_zero_std"] == [0.5, 0.0]
    assert iteration["trl"][0]["frac_reward_zero_std"] == [0.25, 0.0]
    assert iteration["trl_s_per_step_over_troupe_s_per_iteration"] == [0.5]


def test_gpu_figures_iteration_leaves_frac_reward_zero_std_none_where_troupe_wrote_none(monkeypatch, tmp_path):
    def run_peak(cmd, device, env=None, log=None):
        out_dir = next(c.split("=", 1)[1] for c in cmd if c.startswith("run.out_dir="))
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"seconds": 2.0, "extra": {"frac_reward_zero_std": 1.0}}) + "\n")
            f.write(json.dumps({"seconds": 2.0}) + "\n")
        return "", 100.0

    monkeypatch.setattr(gpu_figures, "run_peak", run_peak)
    args = gpu_figures.argparse.Namespace(device="cpu", dtype="f32", reward_python="python3", iterations=2,
                                          groups=1, group_size=2, new_tokens=8, troupe="troupe", reward="length")
    got = gpu_figures.troupe_iteration(args, "m", str(tmp_path), "a")
    assert got["frac_reward_zero_std"] == [1.0, None]


def test_gpu_figures_refuses_an_unknown_reward(tmp_path):
    got = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_figures.py"), "--device", "cpu",
                          "--reward", "env_return", "--out", str(tmp_path / "f.json")],
                         capture_output=True, text=True)
    assert got.returncode != 0 and "--reward" in got.stderr and "env_return" in got.stderr, got.stderr


def test_gpu_figures_writes_each_preset_in_the_runs_dtype(monkeypatch, tmp_path):
    """The presets' model directories are stored in the run's dtype (bf16: half the disk and
    write time, each f32 value drawn, rounded once), made once each."""
    made = []

    def run(cmd, env=None, log=None):
        if "init-model" in cmd:
            made.append(cmd)
        return ""

    for dtype in ("bf16", "f32"):
        made.clear()
        monkeypatch.setattr(gpu_figures, "run", run)
        monkeypatch.setattr(gpu_figures, "troupe_iteration",
                            lambda *a, **k: {"s_per_iteration": 1.0, "update_gflop_per_s": [None]})
        monkeypatch.setattr(gpu_figures, "trl_iteration", lambda args, model_dir: {"s_per_step": 1.0})
        monkeypatch.setattr(gpu_figures, "gemm_tflops", lambda args: {"tflops": 1.0})
        monkeypatch.setattr(gpu_figures, "machine", lambda *a: {})
        out = tmp_path / f"figures-{dtype}.json"
        monkeypatch.setattr(sys, "argv", ["gpu_figures.py", "--device", "cpu", "--dtype", dtype,
                                          "--troupe", str(fake_troupe(tmp_path)), "--reps", "2", "--skip-kernels",
                                          "--skip-memory", "--out", str(out)])
        gpu_figures.main()
        assert len(made) == 1, made
        cmd = made[0]
        assert cmd[cmd.index("--preset") + 1] == "qwen3-0.6b"
        assert cmd[cmd.index("--dtype") + 1] == dtype
