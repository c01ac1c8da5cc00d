"""The README's Python example: two agents on the built-in model (no download) learn a toy reward
in under a minute on a laptop's CPU, and the held-out reward shows it.

    python3 python/examples/quickstart.py

The reward is the share of each reply's letters that are letters of "cooperate" (one value per
episode, shared by both agents): something a random-weight model can climb. The run directory is
a temporary one, removed when the script ends.
"""

import argparse

import troupe

LETTERS = set("cooperate")


def cooperate_letters(completions_agent0, completions_agent1, batch_items):
    """One reward per episode: the mean over both replies of the share of "cooperate" letters."""
    def share(text):
        letters = [c for c in text.lower() if c.isalpha()]
        return sum(c in LETTERS for c in letters) / max(len(letters), 1)

    return [(share(a) + share(b)) / 2 for a, b in zip(completions_agent0, completions_agent1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    iterations = parser.parse_args().iterations
    trainer = troupe.MAGRPOTrainer(
        num_agents=2,                          # two agents, one LoRA adapter each, on one frozen base
        reward_funcs=[cooperate_letters],
        config={                               # anything `troupe train --config` takes
            "run": {"iterations": iterations, "checkpoint_every": 100, "seed": 3},
            "action": {"max_new_tokens": 16},
            "training": {"group_size": 4, "groups_per_iteration": 2, "optimizer": {"lr": 5.0e-3}},
            "eval": {"episodes": 16},
        },
    )
    before = trainer.evaluate()["reward"]["0"]
    while not trainer.run.finished():
        metrics = trainer.step()
        print(f"iteration {metrics['iteration']:2d}: training reward {metrics['mean_return']['0']:.3f}")
    after = trainer.evaluate()["reward"]["0"]
    print(f"held-out reward: {before['mean']:.3f} ± {before['stderr']:.3f} before, "
          f"{after['mean']:.3f} ± {after['stderr']:.3f} after")


if __name__ == "__main__":
    main()
