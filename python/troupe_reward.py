"""The server side of troupe's external reward functions, for Python: one function per reward.

troupe calls a reward function written in another language as a child process, once per
iteration, with every episode in one JSON line (envs/README.md, "Reward functions in any
language"). This module speaks that exchange, so a Python reward function in the shape
multi-agent trainers use is served by one call. It uses the standard library only::

    from troupe_reward import serve_reward

    def same_length(completions_agent0, completions_agent1, batch_items):
        # one float per episode (both seats get it), or a list with one float per seat
        return [-abs(len(a) - len(b)) / 100 for a, b in zip(completions_agent0, completions_agent1)]

    if __name__ == "__main__":
        serve_reward(same_length)

and in the troupe config::

    rewards:
      functions:
        - {name: env_return, weight: 1.0}
        - {name: external, command: [python3, same_length.py], weight: 0.5}

``completions_agentK[i]`` is everything seat K replied in episode i, its turns joined by newlines;
``batch_items[i]`` is the episode as troupe sent it: ``seed``, ``completions`` and ``prompts``
(per seat, one entry per turn), ``returns`` (per seat) and ``metrics``.
"""

import json
import math
import sys
import traceback

__all__ = ["serve_reward"]


def _answer(line, reward_fn):
    """The answer to one request line, as a dict."""
    try:
        request = json.loads(line)
    except ValueError:
        return {"id": None, "error": "the request is not JSON"}
    if not isinstance(request, dict):
        return {"id": None, "error": "the request is not a JSON object"}
    request_id = request.get("id")
    if request.get("method") != "score":
        return {"id": request_id, "error": f"unknown method {request.get('method')!r}"}
    episodes = request.get("episodes")
    if not isinstance(episodes, list):
        return {"id": request_id, "error": "`episodes` is not a list"}
    seats = max((len(e.get("completions", [])) for e in episodes), default=0)
    per_seat = [["\n".join(e["completions"][s]) if s < len(e["completions"]) else "" for e in episodes] for s in range(seats)]
    try:
        rewards = list(reward_fn(*per_seat, episodes))
    except Exception as err:  # the user's function failed: say so, keep serving
        traceback.print_exc(file=sys.stderr)
        return {"id": request_id, "error": f"{type(err).__name__}: {err}"}
    if len(rewards) != len(episodes):
        return {"id": request_id, "error": f"the reward function gave {len(rewards)} rewards for {len(episodes)} episodes"}
    try:
        rewards = [[float(x) for x in r] if isinstance(r, (list, tuple)) else float(r) for r in rewards]
    except (TypeError, ValueError) as err:
        return {"id": request_id, "error": f"a reward is not a number: {err}"}
    flat = [x for r in rewards for x in (r if isinstance(r, list) else [r])]
    if not all(math.isfinite(x) for x in flat):
        return {"id": request_id, "error": f"a reward is not a finite number: {rewards}"}
    return {"id": request_id, "result": {"rewards": rewards}}


def serve_reward(reward_fn, stdin=None, stdout=None):
    """Serves ``reward_fn(completions_agent0, completions_agent1, ..., batch_items)`` until stdin
    ends. Anything the function prints goes to stderr, so stdout carries only the exchange."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    real_stdout, sys.stdout = stdout, sys.stderr
    try:
        for line in stdin:
            if line.strip():
                real_stdout.write(json.dumps(_answer(line, reward_fn)) + "\n")
                real_stdout.flush()
    finally:
        sys.stdout = real_stdout
