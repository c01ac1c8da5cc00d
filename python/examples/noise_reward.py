"""A reward that differs for every reply whatever its text: seeded uniform noise in [0, 1).

For measuring an iteration's time and memory on a random model (the ``qwen3-*`` presets), whose
replies decode to little text, so that a length reward leaves whole groups equal and unscored.
It teaches nothing.

    troupe train --config configs/writing_tldr.yaml \\
      --set 'rewards.functions=[{name: external, command: [python3, python/examples/noise_reward.py], weight: 1.0}]'
"""

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from troupe_reward import serve_reward  # noqa: E402

RNG = random.Random(0)


def noise_reward(*seats_and_items):
    """One reward per seat of every episode, each drawn anew."""
    seats = seats_and_items[:-1]
    return [[RNG.random() for _ in replies] for replies in zip(*seats)]


if __name__ == "__main__":
    serve_reward(noise_reward)
