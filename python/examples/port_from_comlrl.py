"""A CoMLRL-style MAGRPO script ported to troupe: two agents answer each prompt, agent 0 briefly
and agent 1 at length, rewarded by the ratio of their lengths (CoMLRL's length-ratio example,
docs/coming-from-trl.md maps every argument).

    python3 python/examples/port_from_comlrl.py                       # the built-in model
    python3 python/examples/port_from_comlrl.py --model Qwen3-0.6B/   # a Hugging Face directory

The CoMLRL original reads, in outline:

    args = MAGRPOConfig(output_dir=..., num_train_epochs=..., learning_rate=5e-5,
                        num_generations=4, max_new_tokens=64, num_agents=2)
    trainer = MAGRPOTrainer(model="Qwen/Qwen2.5-0.5B", num_agents=2, reward_funcs=length_ratio,
                            formatters=[brief, detailed], args=args, train_dataset=dataset,
                            wandb_config={"project": "mlrl"})
    trainer.train()
"""

import argparse
import tempfile

import troupe

PROMPTS = [
    "Describe a lighthouse.",
    "Describe a market at dawn.",
    "Describe a storm at sea.",
    "Describe an old library.",
    "Describe a mountain village.",
    "Describe a night train.",
]


def length_ratio(completions_agent0, completions_agent1, batch_items):
    """1 when agent 1's reply is 2 to 3 times as long as agent 0's, less the further it is."""
    rewards = []
    for brief, detailed in zip(completions_agent0, completions_agent1):
        ratio = len(detailed) / max(len(brief), 1)
        rewards.append(1.0 if 2.0 <= ratio <= 3.0 else max(0.0, 1.0 - min(abs(ratio - 2.0), abs(ratio - 3.0)) / 3.0))
    return rewards


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face directory or GGUF file (default: built in)")
    parser.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        trainer = troupe.MAGRPOTrainer(
            model=args.model,                              # MAGRPOTrainer(model=...)
            num_agents=2,                                  # MAGRPOConfig.num_agents
            reward_funcs=[length_ratio],                   # the same signature
            train_dataset=[{"prompt": p} for p in PROMPTS[:4]],
            eval_dataset=[{"prompt": p} for p in PROMPTS[4:]],
            instructions=["Answer in one short sentence.", "Answer in detail, in several sentences."],
            output_dir=out,                                # MAGRPOConfig.output_dir
            config={
                "run": {"iterations": args.iterations},    # num_train_epochs x dataset size, in iterations
                "action": {"max_new_tokens": 32},          # MAGRPOConfig.max_new_tokens
                "training": {
                    "group_size": 4,                       # MAGRPOConfig.num_generations
                    "groups_per_iteration": 2,             # prompts per update
                    "optimizer": {"lr": 5.0e-3},           # MAGRPOConfig.learning_rate (LoRA, not full weights)
                },
                "eval": {"episodes": 8},
            },
        )
        before = trainer.evaluate()["reward"]["0"]
        history = trainer.train()
        after = trainer.evaluate()["reward"]["0"]
        print(f"{len(history)} iterations; held-out reward {before['mean']:.3f} ± {before['stderr']:.3f} "
              f"-> {after['mean']:.3f} ± {after['stderr']:.3f}")
        trainer.save_adapters(f"{out}/adapters")          # PEFT directories, one per agent


if __name__ == "__main__":
    main()
