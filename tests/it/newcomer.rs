//! What a newcomer meets in the first hour, as they meet it through the `troupe` binary:
//! TensorBoard files beside `metrics.jsonl`, a held-out evaluation at the last iteration, a
//! resume that cannot go backwards, a changed learning-rate schedule said out loud, `--set`
//! blamed for its own mistakes, plain-text logs, and `eval` of baselines without adapters.

use crate::common;
use common::{stderr, succeeds};

use std::path::{Path, PathBuf};
use std::process::Command;

fn troupe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env("RUST_LOG", "info").output().expect("run troupe")
}

fn error_line(out: &std::process::Output) -> String {
    assert!(!out.status.success(), "expected a failure, stdout: {}", String::from_utf8_lossy(&out.stdout));
    let text = stderr(out);
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "one error line: {text}");
    lines[0].to_string()
}

/// A tiny Hanabi config in `dir` (run in `dir/run`): `iterations`, a held-out evaluation every
/// `eval_every`, the learning rate decaying to half, metrics to JSONL and TensorBoard.
fn write_config(dir: &Path, iterations: usize, eval_every: usize) -> PathBuf {
    let path = dir.join("tiny.yaml");
    let text = format!(
        "run: {{out_dir: {}, seed: 3, iterations: {iterations}, checkpoint_every: 1, report_to: [jsonl, tensorboard]}}\n\
         env: {{name: hanabi, players: 2, history_moves: 1}}\n\
         adapter: {{r: 4, lora_alpha: 8.0}}\n\
         action: {{mode: choice}}\n\
         training: {{group_size: 2, groups_per_iteration: 1, lr: 1.0e-2, lr_final_fraction: 0.5, max_episode_steps: 3}}\n\
         eval: {{episodes: 2, seed: 5000, every: {eval_every}, every_episodes: 2, max_episode_steps: 4}}\n",
        dir.join("run").display()
    );
    std::fs::write(&path, text).expect("write config");
    path
}

fn metrics(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// The tags of every scalar in a TensorBoard event file, read as TensorBoard reads it: TFRecord
/// frames whose masked CRC-32C checksums must hold, `Event.summary.value.tag` (field 5, 1, 1).
fn event_tags(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).expect("event file");
    let masked = |data: &[u8]| crc32c::crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8);
    let mut tags = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        assert_eq!(u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4")), masked(len_bytes));
        let data = &bytes[at + 12..at + 12 + len];
        assert_eq!(u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().expect("4")), masked(data));
        at += 16 + len;
        for summary in fields(data).into_iter().filter(|(f, _)| *f == 5) {
            for value in fields(summary.1).into_iter().filter(|(f, _)| *f == 1) {
                for (field, tag) in fields(value.1) {
                    if field == 1 {
                        tags.push(String::from_utf8(tag.to_vec()).expect("UTF-8 tag"));
                    }
                }
            }
        }
    }
    tags
}

/// The length-delimited fields of a protobuf message (other wire types skipped).
fn fields(mut data: &[u8]) -> Vec<(u64, &[u8])> {
    fn varint(data: &mut &[u8]) -> u64 {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = data[0];
            *data = &data[1..];
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                break;
            }
        }
        value
    }
    let mut out = Vec::new();
    while !data.is_empty() {
        let key = varint(&mut data);
        match key & 7 {
            0 => {
                varint(&mut data);
            }
            1 => data = &data[8..],
            5 => data = &data[4..],
            2 => {
                let len = varint(&mut data) as usize;
                out.push((key >> 3, &data[..len]));
                data = &data[len..];
            }
            wire => panic!("wire type {wire}"),
        }
    }
    out
}

#[test]
fn a_run_reports_to_tensorboard_evaluates_its_last_iteration_and_only_goes_forward() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let config = write_config(tmp.path(), 3, 2);
    let config_s = config.to_str().expect("utf-8");
    let out = troupe(&["train", "--config", config_s, "--quiet"]);
    succeeds(&out);
    assert!(!stderr(&out).contains('\u{1b}'), "a log that is not a terminal has no colour codes");
    let run = tmp.path().join("run");

    // metrics.jsonl keeps its keys; the held-out evaluation runs at iteration 2 (every 2) and
    // at the last one, 3.
    let lines = metrics(&run);
    assert_eq!(lines.len(), 3);
    let evaluated: Vec<bool> = lines.iter().map(|l| l["extra"].get("eval_score").is_some()).collect();
    assert_eq!(evaluated, [false, true, true]);

    // TensorBoard: one event file, every iteration's scalars under TRL's names.
    let files: Vec<PathBuf> =
        std::fs::read_dir(run.join("tensorboard")).expect("tensorboard/").map(|e| e.expect("entry").path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("events.out.tfevents.")));
    let tags = event_tags(&files[0]);
    for tag in [
        "reward",
        "reward_std",
        "agent_0/reward",
        "agent_1/reward_std",
        "learning_rate",
        "loss",
        "entropy",
        "eval/score",
    ] {
        assert!(tags.iter().any(|t| t == tag), "{tag} in {tags:?}");
    }
    assert_eq!(tags.iter().filter(|t| *t == "reward").count(), 3, "one per iteration");

    // Going backwards is refused, blaming --set; nothing is lost.
    let run_s = run.to_str().expect("utf-8");
    let line = error_line(&troupe(&["train", "--resume", run_s, "--set", "run.iterations=2"]));
    assert!(line.contains("--set") && line.contains("run.iterations") && line.contains("iteration 3"), "{line}");
    assert_eq!(metrics(&run).len(), 3);

    // Extending a run with a decaying learning rate says how the schedule changes.
    let out = troupe(&["train", "--resume", run_s, "--set", "run.iterations=4", "--quiet"]);
    assert_eq!(succeeds(&out)["iterations"], 4);
    let said = stderr(&out);
    assert!(said.contains("run.iterations 3 -> 4") && said.contains("learning rate"), "{said}");
    assert_eq!(metrics(&run).len(), 4);
    assert_eq!(std::fs::read_dir(run.join("tensorboard")).expect("tensorboard/").count(), 2, "a file per process");
}

#[test]
fn set_mistakes_are_blamed_on_set() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let config = write_config(tmp.path(), 1, 0);
    let line = error_line(&troupe(&["train", "--config", config.to_str().expect("utf-8"), "--set", "training.lrr=1"]));
    assert!(line.starts_with("error: --set") && line.contains("training.lrr"), "{line}");
    let line = error_line(&troupe(&[
        "train",
        "--config",
        config.to_str().expect("utf-8"),
        "--set",
        "run.report_to=[jsonl, wandb]",
    ]));
    assert!(line.contains("run.report_to") && line.contains("wandb"), "{line}");
    assert!(!tmp.path().join("run").exists());
}

#[test]
fn eval_of_baselines_needs_no_adapters() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let config = write_config(tmp.path(), 1, 0);
    let config_s = config.to_str().expect("utf-8");
    let summary = succeeds(&troupe(&[
        "eval",
        "--config",
        config_s,
        "--episodes",
        "2",
        "--set",
        "eval.baseline_seats={0: rule, 1: rule}",
    ]));
    assert!(summary["score"]["mean"].as_f64().is_some(), "{summary}");
    assert!(summary["adapters"].is_null());
    let line = error_line(&troupe(&["eval", "--config", config_s, "--set", "eval.baseline_seats={1: rule}"]));
    assert!(line.contains("--adapters") && line.contains("seat 0"), "{line}");
}
