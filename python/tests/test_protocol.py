"""The `external` protocol (envs/README.md) as python/troupe_env.py serves it: the example game
python/examples/guess_env.py driven as a subprocess, and troupe_env's own checks in process.

Run from the repository root: python3 -m unittest discover -s python/tests -v
"""

import io
import json
import math
import os
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python/
sys.path.insert(0, ROOT)

import troupe_env  # noqa: E402
from troupe_env import Environment, IllegalAction  # noqa: E402

GUESS = os.path.join(ROOT, "examples", "guess_env.py")


class Client:
    """A protocol client: one request line out, one answer line back, ids counted from 0."""

    def __init__(self, path=GUESS):
        self.proc = subprocess.Popen(
            [sys.executable, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.next_id = 0
        self.lines = []  # every answer line, as received

    def raw(self, line):
        """Sends one line as is; returns the answer line (bytes)."""
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise AssertionError("the server closed stdout; stderr: " + self.proc.stderr.read().decode())
        self.lines.append(answer)
        return answer

    def call(self, method, **fields):
        """Sends a request; returns the parsed answer, after checking its id."""
        request_id = self.next_id
        self.next_id += 1
        line = json.dumps({"id": request_id, "method": method, **fields}).encode()
        answer = json.loads(self.raw(line))
        assert answer.get("id") == request_id, answer
        assert ("result" in answer) != ("error" in answer), answer
        return answer

    def result(self, method, **fields):
        answer = self.call(method, **fields)
        assert "result" in answer, answer
        return answer["result"]

    def finish(self):
        """Closes stdin; returns the exit status, the rest of stdout and stderr."""
        out, err = self.proc.communicate(timeout=10)
        return self.proc.returncode, out, err

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def check_state(test, state, num_seats):
    """The checks troupe makes of a State (envs/src/external/protocol.rs)."""
    test.assertEqual(
        set(state),
        {"acting_seats", "terminal", "instructions", "observations", "legal_actions", "returns", "metrics"},
    )
    for field in ("instructions", "observations", "legal_actions", "returns"):
        test.assertEqual(len(state[field]), num_seats, field)
    acting = state["acting_seats"]
    test.assertEqual(len(set(acting)), len(acting))
    test.assertTrue(all(0 <= s < num_seats for s in acting))
    test.assertEqual(state["terminal"], not acting)
    for seat, legal in enumerate(state["legal_actions"]):
        if legal is not None:
            ids = [a["id"] for a in legal]
            test.assertEqual(ids, sorted(set(ids)))
            if seat in acting:
                test.assertTrue(legal)
            else:
                test.assertEqual(legal, [])
    test.assertTrue(all(math.isfinite(r) for r in state["returns"]))
    test.assertIn("score", state["metrics"])


class GuessServerTest(unittest.TestCase):
    """guess_env.py as a subprocess."""

    def setUp(self):
        self.client = Client()
        self.addCleanup(self.client.kill)

    def init(self, **params):
        hello = self.client.result("init", protocol=1, params=params)
        self.assertEqual(hello, {"name": "guess_sum", "num_seats": 2})

    def reset(self, *pairs):
        states = self.client.result("reset", episodes=[{"episode": e, "seed": s} for e, s in pairs])["states"]
        self.assertEqual(len(states), len(pairs))
        for state in states:
            check_state(self, state, 2)
        return states

    def step(self, *entries):
        results = self.client.result("step", episodes=[{"episode": e, "actions": a} for e, a in entries])["results"]
        self.assertEqual(len(results), len(entries))
        for result in results:
            if "state" in result:
                check_state(self, result["state"], 2)
                self.assertEqual(len(result["rewards"]), 2)
        return results

    def test_a_whole_game_of_batched_episodes(self):
        self.init()
        states = self.reset((0, 7), (1, 8), (2, 2**64 - 1))
        for state in states:
            self.assertEqual(state["acting_seats"], [0, 1])
            self.assertFalse(state["terminal"])
            self.assertEqual([a["text"] for a in state["legal_actions"][0]], ["say 1", "say 2", "say 3", "say 4"])
            self.assertEqual(state["returns"], [0.0, 0.0])
            self.assertEqual(state["metrics"], {"score": 0.0, "honest_signals": 0.0})
        secrets = [[int(o.split("number is ")[1][0]) for o in s["observations"]] for s in states]
        # Every seat says its own number, then guesses the sum: a perfect game.
        results = self.step(*[(e, [{"id": secrets[e][0]}, {"id": secrets[e][1]}]) for e in range(3)])
        for e, result in enumerate(results):
            self.assertEqual(result["rewards"], [0.0, 0.0])
            self.assertEqual(result["state"]["metrics"]["honest_signals"], 2.0)
            self.assertEqual(result["state"]["legal_actions"][1][0], {"id": 2, "text": "sum 2"})
        results = self.step(*[(e, [{"id": sum(secrets[e])}, {"id": 2 * 4}]) for e in range(3)])
        for e, result in enumerate(results):
            state = result["state"]
            right = 0.5 + (0.5 if sum(secrets[e]) == 8 else 0.0)
            self.assertEqual(result["rewards"], [right, right])
            self.assertTrue(state["terminal"])
            self.assertEqual(state["acting_seats"], [])
            self.assertEqual(state["legal_actions"], [[], []])
            self.assertEqual(state["returns"], [right, right])
            self.assertEqual(state["metrics"]["score"], right)
        # An episode that is over takes no more steps.
        self.assertIn("over", self.step((0, [{"id": 2}, {"id": 2}]))[0]["error"])
        # A reset of a used episode id starts it afresh.
        self.assertEqual(self.reset((0, 7))[0], states[0])
        self.assertEqual(self.client.result("close", episodes=[0, 1, 2, 99]), {})
        self.assertIn("never reset", self.step((1, [{"id": 1}, {"id": 1}]))[0]["error"])
        status, out, _ = self.client.finish()
        self.assertEqual((status, out), (0, b""))

    def test_parse_reads_legal_texts_and_refuses_others(self):
        self.init()
        self.reset((5, 1))
        requests = [
            {"episode": 5, "seat": 0, "text": "say 3"},
            {"episode": 5, "seat": 1, "text": "  <ANSWER> Say   2 </answer>\n"},
            {"episode": 5, "seat": 1, "text": "I think <answer>x</answer> then <answer>say 4</answer>"},
            {"episode": 5, "seat": 0, "text": "say 9"},
            {"episode": 5, "seat": 0, "text": "hello"},
            {"episode": 6, "seat": 0, "text": "say 1"},
        ]
        results = self.client.result("parse", requests=requests)["results"]
        self.assertEqual(results[:3], [{"action": {"id": 3}}, {"action": {"id": 2}}, {"action": {"id": 4}}])
        for result in results[3:]:
            self.assertEqual(set(result), {"error"})
        self.assertIn("say 1, say 2", results[3]["error"])
        self.assertIn("never reset", results[5]["error"])

    def test_an_illegal_step_is_refused_and_changes_nothing(self):
        self.init()
        before = self.reset((0, 3), (1, 3))
        results = self.step(
            (0, [{"id": 9}, {"id": 1}]),  # not a legal id
            (1, [{"id": 1}, {"id": 2}]),  # fine: the other entries are unaffected
            (0, [{"id": 1}]),  # one action for two acting seats
            (0, [{"text": "say 1"}, {"id": 1}]),  # text for a seat with legal actions
            (42, [{"id": 1}, {"id": 1}]),  # never reset
        )
        self.assertIn("not a legal action of seat 0", results[0]["error"])
        self.assertIn("state", results[1])
        self.assertIn("1 actions for 2 acting seats", results[2]["error"])
        self.assertIn("action id", results[3]["error"])
        self.assertIn("never reset", results[4]["error"])
        for result in (results[0], results[2], results[3], results[4]):
            self.assertEqual(set(result), {"error"})
        # Episode 0 is where it was: the same legal step gives the same state as episode 1's.
        again = self.step((0, [{"id": 1}, {"id": 2}]))[0]
        self.assertEqual(again, results[1])
        self.assertNotEqual(again["state"], before[0])

    def test_open_ended_text_and_an_illegal_action_raised_by_the_game(self):
        self.init(open_guess=True)
        self.reset((0, 11))
        state = self.step((0, [{"id": 1}, {"id": 1}]))[0]["state"]
        self.assertEqual(state["legal_actions"], [None, None])
        self.assertEqual(state["acting_seats"], [0, 1])
        parsed = self.client.result("parse", requests=[{"episode": 0, "seat": 1, "text": "seven"}])["results"]
        self.assertEqual(parsed, [{"action": {"text": "seven"}}])
        refused = self.step((0, [{"text": "five"}, {"text": "<answer>4</answer>"}]))[0]
        self.assertEqual(refused, {"error": "'five' holds no whole number"})
        self.assertIn("text, not action id", self.step((0, [{"id": 3}, {"text": "3"}]))[0]["error"])
        done = self.step((0, [{"text": "the sum is 5"}, {"text": "<answer>4</answer>"}]))[0]["state"]
        self.assertTrue(done["terminal"])
        self.assertIn("you guessed 5, your partner guessed 4", done["observations"][0])

    def test_bad_requests_get_error_answers_with_their_id(self):
        answer = self.client.call("reset", episodes=[{"episode": 0, "seed": 1}])
        self.assertIn("before `init`", answer["error"])
        answer = self.client.call("frobnicate", episodes=[])
        self.assertEqual(answer["id"], 1)
        self.assertIn("unknown method", answer["error"])
        self.assertIn("protocol 2", self.client.call("init", protocol=2, params={})["error"])
        self.assertIn("unknown parameters", self.client.call("init", protocol=1, params={"colour": 1})["error"])
        self.init()
        self.assertIn("already", self.client.call("init", protocol=1, params={})["error"])
        self.assertIn("`seed`", self.client.call("reset", episodes=[{"episode": 0}])["error"])
        self.assertIn("`seed`", self.client.call("reset", episodes=[{"episode": 0, "seed": -1}])["error"])
        self.assertIn("`episodes`", self.client.call("step")["error"])
        bad_action = self.client.call("step", episodes=[{"episode": 0, "actions": [{"id": "x"}]}])
        self.assertIn("an action must be", bad_action["error"])
        answer = json.loads(self.client.raw(b"this is not json"))
        self.assertIsNone(answer["id"])
        self.assertIn("not JSON", answer["error"])
        self.reset((0, 1))
        status, out, _ = self.client.finish()
        self.assertEqual((status, out), (0, b""))

    def test_eof_ends_the_server_cleanly(self):
        status, out, err = self.client.finish()
        self.assertEqual((status, out, err), (0, b"", b""))

    def test_the_same_seeds_give_byte_identical_answers(self):
        def play(client):
            client.result("init", protocol=1, params={"max": 6})
            client.result("reset", episodes=[{"episode": e, "seed": 100 + e} for e in range(8)])
            for round_ in range(2):
                actions = [{"id": 2 + round_}, {"id": 3 + round_}]
                client.result("step", episodes=[{"episode": e, "actions": actions} for e in range(8)])
            return client.lines

        other = Client()
        self.addCleanup(other.kill)
        first, second = play(self.client), play(other)
        self.assertEqual(first, second)
        reset = json.loads(first[1])["result"]["states"]
        self.assertGreater(len({s["observations"][0] for s in reset}), 1, "different seeds, different deals")


class Counter(Environment):
    """A one-seat test game: `add 1` or `add 2` until the total reaches 3."""

    name = "counter"

    def __init__(self, params):
        self.params = params

    def num_seats(self):
        return 1

    def reset(self, seed):
        self.total = 0

    def acting_seats(self):
        return [0]

    def observation(self, seat):
        return f"total {self.total}"

    def legal_actions(self, seat):
        return [{"id": 2, "text": "add 2"}, (1, "add 1")]  # any order, pairs or dicts

    def step(self, actions):
        if self.params.get("crash_at") == self.total:
            raise KeyError("boom")
        self.total += actions[0]
        return [float(actions[0])]

    def is_terminal(self):
        return self.total >= 3

    def metrics(self):
        if self.params.get("bad_metrics") and self.total:
            return {"score": 1.0, "extra": 2.0}
        return None


def run_in_process(factory, requests):
    """Serves `requests` (dicts, ids added) in this process; the parsed answers."""
    lines = [json.dumps({"id": i, **r}).encode() + b"\n" for i, r in enumerate(requests)]
    out = io.BytesIO()
    troupe_env.serve(factory, stdin=io.BytesIO(b"".join(lines)), stdout=out)
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [a["id"] for a in answers] == list(range(len(requests))), answers
    return answers


class ServerChecksTest(unittest.TestCase):
    """troupe_env's defaults and its checks of the environment's answers, in process."""

    def run_counter(self, params, *requests):
        stderr, sys.stderr = sys.stderr, io.StringIO()  # tracebacks of the failures tested here
        try:
            init = {"method": "init", "protocol": 1, "params": params}
            return run_in_process(Counter, [init, *requests])
        finally:
            sys.stderr = stderr

    def test_defaults_sorted_legal_actions_summed_returns_and_score(self):
        answers = self.run_counter(
            {},
            {"method": "reset", "episodes": [{"episode": 0, "seed": 0}]},
            {"method": "step", "episodes": [{"episode": 0, "actions": [{"id": 2}]}]},
            {"method": "step", "episodes": [{"episode": 0, "actions": [{"id": 1}]}]},
        )
        self.assertEqual(answers[0]["result"], {"name": "counter", "num_seats": 1})
        state = answers[1]["result"]["states"][0]
        self.assertEqual(state["legal_actions"], [[{"id": 1, "text": "add 1"}, {"id": 2, "text": "add 2"}]])
        self.assertEqual(state["instructions"], [""])
        final = answers[3]["result"]["results"][0]["state"]
        self.assertEqual((final["terminal"], final["returns"], final["metrics"]), (True, [3.0], {"score": 3.0}))

    def test_an_exception_in_the_game_is_an_error_answer_and_drops_the_episode(self):
        answers = self.run_counter(
            {"crash_at": 0},
            {"method": "reset", "episodes": [{"episode": 0, "seed": 0}]},
            {"method": "step", "episodes": [{"episode": 0, "actions": [{"id": 1}]}]},
            {"method": "step", "episodes": [{"episode": 0, "actions": [{"id": 1}]}]},
        )
        error = answers[2]["error"]
        self.assertTrue(error.startswith("exception in the environment: KeyError: 'boom' (raised at test_protocol.py:"), error)
        self.assertIn("in step); traceback on stderr", error)
        self.assertIn("dropped", answers[3]["result"]["results"][0]["error"])

    def test_metric_keys_must_stay_the_same(self):
        answers = self.run_counter(
            {"bad_metrics": True},
            {"method": "reset", "episodes": [{"episode": 0, "seed": 0}]},
            {"method": "step", "episodes": [{"episode": 0, "actions": [{"id": 1}]}]},
        )
        self.assertIn("keep them the same", answers[2]["error"])

    def test_print_in_the_game_does_not_reach_the_protocol(self):
        class Chatty(Counter):
            def observation(self, seat):
                print("debugging output")
                return "x"

        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            answers = run_in_process(
                Chatty,
                [
                    {"method": "init", "protocol": 1, "params": {}},
                    {"method": "reset", "episodes": [{"episode": 0, "seed": 0}]},
                ],
            )
            self.assertIn("debugging output", sys.stderr.getvalue())
        finally:
            sys.stderr = stderr
        self.assertEqual(answers[1]["result"]["states"][0]["observations"], ["x"])

    def test_answer_span(self):
        self.assertEqual(troupe_env.answer_span("think <answer>a</answer> more <ANSWER> b </Answer>"), " b ")
        self.assertEqual(troupe_env.answer_span("<answer>open ended"), "open ended")
        self.assertEqual(troupe_env.answer_span("plain"), "plain")
        self.assertEqual(troupe_env.answer_span("İ<answer>x</answer>"), "x")

    def test_the_default_parse_refuses_ambiguity(self):
        class Twins(Counter):
            def legal_actions(self, seat):
                return [(1, "Go"), (2, "go ")]

        env = Twins({})
        with self.assertRaises(IllegalAction):
            env.parse(0, "go")


if __name__ == "__main__":
    unittest.main()
