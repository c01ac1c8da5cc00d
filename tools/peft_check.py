#!/usr/bin/env python3
"""Adapters trained by troupe on a bf16 base, loaded by PEFT: PEFT's per-token log-probs against
`troupe logprobs`, in float32 and in bfloat16.

Usage, from the repository root, with troupe built (`cargo build --bin troupe`) and the fixture
reference stack (`pip install -r fixtures/regenerate/requirements.txt`: torch, transformers, PEFT):

    python tools/peft_check.py --troupe target/debug/troupe
    python tools/peft_check.py --troupe target/debug/troupe --fixture-out fixtures/bf16-trained

1. Copies the `tiny-qwen2` fixture model with `max_position_embeddings` raised to 4096 (its weights
   unchanged; Hanabi's prompts are longer than its 512 positions) and trains two agents on it for
   `--iterations` MAGRPO iterations of 2-player Hanabi with `troupe train --set model.dtype=bf16`
   (`train.yaml` in the work directory is the config).
2. Loads the saved adapter directory (PEFT's layout) with `PeftModel.from_pretrained` on the
   transformers model of the same base, once loaded in float32 and once in bfloat16 (PEFT keeps
   the LoRA factors in float32 on it), and computes log p(token t | tokens < t) for each text.
3. Runs `troupe logprobs --adapter DIR:agent_N` on the same model and texts, `--dtype f32` and
   `--dtype bf16`, and prints the largest differences as one JSON object; it exits non-zero if a
   difference exceeds the tolerances of `tests/it/mixed_precision.rs` (float32 against float32: 1e-3).

--fixture-out DIR writes the trained adapters (DIR/adapters) and PEFT's outputs on them
(DIR/expected.json) for `tests/it/mixed_precision.rs`, which checks troupe against them without torch.
--adapters DIR skips training and checks an existing adapter directory (its base: `--model`).
"""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_MODEL = ROOT / "fixtures" / "models" / "tiny-qwen2"
# The tolerances of tests/it/mixed_precision.rs (and 1e-3 for float32 against float32).
TOLERANCES = {"troupe_f32_vs_peft_f32": 1e-3, "troupe_bf16_vs_peft_f32": 0.15, "troupe_bf16_vs_peft_bf16": 0.25}
# Hanabi-like prompts (the compact observation's vocabulary) and the fixture texts; all fit in the
# fixture model's 512 positions, so the committed fixture is checked on the committed model.
EXTRA_TEXTS = [
    "Hanabi, 2 players. You are player 0. Fireworks: R0 Y0 G0 W0 B0. Hints 8, lives 3, deck 40.\n"
    "Player 1 holds: R1 G3 W2 B1 Y4. You know: card 0 is red, card 3 is a 1.\n"
    "Legal actions: play 0, play 1, discard 2, hint player 1 red, hint player 1 rank 1.\nAction: play 3",
]
HANABI_CONFIG = """\
run: {{out_dir: {out}, seed: 3, iterations: {iterations}, checkpoint_every: {iterations}}}
model: {{path: {model}}}
env: {{name: hanabi, players: 2, history_moves: 1}}
adapter: {{r: 4, lora_alpha: 8.0, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}}
action: {{mode: free, max_new_tokens: 4, chat_template: false}}
training: {{group_size: 2, groups_per_iteration: 1, lr: 5.0e-2, warmup_iterations: 0, max_episode_steps: 3}}
"""


