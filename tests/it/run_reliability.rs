//! No dead ends and nothing accepted silently, as a user meets them on the command line: one
//! trainer per run directory (a second one and a `--resume` of a running run are refused with
//! the holder's pid; a killed holder's lock is no obstacle), a run cut off during its first
//! checkpoint resumes with one command, a corrupt newest checkpoint falls back to the one
//! before, values that cannot fit the model or memory are refused before anything is written,
//! and empty, cut-off or edited inputs get a clear error.

use crate::common;
use common::{stderr, succeeds};

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env("RUST_LOG", "warn").output().expect("troupe runs")
}

/// The one `error` line of a failed command.
fn error_line(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure, stdout: {}", String::from_utf8_lossy(&out.stdout));
    let text = stderr(out);
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "one error line: {text}");
    lines[0].to_string()
}

fn metric_iterations(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["iteration"].as_u64().expect("iteration"))
        .collect()
}

#[test]
fn one_trainer_per_run_directory_and_a_dead_holder_is_no_obstacle() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let run = tmp.path().join("run");
    let config = common::tiny_hanabi_config(tmp.path(), &run, 1000, true);
    let config_s = config.to_str().expect("utf-8");
    let mut first = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["train", "--config", config_s, "--quiet"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let started = Instant::now();
    while !run.join("checkpoints/iteration-000000/state.json").exists() {
        assert!(started.elapsed() < Duration::from_secs(300), "no first checkpoint within 5 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = first.id().to_string();
    // A second trainer on the same directory, and a resume of the running run: both refused,
    // naming the holder.
    for args in
        [vec!["train", "--config", config_s, "--quiet"], vec!["train", "--resume", run.to_str().expect("utf-8")]]
    {
        let line = error_line(&troupe(&args));
        assert!(line.contains("in use") && line.contains(&pid), "{line}");
    }
    // Killed: the kernel drops its lock, and the run continues.
    first.kill().expect("kill");
    first.wait().expect("wait");
    let summary =
        succeeds(&troupe(&["train", "--resume", run.to_str().expect("utf-8"), "--set", "run.iterations=1", "--quiet"]));
    // Iteration 1, or later if the killed trainer got that far first.
    assert!(summary["iterations"].as_u64().is_some_and(|done| done >= 1), "{summary}");
}

#[test]
fn a_run_cut_off_in_its_first_checkpoint_resumes_with_one_command() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let run = tmp.path().join("run");
    let config = common::tiny_hanabi_config(tmp.path(), &run, 1, true);
    succeeds(&troupe(&["train", "--config", config.to_str().expect("utf-8"), "--quiet"]));
    // As a kill (or a full disk) during the first checkpoint leaves it: config.yaml, no
    // complete checkpoint, a partial staging directory.
    let checkpoints = run.join("checkpoints");
    std::fs::remove_dir_all(&checkpoints).expect("remove");
    std::fs::create_dir_all(checkpoints.join(".iteration-000000.staging-4242/adapters")).expect("partial");
    std::fs::remove_file(run.join("metrics.jsonl")).expect("remove");
    let line = error_line(&troupe(&["train", "--config", config.to_str().expect("utf-8")]));
    assert!(line.contains("--resume"), "{line}");
    let resumed = troupe(&["train", "--resume", run.to_str().expect("utf-8"), "--quiet"]);
    let summary = succeeds(&resumed);
    assert_eq!(summary["iterations"], 1);
    assert!(checkpoints.join("iteration-000000/state.json").exists());
    assert!(checkpoints.join("iteration-000001/state.json").exists());
    assert_eq!(metric_iterations(&run), vec![1]);

    // A corrupt newest checkpoint: resume falls back to the one before, saying so.
    let newest = checkpoints.join("iteration-000001");
    std::fs::write(newest.join("optimizer.safetensors"), b"\x10\x00\x00\x00").expect("corrupt");
    let resumed = troupe(&["train", "--resume", run.to_str().expect("utf-8"), "--set", "run.iterations=2", "--quiet"]);
    let summary = succeeds(&resumed);
    assert_eq!(summary["iterations"], 2);
    let said = stderr(&resumed);
    assert!(
        said.contains("iteration-000001") && said.contains("unreadable") && said.contains("iteration-000000"),
        "{said}"
    );
    assert!(checkpoints.join("corrupt-iteration-000001").is_dir());
    assert_eq!(metric_iterations(&run), vec![1, 2]);

    // Editing config.yaml: the run's length is honoured, anything else refused by name.
    let config_yaml = run.join("config.yaml");
    let original = std::fs::read_to_string(&config_yaml).expect("read");
    std::fs::write(&config_yaml, original.replace("\n    lr: 0.01\n", "\n    lr: 0.5\n")).expect("edit");
    let line = error_line(&troupe(&["train", "--resume", run.to_str().expect("utf-8")]));
    assert!(line.contains("training.optimizer.lr (0.01 -> 0.5)"), "{line}");
    std::fs::write(&config_yaml, original.replace("\n  iterations: 2\n", "\n  iterations: 3\n")).expect("edit");
    let summary = succeeds(&troupe(&["train", "--resume", run.to_str().expect("utf-8"), "--quiet"]));
    assert_eq!(summary["iterations"], 3);
}

#[test]
fn values_that_cannot_fit_are_refused_before_the_run_directory_exists() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let run = tmp.path().join("run");
    let config = common::tiny_hanabi_config(tmp.path(), &run, 1, true);
    let config_s = config.to_str().expect("utf-8");
    // The built-in model's context is 4096 tokens.
    for (set, words) in [
        ("action.max_new_tokens=5000", ["action.max_new_tokens", "max_position_embeddings"]),
        ("action.max_new_tokens=4094", ["first prompt", "max_position_embeddings"]),
        ("training.group_size=100000000000", ["training.group_size", "too large"]),
        ("training.groups_per_iteration=100000000000", ["training.groups_per_iteration", "too large"]),
    ] {
        let line = error_line(&troupe(&["train", "--config", config_s, "--set", set]));
        assert!(words.iter().all(|word| line.contains(word)), "{set}: {line}");
        assert!(!run.exists(), "{set} created the run directory");
    }
    for episodes in ["100000000000", "0"] {
        let out = tmp.path().join("games.jsonl");
        let line = error_line(&troupe(&[
            "env",
            "record",
            "hanabi",
            "--episodes",
            episodes,
            "--seed",
            "1",
            "--policy",
            "random",
            "--out",
            out.to_str().expect("utf-8"),
        ]));
        assert!(line.contains("--episodes"), "{line}");
        assert!(!out.exists());
        let line = error_line(&troupe(&["env", "bench", "hanabi", "--episodes", episodes]));
        assert!(line.contains("--episodes"), "{line}");
        let line = error_line(&troupe(&[
            "eval",
            "--config",
            config_s,
            "--adapters",
            run.to_str().expect("utf-8"),
            "--episodes",
            episodes,
        ]));
        assert!(line.contains("--episodes"), "{line}");
    }
}

