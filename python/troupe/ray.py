"""Rollouts on Ray with adapter-only weight sync.

    import ray, troupe, troupe.ray
    ray.init()                                   # or ray.init(address="auto") on a cluster
    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[my_reward])
    runner = troupe.ray.RayRunner(trainer, num_actors=2)
    runner.train()

Each rollout actor (:class:`RolloutActor`) loads the frozen base once and, every iteration,
receives only the agents' LoRA adapters (the PEFT files, a few hundred kB to a few MB), never the
base. The learner (the trainer, in the driver process) begins each iteration with a plan (every
episode's environment seed and random stream), ships the adapters once through Ray's object
store, hands each actor a contiguous range of the plan's episodes, gathers the episodes, computes
the rewards and the update, and goes on. Because every episode draws from its own random stream,
a run gives the same samples with any number of actors as in one process.

An actor that dies (or does not answer within ``timeout_s``) is replaced by a new one, which
gets the adapters and plays the same range again; after ``max_restarts`` replacements of one
range the iteration fails with an error rather than waiting forever.
"""

import os
import shutil
import tempfile
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ._engine import RolloutWorker

__all__ = ["RayRunner", "RolloutActor", "read_adapter_files"]


def read_adapter_files(directory):
    """Every file under ``directory`` as ``{relative path: bytes}`` (what an actor is sent)."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


class _Actor:
    """A rollout worker in its own process: the base once, the adapters as last sent."""

    def __init__(self, config_yaml, envs):
        self.worker = RolloutWorker(config_yaml, "<ray rollout actor>", envs)
        self.adapters_dir = tempfile.mkdtemp(prefix="troupe-actor-")
        self.version = None

    def load_adapters(self, version, files):
        """Writes the adapters' files and loads them (skipped when ``version`` is loaded already)."""
        if version == self.version:
            return os.getpid()
        target = os.path.join(self.adapters_dir, str(version))
        for rel, data in files.items():
            path = os.path.join(target, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        self.worker.load_adapters(target)
        if self.version is not None:
            shutil.rmtree(os.path.join(self.adapters_dir, str(self.version)), ignore_errors=True)
        self.version = version
        return os.getpid()

    def play(self, version, files, plan, start, end):
        """Episodes ``start..end`` of ``plan`` (JSON), as JSON bytes, with the adapters of
        ``version`` (loaded from ``files`` first unless they are loaded already)."""
        self.load_adapters(version, files)
        return self.worker.play(plan, start, end)

    def pid(self):
        return os.getpid()


#: The Ray actor class (``ray.remote`` of :class:`_Actor`); options are set per runner.
RolloutActor = ray.remote(_Actor)


class RayRunner:
    """Trains ``trainer`` (a :class:`troupe.MAGRPOTrainer`) with its rollouts played by
    ``num_actors`` Ray actors.

    actor_options: passed to ``RolloutActor.options`` (e.g. ``{"num_cpus": 1}``, or
                   ``{"num_gpus": 1}`` on a GPU cluster).
    timeout_s:     the longest wait for one actor's range before it is replaced.
    max_restarts:  replacements of one range within an iteration before the iteration fails.
    """

    def __init__(self, trainer, num_actors=2, actor_options=None, timeout_s=600.0, max_restarts=3):
        if num_actors < 1:
            raise ValueError("num_actors must be at least 1")
        if not ray.is_initialized():
            ray.init()
        self.trainer = trainer
        self.run = trainer.run
        self.num_actors = num_actors
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.actor_options = dict(actor_options or {"num_cpus": 1})
        self._config_yaml = self.run.config_yaml()
        self._envs = trainer._envs
        self.actors = [self._new_actor() for _ in range(num_actors)]
        self.restarts = 0
        #: Per iteration: bytes of adapters sent (all actors), bytes of episodes received, seconds.
        self.sync_log = []
        self._version = 0
        # A test hook: the index of an actor to kill right after the next plays are sent.
        self._kill_after_dispatch = None

    def _new_actor(self):
        return RolloutActor.options(**self.actor_options).remote(self._config_yaml, self._envs)

    def _ranges(self, total):
        """Contiguous, near-equal ranges of ``total`` episodes, one per actor (some may be empty)."""
        base, extra = divmod(total, self.num_actors)
        ranges, start = [], 0
        for i in range(self.num_actors):
            end = start + base + (1 if i < extra else 0)
            ranges.append((start, end))
            start = end
        return ranges

    def _dispatch(self, i, plan, rng, files_ref):
        return self.actors[i].play.remote(self._version, files_ref, plan, rng[0], rng[1])

    def step(self):
        """One iteration: plan, ship adapters, play on the actors, learn. Returns the metrics."""
        import json

        started = time.perf_counter()
        plan_json = self.run.begin_iteration()
        plan = json.loads(plan_json)
        total = len(plan["starts"]) * plan["group_size"]
        with tempfile.TemporaryDirectory(prefix="troupe-sync-") as tmp:
            self.run.save_adapters(os.path.join(tmp, "adapters"))
            files = read_adapter_files(os.path.join(tmp, "adapters"))
        self._version += 1
        files_ref = ray.put(files)
        adapter_bytes = sum(len(b) for b in files.values())
        ranges = self._ranges(total)
        pending = {i: self._dispatch(i, plan_json, r, files_ref) for i, r in enumerate(ranges)}
        if self._kill_after_dispatch is not None:
            ray.kill(self.actors[self._kill_after_dispatch], no_restart=True)
            self._kill_after_dispatch = None
        parts = [None] * self.num_actors
        attempts = [0] * self.num_actors
        sent = adapter_bytes * self.num_actors
        while pending:
            i, ref = next(iter(pending.items()))
            try:
                parts[i] = ray.get(ref, timeout=self.timeout_s)
                del pending[i]
            except (RayActorError, GetTimeoutError, RayTaskError) as err:
                attempts[i] += 1
                if attempts[i] > self.max_restarts:
                    raise RuntimeError(
                        f"rollout actor {i} failed {attempts[i]} times on episodes {ranges[i][0]}..{ranges[i][1]}"
                        f" of iteration {plan['iteration']}: {err}"
                    ) from err
                ray.kill(self.actors[i], no_restart=True)
                self.actors[i] = self._new_actor()
                self.restarts += 1
                sent += adapter_bytes
                pending[i] = self._dispatch(i, plan_json, ranges[i], files_ref)
        rollout_seconds = time.perf_counter() - started
        metrics = json.loads(self.run.finish_iteration(parts, rollout_seconds))
        self.sync_log.append({
            "iteration": plan["iteration"],
            "adapter_bytes_sent": sent,
            "episode_bytes_received": sum(len(p) for p in parts),
            "rollout_seconds": rollout_seconds,
            "episodes": total,
            "restarts": self.restarts,
        })
        self.trainer.history.append(metrics)
        return metrics

    def train(self, iterations=None):
        """Runs the trainer's configured iterations (or ``iterations`` more) on the actors."""
        return self.trainer.train(iterations, step=self.step)

    def shutdown(self):
        """Stops the actors."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
