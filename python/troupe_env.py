"""The server side of troupe's `external` environment protocol, for Python: one class per game.

troupe starts an environment written in another language as a child process and talks to it in
JSON lines over stdin and stdout (envs/README.md, "Environments in any language: the `external`
protocol", is the specification). This module speaks that protocol, so a Python environment is a
subclass of :class:`Environment` and a call to :func:`serve`. It uses the standard library only.

A complete environment (two seats take 1 to 3 stones in turn; whoever takes the last one wins)::

    import random
    from troupe_env import Environment, serve

    class Nim(Environment):
        name = "nim"
        num_seats = 2

        def reset(self, seed):
            self.stones, self.turn = random.Random(seed).randint(5, 15), 0

        def acting_seats(self):
            return [self.turn]

        def instructions(self, seat):
            return "Take 1 to 3 stones in turn; whoever takes the last stone wins."

        def observation(self, seat):
            return f"You are seat {seat}. {self.stones} stones are left."

        def legal_actions(self, seat):
            return [(n, f"take {n}") for n in range(1, min(3, self.stones) + 1)]

        def step(self, actions):
            self.stones -= actions[0]
            if self.stones == 0:
                return [1.0, -1.0] if self.turn == 0 else [-1.0, 1.0]
            self.turn = 1 - self.turn
            return [0.0, 0.0]

        def is_terminal(self):
            return self.stones == 0

    if __name__ == "__main__":
        serve(lambda params: Nim())

and in the troupe config: ``env: {name: external, command: [python3, nim.py]}``.

What the server does for you:

* every ``reset`` builds a fresh environment with ``factory(params)`` and calls its
  :meth:`Environment.reset`, so episodes never share state;
* it checks each joint action before :meth:`Environment.step` sees it (one action per acting seat,
  an id among the seat's legal actions, or text for a seat with open-ended replies) and answers an
  illegal one with an ``error`` entry, the episode unchanged;
* it asks :meth:`Environment.legal_actions` only of acting seats (the others get ``[]``), sends
  no acting seats once :meth:`Environment.is_terminal`, sorts legal actions by id, sums the step
  rewards into the returns unless :meth:`Environment.returns` says otherwise, and checks every
  State it sends (one entry per seat, finite numbers, the same metric keys in every episode);
* an exception in your code (other than :class:`IllegalAction` from ``step`` or ``parse``)
  becomes an ``error`` answer "exception in the environment: Type: message (raised at
  FILE:LINE in FUNCTION)", with the whole traceback on stderr; the
  episodes of a ``step`` that failed that way are dropped until they are reset;
* while serving, ``print`` goes to stderr: stdout carries the protocol only.
"""

import json
import math
import os
import sys
import traceback

__all__ = ["Environment", "IllegalAction", "serve", "answer_span", "PROTOCOL_VERSION"]

#: The protocol version this module speaks (``init.protocol``).
PROTOCOL_VERSION = 1

_U64 = 1 << 64
_U32 = 1 << 32


class IllegalAction(Exception):
    """Raised by :meth:`Environment.step` (before changing anything) or
    :meth:`Environment.parse` when an action or a reply is not acceptable; the message says why
    and becomes the ``error`` entry troupe gets for that episode."""


def answer_span(text):
    """The part of an agent's reply that holds its answer: the content of the last
    ``<answer>...</answer>`` pair (tags in any case; an unclosed tag runs to the end) when there
    is one, else the whole text. The same rule as troupe's built-in parsers."""
    lower = "".join(c.lower() if c.isascii() else c for c in text)  # same offsets as text
    open_at = lower.rfind("<answer>")
    if open_at < 0:
        return text
    start = open_at + len("<answer>")
    end = lower.find("</answer>", start)
    return text[start:] if end < 0 else text[start:end]


def _normalize(text):
    """Lowercase, with runs of whitespace made one space and none at either end."""
    return " ".join(text.split()).casefold()


