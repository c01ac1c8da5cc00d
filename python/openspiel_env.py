#!/usr/bin/env python3
"""Any OpenSpiel game as a troupe environment, over the `external` protocol (envs/README.md).

Needs OpenSpiel (``pip install open_spiel``). In a troupe config::

    env:
      name: external
      command: [python3, python/openspiel_env.py]
      params: {game: kuhn_poker}          # or e.g. {game: leduc_poker, game_params: {players: 3}}

Parameters (all optional):

* ``game``: the OpenSpiel short name (default ``kuhn_poker``); ``pyspiel.registered_names()``
  lists them.
* ``game_params``: the game's parameters, e.g. ``{players: 3}`` (default none).
* ``view``: what a seat's observation shows: ``information_state`` (its information state
  string, which in perfect-information games such as tic_tac_toe is the list of moves),
  ``observation`` (its observation string, e.g. the board), or ``auto`` (the default: the
  information state when the game provides one, else the observation).

Seat ``p`` is OpenSpiel player ``p``. Chance nodes are resolved inside ``reset`` and ``step`` by
:func:`sample_chance` with a ``random.Random(seed)`` of the episode, so a seed and the players'
actions fix the whole game. A step's rewards are the sum of ``state.rewards()`` over the
transitions it makes (the player's action and the chance outcomes that follow); the returns are
``state.returns()``. Metrics: ``score`` (seat 0's return) and ``moves`` (player actions so far).
Only sequential games are served (simultaneous-move games are refused at ``init``).
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from troupe_env import Environment, serve  # noqa: E402

try:
    import pyspiel
except ImportError:  # reported at init, as an error answer troupe shows
    pyspiel = None

#: The game played when the parameters name none.
DEFAULT_GAME = "kuhn_poker"

_VIEWS = ("auto", "information_state", "observation")


def sample_chance(state, rng):
    """One outcome of chance node ``state``, drawn with ``rng``: the first outcome (in OpenSpiel's
    order) whose cumulative probability exceeds ``rng.random()``, the last one on rounding."""
    outcomes = state.chance_outcomes()
    u = rng.random()
    total = 0.0
    for action, probability in outcomes:
        total += probability
        if u < total:
            return action
    return outcomes[-1][0]


class Game:
    """A loaded OpenSpiel game and how its seats see it: shared by all of a process's episodes."""

    def __init__(self, params):
        if pyspiel is None:
            raise RuntimeError("OpenSpiel is not installed for this python (pip install open_spiel)")
        unknown = set(params) - {"game", "game_params", "view"}
        if unknown:
            raise ValueError(f"unknown parameters {sorted(unknown)} (known: game, game_params, view)")
        name = params.get("game", DEFAULT_GAME)
        game_params = params.get("game_params") or {}
        if not isinstance(name, str):
            raise ValueError(f"`game` must be a string, not {name!r}")
        if not isinstance(game_params, dict):
            raise ValueError(f"`game_params` must be a mapping, not {game_params!r}")
        view = params.get("view", "auto")
        if view not in _VIEWS:
            raise ValueError(f"`view` must be one of {', '.join(_VIEWS)}, not {view!r}")
        self.game = pyspiel.load_game(name, game_params) if game_params else pyspiel.load_game(name)
        game_type = self.game.get_type()
        if game_type.dynamics != pyspiel.GameType.Dynamics.SEQUENTIAL:
            raise ValueError(f"{name} is not a sequential game ({game_type.dynamics}); only sequential games are served")
        self.name = name
        self.long_name = game_type.long_name
        self.num_players = self.game.num_players()
        if view == "auto":
            view = "information_state" if game_type.provides_information_state_string else "observation"
        provided = {
            "information_state": game_type.provides_information_state_string,
            "observation": game_type.provides_observation_string,
        }
        if not provided[view]:
            raise ValueError(f"{name} provides no {view} string")
        self.view = view

    def view_string(self, state, player):
        """What ``player`` sees of ``state``: its information state or observation string."""
        if self.view == "information_state":
            return state.information_state_string(player)
        return state.observation_string(player)


def observation_text(game, state, player):
    """The observation of ``player``: a sentence saying who it is, the OpenSpiel view (its own
    lines, trailing newlines dropped), and a last line saying whose turn it is or how it ended."""
    n = game.num_players
    kind = "information state" if game.view == "information_state" else "observation"
    header = f"You are player {player} of {n} in {game.long_name}. Your {kind} (OpenSpiel `{game.name}`):"
    view = game.view_string(state, player).rstrip("\n")
    if state.is_terminal():
        returns = state.returns()
        footer = f"The game is over. Your return is {returns[player]:g}."
    elif state.current_player() == player:
        texts = [state.action_to_string(player, a) for a in state.legal_actions(player)]
        footer = "It is your turn. Legal actions: " + ", ".join(texts) + "."
    else:
        footer = f"Player {state.current_player()} is to act."
    return f"{header}\n{view}\n{footer}"


class OpenSpielEnv(Environment):
    """One episode of an OpenSpiel game."""

    def __init__(self, game):
        self.spec = game
        self.name = game.name
        self.num_seats = game.num_players

    def reset(self, seed):
        """A new initial state, its opening chance nodes resolved with ``random.Random(seed)``."""
        self.rng = random.Random(seed)
        self.state = self.spec.game.new_initial_state()
        self.moves = 0
        self._resolve_chance([0.0] * self.num_seats)

    def _resolve_chance(self, rewards):
        """Samples chance outcomes until a player is to act (or the game ends), adding each
        transition's rewards to ``rewards``."""
        while self.state.is_chance_node():
            self.state.apply_action(sample_chance(self.state, self.rng))
            rewards[:] = [r + x for r, x in zip(rewards, self.state.rewards())]

    def acting_seats(self):
        """The current player."""
        return [self.state.current_player()]

    def instructions(self, seat):
        """The game, the seat, and the answer format."""
        return (
            f"You are playing {self.spec.long_name} (OpenSpiel `{self.spec.name}`) as player {seat} of "
            f"{self.num_seats}. On your turn, reply with exactly one of the legal actions listed in "
            "your observation."
        )

    def observation(self, seat):
        """See :func:`observation_text`."""
        return observation_text(self.spec, self.state, seat)

    def legal_actions(self, seat):
        """The player's legal actions, named by ``state.action_to_string``."""
        return [(a, self.state.action_to_string(seat, a)) for a in self.state.legal_actions(seat)]

    def step(self, actions):
        """Applies the current player's action, then resolves chance; the rewards of both."""
        self.state.apply_action(actions[0])
        self.moves += 1
        rewards = list(self.state.rewards())
        self._resolve_chance(rewards)
        return rewards

    def is_terminal(self):
        """Whether OpenSpiel's state is terminal."""
        return self.state.is_terminal()

    def returns(self):
        """``state.returns()``."""
        return self.state.returns()

    def metrics(self):
        """``score``: seat 0's return; ``moves``: player actions so far."""
        return {"score": self.state.returns()[0], "moves": float(self.moves)}


def make_factory():
    """A factory for :func:`troupe_env.serve` that loads the game once per set of parameters."""
    games = {}

    def factory(params):
        key = repr(sorted(params.items()))
        if key not in games:
            games[key] = Game(params)
        return OpenSpielEnv(games[key])

    return factory


if __name__ == "__main__":
    serve(make_factory())
