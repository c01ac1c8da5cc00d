"""troupe from Python: train teams of LLM agents (one LoRA adapter each over one frozen base)
by multi-agent GRPO, with the Rust engine doing the work.

    import troupe

    def cooperative(completions_agent0, completions_agent1, batch_items):
        return [float("cooperate" in a + b) for a, b in zip(completions_agent0, completions_agent1)]

    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[cooperative],
                                   config={"run": {"iterations": 20}})
    trainer.train()
    print(trainer.evaluate())
    trainer.save_adapters("adapters/")      # PEFT directories, one per agent

The names follow the multi-agent trainers people know (``MAGRPOTrainer``, ``reward_funcs``,
``reward_weights``, ``train_dataset``). Everything the command line's config file says can be
given as ``config`` (a dict, or the path of a YAML file); the keyword arguments fill in the parts
they name. The engine runs with the GIL released; Python reward functions and environments are
called back in batches. Rollouts scale out over Ray with :mod:`troupe.ray`.
"""

import copy
import json
import os
import re
import shutil
import tempfile
import weakref

# The protocol helpers, python/troupe_env.py and python/troupe_reward.py (standalone modules an
# external process runs on its own), are part of the package through symbolic links.
from . import _env as troupe_env
from . import _reward as troupe_reward
from . import _engine
from ._engine import RolloutWorker, Run

Environment = troupe_env.Environment
IllegalAction = troupe_env.IllegalAction

__all__ = ["MAGRPOTrainer", "Environment", "IllegalAction", "Run", "RolloutWorker", "__version__"]
__version__ = _engine.__version__

#: What a trainer starts from before ``config`` and the keyword arguments: the built-in model,
#: two agents, the writing task (TL;DR summaries), short replies.
DEFAULT_CONFIG = {
    "run": {"seed": 0, "iterations": 10, "checkpoint_every": 5, "log_every": 1},
    "model": {"path": None, "preset": "tiny", "seed": 0, "device": "cpu"},
    "env": {"name": "writing_tldr"},
    "agents": {"num_agents": 2, "mode": "per_agent"},
    "action": {"mode": "free", "max_new_tokens": 32},
    "training": {"group_size": 4, "groups_per_iteration": 2, "warmup_iterations": 0},
    "eval": {"episodes": 16, "env": {"split": "test"}},
}


