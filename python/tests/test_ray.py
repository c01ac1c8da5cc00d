"""Rollouts on Ray (troupe.ray): two local actors sample what one process samples, an actor killed
mid-iteration is replaced and its episodes played again, and only adapters are shipped.

Run from the repository root: python3 -m pytest python/tests -v
"""

import pytest

troupe = pytest.importorskip("troupe", reason="the troupe package is not installed (pip install .)")
ray = pytest.importorskip("ray", reason="troupe.ray needs Ray (pip install 'ray>=2.9')")
import troupe.ray  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def recording_trainer(path, log):
    """A trainer whose reward function records every completion it is given, per iteration."""

    def reward(a, b, items):
        log.append(list(zip(a, b)))
        return [len(x) / 100 - len(y) / 200 for x, y in zip(a, b)]

    config = {
        "run": {"iterations": 2, "checkpoint_every": 100, "seed": 5},
        "action": {"max_new_tokens": 12},
        "training": {"group_size": 3, "groups_per_iteration": 2, "optimizer": {"lr": 5.0e-3}, "warmup_iterations": 0},
    }
    return troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[reward], config=config, output_dir=path)


def test_two_actors_sample_what_one_process_samples_and_survive_a_kill(tmp_path, local_ray):
    single_log, ray_log, killed_log = [], [], []
    single = recording_trainer(tmp_path / "single", single_log)
    single_metrics = single.train()

    on_ray = recording_trainer(tmp_path / "ray", ray_log)
    runner = troupe.ray.RayRunner(on_ray, num_actors=2, timeout_s=120)
    ray_metrics = runner.train()
    assert ray_log == single_log, "the same completions, episode by episode"
    for a, b in zip(single_metrics, ray_metrics):
        assert a["mean_return"] == b["mean_return"]
        assert abs(a["loss"] - b["loss"]) < 1e-6
    # Only adapters travel: each actor got every agent's PEFT files once per iteration.
    log = runner.sync_log
    assert len(log) == 2 and all(entry["restarts"] == 0 for entry in log)
    assert all(0 < entry["adapter_bytes_sent"] < 2 * 2 * 1_000_000 for entry in log)
    runner.shutdown()

    killed = recording_trainer(tmp_path / "killed", killed_log)
    runner = troupe.ray.RayRunner(killed, num_actors=2, timeout_s=120)
    runner._kill_after_dispatch = 0
    runner.step()
    runner.step()
    assert runner.restarts == 1, "the killed actor was replaced once"
    assert killed_log == single_log, "its episodes were played again, the same"
    runner.shutdown()


def test_a_python_environment_plays_on_the_actors(tmp_path, local_ray):
    import test_package
    from test_package import Nim

    # The actors unpickle the environment class: ship the test module by value, since the
    # actors' processes cannot import it by name.
    ray.cloudpickle.register_pickle_by_value(test_package)

    def played(log):
        def reward(a, b, items):
            log.append([item["seed"] for item in items] + list(a) + list(b))
            return [0.0 for _ in a]
        return reward

    config = {
        "run": {"iterations": 1, "checkpoint_every": 100, "seed": 2},
        "action": {"mode": "choice"},
        "training": {"group_size": 2, "groups_per_iteration": 2, "max_episode_steps": 20},
    }
    single_log, ray_log = [], []
    troupe.MAGRPOTrainer(num_agents=2, env=Nim, reward_funcs=[played(single_log)], config=config,
                         output_dir=tmp_path / "single").train()
    trainer = troupe.MAGRPOTrainer(num_agents=2, env=Nim, reward_funcs=[played(ray_log)], config=config,
                                   output_dir=tmp_path / "ray")
    runner = troupe.ray.RayRunner(trainer, num_actors=2, timeout_s=120)
    runner.train()
    runner.shutdown()
    assert ray_log == single_log and single_log