#[test]
fn empty_cut_off_and_foreign_inputs_are_refused() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let write = |name: &str, text: &str| {
        let path = tmp.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.to_str().expect("utf-8").to_string()
    };
    for (name, text, words) in [
        ("empty.yaml", "", vec!["empty.yaml", "no config"]),
        ("comments.yaml", "# just a comment\n   \n# and another\n", vec!["comments.yaml", "no config"]),
        ("cut.yaml", "run: {iterations: 1}\ntraining: {group_size: 2}\neval:\n", vec!["cut.yaml", "eval", "cut off"]),
    ] {
        let line = error_line(&troupe(&["train", "--config", &write(name, text)]));
        assert!(words.iter().all(|word| line.contains(word)), "{name}: {line}");
    }
    // A directory that is not a run: refused, and left exactly as it was.
    let foreign = tmp.path().join("mine");
    std::fs::create_dir(&foreign).expect("dir");
    std::fs::write(foreign.join("notes.txt"), "keep me").expect("write");
    let config = common::tiny_hanabi_config(tmp.path(), &foreign, 1, true);
    let line = error_line(&troupe(&["train", "--config", config.to_str().expect("utf-8")]));
    assert!(line.contains("not a run directory") && line.contains("notes.txt"), "{line}");
    let entries: Vec<_> = std::fs::read_dir(&foreign).expect("list").map(|e| e.expect("entry").file_name()).collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("notes.txt")]);
    // Empty solution and replay files.
    let problems = concat!(env!("CARGO_MANIFEST_DIR"), "/envs/data/coding_problems.jsonl");
    let empty = write("empty.jsonl", "");
    let line = error_line(&troupe(&["code", "check", "--problems", problems, "--solutions", &empty]));
    assert!(line.contains("empty.jsonl") && line.contains("no solutions"), "{line}");
    let line = error_line(&troupe(&["env", "replay", &empty]));
    assert!(line.contains("empty.jsonl") && line.contains("no game records"), "{line}");
}

