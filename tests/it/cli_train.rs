//! `troupe train`, `troupe eval` and `troupe plot` as a user runs them: a tiny run from a YAML
//! file, its run directory, resuming after a real kill, eval JSON with a baseline seat, and bad
//! input giving one clear line and a non-zero exit.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn troupe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn json_stdout(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn error_line(out: &std::process::Output) -> String {
    assert!(!out.status.success(), "expected a failure, stdout: {}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "one error line: {stderr}");
    lines[0].to_string()
}

#[test]
fn a_run_of_no_iterations_writes_the_fresh_adapters_and_succeeds() {
    // `run.iterations: 0` is how a user gets `iteration-000000` to evaluate the base model.
    let tmp = tempfile::tempdir().unwrap();
    let config = common::tiny_hanabi_config(tmp.path(), &tmp.path().join("run"), 0, true);
    let summary = json_stdout(&troupe(&["train", "--config", config.to_str().unwrap(), "--quiet"]));
    assert_eq!(summary["iterations"], 0);
    assert_eq!(summary["plots"], serde_json::json!([]));
    assert!(tmp.path().join("run/checkpoints/iteration-000000").is_dir());
}

#[test]
fn train_writes_a_run_directory_and_eval_reads_it() {
    let tmp = tempfile::tempdir().unwrap();
    let config = common::tiny_hanabi_config(tmp.path(), &tmp.path().join("run"), 2, true);
    let config_s = config.to_str().unwrap();
    let summary = json_stdout(&troupe(&["train", "--config", config_s, "--quiet"]));
    assert_eq!(summary["iterations"], 2);
    let run = tmp.path().join("run");
    assert!(run.join("config.yaml").exists());
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["iteration"], i as u64 + 1);
        for key in
            ["mean_return", "std_return", "invalid_rate", "loss", "grad_norm", "lr", "tokens_per_second", "seconds"]
        {
            assert!(line.get(key).is_some(), "metrics line has {key}: {line}");
        }
    }
    assert!(lines[0]["extra"]["format_warmup_nll_last"].as_f64().is_some(), "the warm-up is reported");
    for i in 0..=2 {
        let dir = run.join(format!("checkpoints/iteration-{i:06}"));
        for file in [
            "adapters/troupe.json",
            "adapters/agent_0/adapter_model.safetensors",
            "adapters/agent_1/adapter_config.json",
            "optimizer.safetensors",
            "state.json",
        ] {
            assert!(dir.join(file).exists(), "{}/{file}", dir.display());
        }
    }
    assert!(run.join("plots/learning_curves.png").exists());

    // eval on the run (newest checkpoint) and on the untrained adapters, with a rule player in seat 1.
    let run_s = run.to_str().unwrap();
    let eval = json_stdout(&troupe(&["eval", "--config", config_s, "--adapters", run_s, "--episodes", "3"]));
    assert_eq!(eval["episodes"], 3);
    assert_eq!(eval["first_seed"], 5000);
    assert!(eval["score"]["mean"].as_f64().is_some() && eval["score"]["stderr"].as_f64().is_some());
    let rate = eval["invalid_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&rate));
    assert!(eval["adapters"].as_str().unwrap().ends_with("iteration-000002/adapters"));
    let untrained = run.join("checkpoints/iteration-000000");
    let baseline = json_stdout(&troupe(&[
        "eval",
        "--config",
        config_s,
        "--adapters",
        untrained.to_str().unwrap(),
        "--set",
        "eval.baseline_seats={1: rule}",
    ]));
    assert_eq!(baseline["baseline_seats"]["1"], "rule");
    assert_eq!(
        baseline["agent_return"].as_object().unwrap().keys().collect::<Vec<_>>(),
        vec!["0"],
        "only agent 0 plays"
    );

    // The same run again is refused rather than overwritten.
    let line = error_line(&troupe(&["train", "--config", config_s]));
    assert!(line.contains("already holds a run") && line.contains("--resume"), "{line}");
}

#[test]
fn a_killed_run_resumes_from_its_last_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let config = common::tiny_hanabi_config(tmp.path(), &tmp.path().join("run"), 6, true);
    let run = tmp.path().join("run");
    let mut child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["train", "--config", config.to_str().unwrap(), "--quiet"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it (SIGKILL, no clean-up) once it has checkpointed an iteration.
    let started = Instant::now();
    while !run.join("checkpoints/iteration-000001/state.json").exists() {
        assert!(started.elapsed() < Duration::from_secs(300), "no checkpoint within 5 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let summary = json_stdout(&troupe(&["train", "--resume", run.to_str().unwrap(), "--quiet"]));
    assert_eq!(summary["iterations"], 6);
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let iterations: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["iteration"].as_u64().unwrap())
        .collect();
    assert_eq!(iterations, (1..=6).collect::<Vec<_>>(), "one line per iteration, none lost or doubled");
}

#[test]
fn bad_configs_and_arguments_give_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = tmp.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let unknown = write("unknown.yaml", "training: {group_sise: 4}\n");
    let line = error_line(&troupe(&["train", "--config", &unknown]));
    assert!(line.contains("unknown.yaml") && line.contains("group_sise"), "{line}");
    let wrong_type = write("type.yaml", "training: {group_size: four}\n");
    let line = error_line(&troupe(&["train", "--config", &wrong_type]));
    assert!(line.contains("training.group_size"), "{line}");
    let seats = write("seats.yaml", "agents: {num_agents: 1, seats: [0, 1]}\n");
    let line = error_line(&troupe(&["train", "--config", &seats]));
    assert!(line.contains("agents.seats"), "{line}");
    let line = error_line(&troupe(&[
        "train",
        "--config",
        &write("ok.yaml", "run: {iterations: 1}\n"),
        "--set",
        "training.lr=fast",
    ]));
    assert!(line.contains("training.optimizer.lr"), "the moved key is named by its new name: {line}");
    let line = error_line(&troupe(&["train", "--resume", tmp.path().join("missing").to_str().unwrap()]));
    assert!(line.contains("missing"), "{line}");
    let line = error_line(&troupe(&[
        "eval",
        "--config",
        &write("e.yaml", "run: {iterations: 1}\n"),
        "--adapters",
        tmp.path().join("none").to_str().unwrap(),
    ]));
    assert!(line.contains("none"), "{line}");
    let coding = write("coding.yaml", "env: {name: coding}\naction: {mode: constrained}\n");
    let line = error_line(&troupe(&["train", "--config", &coding]));
    assert!(line.contains("action.mode"), "{line}");
}