class Environment:
    """One episode of a game or task. Subclass it and override the methods below; :func:`serve`
    builds one instance per episode (per ``reset``) and calls them.

    Seats are numbered ``0 .. num_seats - 1``. An action is an ``int`` (the id of a legal
    action) for a seat with a finite list of legal actions, or a ``str`` for a seat whose
    :meth:`legal_actions` is ``None`` (open-ended text replies).
    """

    #: The environment's name, as troupe reports it (default: the class name).
    name = None

    #: The number of seats (an ``int`` >= 1, or a method returning one), the same in every
    #: episode.
    num_seats = 1

    def reset(self, seed):
        """Starts the episode from ``seed`` (an unsigned 64-bit int). Everything random must come
        from it (e.g. ``random.Random(seed)``): the same seed and actions give the same episode."""
        raise NotImplementedError("reset(seed)")

    def acting_seats(self):
        """The seats that must act now (a list of distinct ints, at least one while the episode
        is not over); ``step`` takes their actions in this order. Not asked once terminal."""
        raise NotImplementedError("acting_seats()")

    def instructions(self, seat):
        """The standing instructions of ``seat`` (rules, answer format). Default: empty."""
        return ""

    def observation(self, seat):
        """What ``seat`` may know now, as text."""
        raise NotImplementedError("observation(seat)")

    def legal_actions(self, seat):
        """The legal actions of acting seat ``seat``: a list of ``(id, text)`` pairs (ids distinct
        ints in ``0 .. 2**32 - 1``, any order), or ``None`` when the seat replies with open-ended
        text. Only asked of acting seats; the others are sent ``[]``."""
        raise NotImplementedError("legal_actions(seat)")

    def step(self, actions):
        """Applies one joint action: ``actions[i]`` is the action of ``acting_seats()[i]`` (an
        int id already checked to be legal, or a str). Returns each seat's reward for this step
        (``num_seats`` numbers; ``None`` for all zeros). Raise :class:`IllegalAction` ("why")
        before changing anything when the action cannot be taken."""
        raise NotImplementedError("step(actions)")

    def is_terminal(self):
        """Whether the episode is over."""
        raise NotImplementedError("is_terminal()")

    def returns(self):
        """Each seat's return so far (``num_seats`` numbers), or ``None`` (the default) for the sum
        of the step rewards, which the server keeps."""
        return None

    def metrics(self):
        """The episode's named numbers: a dict of str to float holding at least ``"score"`` (what
        ``troupe eval`` reports), with the same keys in every episode; ``None`` (the default) for
        ``{"score": <seat 0's return>}``."""
        return None

    def parse(self, seat, text):
        """Reads an agent's reply as an action of acting seat ``seat``: an int id or, for an
        open-ended seat, a str. Raise :class:`IllegalAction` ("why") when the text is no action.

        Default: for a seat with legal actions, the one whose text equals the reply, ignoring
        case, whitespace at either end (and runs of it inside) and an ``<answer>...</answer>``
        wrapper (see :func:`answer_span`); for an open-ended seat, the reply as it is."""
        legal = self.legal_actions(seat)
        if legal is None:
            return text
        wanted = _normalize(answer_span(text))
        matches = [int(action[0]) for action in _pairs(legal) if _normalize(action[1]) == wanted]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise IllegalAction(f"{text!r} matches {len(matches)} legal actions")
        shown = ", ".join(action[1] for action in _pairs(legal))
        raise IllegalAction(f"{text!r} is not a legal action; the legal actions are: {shown}")


def _pairs(legal):
    """``legal_actions`` entries as ``(id, text)`` tuples (pairs or ``{"id", "text"}`` dicts)."""
    out = []
    for action in legal:
        if isinstance(action, dict):
            out.append((action.get("id"), action.get("text")))
        else:
            action_id, text = action
            out.append((action_id, text))
    return out


