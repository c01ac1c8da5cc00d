"""python/openspiel_env.py against OpenSpiel itself: seeded random games played through the
adapter's server process, each replayed move by move on a fresh pyspiel state (the same chance
outcomes, drawn by the documented rule from the episode's seed, and the same actions), checking
at every step the acting seat, the legal action ids and texts, the observations, the step
rewards and the returns.

Skipped when pyspiel cannot be imported (pip install open_spiel). Run from the repository root:
  python -m unittest discover -s python/tests -v
"""

import json
import os
import random
import subprocess
import sys
import unittest

try:
    import pyspiel
except ImportError:
    pyspiel = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python/
ADAPTER = os.path.join(ROOT, "openspiel_env.py")

GAMES = [
    ("kuhn_poker", {}),
    ("kuhn_poker", {"players": 3}),
    ("leduc_poker", {}),
    ("tic_tac_toe", {}),
    ("liars_dice", {}),
    ("connect_four", {}),
]
EPISODES = 20


def sample_chance(state, rng):
    """The adapter's documented rule, written out again: the first outcome whose cumulative
    probability exceeds rng.random(), else the last."""
    u = rng.random()
    total = 0.0
    outcomes = state.chance_outcomes()
    for action, probability in outcomes:
        total += probability
        if u < total:
            return action
    return outcomes[-1][0]