/// Rewrites every f32 of tensor `name` in a safetensors file as NaN.
fn poison_tensor(path: &Path, name: &str) {
    let mut bytes = std::fs::read(path).expect("read weights");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).expect("header");
    let entry = &header[name];
    assert_eq!(entry["dtype"], "F32", "{entry}");
    let start = 8 + header_len + entry["data_offsets"][0].as_u64().expect("offset") as usize;
    let end = 8 + header_len + entry["data_offsets"][1].as_u64().expect("offset") as usize;
    for chunk in bytes[start..end].chunks_mut(4) {
        chunk.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(path, bytes).expect("write weights");
}

#[test]
fn nan_weights_and_adapters_of_another_base_are_not_accepted_silently() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let model = tmp.path().join("model");
    succeeds(&troupe(&["init-model", "--out", model.to_str().expect("utf-8"), "--seed", "7"]));
    // Adapters trained (initialised) on the built-in model (seed 0) record its fingerprint.
    let run = tmp.path().join("run");
    let config = common::tiny_hanabi_config(tmp.path(), &run, 0, true);
    let _ = troupe(&["train", "--config", config.to_str().expect("utf-8"), "--quiet"]);
    let adapters = run.join("checkpoints/iteration-000000/adapters");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapters.join("troupe.json")).expect("manifest")).expect("json");
    assert!(manifest["base_fingerprint"].as_str().is_some_and(|f| f.starts_with("fnv1a64:")), "{manifest}");
    let spec = format!("{}:agent_0", adapters.display());
    let other_base =
        troupe(&["logprobs", "--model", model.to_str().expect("utf-8"), "--adapter", &spec, "--text", "play card 1"]);
    succeeds(&other_base);
    assert!(stderr(&other_base).contains("another base model"), "{}", stderr(&other_base));
    let same_base = troupe(&["logprobs", "--adapter", &spec, "--text", "play card 1"]);
    succeeds(&same_base);
    assert!(!stderr(&same_base).contains("another base model"), "{}", stderr(&same_base));
    // A reply budget beyond the context: refused before generating anything.
    let line = error_line(&troupe(&["generate", "--prompt", "hi", "--max-new-tokens", "100000000000"]));
    assert!(line.contains("--max-new-tokens") && line.contains("max_position_embeddings"), "{line}");
    // NaN weights: an error, not null log-probabilities.
    poison_tensor(&model.join("model.safetensors"), "model.norm.weight");
    let line = error_line(&troupe(&["logprobs", "--model", model.to_str().expect("utf-8"), "--text", "play card 1"]));
    assert!(line.contains("non-finite") && line.contains("NaN"), "{line}");
}
