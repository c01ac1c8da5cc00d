"""Experiment tracking and resuming from Python: TensorBoard event files read back by
TensorBoard's own reader, W&B offline through the wandb package (skipped where it is not
installed), `MAGRPOTrainer(resume=...)`, and the temporary run directory cleaned up."""

import gc
import glob
import os
import subprocess
import sys

import pytest

troupe = pytest.importorskip("troupe", reason="the troupe package is not installed (pip install .)")


def letters(completions_agent0, completions_agent1, batch_items):
    return [sum(c in "cooperate" for c in a + b) / max(len(a + b), 1)
            for a, b in zip(completions_agent0, completions_agent1)]


def small_config(iterations):
    return {
        "run": {"iterations": iterations, "checkpoint_every": 1, "seed": 3},
        "action": {"max_new_tokens": 8},
        "training": {"group_size": 2, "groups_per_iteration": 1, "optimizer": {"lr": 5.0e-3}},
        "eval": {"episodes": 2},
    }


def test_tensorboard_files_read_back_with_trl_names(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[letters], config=small_config(2),
                                   output_dir=tmp_path / "run", report_to=["tensorboard"])
    history = trainer.train()
    files = glob.glob(str(tmp_path / "run" / "tensorboard" / "events.out.tfevents.*"))
    assert len(files) == 1, files
    reader = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    for tag in ["reward", "reward_std", "agent_0/reward", "agent_1/reward", "grad_norm", "agent_0/grad_norm",
                "learning_rate", "loss", "completions/mean_length", "completions/clipped_ratio",
                "frac_reward_zero_std", "turn_0/reward", "invalid_rate", "perf/tokens_per_second"]:
        assert tag in tags, (tag, sorted(tags))
    rewards = reader.Scalars("agent_0/reward")
    assert [e.step for e in rewards] == [1, 2]
    # The same numbers as metrics.jsonl (float32 in the event file).
    for event, line in zip(rewards, history):
        assert event.value == pytest.approx(line["mean_return"]["0"], rel=1e-6, abs=1e-7)
    lr = reader.Scalars("learning_rate")
    assert lr[0].value == pytest.approx(history[0]["lr"], rel=1e-6)


def test_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="report_to=['wandb'] needs the wandb package")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[letters], config=small_config(2),
                                   output_dir=tmp_path / "run", report_to=["wandb"], wandb_project="troupe-test")
    trainer.train()
    summary = dict(trainer._wandb_run.summary)
    trainer.finish()
    assert "reward" in summary and "agent_1/reward" in summary and "learning_rate" in summary, summary
    assert glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*")), "an offline run directory"
    del wandb


def test_report_to_is_checked():
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        troupe.MAGRPOTrainer(num_agents=2, report_to=["mlflow"])


def test_resume_continues_a_run(tmp_path):
    run = tmp_path / "run"
    first = troupe.MAGRPOTrainer(num_agents=2, reward_funcs=[letters], config=small_config(2), output_dir=run)
    first.train()
    del first
    gc.collect()  # drops the run's lock
    resumed = troupe.MAGRPOTrainer(resume=run, reward_funcs=[letters], config={"run": {"iterations": 3}})
    assert resumed.run.iteration() == 2
    lines = resumed.train()
    assert [line["iteration"] for line in lines] == [3]
    assert resumed.config["run"]["iterations"] == 3
    with pytest.raises(RuntimeError, match="run.iterations"):
        del resumed
        gc.collect()
        troupe.MAGRPOTrainer(resume=run, reward_funcs=[letters], config={"run": {"iterations": 1}})


def test_the_temporary_run_directory_is_removed(tmp_path):
    script = (
        "import troupe\n"
        "t = troupe.MAGRPOTrainer(num_agents=2, config={'run': {'iterations': 1}, 'action': {'max_new_tokens': 4},"
        " 'training': {'group_size': 2, 'groups_per_iteration': 1}, 'eval': {'episodes': 1}})\n"
        "t.train()\n"
        "print(t.output_dir)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    run_dir = out.stdout.strip().splitlines()[-1]
    assert run_dir.startswith(str(tmp_path)), run_dir
    assert not os.path.exists(run_dir), "the temporary run directory is left behind"