def fixture_helpers():
    """fixtures/regenerate/models.py: its texts and its log-prob function (the ones expected.json uses)."""
    spec = importlib.util.spec_from_file_location("fixture_models", ROOT / "fixtures" / "regenerate" / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(cmd, quiet=False):
    if not quiet:
        print("+ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    done = subprocess.run(list(map(str, cmd)), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"error: `{' '.join(map(str, cmd))}` exited with {done.returncode}")
    return done.stdout


def train(troupe, work, iterations):
    """Trains two Hanabi agents in bf16 on a long-context copy of tiny-qwen2; their adapter dir."""
    model = work / "tiny-qwen2"
    model.mkdir()
    for path in FIXTURE_MODEL.iterdir():
        if path.is_file():
            shutil.copy(path, model / path.name)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (model / "config.json").write_text(json.dumps(config, indent=2))
    out = work / "run"
    yaml = work / "train.yaml"
    yaml.write_text(HANABI_CONFIG.format(out=out, model=model, iterations=iterations))
    run([troupe, "train", "--config", yaml, "--set", "model.dtype=bf16"])
    return model, out / "checkpoints" / f"iteration-{iterations:06d}" / "adapters"


def agents(adapters):
    return sorted(p.name for p in adapters.iterdir() if (p / "adapter_config.json").exists())


@torch.no_grad()
def peft_logprobs(model_dir, adapters, names, token_ids, dtype, logprobs):
    """{"base" | agent: [log-probs per text]} from transformers + PEFT with the model in `dtype`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def score(m):
        return [logprobs(m(torch.tensor([ids])).logits[0], ids) for ids in token_ids]

    result = {"base": score(model)}
    peft = PeftModel.from_pretrained(model, adapters / names[0], adapter_name=names[0]).eval()
    for name in names[1:]:
        peft.load_adapter(adapters / name, adapter_name=name)
    lora = {p.dtype for n, p in peft.named_parameters() if ".lora_" in n}
    assert lora == {torch.float32}, f"PEFT holds the LoRA factors in {lora}"
    for name in names:
        peft.set_adapter(name)
        result[name] = score(peft)
    return result


def troupe_logprobs(troupe, model_dir, adapters, names, texts, dtype):
    """{"base" | agent: [(ids, log-probs) per text]} from `troupe logprobs --dtype dtype`."""
    result = {}
    for name in ["base", *names]:
        adapter = [] if name == "base" else ["--adapter", f"{adapters}:{name}"]
        result[name] = []
        for text in texts:
            out = json.loads(run([troupe, "logprobs", "--model", model_dir, *adapter, "--text", text, "--dtype", dtype],
                                 quiet=True))
            result[name].append((out["input_ids"], out["logprobs"]))
    return result


def max_diff(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--troupe", default=str(ROOT / "target" / "debug" / "troupe"), help="the troupe binary")
    p.add_argument("--iterations", type=int, default=2, help="MAGRPO iterations to train")
    p.add_argument("--adapters", type=Path, help="check this adapter directory instead of training")
    p.add_argument("--model", type=Path, help="the base of --adapters (default: the tiny-qwen2 fixture)")
    p.add_argument("--work", type=Path, help="keep the model copy, the run and its adapters here")
    p.add_argument("--fixture-out", type=Path, help="write the adapters and PEFT's outputs here")
    args = p.parse_args()
    torch.set_num_threads(1)  # one thread: the same float sums on every machine
    helpers = fixture_helpers()
    with tempfile.TemporaryDirectory(prefix="troupe-peft-check-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        check(args, helpers, work)


def check(args, helpers, work):
    if args.adapters:
        model_dir, adapters = args.model or FIXTURE_MODEL, args.adapters
    else:
        model_dir, adapters = train(args.troupe, work, args.iterations)
    names = agents(adapters)
    texts = helpers.TEXTS + EXTRA_TEXTS

    ours = {dtype: troupe_logprobs(args.troupe, model_dir, adapters, names, texts, dtype) for dtype in ("f32", "bf16")}
    token_ids = [ids for ids, _ in ours["f32"]["base"]]
    peft = {key: peft_logprobs(model_dir, adapters, names, token_ids, dtype, helpers.logprobs)
            for key, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16))}

    diffs = {"troupe_f32_vs_peft_f32": 0.0, "troupe_bf16_vs_peft_f32": 0.0, "troupe_bf16_vs_peft_bf16": 0.0,
             "peft_bf16_vs_peft_f32": 0.0, "troupe_bf16_vs_troupe_f32": 0.0, "adapter_vs_base_f32": 0.0}
    for name in names:
        for i in range(len(texts)):
            for dtype in ("f32", "bf16"):
                assert ours[dtype][name][i][0] == token_ids[i], "troupe tokenized a text two ways"
            ours_f32, ours_bf16 = ours["f32"][name][i][1], ours["bf16"][name][i][1]
            peft_f32, peft_bf16 = peft["f32"][name][i], peft["bf16"][name][i]
            for key, a, b in (("troupe_f32_vs_peft_f32", ours_f32, peft_f32),
                              ("troupe_bf16_vs_peft_f32", ours_bf16, peft_f32),
                              ("troupe_bf16_vs_peft_bf16", ours_bf16, peft_bf16),
                              ("peft_bf16_vs_peft_f32", peft_bf16, peft_f32),
                              ("troupe_bf16_vs_troupe_f32", ours_bf16, ours_f32),
                              ("adapter_vs_base_f32", peft_f32, peft["f32"]["base"][i])):
                diffs[key] = max(diffs[key], max_diff(a, b))
    report = {"adapters": str(adapters), "model": str(model_dir), "agents": names, "texts": len(texts),
              "max_abs_logprob_diff": diffs, "tolerances": TOLERANCES, "torch": torch.__version__}
    print(json.dumps(report, indent=1))

    if args.fixture_out:
        out = args.fixture_out
        shutil.rmtree(out / "adapters", ignore_errors=True)
        (out / "adapters").mkdir(parents=True)
        for name in names:
            (out / "adapters" / name).mkdir()
            shutil.copy(adapters / name / "adapter_model.safetensors", out / "adapters" / name)
            # As troupe wrote it but for the base's path, a temporary copy of the fixture model.
            config = json.loads((adapters / name / "adapter_config.json").read_text())
            config["base_model_name_or_path"] = "fixtures/models/tiny-qwen2"
            (out / "adapters" / name / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if (adapters / "troupe.json").exists():
            shutil.copy(adapters / "troupe.json", out / "adapters" / "troupe.json")
        expected = {"base": "tiny-qwen2", "trained": "troupe train --set model.dtype=bf16, "
                    f"{args.iterations} MAGRPO iterations of 2-player Hanabi (tools/peft_check.py)",
                    "peft_f32": {}, "peft_bf16": {}}
        for key in ("f32", "bf16"):
            expected[f"peft_{key}"] = {
                name: [{"text": text, "input_ids": ids, "logprobs": lp}
                       for text, ids, lp in zip(texts, token_ids, peft[key][name])]
                for name in ["base", *names]}
        (out / "expected.json").write_text(json.dumps(expected, indent=1))
        print(f"wrote {out}", file=sys.stderr)

    failed = [key for key, limit in TOLERANCES.items() if not diffs[key] < limit]
    if failed or not diffs["adapter_vs_base_f32"] > 1e-3:
        sys.exit(f"error: {failed or 'the adapters do not change the outputs'} (see max_abs_logprob_diff)")


if __name__ == "__main__":
    main()
