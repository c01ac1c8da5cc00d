//! The plug-in crate's binary, end to end, as a user runs it: its environment and policy are
//! listed and benchmarked, a training run is killed (SIGKILL) after its first checkpoint and
//! resumed to the same adapters as an uninterrupted run, and `eval` seats the plug-in's policy.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_signal-troupe");

fn config_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/signal.yaml")
}

fn run(args: &[&str]) -> Output {
    let output = Command::new(BIN).args(args).output().expect("the plug-in binary runs");
    assert!(
        output.status.success(),
        "signal-troupe {args:?} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout)))
}

/// Small settings for a test run writing to `out`.
fn train_sets(out: &Path) -> Vec<String> {
    [
        format!("run.out_dir={}", out.display()),
        "run.iterations=4".to_string(),
        "run.checkpoint_every=1".to_string(),
        "training.groups_per_iteration=2".to_string(),
        "eval.every=2".to_string(),
        "eval.every_episodes=4".to_string(),
    ]
    .to_vec()
}

fn with_sets<'a>(head: &[&'a str], sets: &'a [String]) -> Vec<&'a str> {
    let mut args = head.to_vec();
    for set in sets {
        args.extend(["--set", set.as_str()]);
    }
    args
}

/// Every adapter file of a checkpoint, by name.
fn adapter_bytes(checkpoint: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    for agent in std::fs::read_dir(checkpoint.join("adapters")).unwrap() {
        let agent = agent.unwrap().path();
        if agent.is_dir() {
            for file in std::fs::read_dir(&agent).unwrap() {
                let file = file.unwrap().path();
                files.push((
                    file.display().to_string().replace(&*checkpoint.display().to_string(), ""),
                    std::fs::read(&file).unwrap(),
                ));
            }
        }
    }
    files.sort();
    files
}

#[test]
fn the_plugin_environment_and_policy_reach_every_command() {
    let list = String::from_utf8(run(&["env", "list"]).stdout).unwrap();
    assert!(list.contains("signal\t") && list.contains("hanabi\t"), "{list}");
    assert!(list.contains("policy oracle\t") && list.contains("policy rule\t"), "{list}");
    assert!(list.contains("reward brevity\t"), "{list}");

    let oracle = json(&run(&["env", "bench", "signal", "--episodes", "200", "--policy", "oracle"]));
    assert_eq!(oracle["mean_score"], 1.0, "{oracle}");
    let random =
        json(&run(&["env", "bench", "signal", "--episodes", "3000", "--policy", "random", "--set", "colours=3"]));
    let mean = random["mean_score"].as_f64().unwrap();
    assert!((mean - 1.0 / 3.0).abs() < 0.03, "random play scores 1/3, got {mean}");

    // The plug-in's reward function trains beside the built-in one; an unknown one is refused.
    let dir = tempfile::tempdir().unwrap();
    let config = config_path();
    let mut sets = train_sets(&dir.path().join("brevity"));
    sets.push("run.iterations=1".to_string());
    sets.push("rewards.functions=[{name: env_return}, {name: brevity, weight: 0.5}]".to_string());
    run(&with_sets(&["train", "--quiet", "--config", config.to_str().unwrap()], &sets));
    let unknown = Command::new(BIN)
        .args(["train", "--config", config.to_str().unwrap(), "--set", "rewards.functions=[{name: terseness}]"])
        .output()
        .unwrap();
    let message = String::from_utf8_lossy(&unknown.stderr);
    assert!(!unknown.status.success() && message.contains("terseness") && message.contains("brevity"), "{message}");

    let bad =
        Command::new(BIN).args(["env", "bench", "signal", "--episodes", "5", "--set", "colours=9"]).output().unwrap();
    assert!(!bad.status.success());
    let message = String::from_utf8_lossy(&bad.stderr);
    assert!(message.contains("colours") && message.contains("9"), "{message}");
}

#[test]
fn a_killed_plugin_run_resumes_to_the_uninterrupted_result_and_evaluates() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_path();
    let config = config.to_str().unwrap();

    let reference = dir.path().join("reference");
    let reference_sets = train_sets(&reference);
    run(&with_sets(&["train", "--quiet", "--config", config], &reference_sets));

    // The same run, killed once its first checkpoint is complete, then resumed.
    let killed = dir.path().join("killed");
    let killed_sets = train_sets(&killed);
    let mut child = Command::new(BIN)
        .args(with_sets(&["train", "--quiet", "--config", config], &killed_sets))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let first = killed.join("checkpoints/iteration-000001");
    let started = Instant::now();
    while !first.join("adapters").exists() && child.try_wait().unwrap().is_none() {
        assert!(started.elapsed() < Duration::from_secs(600), "no checkpoint within 10 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let resumed = json(&run(&["train", "--quiet", "--resume", killed.to_str().unwrap()]));
    assert_eq!(resumed["iterations"], 4, "{resumed}");

    let last = |run: &Path| run.join("checkpoints/iteration-000004");
    assert_eq!(adapter_bytes(&last(&killed)), adapter_bytes(&last(&reference)), "resumed adapters differ");
    assert!(!adapter_bytes(&last(&reference)).is_empty());

    // Eval of the trained adapters, and with the plug-in's own policy in both seats.
    let adapters = killed.to_str().unwrap();
    let trained = json(&run(&["eval", "--config", config, "--adapters", adapters, "--episodes", "30"]));
    assert_eq!(trained["env"], "signal");
    assert_eq!(trained["episodes"], 30);
    let oracle = json(&run(&[
        "eval",
        "--config",
        config,
        "--adapters",
        adapters,
        "--episodes",
        "30",
        "--set",
        "eval.baseline_seats={0: oracle, 1: oracle}",
    ]));
    assert_eq!(oracle["score"]["mean"], 1.0, "{oracle}");
    let unknown = Command::new(BIN)
        .args(["eval", "--config", config, "--adapters", adapters, "--set", "eval.baseline_seats={0: psychic}"])
        .output()
        .unwrap();
    assert!(!unknown.status.success());
    let message = String::from_utf8_lossy(&unknown.stderr);
    assert!(message.contains("psychic") && message.contains("oracle"), "{message}");
}
