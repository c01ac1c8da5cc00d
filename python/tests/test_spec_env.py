"""A second environment written from envs/README.md alone (the protocol, "What an agent sees"),
served as an external process by python/troupe_env.py and trained by troupe: the prompt is the
one the spec shows, a reward function in `choice` mode receives the chosen actions' texts, episode
metrics land in metrics.jsonl as `env_<key>`, and an exception in the environment stops the run
naming itself and where it was raised."""

import json
import os
import sys
import textwrap

import pytest

troupe = pytest.importorskip("troupe", reason="the troupe package is not installed (pip install .)")

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

COUNT_TO_4 = textwrap.dedent('''
    import sys
    sys.path.insert(0, {python_dir!r})
    import troupe_env


    class CountTo4(troupe_env.Environment):
        name = "count_to_4"
        num_seats = 2

        def __init__(self, params):
            self.crash = params.get("crash", False)

        def reset(self, seed):
            self.total, self.turn, self.last = 0, 0, None

        def acting_seats(self):
            return [self.turn % 2]

        def instructions(self, seat):
            return 'We count together to 4. On your turn say "one" or "two" to add 1 or 2.'

        def observation(self, seat):
            said = "nothing yet" if self.last is None else self.last
            return f"The total is {{self.total}}. Your partner said {{said}}. Say one of: one, two."

        def legal_actions(self, seat):
            return [(1, "one"), (2, "two")]

        def step(self, actions):
            if self.crash:
                return 1 / 0
            self.total += actions[0]
            self.last = "one" if actions[0] == 1 else "two"
            self.turn += 1
            if self.is_terminal():
                return [float(self.total == 4)] * 2
            return [0.0, 0.0]

        def is_terminal(self):
            return self.total >= 4

        def metrics(self):
            return {{"score": float(self.total == 4), "turns": float(self.turn)}}


    troupe_env.serve(CountTo4)
''')


def write_env(tmp_path):
    path = tmp_path / "count_to_4.py"
    path.write_text(COUNT_TO_4.format(python_dir=PYTHON_DIR))
    return path


def config(env_path, **params):
    return {
        "run": {"iterations": 2, "checkpoint_every": 100, "seed": 1},
        "env": {"name": "external", "command": [sys.executable, str(env_path)], "params": params},
        "action": {"mode": "choice", "chat_template": False},
        "training": {"group_size": 2, "groups_per_iteration": 2, "optimizer": {"lr": 1.0e-3}},
        "eval": {"episodes": 4},
    }


def test_an_environment_written_from_the_spec_trains_as_the_spec_says(tmp_path):
    seen = []

    def exact_four(completions_agent0, completions_agent1, batch_items):
        seen.extend(batch_items)
        return [item["metrics"]["score"] for item in batch_items]

    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[exact_four], config=config(write_env(tmp_path)),
                                   output_dir=tmp_path / "run")
    history = trainer.train()
    assert len(history) == 2 and len(seen) == 8
    first = seen[0]
    # The prompt: instructions, a blank line, the observation, a newline; no list of actions added.
    assert first["prompts"][0][0] == (
        'We count together to 4. On your turn say "one" or "two" to add 1 or 2.\n\n'
        "The total is 0. Your partner said nothing yet. Say one of: one, two.\n"
    )
    # In choice mode a reward function receives the chosen actions' texts.
    replies = [r for item in seen for seat in item["completions"] for r in seat]
    assert replies and set(replies) <= {"one", "two"}, replies
    # Episode metrics: `score` and `env_<key>` in metrics.jsonl, every iteration.
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        assert 2.0 <= line["extra"]["env_turns"] <= 4.0
        assert 0.0 <= line["extra"]["score"] <= 1.0
        assert line["invalid_rate"] == 0.0


def test_an_exception_in_the_environment_is_reported_as_one(tmp_path):
    trainer = troupe.MAGRPOTrainer(num_agents=2, config=config(write_env(tmp_path), crash=True),
                                   output_dir=tmp_path / "run")
    with pytest.raises(RuntimeError) as raised:
        trainer.step()
    message = str(raised.value)
    assert "exception in the environment: ZeroDivisionError" in message, message
    assert "count_to_4.py" in message and "in step" in message, message
    assert "illegal" not in message.lower(), message