def _merge(base, extra):
    """``base`` with ``extra`` merged in, nested dicts key by key (``extra`` wins)."""
    out = copy.deepcopy(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _load_config(config):
    """``config`` as a dict: a dict as given, or the YAML file at that path."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    import yaml  # only needed for a config file

    with open(path, encoding="utf-8") as f:
        loaded = yaml.safe_load(f)
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: a troupe config is a YAML mapping")
    return loaded


class _InProcessServer:
    """The external environment protocol's server (the one ``troupe_env.serve`` runs) answering
    request lines in this process: the engine calls :meth:`call` instead of writing to a pipe."""

    def __init__(self, factory):
        self._server = troupe_env._Server(factory)

    def call(self, line):
        response = troupe_env._handle(self._server, line)
        try:
            return json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as err:
            return json.dumps({"id": response.get("id"), "error": f"the answer is not JSON: {err}"})


def _env_factory(env):
    """``factory(params)`` building a fresh episode object from what the user gave: an
    :class:`Environment` instance (deep-copied), a subclass (instantiated), or a callable taking
    the config's parameters."""
    if isinstance(env, troupe_env.Environment):
        return lambda params: copy.deepcopy(env)
    if isinstance(env, type) and issubclass(env, troupe_env.Environment):
        return lambda params: env()
    if callable(env):
        return env
    raise TypeError(f"env must be a troupe.Environment, a subclass of it, or a factory; got {type(env).__name__}")


class _ServerFactory:
    """A picklable zero-argument callable making an in-process server over ``factory`` (what
    the engine calls once per distinct set of environment parameters)."""

    def __init__(self, factory):
        self.factory = factory

    def __call__(self):
        return _InProcessServer(self.factory)


class _DatasetEnv(troupe_env.Environment):
    """One prompt of a dataset to every agent at once; each replies once. The rewards come from
    the reward functions (the environment gives 0); metric ``item`` is the prompt's index and
    ``test`` whether it is an evaluation prompt."""

    def __init__(self, rows, num_agents, field, instructions, test):
        self.rows, self.num_seats, self.field, self.instructions_text = rows, num_agents, field, instructions
        self.test = test
        self.name = "dataset"
        self.index, self.done = 0, False

    def reset(self, seed):
        self.index, self.done = seed % len(self.rows), False

    def acting_seats(self):
        return list(range(self.num_seats))

    def instructions(self, seat):
        text = self.instructions_text
        return text[seat] if isinstance(text, (list, tuple)) else text

    def observation(self, seat):
        return str(self.rows[self.index][self.field])

    def legal_actions(self, seat):
        return None

    def step(self, actions):
        self.done = True
        return None

    def is_terminal(self):
        return self.done

    def metrics(self):
        return {"score": 0.0, "item": float(self.index), "test": float(self.test)}


class _DatasetFactory:
    """Builds :class:`_DatasetEnv` episodes: ``split: test`` draws from the evaluation rows."""

    def __init__(self, train, test, num_agents, field, instructions):
        self.train, self.test = train, test or train
        self.num_agents, self.field, self.instructions = num_agents, field, instructions

    def __call__(self, params):
        test = params.get("split") == "test"
        return _DatasetEnv(self.test if test else self.train, self.num_agents, self.field, self.instructions, test)


_LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class _BatchReward:
    """A reward function ``fn(completions_agent0, ..., batch_items) -> list`` as the engine calls
    it (every episode of an iteration as JSON; one list of values per episode back). The
    arguments are what ``troupe_reward.serve_reward`` passes an external function; with a
    ``train_dataset`` each batch item is the dataset row the episode was built from."""

    def __init__(self, fn, dataset=None):
        self.fn, self.dataset = fn, dataset
        self.name = getattr(fn, "__name__", type(fn).__name__)

    def _rows(self, episodes):
        if self.dataset is None:
            return episodes
        rows = []
        for episode in episodes:
            item = int(episode["metrics"].get("item", 0))
            split_rows = self.dataset[1] if episode["metrics"].get("test") else self.dataset[0]
            rows.append(split_rows[item] if item < len(split_rows) else episode)
        return rows

    def __call__(self, items_json):
        episodes = json.loads(items_json)
        request = json.dumps({"id": 0, "method": "score", "episodes": episodes})
        answer = troupe_reward._answer(request, lambda *args: self.fn(*args[:-1], self._rows(args[-1])))
        if "error" in answer:
            raise ValueError(answer["error"])
        return [r if isinstance(r, list) else [r] for r in answer["result"]["rewards"]]


class MAGRPOTrainer:
    """Multi-agent GRPO over the Rust engine: ``num_agents`` agents, one LoRA adapter each, on one
    frozen base.

    model:          None (the built-in model), or a Hugging Face directory or GGUF file.
    num_agents:     agents (and seats, agent i in seat i unless ``config`` says otherwise).
    reward_funcs:   Python functions ``fn(completions_agent0, completions_agent1, ...,
                    batch_items) -> list`` (one float per episode, or a list of one per seat),
                    called once per iteration with every episode. Without any, the
                    environment's return is the reward.
    reward_weights: one weight per function (default 1 each).
    train_dataset:  a list of dicts with a ``"prompt"`` (see ``prompt_field``): every agent
                    answers each prompt; ``eval_dataset`` holds the evaluation's prompts.
    env:            a :class:`troupe.Environment` (instance, subclass or factory) played in this
                    process through the external protocol's checks, instead of a built-in one.
    config:         a dict or a YAML file path, as ``troupe train --config`` takes.
    output_dir:     the run directory (default: a fresh temporary one, removed when the trainer
                    is garbage-collected or Python exits; give a directory to keep the run).
    report_to:      where the metrics go besides ``metrics.jsonl``: ``"tensorboard"`` (event
                    files in ``output_dir/tensorboard/``) and ``"wandb"`` (through the ``wandb``
                    package, which must be installed; ``wandb_project`` names the project),
                    with TRL's metric names (docs/tracking.md).
    resume:         a run directory to continue from its newest checkpoint (its saved config
                    is used; give the same ``reward_funcs`` and ``env`` again). ``config`` may
                    then only raise ``run.iterations``.
    """

    def __init__(self, model=None, num_agents=2, reward_funcs=None, reward_weights=None, train_dataset=None,
                 eval_dataset=None, env=None, config=None, output_dir=None, prompt_field="prompt",
                 instructions="Answer the prompt.", report_to=None, wandb_project="troupe", resume=None):
        report_to = [report_to] if isinstance(report_to, str) else list(report_to or [])
        unknown = [r for r in report_to if r not in ("jsonl", "tensorboard", "wandb")]
        if unknown:
            raise ValueError(f"report_to: unknown tracker {unknown[0]!r} (known: jsonl, tensorboard, wandb)")
        self._wandb = None
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("report_to=['wandb'] needs the wandb package: pip install wandb") from err
            self._wandb, self._wandb_project = wandb, wandb_project
        self._wandb_run = None
        reward_funcs = list(reward_funcs or [])
        if reward_weights is not None and len(reward_weights) != len(reward_funcs):
            raise ValueError(f"{len(reward_weights)} reward_weights for {len(reward_funcs)} reward_funcs")
        if env is not None and train_dataset is not None:
            raise ValueError("give env or train_dataset, not both")
        user = _load_config(config)
        cfg = _merge(DEFAULT_CONFIG, user)
        if "env" in user and "env" not in user.get("eval", {}):
            cfg["eval"].pop("env", None)  # the default's test split belongs to the default environment
        if model is not None:
            cfg["model"]["path"] = os.fspath(model)
        agents = cfg.setdefault("agents", {})
        if num_agents is not None and "num_agents" not in user.get("agents", {}):
            agents["num_agents"] = num_agents
        agents.setdefault("seats", list(range(agents["num_agents"])))
        if "tensorboard" in report_to:
            cfg["run"]["report_to"] = ["jsonl", "tensorboard"]
        if resume is not None:
            output_dir = resume
        self.output_dir = os.fspath(output_dir) if output_dir else tempfile.mkdtemp(prefix="troupe-run-")
        if output_dir is None:
            os.rmdir(self.output_dir)  # the engine makes the run directory itself
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.output_dir, True)
        cfg["run"]["out_dir"] = self.output_dir

        self._envs = []
        dataset = None
        if train_dataset is not None:
            train = [dict(row) for row in train_dataset]
            test = [dict(row) for row in eval_dataset] if eval_dataset is not None else None
            if not train or any(prompt_field not in row for row in train + (test or [])):
                raise ValueError(f"train_dataset must be a non-empty list of dicts with a {prompt_field!r} key")
            factory = _DatasetFactory(train, test, agents["num_agents"], prompt_field, instructions)
            self._envs.append(("python_dataset", _ServerFactory(factory)))
            cfg["env"] = {"name": "python_dataset", "split": "train"}
            dataset = (train, test or train)
        elif env is not None:
            self._envs.append(("python_env", _ServerFactory(_env_factory(env))))
            cfg["env"] = {"name": "python_env"}
            cfg.setdefault("eval", {})["env"] = user.get("eval", {}).get("env", {})

        self._rewards = []
        if reward_funcs:
            functions, seen, labels = [], set(), set()
            for i, fn in enumerate(reward_funcs):
                wrapped = _BatchReward(fn, dataset)
                name = f"py_{wrapped.name}"
                while name in seen:
                    name = f"{name}_{i}"
                seen.add(name)
                self._rewards.append((name, wrapped))
                weight = 1.0 if reward_weights is None else float(reward_weights[i])
                function = {"name": name, "weight": weight}
                # Its metrics go under rewards/<fn.__name__>/mean, as TRL names them (a name that
                # is not a metric name, such as a lambda's, keeps the registered one).
                if _LABEL.fullmatch(wrapped.name) and wrapped.name not in labels:
                    function["label"] = wrapped.name
                    labels.add(wrapped.name)
                functions.append(function)
            cfg.setdefault("rewards", {})["functions"] = functions
        self.config = cfg
        # JSON is YAML: the engine reads the dict as its config file.
        if resume is not None:
            iterations = user.get("run", {}).get("iterations")
            overrides = [] if iterations is None else [f"run.iterations={int(iterations)}"]
            self._run = Run("", os.fspath(resume), self._rewards, self._envs, os.fspath(resume), overrides)
            import yaml

            self.config = yaml.safe_load(self._run.config_yaml())
        else:
            self._run = Run(json.dumps(cfg), "<MAGRPOTrainer config>", self._rewards, self._envs)
        self.history = []

    @property
    def run(self):
        """The engine's run (:class:`troupe.Run`): iterations, plans, checkpoints."""
        return self._run

    @property
    def config_yaml(self):
        """The resolved config, every default included (what the run directory's config.yaml holds)."""
        return self._run.config_yaml()

    def train(self, iterations=None, step=None):
        """Runs the configured iterations (or ``iterations`` more) with ``step`` (default
        :meth:`step`; :class:`troupe.ray.RayRunner` passes its own); returns their metrics lines."""
        step = step or self.step
        target = None if iterations is None else self._run.iteration() + iterations
        out = []
        while not self._run.finished() and (target is None or self._run.iteration() < target):
            out.append(step())
        return out

    def step(self):
        """One iteration (rollouts, rewards, update); returns its metrics line as a dict."""
        line = self._run.run_iteration()
        metrics = json.loads(line)
        self.history.append(metrics)
        self._track(line, metrics)
        return metrics

    def _track(self, line, metrics):
        """Logs a metrics line to W&B (``report_to=["wandb"]``) under TRL's names."""
        if self._wandb is None:
            return
        if self._wandb_run is None:
            self._wandb_run = self._wandb.init(project=self._wandb_project, dir=self.output_dir,
                                               config=self.config, reinit=True)
        self._wandb_run.log(dict(_engine.trl_scalars(line)), step=metrics["iteration"])

    def finish(self):
        """Closes the W&B run, if any (also done when Python exits)."""
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def evaluate(self, episodes=None):
        """Plays ``episodes`` held-out episodes (default ``eval.episodes``; the evaluation prompts or
        ``eval.env``) and returns per agent the reward's mean and standard error (``reward``),
        each reward function's by its name (``rewards``), the ``score`` metric's, and a few
        replies."""
        return json.loads(self._run.evaluate(episodes))

    def save_adapters(self, directory):
        """Saves every agent's adapter as a PEFT directory under ``directory`` (``agent_0/``, ...),
        loadable with ``PeftModel.from_pretrained(base, directory + "/agent_0")``."""
        self._run.save_adapters(os.fspath(directory))

    def logprobs(self, text, agent=None):
        """``(token_ids, logprobs)`` of ``text`` under the base with agent ``agent``'s adapter
        (``None``: the base alone); ``logprobs[i]`` is log p(token i + 1 | tokens up to i)."""
        return self._run.logprobs(text, agent)
