"""The Python package `troupe` over the Rust engine: a Python reward function trained up, a Python
environment object played through the protocol's checks, adapters loaded by PEFT.

Needs the package installed (`pip install .`, or the extension module built in place: see
.ci/run). Run from the repository root: python3 -m pytest python/tests -v
"""

import json
import os

import pytest

troupe = pytest.importorskip("troupe", reason="the troupe package is not installed (pip install .)")

LETTERS = set("cooperate")


def cooperate_letters(completions_agent0, completions_agent1, batch_items):
    """A toy reward the built-in random model can climb: the share of each reply's letters that are
    letters of "cooperate" (one value per episode, shared by both agents)."""
    def share(text):
        letters = [c for c in text.lower() if c.isalpha()]
        return sum(c in LETTERS for c in letters) / max(len(letters), 1)

    return [(share(a) + share(b)) / 2 for a, b in zip(completions_agent0, completions_agent1)]


def small_config(iterations, **training):
    return {
        "run": {"iterations": iterations, "checkpoint_every": 100, "seed": 3},
        "action": {"max_new_tokens": 16},
        "training": {"group_size": 4, "groups_per_iteration": 2, "optimizer": {"lr": 5.0e-3}, "warmup_iterations": 0, **training},
        "eval": {"episodes": 16},
    }


def test_a_python_reward_function_is_trained_up(tmp_path):
    calls = []

    def reward(completions_agent0, completions_agent1, batch_items):
        calls.append(len(completions_agent0))
        assert all(len(item["prompts"]) == 2 and item["prompts"][0] for item in batch_items), "every episode's prompts"
        return cooperate_letters(completions_agent0, completions_agent1, batch_items)

    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[reward], config=small_config(12),
                                   output_dir=tmp_path / "run")
    before = trainer.evaluate()
    history = trainer.train()
    after = trainer.evaluate()
    # One batched call per iteration (2 groups x 4 episodes), between the evaluations' (16 each).
    assert len(history) == 12 and calls == [16] + [8] * 12 + [16]
    first = sum(h["mean_return"]["0"] for h in history[:3]) / 3
    last = sum(h["mean_return"]["0"] for h in history[-3:]) / 3
    # Held-out posts: the trained agents' reward beats the untrained ones' by several standard errors.
    gain = after["reward"]["0"]["mean"] - before["reward"]["0"]["mean"]
    se = (after["reward"]["0"]["stderr"] ** 2 + before["reward"]["0"]["stderr"] ** 2) ** 0.5
    print(f"training reward {first:.3f} -> {last:.3f}; held-out {before['reward']['0']} -> {after['reward']['0']}")
    assert last > first
    assert gain > 3 * se, (before["reward"], after["reward"])
    # The function has its own metric under its __name__, as TRL names it: with one function of
    # weight 1 (the environment gives 0), it is each agent's return.
    for h in history:
        assert abs(h["extra"]["rewards/reward/mean"] - h["mean_return"]["0"]) < 1e-9, h["extra"]
        assert "rewards/reward/std" in h["extra"]
    assert abs(after["rewards"]["reward"]["mean"] - after["reward"]["0"]["mean"]) < 1e-9, after
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_reward_weights_and_a_failing_reward_function(tmp_path):
    def one(a, b, items):
        return [1.0] * len(a)

    def per_seat(a, b, items):
        return [[0.0, 2.0] for _ in a]

    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[one, per_seat], reward_weights=[0.5, 1.0],
                                   config=small_config(1), output_dir=tmp_path / "w")
    metrics = trainer.step()
    assert metrics["mean_return"] == {"0": 0.5, "1": 2.5}

    def broken(a, b, items):
        raise KeyError("no such field")

    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[broken], config=small_config(1),
                                   output_dir=tmp_path / "b")
    with pytest.raises(RuntimeError, match="py_broken.*KeyError"):
        trainer.step()
    with pytest.raises(ValueError, match="2 reward_weights for 1 reward_funcs"):
        troupe.MAGRPOTrainer(reward_funcs=[one], reward_weights=[1, 2])


