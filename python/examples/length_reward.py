"""TRL's GRPO peer reward, served to troupe: each seat's reply scored by its length in
characters, ``-|len - 200| / 100`` (``tools/trl_grpo_peer.py``'s ``reward_len``), so a troupe
iteration and a TRL step train on the same kind of signal (nearly every advantage non-zero).

    troupe train --config configs/writing_tldr.yaml \\
      --set 'rewards.functions=[{name: external, command: [python3, python/examples/length_reward.py], weight: 1.0}]'
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from troupe_reward import serve_reward  # noqa: E402


def length_reward(*seats_and_items):
    """One reward per seat of every episode: how far each seat's reply is from 200 characters."""
    seats = seats_and_items[:-1]
    return [[-abs(len(reply) - 200) / 100 for reply in replies] for replies in zip(*seats)]


if __name__ == "__main__":
    serve_reward(length_reward)