/// Without a GPU backend there are no kernels to count: `--profile-kernels` says so before
/// anything is written.
#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
#[test]
fn profile_kernels_without_a_gpu_build_is_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let config = common::tiny_hanabi_config(tmp.path(), &tmp.path().join("run"), 1, true);
    let line = error_line(&troupe(&["train", "--config", config.to_str().unwrap(), "--profile-kernels"]));
    assert!(line.contains("--profile-kernels") && line.contains("--features cuda"), "{line}");
    assert!(!tmp.path().join("run").exists());
}

/// The error line of `troupe train` on a one-iteration run with `key=value` in its environment,
/// after checking that the run directory was not made.
fn train_error_with_env(key: &str, value: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let config = common::tiny_hanabi_config(tmp.path(), &tmp.path().join("run"), 1, true);
    let out = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["train", "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .env(key, value)
        .output()
        .unwrap();
    assert!(!tmp.path().join("run").exists(), "{key}={value}: no run directory");
    error_line(&out)
}

#[test]
fn an_unknown_gpu_kernels_choice_is_one_clear_line_before_any_work() {
    let line = train_error_with_env("TROUPE_GPU_KERNELS", "cubecl");
    assert!(line.contains("TROUPE_GPU_KERNELS") && line.contains("\"cubecl\"") && line.contains("burn"), "{line}");
}

#[test]
fn a_bad_gpu_width_step_is_one_clear_line_before_any_work() {
    let line = train_error_with_env("TROUPE_WIDTH_STEP", "0");
    assert!(line.contains("TROUPE_WIDTH_STEP") && line.contains("\"0\"") && line.contains("positive"), "{line}");
}

#[test]
fn an_unknown_matmul_kernel_is_one_clear_line_before_any_work() {
    let line = train_error_with_env("TROUPE_MATMUL", "cublas");
    assert!(line.contains("TROUPE_MATMUL") && line.contains("\"cublas\""), "{line}");
    assert!(line.contains("auto, simple-cmma") && line.contains("specialized-tma-cmma"), "{line}");
}

#[test]
fn print_config_shows_every_default_and_trains_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // An older config: `training.micro_batch_rows` has moved to `runtime:`.
    let path = dir.path().join("old.yaml");
    std::fs::write(
        &path,
        format!("run: {{out_dir: {}}}\ntraining: {{micro_batch_rows: 4}}\n", dir.path().join("run").display()),
    )
    .unwrap();
    let out = troupe(&[
        "train",
        "--config",
        path.to_str().unwrap(),
        "--set",
        "training.objective.kind=clipped",
        "--set",
        "training.objective.epochs_per_iteration=2",
        "--print-config",
    ]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let printed: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).unwrap();
    let objective = &printed["training"]["objective"];
    assert_eq!(objective["kind"], "clipped");
    assert_eq!(objective["epochs_per_iteration"], 2);
    assert_eq!(objective["clip_low"], 0.2, "defaults are written out");
    assert_eq!(printed["training"]["kl"]["estimator"], "k3");
    assert_eq!(printed["runtime"]["micro_batch_rows"], 4, "the moved key is read in its new place");
    assert_eq!(printed["runtime"]["eval_batch_episodes"], 64);
    assert!(printed["training"].get("micro_batch_rows").is_none());
    assert!(!dir.path().join("run").exists(), "nothing trained, nothing written");
    // The printed config is itself a config that loads.
    let resolved = dir.path().join("resolved.yaml");
    std::fs::write(&resolved, &out.stdout).unwrap();
    let again = troupe(&["train", "--config", resolved.to_str().unwrap(), "--print-config"]);
    assert_eq!(String::from_utf8_lossy(&again.stdout), String::from_utf8_lossy(&out.stdout));
    // A clipped-only knob without the clipped objective is refused with the key.
    let line = error_line(&troupe(&[
        "train",
        "--config",
        path.to_str().unwrap(),
        "--set",
        "training.objective.epochs_per_iteration=3",
        "--print-config",
    ]));
    assert!(line.contains("training.objective.epochs_per_iteration"), "{line}");
}