class Server:
    """The adapter as a subprocess: one request line out, one answer line back."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, ADAPTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.next_id = 0

    def call(self, method, **fields):
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.proc.stdin.write(json.dumps({"id": request_id, "method": method, **fields}).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError("the adapter exited; stderr: " + self.proc.stderr.read().decode())
        answer = json.loads(line)
        assert answer["id"] == request_id, answer
        return answer

    def result(self, method, **fields):
        answer = self.call(method, **fields)
        assert "result" in answer, answer
        return answer["result"]

    def close(self):
        out, _ = self.proc.communicate(timeout=30)
        return self.proc.returncode, out

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


class Replay:
    """One episode replayed on pyspiel: the state, the chance generator, the moves made."""

    def __init__(self, game, seed):
        self.state = game.new_initial_state()
        self.rng = random.Random(seed)
        self.moves = 0
        self.resolve([0.0] * game.num_players())

    def resolve(self, rewards):
        while self.state.is_chance_node():
            self.state.apply_action(sample_chance(self.state, self.rng))
            rewards[:] = [a + b for a, b in zip(rewards, self.state.rewards())]
        return rewards

    def apply(self, action):
        self.state.apply_action(action)
        self.moves += 1
        return self.resolve(list(self.state.rewards()))


@unittest.skipUnless(pyspiel is not None, "pyspiel is not installed (pip install open_spiel)")
class OpenSpielAdapterTest(unittest.TestCase):
    def expect_state(self, game, name, view, got, replay, where):
        """Compares one State from the adapter with the replayed pyspiel state."""
        state, n = replay.state, game.num_players()
        self.assertEqual(got["terminal"], state.is_terminal(), where)
        acting = [] if state.is_terminal() else [state.current_player()]
        self.assertEqual(got["acting_seats"], acting, where)
        for p in range(n):
            legal = [] if p not in acting else [{"id": a, "text": state.action_to_string(p, a)} for a in state.legal_actions(p)]
            self.assertEqual(got["legal_actions"][p], legal, f"{where}, seat {p}")
            lines = got["observations"][p].split("\n")
            self.assertTrue(lines[0].startswith(f"You are player {p} of {n} in {game.get_type().long_name}."), lines[0])
            raw = state.information_state_string(p) if view == "information_state" else state.observation_string(p)
            self.assertEqual("\n".join(lines[1:-1]), raw.rstrip("\n"), f"{where}, seat {p}")
            if acting == [p]:
                self.assertIn(", ".join(a["text"] for a in legal), lines[-1])
            self.assertIn(game.get_type().long_name, got["instructions"][p])
        self.assertEqual(got["returns"], list(state.returns()), where)
        self.assertEqual(got["metrics"], {"score": state.returns()[0], "moves": float(replay.moves)}, where)

    def play(self, name, game_params, view="auto", episodes=EPISODES, first_seed=0):
        game = pyspiel.load_game(name, game_params) if game_params else pyspiel.load_game(name)
        if view == "auto":
            view = "information_state" if game.get_type().provides_information_state_string else "observation"
        server = Server()
        self.addCleanup(server.kill)
        params = {"game": name, "game_params": game_params} if game_params else {"game": name}
        if view != "auto":
            params["view"] = view
        hello = server.result("init", protocol=1, params=params)
        self.assertEqual(hello, {"name": name, "num_seats": game.num_players()})
        seeds = [first_seed + 1000003 * e for e in range(episodes)]
        states = server.result("reset", episodes=[{"episode": e, "seed": s} for e, s in enumerate(seeds)])["states"]
        replays = [Replay(game, s) for s in seeds]
        for e, (got, replay) in enumerate(zip(states, replays)):
            self.expect_state(game, name, view, got, replay, f"{name} episode {e} reset")
        chooser = random.Random(f"{name}{game_params}")
        steps = 0
        while True:
            live = [e for e, s in enumerate(states) if not s["terminal"]]
            if not live:
                break
            entries, parses = [], []
            for e in live:
                seat = states[e]["acting_seats"][0]
                choice = chooser.choice(states[e]["legal_actions"][seat])
                entries.append((e, choice["id"]))
                parses.append({"episode": e, "seat": seat, "text": f"<answer> {choice['text'].upper()} </answer>"})
            parsed = server.result("parse", requests=parses)["results"]
            self.assertEqual(parsed, [{"action": {"id": a}} for _, a in entries])
            results = server.result("step", episodes=[{"episode": e, "actions": [{"id": a}]} for e, a in entries])["results"]
            for (e, action), result in zip(entries, results):
                rewards = replays[e].apply(action)
                where = f"{name} episode {e} move {replays[e].moves}"
                self.assertEqual(result["rewards"], rewards, where)
                self.expect_state(game, name, view, result["state"], replays[e], where)
                states[e] = result["state"]
                steps += 1
        for state, replay in zip(states, replays):
            self.assertEqual(state["returns"], list(replay.state.returns()))
        self.assertEqual(server.close(), (0, b""))
        return steps

    def test_games_match_pyspiel_move_by_move(self):
        for name, game_params in GAMES:
            with self.subTest(game=name, params=game_params):
                self.assertGreater(self.play(name, game_params), EPISODES)

    def test_observation_view(self):
        self.play("tic_tac_toe", {}, view="observation", episodes=5)

    def test_the_same_seed_gives_the_same_deal_and_different_seeds_differ(self):
        server = Server()
        self.addCleanup(server.kill)
        server.result("init", protocol=1, params={"game": "leduc_poker"})
        reset = [{"episode": e, "seed": s} for e, s in enumerate([5, 5, 6, 2**64 - 1])]
        states = server.result("reset", episodes=reset)["states"]
        self.assertEqual(states[0], states[1])
        self.assertNotEqual({json.dumps(s) for s in states}, {json.dumps(states[0])})

    def test_refusals(self):
        server = Server()
        self.addCleanup(server.kill)
        self.assertIn("not a sequential game", server.call("init", protocol=1, params={"game": "goofspiel"})["error"])
        self.assertIn("unknown parameters", server.call("init", protocol=1, params={"gmae": "x"})["error"])
        self.assertIn("no observation string", server.call("init", protocol=1, params={"game": "liars_dice", "view": "observation"})["error"])
        self.assertEqual(server.result("init", protocol=1, params={}), {"name": "kuhn_poker", "num_seats": 2})
        state = server.result("reset", episodes=[{"episode": 0, "seed": 1}])["states"][0]
        illegal = server.result("step", episodes=[{"episode": 0, "actions": [{"id": 7}]}])["results"][0]
        self.assertIn("not a legal action", illegal["error"])
        parsed = server.result("parse", requests=[{"episode": 0, "seat": 0, "text": "fold"}])["results"][0]
        self.assertIn("Pass, Bet", parsed["error"])
        self.assertEqual(server.result("reset", episodes=[{"episode": 0, "seed": 1}])["states"][0], state)


if __name__ == "__main__":
    unittest.main()