class ProtocolError(Exception):
    """A request that does not follow the protocol (answered with an ``error``)."""


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value, what):
    """``value`` as a finite float, or a ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy scalars and the like
        except (TypeError, ValueError):
            raise ValueError(f"{what} is {value!r}, not a number") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}")
    return value


def _field(obj, key, check, what):
    """``obj[key]`` checked by ``check``, or a ProtocolError saying it must be ``what``."""
    if not isinstance(obj, dict) or key not in obj:
        raise ProtocolError(f"missing field `{key}`")
    value = obj[key]
    if not check(value):
        raise ProtocolError(f"`{key}` must be {what}, not {json.dumps(value)[:100]}")
    return value


def _entries(request, key):
    return _field(request, key, lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v), "a list of objects")


def _episode_id(entry):
    return _field(entry, "episode", lambda v: _is_int(v) and 0 <= v < _U64, "an unsigned 64-bit integer")


class _Episode:
    """One episode: the environment, its running sum of rewards, and the last State sent."""

    __slots__ = ("env", "reward_sums", "state")

    def __init__(self, env, num_seats):
        self.env = env
        self.reward_sums = [0.0] * num_seats
        self.state = None


class _Server:
    """The protocol state of one process: the parameters, the seat count and the episodes."""

    def __init__(self, factory):
        self.factory = factory
        self.params = None
        self.name = None
        self.num_seats = None
        self.metric_keys = None
        self.episodes = {}
        self.lost = {}  # episode -> why it was dropped

    # ----------------------------------------------------------------- the methods

    def init(self, request):
        if self.num_seats is not None:
            raise ProtocolError("`init` was already called")
        protocol = _field(request, "protocol", _is_int, "an integer")
        if protocol != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol {protocol} is not supported (this server speaks {PROTOCOL_VERSION})")
        params = request.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ProtocolError("`params` must be an object")
        probe = self.factory(params)
        if not isinstance(probe, Environment):
            raise TypeError(f"the factory returned {type(probe).__name__}, not an Environment")
        num_seats = probe.num_seats() if callable(probe.num_seats) else probe.num_seats
        if not _is_int(num_seats) or num_seats < 1:
            raise ValueError(f"num_seats is {num_seats!r}, not an integer >= 1")
        name = probe.name if probe.name is not None else type(probe).__name__
        if callable(name):
            name = name()
        if not isinstance(name, str):
            raise ValueError(f"name is {name!r}, not a string")
        self.params, self.num_seats, self.name = params, num_seats, name
        return {"name": name, "num_seats": num_seats}

    def reset(self, request):
        entries = _entries(request, "episodes")
        fresh = []
        for entry in entries:
            episode_id = _episode_id(entry)
            seed = _field(entry, "seed", lambda v: _is_int(v) and 0 <= v < _U64, "an unsigned 64-bit integer")
            env = self.factory(self.params)
            if not isinstance(env, Environment):
                raise TypeError(f"the factory returned {type(env).__name__}, not an Environment")
            env.reset(seed)
            episode = _Episode(env, self.num_seats)
            episode.state = self._state(episode)
            fresh.append((episode_id, episode))
        for episode_id, episode in fresh:  # all or nothing
            self.episodes[episode_id] = episode
            self.lost.pop(episode_id, None)
        return {"states": [episode.state for _, episode in fresh]}

    def step(self, request):
        entries = _entries(request, "episodes")
        for entry in entries:  # malformed requests are refused before anything changes
            _episode_id(entry)
            for action in _field(entry, "actions", lambda v: isinstance(v, list), "a list"):
                _wire_action(action)
        results = []
        done = []
        try:
            for entry in entries:
                episode_id = entry["episode"]
                done.append(episode_id)
                results.append(self._step_one(episode_id, [_wire_action(a) for a in entry["actions"]]))
        except Exception as err:
            for episode_id in done:  # their states are unknown to troupe now
                if self.episodes.pop(episode_id, None) is not None:
                    self.lost[episode_id] = f"a step failed with {type(err).__name__}: {err}"
            raise
        return {"results": results}

    def parse(self, request):
        entries = _entries(request, "requests")
        for entry in entries:
            _episode_id(entry)
            _field(entry, "seat", _is_int, "an integer")
            _field(entry, "text", lambda v: isinstance(v, str), "a string")
        return {"results": [self._parse_one(e["episode"], e["seat"], e["text"]) for e in entries]}

    def close(self, request):
        ids = _field(request, "episodes", lambda v: isinstance(v, list) and all(_is_int(e) for e in v), "a list of integers")
        for episode_id in ids:
            self.episodes.pop(episode_id, None)
            self.lost.pop(episode_id, None)
        return {}

    # ----------------------------------------------------------------- helpers

    def _find(self, episode_id):
        """The episode, or the reason there is none (a str)."""
        episode = self.episodes.get(episode_id)
        if episode is not None:
            return episode
        if episode_id in self.lost:
            return f"episode {episode_id} was dropped ({self.lost[episode_id]}); reset it"
        return f"episode {episode_id} was never reset (or was closed)"

    def _step_one(self, episode_id, actions):
        episode = self._find(episode_id)
        if isinstance(episode, str):
            return {"error": episode}
        state = episode.state
        if state["terminal"]:
            return {"error": f"episode {episode_id} is over"}
        acting = state["acting_seats"]
        if len(actions) != len(acting):
            return {"error": f"{len(actions)} actions for {len(acting)} acting seats {acting}"}
        for seat, action in zip(acting, actions):
            legal = state["legal_actions"][seat]
            if legal is None:
                if not isinstance(action, str):
                    return {"error": f"seat {seat} replies with text, not action id {action}"}
            elif isinstance(action, str):
                return {"error": f"seat {seat} takes an action id, not text {action!r}"}
            elif not any(a["id"] == action for a in legal):
                return {"error": f"action {action} is not a legal action of seat {seat}"}
        try:
            rewards = episode.env.step(list(actions))
        except IllegalAction as err:
            return {"error": str(err) or "illegal action"}
        if rewards is None:
            rewards = [0.0] * self.num_seats
        rewards = list(rewards)
        if len(rewards) != self.num_seats:
            raise ValueError(f"step returned {len(rewards)} rewards for {self.num_seats} seats")
        rewards = [_number(r, f"reward of seat {s}") for s, r in enumerate(rewards)]
        episode.reward_sums = [a + b for a, b in zip(episode.reward_sums, rewards)]
        episode.state = self._state(episode)
        return {"rewards": rewards, "state": episode.state}

    def _parse_one(self, episode_id, seat, text):
        episode = self._find(episode_id)
        if isinstance(episode, str):
            return {"error": episode}
        state = episode.state
        if seat not in state["acting_seats"]:
            return {"error": f"seat {seat} is not to act now"}
        try:
            action = episode.env.parse(seat, text)
        except IllegalAction as err:
            return {"error": str(err) or "not an action"}
        legal = state["legal_actions"][seat]
        if legal is None:
            if not isinstance(action, str):
                raise TypeError(f"parse for open-ended seat {seat} returned {action!r}, not a str")
            return {"action": {"text": action}}
        if not _is_int(action) or not any(a["id"] == action for a in legal):
            raise ValueError(f"parse read {text!r} as {action!r}, which is not a legal action id of seat {seat}")
        return {"action": {"id": action}}

    def _state(self, episode):
        """The State of ``episode`` now, checked."""
        env, n = episode.env, self.num_seats
        terminal = bool(env.is_terminal())
        acting = [] if terminal else list(env.acting_seats())
        if not terminal:
            if not acting:
                raise ValueError("acting_seats() is empty but the episode is not terminal")
            if any(not _is_int(s) or not 0 <= s < n for s in acting) or len(set(acting)) != len(acting):
                raise ValueError(f"acting_seats() is {acting}: seats must be distinct ints in 0..{n - 1}")
        instructions = [env.instructions(s) for s in range(n)]
        observations = [env.observation(s) for s in range(n)]
        for what, texts in (("instructions", instructions), ("observation", observations)):
            for seat, text in enumerate(texts):
                if not isinstance(text, str):
                    raise ValueError(f"{what}({seat}) is {type(text).__name__}, not a str")
        legal_actions = [[] for _ in range(n)]
        for seat in acting:
            legal_actions[seat] = self._legal(env, seat)
        returns = env.returns()
        if returns is None:
            returns = episode.reward_sums
        returns = list(returns)
        if len(returns) != n:
            raise ValueError(f"returns() has {len(returns)} entries for {n} seats")
        returns = [_number(r, f"return of seat {s}") for s, r in enumerate(returns)]
        metrics = env.metrics()
        if metrics is None:
            metrics = {"score": returns[0]}
        if not isinstance(metrics, dict) or "score" not in metrics:
            raise ValueError(f"metrics() is {metrics!r}: a dict with at least \"score\" is needed")
        metrics = {str(k): _number(v, f"metric {k!r}") for k, v in metrics.items()}
        keys = sorted(metrics)
        if self.metric_keys is None:
            self.metric_keys = keys
        elif keys != self.metric_keys:
            raise ValueError(f"metrics() has keys {keys}, but earlier states had {self.metric_keys} (keep them the same)")
        return {
            "acting_seats": acting,
            "terminal": terminal,
            "instructions": instructions,
            "observations": observations,
            "legal_actions": legal_actions,
            "returns": returns,
            "metrics": metrics,
        }

    @staticmethod
    def _legal(env, seat):
        legal = env.legal_actions(seat)
        if legal is None:
            return None
        out = []
        for action_id, text in _pairs(legal):
            if not _is_int(action_id) or not 0 <= action_id < _U32:
                raise ValueError(f"legal action id {action_id!r} of seat {seat} is not an int in 0..2**32-1")
            if not isinstance(text, str):
                raise ValueError(f"legal action {action_id} of seat {seat} has text {text!r}, not a str")
            out.append({"id": action_id, "text": text})
        out.sort(key=lambda a: a["id"])
        for a, b in zip(out, out[1:]):
            if a["id"] == b["id"]:
                raise ValueError(f"legal action id {a['id']} of seat {seat} appears twice")
        if not out:
            raise ValueError(f"acting seat {seat} has no legal action")
        return out


def _wire_action(action):
    """An Action object as an int id or a str, or a ProtocolError."""
    if isinstance(action, dict) and len(action) == 1:
        if "id" in action and _is_int(action["id"]) and action["id"] >= 0:
            return action["id"]
        if "text" in action and isinstance(action["text"], str):
            return action["text"]
    raise ProtocolError(f'an action must be {{"id": n}} or {{"text": "..."}}, not {json.dumps(action)[:100]}')


_METHODS = {
    "init": _Server.init,
    "reset": _Server.reset,
    "step": _Server.step,
    "parse": _Server.parse,
    "close": _Server.close,
}


def _handle(server, line):
    """Answers one request line (bytes or str) of ``server``; returns the response object."""
    request_id = None
    try:
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError) as err:
            raise ProtocolError(f"the request is not JSON: {err}") from None
        if not isinstance(request, dict):
            raise ProtocolError("the request is not a JSON object")
        request_id = request.get("id")
        if not _is_int(request_id):
            request_id = None
            raise ProtocolError("the request has no integer `id`")
        method = request.get("method")
        if method not in _METHODS:
            raise ProtocolError(f"unknown method {json.dumps(method)} (known: {', '.join(_METHODS)})")
        if method != "init" and server.num_seats is None:
            raise ProtocolError(f"`{method}` before `init`")
        return {"id": request_id, "result": _METHODS[method](server, request)}
    except ProtocolError as err:
        return {"id": request_id, "error": str(err)}
    except Exception as err:  # the environment's own code failed
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        return {"id": request_id, "error": _exception_message(err)}


def _exception_message(err):
    """One line for an exception raised by the environment's code: its type and message and
    where it was raised (the innermost frame); the whole traceback goes to stderr."""
    frames = traceback.extract_tb(err.__traceback__)
    where = ""
    if frames:
        frame = frames[-1]
        where = f" (raised at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    message = " ".join(str(err).split())
    return f"exception in the environment: {type(err).__name__}: {message}{where}; traceback on stderr"


def serve(factory, stdin=None, stdout=None):
    """Serves the protocol until stdin closes, then returns.

    ``factory(params)`` returns a new :class:`Environment`, ``params`` being the dict from the
    config (``env.params``, ``{}`` when absent). It is called once at ``init`` (to learn the name
    and seat count, and to refuse bad parameters early) and once per ``reset`` of an episode.

    ``stdin`` and ``stdout`` are binary streams (default: the process's); while serving,
    ``sys.stdout`` points at stderr so that stray prints cannot break the protocol.
    """
    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout.buffer
    server = _Server(factory)
    saved, sys.stdout = sys.stdout, sys.stderr
    try:
        for line in stdin:
            if not line.strip():
                continue
            response = _handle(server, line)
            try:
                data = json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            except (TypeError, ValueError) as err:
                data = json.dumps({"id": response.get("id"), "error": f"the answer cannot be sent as JSON: {err}"})
            try:
                stdout.write(data.encode("utf-8") + b"\n")
                stdout.flush()
            except BrokenPipeError:
                return
    finally:
        sys.stdout = saved
