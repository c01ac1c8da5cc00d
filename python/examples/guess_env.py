#!/usr/bin/env python3
"""Guess the sum: a tiny cooperative two-seat game served over troupe's `external` protocol.

Each seat privately draws a number from 1 to `max`. Both seats first say a number to each other
at the same time (round 1), then both guess the sum of the two secret numbers at the same time
(round 2). Each right guess gives both seats 0.5, so a team that learns to say its own number
scores 1.0; random play scores about 1 / (2 * max - 1).

Parameters (the config's `env.params`):
  max: the largest secret number (default 4).
  open_guess: when true, round 2 is answered with open-ended text (legal actions `null`), read
    for the first whole number in it; a reply with none is an illegal action. Default false.

Run it as a server (troupe does this from the config):
  env: {name: external, command: [python3, python/examples/guess_env.py], params: {max: 4}}
"""

import os
import random
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from troupe_env import Environment, IllegalAction, answer_span, serve  # noqa: E402


class GuessSum(Environment):
    """One game of Guess the sum."""

    name = "guess_sum"
    num_seats = 2

    def __init__(self, max_number=4, open_guess=False):
        if not isinstance(max_number, int) or isinstance(max_number, bool) or not 1 <= max_number <= 1000:
            raise ValueError(f"max must be an integer from 1 to 1000, not {max_number!r}")
        self.max = max_number
        self.open_guess = bool(open_guess)

    def reset(self, seed):
        """Draws both secret numbers from `seed`."""
        rng = random.Random(seed)
        self.secrets = [rng.randint(1, self.max), rng.randint(1, self.max)]
        self.said = None  # round 1's numbers, once said
        self.guesses = None  # round 2's guesses, once made

    def acting_seats(self):
        """Both seats act in both rounds."""
        return [0, 1]

    def instructions(self, seat):
        """The rules, the same for both seats."""
        answer = "a whole number" if self.open_guess else "one of the legal actions"
        return (
            f"You and your partner each hold a secret number from 1 to {self.max}. First you both say a "
            "number to each other, then you both guess the sum of the two secret numbers. Each right "
            f"guess scores 0.5 for the team. Reply with {answer}."
        )

    def observation(self, seat):
        """The seat's own number, what the partner said, and how the game ended."""
        partner = 1 - seat
        text = f"You are seat {seat}. Your secret number is {self.secrets[seat]}."
        if self.said is None:
            return text + " Say a number to your partner."
        text += f" You said {self.said[seat]}; your partner said {self.said[partner]}."
        if self.guesses is None:
            return text + " Guess the sum of both secret numbers."
        return text + (
            f" The secret numbers were {self.secrets[0]} and {self.secrets[1]} (sum {sum(self.secrets)});"
            f" you guessed {self.guesses[seat]}, your partner guessed {self.guesses[partner]}."
        )

    def legal_actions(self, seat):
        """Round 1: `say k`; round 2: `sum k` (or open-ended text with `open_guess`)."""
        if self.said is None:
            return [(k, f"say {k}") for k in range(1, self.max + 1)]
        if self.open_guess:
            return None
        return [(k, f"sum {k}") for k in range(2, 2 * self.max + 1)]

    def step(self, actions):
        """Records what both seats said, or scores both guesses."""
        if self.said is None:
            self.said = list(actions)
            return [0.0, 0.0]
        guesses = [self._read_guess(a) for a in actions]  # may refuse, before any change
        self.guesses = guesses
        reward = 0.5 * sum(g == sum(self.secrets) for g in guesses)
        return [reward, reward]

    def _read_guess(self, action):
        if not isinstance(action, str):
            return action
        match = re.search(r"\d+", answer_span(action))
        if match is None:
            raise IllegalAction(f"{action!r} holds no whole number")
        return int(match.group())

    def is_terminal(self):
        """Over once both seats have guessed."""
        return self.guesses is not None

    def metrics(self):
        """`score` (the team's return, 0 to 1) and `honest_signals` (seats that said their own
        number in round 1, 0 to 2)."""
        honest = 0 if self.said is None else sum(s == n for s, n in zip(self.said, self.secrets))
        score = 0.0 if self.guesses is None else 0.5 * sum(g == sum(self.secrets) for g in self.guesses)
        return {"score": score, "honest_signals": float(honest)}


def make(params):
    """Builds a game from the config's parameters (`max`, `open_guess`); others are refused."""
    unknown = set(params) - {"max", "open_guess"}
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)} (known: max, open_guess)")
    return GuessSum(params.get("max", 4), params.get("open_guess", False))


if __name__ == "__main__":
    serve(make)
