"""Rollout throughput of troupe.ray with 1 and 2 local actors beside the single-process run, and
the bytes each iteration ships (adapters only) against what shipping the base would cost.

    python3 python/examples/ray_throughput.py [--iterations 3] [--preset tiny]

Prints one JSON line per setting: generated tokens per second of the rollout phase (sync and
dispatch included), seconds per iteration, adapter bytes sent per iteration (all actors), and the
f32 base's bytes times the actors.
"""

import argparse
import json
import os
import tempfile
import time

import ray

import troupe
import troupe.ray


def reward(a, b, items):
    return [len(x) / 100 + len(y) / 100 for x, y in zip(a, b)]


def config(iterations, preset):
    return {
        "run": {"iterations": iterations, "checkpoint_every": 1000, "seed": 1},
        "model": {"preset": preset},
        "action": {"max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0},
        "training": {"group_size": 4, "groups_per_iteration": 4, "optimizer": {"lr": 1.0e-3}, "warmup_iterations": 0},
    }


def base_bytes(trainer):
    with tempfile.TemporaryDirectory() as tmp:
        trainer.run.write_base_model(os.path.join(tmp, "base"))
        return sum(os.path.getsize(os.path.join(tmp, "base", f)) for f in os.listdir(os.path.join(tmp, "base"))
                   if f.endswith(".safetensors"))


def summarize(label, metrics, actors, sync=None, base=None):
    steady = metrics[1:] or metrics  # the first iteration also starts the actors' models
    out = {
        "setting": label,
        "actors": actors,
        "rollout_tokens_per_second": sum(m["tokens_per_second"] for m in steady) / len(steady),
        "seconds_per_iteration": sum(m["seconds"] for m in steady) / len(steady),
    }
    if sync:
        out["adapter_bytes_per_iteration"] = sum(s["adapter_bytes_sent"] for s in sync) / len(sync)
        out["episode_bytes_per_iteration"] = sum(s["episode_bytes_received"] for s in sync) / len(sync)
        out["full_base_bytes_per_iteration"] = base * actors
    print(json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--preset", default="tiny")
    a = p.parse_args()
    single = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[reward], config=config(a.iterations, a.preset))
    summarize("single process", single.train(), 0)
    base = base_bytes(single)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    for actors in (1, 2):
        trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[reward], config=config(a.iterations, a.preset))
        runner = troupe.ray.RayRunner(trainer, num_actors=actors, timeout_s=600)
        started = time.perf_counter()
        metrics = runner.train()
        summarize(f"ray, {actors} actor(s), {time.perf_counter() - started:.1f} s in all", metrics, actors,
                  runner.sync_log, base)
        runner.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