def test_a_train_dataset_and_its_rows_reach_the_reward_function(tmp_path):
    rows = [{"prompt": f"Say something about item {i}.", "target": i} for i in range(6)]
    seen = []

    def reward(a, b, items):
        seen.extend(item["target"] for item in items)
        return [float(item["target"]) for item in items]

    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[reward], train_dataset=rows[:4],
                                   eval_dataset=rows[4:], config=small_config(1), output_dir=tmp_path / "d")
    trainer.step()
    assert seen and set(seen) <= {0, 1, 2, 3}
    seen.clear()
    result = trainer.evaluate(episodes=4)
    assert set(seen) <= {4, 5} and result["reward"]["0"]["mean"] >= 4.0


class Nim(troupe.Environment):
    """Two seats take 1 to 3 stones in turn; whoever takes the last one wins."""

    name = "nim"
    num_seats = 2
    resets = 0

    def reset(self, seed):
        Nim.resets += 1
        self.stones, self.turn = 5 + seed % 7, 0

    def acting_seats(self):
        return [self.turn]

    def instructions(self, seat):
        return "Take 1 to 3 stones in turn; whoever takes the last stone wins. Answer `take N`."

    def observation(self, seat):
        return f"You are seat {seat}. {self.stones} stones are left."

    def legal_actions(self, seat):
        return [(n, f"take {n}") for n in range(1, min(3, self.stones) + 1)]

    def step(self, actions):
        self.stones -= actions[0]
        if self.stones == 0:
            return [1.0, -1.0] if self.turn == 0 else [-1.0, 1.0]
        self.turn = 1 - self.turn
        return None

    def is_terminal(self):
        return self.stones == 0


def test_a_python_environment_round_trips(tmp_path):
    config = small_config(2)
    config["action"] = {"mode": "choice"}
    config["training"]["max_episode_steps"] = 20
    Nim.resets = 0
    trainer = troupe.MAGRPOTrainer(num_agents=2, env=Nim, config=config, output_dir=tmp_path / "nim")
    history = trainer.train()
    assert Nim.resets >= 16, "every episode reset a Python object"
    # Every game ends with one winner: the seats' returns sum to zero, and each agent's mean
    # return is in [-1, 1].
    for h in history:
        assert abs(h["mean_return"]["0"] + h["mean_return"]["1"]) < 1e-9
        assert h["invalid_rate"] == 0.0
    result = trainer.evaluate(episodes=8)
    assert abs(result["score"]["mean"]) <= 1.0
    assert all(r.startswith("take ") for s in result["samples"] for r in s["replies"])


class Broken(Nim):
    def step(self, actions):
        super().step(actions)
        return [1.0]  # one reward for two seats


def test_a_python_environment_that_breaks_the_protocol_is_named(tmp_path):
    config = small_config(1)
    config["action"] = {"mode": "choice"}
    trainer = troupe.MAGRPOTrainer(num_agents=2, env=Broken, config=config, output_dir=tmp_path / "broken")
    with pytest.raises(RuntimeError, match="python_env"):
        trainer.step()


def test_saved_adapters_load_in_peft_with_the_same_logprobs(tmp_path):
    torch = pytest.importorskip("torch", reason="PEFT's check needs torch, transformers and peft")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[cooperate_letters], config=small_config(2),
                                   output_dir=tmp_path / "run")
    trainer.train()
    trainer.save_adapters(tmp_path / "adapters")
    trainer.run.write_base_model(str(tmp_path / "base"))
    text = "Two agents cooperate on a short summary of the post."
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    for agent in (0, 1):
        ids, ours = trainer.logprobs(text, agent)
        model = peft.PeftModel.from_pretrained(base, tmp_path / "adapters" / f"agent_{agent}").eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        theirs = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        _, plain = trainer.logprobs(text, None)
        assert max(abs(a - b) for a, b in zip(ours, plain)) > 1e-4, "the adapter changes the outputs"
        assert max(abs(a - float(b)) for a, b in zip(ours, theirs)) < 1e-4
        base = model.unload()
