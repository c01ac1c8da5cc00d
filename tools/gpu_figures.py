#!/usr/bin/env python3
"""troupe against PyTorch / PEFT / TRL on one device, side by side, into one JSON file.

Usage, from the repository root, with troupe built (`cargo build --release [--features cuda]`)
and a Python that has the peers (`pip install -r tools/requirements-peers.txt`):

    python3 tools/gpu_figures.py --device cuda --python /venv/bin/python --out figures.json
    python3 tools/gpu_figures.py --device cpu --quick --out /tmp/figures.json   # a smoke run

On a machine without cargo, build the benchmark executables elsewhere
(`cargo bench --no-run --features cuda --bench model --bench adapters --bench gemm --bench sampling`
prints their paths), copy them into one folder as `model`, `adapters`, `gemm` and `sampling`, and pass
`--benches FOLDER`.

Runs, in this order, each part `--reps` times alternating troupe and its peer:
- kernels (`--kernel-presets`, default `small,qwen3-0.6b`): troupe's criterion benchmarks `model`
  (prefill / decode, batch 1 and 16) and `adapters` (LoRA step, mixed-adapter forward) at each
  preset (`TROUPE_BENCH_PRESETS`), read by `criterion_fastest.py`, and `peer_bench.py` on the
  same model directory. `model` runs twice, with each attention kernel
  (`TROUPE_ATTENTION`, `runtime.attention`): `materialized` (what `auto` runs today; its figures
  are the ones compared with PyTorch) and `flash` (`attention_flash`, with the ratios
  `attention_flash_over_materialized`, above 1 when flash is faster); with `--burn-kernels`, once
  more with burn's composites in place of troupe's GPU kernels (`TROUPE_GPU_KERNELS=burn`:
  `burn_kernels`, with the ratios `troupe_kernels_over_burn`, above 1 when troupe's are faster);
- a whole iteration (`--preset`, default qwen3-0.6b; several separated by commas): `troupe train`
  on `writing_tldr` with `--reward`'s reward, 2 agents x `--groups` x `--group-size` replies of
  `--new-tokens` tokens, and TRL's GRPOTrainer with PEFT LoRA (`trl_grpo_peer.py --reward`) making as many completions per step;
  seconds per iteration / step after the first, each side's peak memory, and each side's
  `frac_reward_zero_std` per iteration / step (the share of groups whose rewards are all equal);
- with `--draw` on a GPU, decoding's draw alone (`device_draw_64x151936`, microseconds for 64
  rows of a Qwen3 vocabulary; top-p 0.95, top-k 50 then top-p 0.9, the whole distribution,
  greedy): troupe's one kernel (benches/sampling.rs) against transformers' `generate` sampling
  (`peer_bench.py --draw`: its warpers, softmax and torch.multinomial), the ratios above 1 when
  troupe's is faster;
- with `--gemm`, before the iterations, the frozen products (`frozen_products_<preset>`, at
  each iteration preset): troupe's benchmark `gemm` times each product of the preset's layers
  and its LM head, `x W^T` and the input's gradient `dy W`, at `--gemm-rows` rows, by each
  cubek routine of `--gemm-kernels` (`TROUPE_MATMUL`), and `peer_bench.py --gemm` the same
  products in PyTorch (cuBLAS): TFLOP/s of each, each product's fastest routine, and the routine
  that takes least time over an update micro-batch's products (each layer's once, the LM head
  once; a shape a routine cannot launch counted at `auto`'s time, as troupe then runs it);
- the update's FLOP rate (troupe's `gflop_per_second_update`, per iteration) as a fraction of the
  device's dense GEMM rate in the same dtype, measured by the peer's Python (torch.matmul);
- with `--matmul KERNEL[,KERNEL]` (`best`: the `--gemm` part's routine for that preset), after
  each preset's iterations the same run with `TROUPE_MATMUL=KERNEL` (`troupe_matmul_<kernel>`);
- with `--troupe-autotune PATH` (troupe built with `--features autotune`), after each preset's
  iterations the same run with that binary, two iterations longer: burn's autotune tunes each new
  shape on first use, so its last iteration is the figure (`troupe_autotune`);
- memory (`--memory-preset`, default qwen3-4b): two agents with LoRA r16 on q,k,v,o train
  `--memory-iterations` iterations of the same shape, with and without
  `runtime.gradient_checkpointing`; peak device memory (the goal is at most 24 GB).
Peak memory is the device's memory in use, sampled every 0.2 s by nvidia-smi, on cuda (nothing
else should run on the GPU meanwhile), and the process's peak resident set on the CPU.
`--reward noise` (the default) scores every reply with seeded uniform noise in [0, 1) on both sides
(python/examples/noise_reward.py for troupe, `trl_grpo_peer.py --reward noise`): it teaches nothing,
but no group's rewards tie. `--reward length` gives both TRL's length reward, -|len - 200| / 100
(python/examples/length_reward.py). A random preset's replies decode to little text (the built-in
tokenizer has 1,024 of the 151,936 ids), so a length reward is nearly constant and can tie whole
groups: troupe skips the rows whose advantage is zero while TRL computes them all the same, which
would flatter troupe's time. The memory run takes the same reward.
Every part runs in `--dtype` (bf16 on cuda, f32 on the CPU by default): troupe's benchmarks with
`TROUPE_DTYPE`, `troupe train` with `--set model.dtype=`, and the peers with their `--dtype`
(PyTorch with SDPA and PEFT, TRL with its bf16 mixed precision; `peer_bench.py`,
`trl_grpo_peer.py`).
Writes `--out`: the machine, the versions, the dtype, the reward, every raw figure and the troupe / peer ratios, each as
the list over repetitions. `--quick` shrinks everything (criterion's shortest run, the tiny preset,
a 2 x 1 x 2 x 8 iteration) to check the script end to end, not to measure.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import criterion_fastest  # noqa: E402

# writing_tldr's agents: two seats write the summary together.
AGENTS = 2


def run(cmd, env=None, log=None):
    """Runs `cmd` from the repository root; its stdout, or an error naming the command."""
    return run_peak(cmd, "cpu", env, log)[0]


def run_peak(cmd, device, env=None, log=None):
    """Runs `cmd` from the repository root; returns (stdout, peak memory in MiB): the GPU's memory
    in use sampled every 0.2 s on cuda, the process's peak resident set on the CPU; or an error
    naming the command."""
    import threading
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=log if log else None, text=True)
    peak, stdout = [0.0], []
    stop = threading.Event()

    def sample():
        index = device.split(":", 1)[1] if ":" in device else "0"
        while not stop.wait(0.2):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", index], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            if smi.returncode == 0 and smi.stdout.strip():
                peak[0] = max(peak[0], float(smi.stdout.strip().splitlines()[0]))

    sampler = threading.Thread(target=sample, daemon=True) if device.startswith("cuda") else None
    if sampler:
        sampler.start()
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
    reader.start()
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    stop.set()
    if sampler:
        sampler.join()
    else:
        peak[0] = usage.ru_maxrss / 1024  # KiB on Linux
    if proc.returncode != 0:
        sys.exit(f"error: `{' '.join(cmd)}` exited with {proc.returncode}")
    return stdout[0], peak[0]


def gemm_tflops(args):
    """The device's dense GEMM rate in `args.dtype`, TFLOP/s: torch.matmul of square matrices,
    the best of several runs (the reference for the update's FLOP fraction)."""
    n = 512 if args.quick else 8192
    code = f"""
import json, time, torch
torch.set_num_threads({args.threads})
dev = torch.device({args.device!r})
dt = {{'bf16': torch.bfloat16, 'f32': torch.float32}}[{args.dtype!r}]
a = torch.randn({n}, {n}, device=dev, dtype=dt); b = torch.randn({n}, {n}, device=dev, dtype=dt)
sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)
for _ in range(3): a @ b
sync(); best = float('inf')
for _ in range(10):
    t = time.perf_counter(); a @ b; sync(); best = min(best, time.perf_counter() - t)
print(json.dumps({{'n': {n}, 'tflops': 2 * {n}**3 / best / 1e12}}))
"""
    return last_json(run([args.python, "-c", code]), "the GEMM rate")


def last_json(text, what):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    sys.exit(f"error: {what} printed no JSON line")


def machine(device, python):
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    try:
        info["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device.startswith("cuda"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             stdout=subprocess.PIPE, text=True)
        info["gpu"] = smi.stdout.strip() if smi.returncode == 0 else None
    versions = subprocess.run([python, "-c", "import torch, transformers, peft, trl; print(torch.__version__, "
                               "transformers.__version__, peft.__version__, trl.__version__)"],
                              stdout=subprocess.PIPE, text=True)
    info["peers"] = dict(zip(["torch", "transformers", "peft", "trl"], versions.stdout.split()))
    try:  # a copied tree (a GPU machine's) may have no .git, and the machine no git
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        info["troupe_commit"] = rev.stdout.strip() or None
    except OSError:
        info["troupe_commit"] = None
    return info


def criterion_timing(args):
    """Criterion's arguments for the measurement's length: its shortest with `--quick`, else
    `--bench-seconds` a benchmark (warm-up 1 s), else criterion's own."""
    if args.quick:
        return ["--warm-up-time", "1", "--measurement-time", "1"]
    if args.bench_seconds:
        return ["--warm-up-time", "1", "--measurement-time", str(args.bench_seconds)]
    return []


def tokens_per_second(criterion_dir, names):
    """Tokens/s of each benchmark in `names` (benchmark id -> key), from criterion's fastest sample
    of its latest run."""
    out = {}
    for bench, key in names.items():
        fastest_ns, _mean = criterion_fastest.fastest_and_mean_ns(criterion_dir, bench)
        # The tokens a pass handles: the throughput the benchmark declared to criterion.
        tokens = criterion_fastest.tokens_per_pass(criterion_dir, bench)
        out[key] = tokens / fastest_ns * 1e9
    return out


def troupe_kernels(args, criterion_dir, preset):
    """Runs troupe's kernel benchmarks at `preset` (`TROUPE_BENCH_PRESETS`); tokens/s (criterion's
    fastest sample, the estimator the peer reports) and the mixed batch's K=8 / K=1 time. The
    prefill / decode benchmarks run with each attention kernel, materialized first: criterion keeps
    a benchmark's latest run only, so each run is read before the next."""
    timing = criterion_timing(args)
    env = {"TROUPE_DEVICE": args.device, "TROUPE_DTYPE": args.dtype, "CARGO_TARGET_DIR": args.target_dir,
           "TROUPE_ATTENTION": "materialized", "TROUPE_BENCH_PRESETS": preset, "TROUPE_GPU_KERNELS": "troupe"}
    # benches/adapters.rs names the small preset's groups without a suffix.
    suffix = "" if preset == "small" else f"_{preset}"
    model = {f"prefill_{preset}/b1x128": "prefill_tok_s_b1", f"prefill_{preset}/b16x128": "prefill_tok_s_b16",
             f"decode_{preset}/b1": "decode_tok_s_b1", f"decode_{preset}/b16": "decode_tok_s_b16"}
    out = {}

    for kernel in ("materialized", "flash"):
        if kernel not in args.attention_kernels.split(","):
            continue
        run([*bench_command(args, "model"), f"^(prefill|decode)_{re.escape(preset)}/", *timing], {**env, "TROUPE_ATTENTION": kernel})
        figures = tokens_per_second(criterion_dir, model)
        if kernel == "materialized":
            out.update(figures)
        else:
            out["attention_flash"] = figures
            out["attention_flash_over_materialized"] = {key: figures[key] / out[key] for key in figures}
    if getattr(args, "burn_kernels", False):
        run([*bench_command(args, "model"), f"^(prefill|decode)_{re.escape(preset)}/", *timing], {**env, "TROUPE_GPU_KERNELS": "burn"})
        figures = tokens_per_second(criterion_dir, model)
        out["burn_kernels"] = figures
        out["troupe_kernels_over_burn"] = {key: out[key] / figures[key] for key in figures}
    lora, mixed = f"lora_train_step{suffix}", f"mixed32x64_forward{suffix}"
    run([*bench_command(args, "adapters"), f"^({re.escape(lora)}/|{re.escape(mixed)}/one_pass/)", *timing], env)
    out.update(tokens_per_second(criterion_dir, {f"{lora}/b8x128": "lora_train_tok_s_b8x128"}))
    k1, k8 = (criterion_fastest.load(criterion_dir, f"{mixed}/one_pass/K{k}", "estimates.json")
              ["mean"]["point_estimate"] for k in (1, 8))
    out["mixed32_K8_rel"] = k8 / k1
    return out


DRAW_GROUP = "device_draw_64x151936"
DRAW_SETTINGS = ("top_p_0.95", "top_k_50_top_p_0.9", "plain", "greedy")


def device_draw(args, criterion_dir):
    """Microseconds a decoding step's draw on the device takes over 64 rows of a Qwen3 vocabulary
    (benches/sampling.rs's `device_draw_64x151936`, criterion's fastest sample), for each sampling
    setting; None where the device draws on the host (the CPU), which the benchmark skips."""
    timing = criterion_timing(args)
    if args.device == "cpu":
        return None
    env = {"TROUPE_DEVICE": args.device, "CARGO_TARGET_DIR": args.target_dir, "TROUPE_GPU_KERNELS": "troupe"}
    run([*bench_command(args, "sampling"), f"^{DRAW_GROUP}/", *timing], env)
    return {f"{name}_us": criterion_fastest.fastest_and_mean_ns(criterion_dir, f"{DRAW_GROUP}/{name}")[0] / 1e3
            for name in DRAW_SETTINGS}


def bench_command(args, name):
    """The command that runs troupe's criterion benchmark `name`, arguments for criterion after it:
    a prebuilt executable (`--benches`) takes the arguments `cargo bench` hands it."""
    if args.benches:
        return [os.path.join(args.benches, name), "--bench"]
    features = ["--features", "cuda"] if args.device.startswith("cuda") else []
    return ["cargo", "bench", *features, "--bench", name, "--"]


# The routines `--gemm` times by default: burn's rule and the accelerated routines burn's autotune
# tries first on a large general product (troupe's names for them, `TROUPE_MATMUL`).
GEMM_KERNELS = ("auto,simple-mma,simple-multirow-cmma,double-cmma,double-mma,double-specialized-cmma,"
                "ordered-double-cmma,ordered-double8-cmma,specialized-cmma,simple-tma-cmma,specialized-tma-cmma")


def known_matmul_kernels(troupe):
    """The routines `TROUPE_MATMUL` names, as the binary lists them when it refuses an unknown one."""
    proc = subprocess.run([troupe, "env", "list"], env={**os.environ, "TROUPE_MATMUL": "?"},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = re.search(r"TROUPE_MATMUL.*\(known: ([^)]*)\)", proc.stderr)
    if proc.returncode == 0 or not found:
        sys.exit(f"error: {troupe} does not list its matmul kernels (TROUPE_MATMUL); is it this commit's build?")
    return [name.strip() for name in found.group(1).split(",")]


def frozen_products(args, criterion_dir, model_dir, preset, kernels):
    """One repetition of the `--gemm` part at `preset`: troupe's TFLOP/s per product and routine
    (`{product: {kernel: tflops}}`, from criterion's fastest sample) and PyTorch's per product."""
    rows = [int(r) for r in args.gemm_rows.split(",")]
    if args.quick:
        timing = ["--warm-up-time", "0.1", "--measurement-time", "0.1"]
    else:
        seconds = args.bench_seconds if args.bench_seconds else 0.5
        timing = ["--warm-up-time", "0.2", "--measurement-time", str(seconds)]
    env = {"TROUPE_DEVICE": args.device, "TROUPE_DTYPE": args.dtype, "CARGO_TARGET_DIR": args.target_dir,
           "TROUPE_BENCH_PRESETS": preset, "TROUPE_GEMM_KERNELS": ",".join(kernels),
           "TROUPE_GEMM_ROWS": args.gemm_rows}
    groups = "|".join(re.escape(f"frozen_{preset}_t{r}") for r in rows)
    names = "|".join(re.escape(k) for k in kernels)
    run([*bench_command(args, "gemm"), f"^({groups})/[^/]+/({names})$", *timing], env)
    ours = {}
    for r in rows:
        group_dir = os.path.join(criterion_dir, f"frozen_{preset}_t{r}")
        for product in sorted(os.listdir(group_dir)) if os.path.isdir(group_dir) else []:
            for kernel in kernels:
                bench = f"frozen_{preset}_t{r}/{product}/{kernel}"
                if not os.path.exists(os.path.join(criterion_dir, bench, "new", "sample.json")):
                    continue
                fastest_ns, _mean = criterion_fastest.fastest_and_mean_ns(criterion_dir, bench)
                flop = criterion_fastest.tokens_per_pass(criterion_dir, bench)
                ours.setdefault(f"t{r}_{product}", {})[kernel] = flop / fastest_ns / 1e3
    peer = last_json(run([args.python, "tools/peer_bench.py", model_dir, "--gemm", "--device", args.device,
                          "--dtype", args.dtype, "--threads", str(args.threads), "--gemm-rows", args.gemm_rows,
                          "--gemm-backward"], log=subprocess.DEVNULL), "peer_bench.py --gemm")
    torch = {}
    for key in ours:
        # troupe's `t2048_fwd_qkv_4096x1024` is the peer's `gemm_gflop_s_t2048_qkv_4096x1024`.
        r, direction, rest = key.split("_", 2)
        peer_key = f"gemm_gflop_s_{r}_{'' if direction == 'fwd' else 'bwd_'}{rest}"
        if peer_key in peer:
            torch[key] = peer[peer_key] / 1e3
    return ours, torch


def layers_of(model_dir):
    """The model's layer count, from its config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def update_products_seconds(tflops, layers, kernel):
    """Seconds a routine takes over one micro-batch's frozen products at the most rows measured:
    each layer's products `layers` times and the LM head's once, forward and input gradient; a
    product the routine did not launch counted at `auto`'s time, which troupe then runs. None when
    a product has neither."""
    rows = max(int(key.split("_", 1)[0][1:]) for key in tflops)
    total = 0.0
    for key, by_kernel in tflops.items():
        r, _direction, rest = key.split("_", 2)
        if int(r[1:]) != rows:
            continue
        rate = by_kernel.get(kernel) or by_kernel.get("auto")
        if not rate:
            return None
        out, inner = (int(n) for n in rest.rsplit("_", 1)[1].split("x"))
        count = 1 if rest.startswith("lm_head") else layers
        total += count * 2 * rows * out * inner / (rate * 1e12)
    return total


# `--reward`'s choices: the script serving each to troupe (trl_grpo_peer.py's `--reward` the same).
REWARD_SCRIPTS = {"noise": "python/examples/noise_reward.py", "length": "python/examples/length_reward.py"}


def troupe_iteration(args, model_dir, work, rep, extra=None, flags=(), troupe=None, env=None):
    out_dir = os.path.join(work, f"run{rep}")
    script = REWARD_SCRIPTS[getattr(args, "reward", "noise")]
    reward = f"[{{name: external, command: [{args.reward_python}, {script}], weight: 1.0}}]"
    sets = {"model.path": model_dir, "model.device": args.device, "model.dtype": args.dtype, "run.out_dir": out_dir,
            "run.iterations": args.iterations, "run.checkpoint_every": 1000,
            "training.groups_per_iteration": args.groups, "training.group_size": args.group_size,
            "action.max_new_tokens": args.new_tokens, "rewards.functions": reward, **(extra or {})}
    cmd = [troupe or args.troupe, "train", "--config", "configs/writing_tldr.yaml", *flags]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    _, peak_mib = run_peak(cmd, args.device, env=env, log=subprocess.DEVNULL)
    lines = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
    seconds = [l["seconds"] for l in lines]
    steady = seconds[1:] or seconds
    kernels = os.path.join(out_dir, "kernels.json")
    profile = json.load(open(kernels)) if "--profile-kernels" in flags and os.path.exists(kernels) else None
    extras = [l.get("extra", {}) for l in lines]
    return {"iteration_s": seconds, "s_per_iteration": sum(steady) / len(steady), "kernels": profile,
            "replies": AGENTS * args.groups * args.group_size, "peak_memory_mib": peak_mib,
            "update_gflop_per_s": [e.get("gflop_per_second_update") for e in extras],
            # Where each iteration's seconds went (rollout, credit, update, optimizer, ...) and the
            # FLOPs the trainer counted per phase.
            "phase_s": [{k[len("seconds_"):]: v for k, v in e.items() if k.startswith("seconds_")} for e in extras],
            "phase_gflop": [{k[len("gflop_"):]: v for k, v in e.items()
                             if k.startswith("gflop_") and not k.startswith("gflop_per_second_")} for e in extras],
            # On a GPU, the device memory each phase kept at its boundaries (MiB in use, from the
            # allocator) and the allocator's reservation (`reserved`), per iteration.
            "phase_memory_mib": [{**{k[len("memory_mib_"):]: v for k, v in e.items() if k.startswith("memory_mib_")},
                                  **({"reserved": e["memory_reserved_mib"]} if "memory_reserved_mib" in e else {})}
                                 for e in extras],
            # The share of (group, agent) pairs whose rewards were all equal, per iteration: their
            # rows have zero advantage and the update skips them.
            "frac_reward_zero_std": [e.get("frac_reward_zero_std") for e in extras],
            "rollout_tok_s": [l.get("tokens_per_second") for l in lines]}


def trl_iteration(args, model_dir):
    # TRL trains one model: as many completions per step as troupe's iteration makes
    # (agents x groups prompts, group_size completions each).
    cmd = [args.python, "tools/trl_grpo_peer.py", model_dir, "envs/data/writing_posts.jsonl",
           "--steps", str(args.iterations), "--threads", str(args.threads), "--prompts",
           str(AGENTS * args.groups), "--gens", str(args.group_size), "--new", str(args.new_tokens),
           "--device", args.device, "--dtype", args.dtype, "--reward", getattr(args, "reward", "noise")]
    out, peak_mib = run_peak(cmd, args.device, log=subprocess.DEVNULL)
    return {**last_json(out, "trl_grpo_peer.py"), "peak_memory_mib": peak_mib}


def ratios(ours, peer, higher_is_better):
    """troupe / peer for each shared key (a time inverts, so above 1 always means troupe ahead)."""
    out = {}
    for key, better in higher_is_better.items():
        if ours.get(key) and peer.get(key):
            out[key] = ours[key] / peer[key] if better else peer[key] / ours[key]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--dtype", choices=["bf16", "f32"],
                   help="precision of troupe's base and the peers' model (default: bf16 on cuda, f32 on the CPU)")
    p.add_argument("--python", default=sys.executable, help="a Python with torch, transformers, peft, trl")
    p.add_argument("--reward", choices=sorted(REWARD_SCRIPTS), default="noise",
                   help="the iterations' reward on both sides: noise (seeded, differs for every reply, so no group "
                        "ties; the default) or length (TRL's length reward, which a random preset's short text "
                        "can tie)")
    p.add_argument("--reward-python", default="python3", help="the Python that serves troupe's reward")
    p.add_argument("--troupe", default=os.path.join(ROOT, "target/release/troupe"))
    p.add_argument("--target-dir", default=os.path.join(ROOT, "target"),
                   help="cargo's target dir for the benches; criterion writes its results under it")
    p.add_argument("--benches", help="a folder holding the benchmark executables `model` and `adapters`, built "
                   "beforehand (`cargo bench --no-run [--features cuda] --bench model --bench adapters` prints "
                   "their paths), for a machine without cargo; default: `cargo bench` builds and runs them")
    p.add_argument("--preset", default="qwen3-0.6b",
                   help="the models of the whole-iteration comparison, separated by commas (qwen3-0.6b,qwen3-1.7b)")
    p.add_argument("--kernel-presets", default="small,qwen3-0.6b",
                   help="the models of the kernel table, separated by commas")
    p.add_argument("--bench-seconds", type=float,
                   help="criterion's measurement time per benchmark (warm-up 1 s); default: criterion's own")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="the peers' CPU threads")
    p.add_argument("--memory-preset", default="qwen3-4b", help="the model of the memory run")
    p.add_argument("--memory-iterations", type=int, default=2)
    p.add_argument("--attention-kernels", default="materialized,flash",
                   help="the attention kernels the prefill / decode benchmarks run with: materialized (compared "
                        "with PyTorch), flash (reported against materialized), or both")
    p.add_argument("--burn-kernels", action="store_true",
                   help="run the prefill / decode benchmarks once more with burn's composites in place of troupe's "
                        "GPU kernels (TROUPE_GPU_KERNELS=burn), to compare the two")
    p.add_argument("--troupe-autotune", default=None,
                   help="a troupe built with --features autotune: after each --preset's iterations, the "
                        "same run with it, two iterations longer (the tuning happens in the first ones)")
    p.add_argument("--kernel-profile", action="store_true",
                   help="after each --preset's iterations, one more troupe run of the same shape with "
                        "--profile-kernels (launches and device time per phase and kernel; a debug aid, "
                        "its seconds are not the timed figures)")
    p.add_argument("--width-steps", default="",
                   help="after each --preset's iterations, the same run once for each of these batch paddings "
                        "(TROUPE_WIDTH_STEP: rows padded to a multiple of S slots; 1 pads to the longest), "
                        "separated by commas, to compare with the default (8 on a GPU)")
    p.add_argument("--copied-prompts", action="store_true",
                   help="after each --preset's iterations, the same run with each reply's row holding its own copy "
                        "of its group's prompt in the rollout's cache and the update (runtime.prompt_cache=copied), "
                        "to compare seconds and memory with the default (held once per group on a GPU)")
    p.add_argument("--f32-kv-cache", action="store_true",
                   help="after each --preset's iterations, the same run with the rollout's KV cache held in f32 "
                        "(runtime.kv_cache=f32), to compare seconds and memory with the default (the base's "
                        "bf16 or f16 on a GPU)")
    p.add_argument("--gemm", action="store_true",
                   help="time the frozen products at each iteration preset by each cubek routine, and PyTorch's")
    p.add_argument("--gemm-rows", default="2048", help="the rows of the --gemm products (64 is a decoding step's)")
    p.add_argument("--gemm-kernels", default=GEMM_KERNELS,
                   help="the routines --gemm times (TROUPE_MATMUL's names), or `all`")
    p.add_argument("--matmul", default="",
                   help="routines (TROUPE_MATMUL) to run each iteration preset once more with; `best`: --gemm's")
    p.add_argument("--draw", action="store_true",
                   help="time decoding's draw alone on the GPU (64 rows of 151,936 logits; top-p, top-k then "
                        "top-p, the whole distribution, greedy) against transformers' sampling, after the kernel table")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-iteration", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--quick", action="store_true", help="smallest settings: checks the script, measures nothing")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.quick:
        args.preset, args.reps, args.iterations, args.memory_preset = "tiny", 1, 2, "tiny"
        args.kernel_presets = "tiny"
        args.groups, args.group_size, args.new_tokens = 1, 2, 8
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "f32"
    kernels = args.attention_kernels.split(",")
    if "materialized" not in kernels or not set(kernels) <= {"materialized", "flash"}:
        sys.exit(f"error: --attention-kernels {args.attention_kernels}: materialized, or materialized,flash")
    steps = [step.strip() for step in args.width_steps.split(",") if step.strip()]
    if not all(step.isdigit() and int(step) >= 1 for step in steps):
        sys.exit(f"error: --width-steps {args.width_steps}: positive counts of slots separated by commas")
    width_steps = [int(step) for step in steps]
    if args.troupe_autotune and not os.access(args.troupe_autotune, os.X_OK):
        sys.exit(f"error: --troupe-autotune {args.troupe_autotune}: no such executable")
    if not os.access(args.troupe, os.X_OK):
        sys.exit(f"error: --troupe {args.troupe}: no such executable (cargo build --release first)")
    needed = (([] if args.skip_kernels else ["model", "adapters"]) + (["gemm"] if args.gemm else [])
              + (["sampling"] if args.draw else []))
    for name in needed if args.benches else ():
        if not os.access(os.path.join(args.benches, name), os.X_OK):
            sys.exit(f"error: --benches {args.benches}: no executable `{name}` in it")
    if not all(r.strip().isdigit() and int(r) >= 1 for r in args.gemm_rows.split(",")):
        sys.exit(f"error: --gemm-rows {args.gemm_rows}: positive counts of rows separated by commas")
    matmuls = [k.strip() for k in args.matmul.split(",") if k.strip()]
    # The routines' names, from the binary, only when a routine is asked for.
    known = known_matmul_kernels(args.troupe) if args.gemm or matmuls else []
    gemm_kernels = known if args.gemm_kernels == "all" else [k.strip() for k in args.gemm_kernels.split(",")]
    for kernel in (gemm_kernels if args.gemm else []) + [k for k in matmuls if k != "best"]:
        if kernel not in known:
            sys.exit(f"error: unknown matmul kernel {kernel!r} (known: {', '.join(known)})")
    if "best" in matmuls and not args.gemm:
        sys.exit("error: --matmul best needs --gemm, whose fastest routine it runs")
    result = {"machine": machine(args.device, args.python), "device": args.device, "dtype": args.dtype,
              "reward": args.reward, "quick": args.quick,
              "settings": {k: getattr(args, k) for k in ("preset", "reps", "iterations", "groups",
                                                          "group_size", "new_tokens", "threads",
                                                          "memory_preset", "memory_iterations")}}
    with tempfile.TemporaryDirectory(prefix="troupe-figures-") as work:
        made = set()

        def model_dir_of(preset):
            path = os.path.join(work, preset)
            if preset not in made:
                # Stored in the run's dtype: a bf16 file, as Qwen publishes its checkpoints, is
                # half the disk and write time of an f32 one and gives every bf16 side the same
                # weights (each f32 value drawn, rounded once).
                run([args.troupe, "init-model", "--out", path, "--preset", preset, "--dtype", args.dtype],
                    log=subprocess.DEVNULL)
                made.add(preset)
            return path

        for preset in [] if args.skip_kernels else args.kernel_presets.split(","):
            directory = model_dir_of(preset)
            criterion_dir = os.path.join(args.target_dir, "criterion")
            kernels = {"troupe": [], "pytorch": [], "ratio": []}
            for _ in range(args.reps):
                ours = troupe_kernels(args, criterion_dir, preset)
                peer = last_json(run([args.python, "tools/peer_bench.py", directory, "--device", args.device,
                                      "--dtype", args.dtype, "--threads", str(args.threads)], log=subprocess.DEVNULL),
                                 "peer_bench.py")
                kernels["troupe"].append(ours)
                kernels["pytorch"].append(peer)
                kernels["ratio"].append(ratios(ours, peer, {"prefill_tok_s_b1": True, "prefill_tok_s_b16": True,
                                                            "decode_tok_s_b1": True, "decode_tok_s_b16": True,
                                                            "lora_train_tok_s_b8x128": True}))
            result[f"kernels_{preset}"] = kernels
            write(args.out, result)
        if args.draw and args.device != "cpu":
            draw = {"troupe": [], "transformers": [], "ratio": []}
            for _ in range(args.reps):
                ours = device_draw(args, os.path.join(args.target_dir, "criterion"))
                peer = last_json(run([args.python, "tools/peer_bench.py", "--draw", "--device", args.device,
                                      "--threads", str(args.threads)], log=subprocess.DEVNULL), "peer_bench.py --draw")
                draw["troupe"].append(ours)
                draw["transformers"].append(peer)
                # Above 1 when troupe's draw takes less time.
                draw["ratio"].append({key: peer[key] / ours[key] for key in ours if key in peer})
            result["device_draw_64x151936"] = draw
            write(args.out, result)
        best_kernel = {}
        for preset in args.preset.split(",") if args.gemm else []:
            model_dir = model_dir_of(preset)
            layers = layers_of(model_dir)
            part = {"rows": args.gemm_rows, "kernels": gemm_kernels, "troupe_tflops": [], "torch_tflops": []}
            for _ in range(args.reps):
                ours, torch = frozen_products(args, os.path.join(args.target_dir, "criterion"), model_dir, preset,
                                              gemm_kernels)
                part["troupe_tflops"].append(ours)
                part["torch_tflops"].append(torch)
            last, torch = part["troupe_tflops"][-1], part["torch_tflops"][-1]
            part["fastest_kernel"] = {key: max(rates, key=rates.get) for key, rates in last.items() if rates}
            part["troupe_best_over_torch"] = [{key: max(rates.values()) / t[key] for key, rates in o.items()
                                               if rates and key in t} for o, t in zip(part["troupe_tflops"],
                                                                                      part["torch_tflops"])]
            part["troupe_auto_over_torch"] = [{key: rates["auto"] / t[key] for key, rates in o.items()
                                               if "auto" in rates and key in t} for o, t in zip(part["troupe_tflops"],
                                                                                               part["torch_tflops"])]
            # One micro-batch's frozen products by each routine, and by PyTorch, in seconds.
            # A routine that launched none of the products is no candidate (troupe would run auto).
            launched = [k for k in gemm_kernels if any(k in rates for rates in last.values())]
            seconds = {k: update_products_seconds(last, layers, k) for k in launched}
            seconds = {k: v for k, v in seconds.items() if v is not None}
            part["update_products_s"] = seconds
            if torch:
                part["update_products_s_torch"] = update_products_seconds(
                    {key: {"auto": rate} for key, rate in torch.items()}, layers, "auto")
            if seconds:
                best_kernel[preset] = part["update_products_best"] = min(seconds, key=seconds.get)
            result[f"frozen_products_{preset}"] = part
            write(args.out, result)
        gemm = None
        for preset in [] if args.skip_iteration else args.preset.split(","):
            model_dir = model_dir_of(preset)
            iteration = {"troupe": [], "trl": [], "trl_s_per_step_over_troupe_s_per_iteration": []}
            for rep in range(args.reps):
                ours = troupe_iteration(args, model_dir, work, f"{preset}-{rep}")
                peer = trl_iteration(args, model_dir)
                iteration["troupe"].append(ours)
                iteration["trl"].append(peer)
                iteration["trl_s_per_step_over_troupe_s_per_iteration"].append(
                    peer["s_per_step"] / ours["s_per_iteration"])
            if gemm is None:
                gemm = result["gemm"] = gemm_tflops(args)
            iteration["update_flop_fraction_of_gemm"] = [
                [rate / (gemm["tflops"] * 1e3) if rate else None for rate in ours["update_gflop_per_s"]]
                for ours in iteration["troupe"]]
            result[f"iteration_{preset}"] = iteration
            write(args.out, result)
            if args.kernel_profile:
                profiled = troupe_iteration(args, model_dir, work, f"{preset}-kernels", flags=("--profile-kernels",))
                result[f"kernel_profile_{preset}"] = profiled["kernels"]
                write(args.out, result)
            for step in width_steps:
                # The same run with the rows of every batch padded to a multiple of `step` slots.
                padded = troupe_iteration(args, model_dir, work, f"{preset}-width{step}",
                                          env={"TROUPE_WIDTH_STEP": str(step)})
                iteration[f"troupe_width_step_{step}"] = padded
                iteration[f"troupe_width_step_{step}_s_over_troupe_s_per_iteration"] = [
                    padded["s_per_iteration"] / ours["s_per_iteration"] for ours in iteration["troupe"]]
                write(args.out, result)
            if args.copied_prompts:
                # The same run with every row's own copy of its group's prompt in the rollout's cache.
                copied = troupe_iteration(args, model_dir, work, f"{preset}-copied",
                                          {"runtime.prompt_cache": "copied"})
                iteration["troupe_copied_prompts"] = copied
                iteration["troupe_copied_prompts_s_over_troupe_s_per_iteration"] = [
                    copied["s_per_iteration"] / ours["s_per_iteration"] for ours in iteration["troupe"]]
                write(args.out, result)
            if args.f32_kv_cache:
                # The same run with the rollout's keys and values held in f32.
                wide = troupe_iteration(args, model_dir, work, f"{preset}-f32-cache", {"runtime.kv_cache": "f32"})
                iteration["troupe_f32_kv_cache"] = wide
                iteration["troupe_f32_kv_cache_s_over_troupe_s_per_iteration"] = [
                    wide["s_per_iteration"] / ours["s_per_iteration"] for ours in iteration["troupe"]]
                write(args.out, result)
            for kernel in matmuls:
                # The same run with the frozen products by another cubek routine.
                name = best_kernel.get(preset) if kernel == "best" else kernel
                if name is None:
                    continue
                other = troupe_iteration(args, model_dir, work, f"{preset}-matmul-{name}",
                                         env={"TROUPE_MATMUL": name})
                key = "troupe_matmul_best" if kernel == "best" else f"troupe_matmul_{name}"
                iteration[key] = {**other, "kernel": name}
                iteration[f"{key}_s_over_troupe_s_per_iteration"] = [
                    other["s_per_iteration"] / ours["s_per_iteration"] for ours in iteration["troupe"]]
                write(args.out, result)
            if args.troupe_autotune:
                # The same run on the build with burn's autotune (`--features autotune`): its first
                # iterations tune each new shape, so its later ones are the figure.
                tuned = troupe_iteration(args, model_dir, work, f"{preset}-autotune",
                                         {"run.iterations": args.iterations + 2}, troupe=args.troupe_autotune)
                iteration["troupe_autotune"] = tuned
                iteration["troupe_autotune_last_s_over_troupe_s_per_iteration"] = [
                    tuned["iteration_s"][-1] / ours["s_per_iteration"] for ours in iteration["troupe"]]
                write(args.out, result)
        if not args.skip_memory:
            # Two agents, LoRA r16 on q,k,v,o: the memory goal's set-up, the iteration's shape.
            memory_dir = os.path.join(work, args.memory_preset)
            model_dir_of(args.memory_preset)
            lora = {"adapter.r": 16, "adapter.lora_alpha": 32.0,
                    "adapter.target_modules": "[q_proj, k_proj, v_proj, o_proj]",
                    "run.iterations": args.memory_iterations}
            memory = {}
            for checkpointing in (False, True):
                ours = troupe_iteration(args, memory_dir, work, f"memory-{checkpointing}",
                                        {**lora, "runtime.gradient_checkpointing": str(checkpointing).lower()})
                memory["gradient_checkpointing" if checkpointing else "plain"] = ours
            result[f"memory_{args.memory_preset}"] = memory
    write(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


def write(path, result):
    """Writes the figures so far, atomically: a run cut short keeps every part it finished."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
