//! What a careless user or an attacker feeds the command line, answered with one clear line and
//! nothing lost: `--out` never replaces what troupe did not write, sizes that could not be
//! allocated are refused before anything is written, input is bounded before the model or the
//! YAML parser sees it, a closed stdout ends a command quietly, non-finite weights are refused
//! where they are read, and an external environment's process group goes with troupe.

use crate::common;
use common::{gone, stderr, succeeds, wait_gone};

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env("RUST_LOG", "warn").output().expect("troupe runs")
}

/// The one `error` line of a failed command (and no panic).
fn error_line(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure, stdout: {}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(out.status.code(), Some(1), "an error exits 1, not by a signal: {:?}", out.status);
    let text = stderr(out);
    assert!(!text.contains("panicked"), "{text}");
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "one error line: {text}");
    lines[0].to_string()
}

fn s(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Every file under `dir` with its bytes, sorted by path.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(next) = stack.pop() {
        for entry in std::fs::read_dir(&next).expect("read dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = std::fs::read(&path).expect("read file");
                files.push((path, bytes));
            }
        }
    }
    files.sort();
    files
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let path = entry.expect("entry").path();
        let target = to.join(path.file_name().expect("name"));
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).expect("copy");
        }
    }
}

#[test]
fn out_directories_are_never_replaced_unless_asked() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let model = common::models_dir().join("tiny-llama");
    let adapters = tmp.path().join("adapters");
    copy_dir(&model.join("adapters"), &adapters);
    let spec = format!("{}:agent_0", adapters.display());

    // A directory holding someone's files: refused by name, nothing touched.
    let precious = tmp.path().join("precious");
    std::fs::create_dir(&precious).expect("mkdir");
    std::fs::write(precious.join("notes.txt"), "mine").expect("write");
    let merge = |out: &Path, force: bool| {
        let mut args = vec!["adapters", "merge", "--model", s(&model), "--adapter", &spec, "--out", s(out)];
        if force {
            args.push("--force");
        }
        troupe(&args)
    };
    let line = error_line(&merge(&precious, false));
    assert!(line.contains(s(&precious)) && line.contains("is not empty") && line.contains("--force"), "{line}");
    assert_eq!(std::fs::read_to_string(precious.join("notes.txt")).expect("kept"), "mine");

    // The adapters being merged, and the directory holding them, are refused even with --force.
    let before = snapshot(&adapters);
    for out in [adapters.clone(), adapters.join("agent_0"), tmp.path().to_path_buf()] {
        let line = error_line(&merge(&out, true));
        assert!(line.contains("which this command reads"), "{line}");
    }
    assert_eq!(snapshot(&adapters), before, "the adapters are untouched");

    // A new directory is written; --force replaces a non-empty one.
    let merged = tmp.path().join("merged");
    succeeds(&merge(&merged, false));
    assert!(merged.join("model.safetensors").is_file());
    succeeds(&merge(&precious, true));
    assert!(!precious.join("notes.txt").exists() && precious.join("model.safetensors").is_file());

    // init-model: an existing model is not silently overwritten.
    let built = tmp.path().join("built");
    succeeds(&troupe(&["init-model", "--out", s(&built), "--seed", "1"]));
    let first = snapshot(&built);
    let line = error_line(&troupe(&["init-model", "--out", s(&built), "--seed", "2"]));
    assert!(line.contains(s(&built)) && line.contains("is not empty"), "{line}");
    assert_eq!(snapshot(&built), first, "the first model is kept");
    succeeds(&troupe(&["init-model", "--out", s(&built), "--seed", "2", "--force"]));
    assert_ne!(snapshot(&built), first, "--force writes the new model");

    // env record: an existing file is kept.
    let games = tmp.path().join("games.jsonl");
    std::fs::write(&games, "old games\n").expect("write");
    let args = ["env", "record", "hanabi", "--episodes", "1", "--seed", "1", "--policy", "random", "--out", s(&games)];
    let line = error_line(&troupe(&args));
    assert!(line.contains("already exists") && line.contains("--force"), "{line}");
    assert_eq!(std::fs::read_to_string(&games).expect("kept"), "old games\n");
}

#[test]
fn impossible_sizes_and_values_are_refused_before_the_run_directory_exists() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let run = tmp.path().join("run");
    let config = common::tiny_hanabi_config(tmp.path(), &run, 1, false);
    for (set, words) in [
        ("adapter.r=100000000", ["adapter.r", "too large"]),
        ("adapter.r=1000", ["adapter.r", "hidden size"]),
        ("eval.every_episodes=100000000", ["eval.every_episodes", "too large"]),
        ("runtime.eval_batch_episodes=1000000000", ["runtime.eval_batch_episodes", "too large"]),
        ("training.format_warmup_steps=100000000000", ["training.format_warmup.steps", "too large"]),
        ("training.lr=1e308", ["training.optimizer.lr", "too large"]),
        ("adapter.lora_alpha=1e308", ["adapter.lora_alpha", "scale"]),
        ("env.life_loss_penalty=.nan", ["env.life_loss_penalty", "not a finite number"]),
        ("run=", ["--set: run: a section", "run.KEY=VALUE"]),
        ("env.observation=weird", ["env.observation:", "unknown variant `weird`"]),
    ] {
        let line = error_line(&troupe(&["train", "--config", s(&config), "--set", "run.iterations=2", "--set", set]));
        assert!(words.iter().all(|word| line.contains(word)), "{set}: {line}");
        assert!(!run.exists(), "{set} created the run directory");
    }
    let line = error_line(&troupe(&["env", "bench", "hanabi", "--episodes", "1", "--set", "bogus=1"]));
    assert!(line.contains("bad parameter bogus: unknown field `bogus`"), "{line}");
    let line = error_line(&troupe(&["env", "bench", "hanabi", "--episodes", "1", "--set", "observation=weird"]));
    assert!(line.contains("bad parameter observation: unknown variant `weird`"), "{line}");
}

#[test]
fn input_is_bounded_before_the_model_or_the_parser_sees_it() {
    // logprobs: the context check comes before the model runs (a quadratic allocation).
    let text = "qz jx vk ".repeat(6000);
    let line = error_line(&troupe(&["logprobs", "--text", &text]));
    assert!(line.contains("--text") && line.contains("exceed the model's context"), "{line}");

    // A config that never ends, and one nested 100,000 deep: one line each, at once.
    let line = error_line(&troupe(&["train", "--config", "/dev/zero"]));
    assert!(line.contains("/dev/zero") && line.contains("too large for a config file"), "{line}");
    let tmp = tempfile::tempdir().expect("temp dir");
    let deep = tmp.path().join("deep.yaml");
    std::fs::write(&deep, format!("run: {}1{}\n", "{a: ".repeat(100_000), "}".repeat(100_000))).expect("write");
    let line = error_line(&troupe(&["train", "--config", s(&deep)]));
    assert!(line.contains("deep.yaml") && line.contains("nested more than 64 levels"), "{line}");
    let deep_set = format!("env.params={}1{}", "[".repeat(50_000), "]".repeat(50_000));
    let config = common::tiny_hanabi_config(tmp.path(), &tmp.path().join("run"), 1, false);
    let line = error_line(&troupe(&["train", "--config", s(&config), "--set", &deep_set]));
    assert!(line.contains("--set: env.params: the value is nested more than 64 levels"), "{line}");
}

/// Runs troupe with its stdout a pipe whose reading end is closed before troupe starts.
fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("troupe runs")
}

#[test]
fn a_closed_stdout_ends_a_command_quietly_as_a_closed_pipe_ends_any_program() {
    let model = common::models_dir().join("tiny-llama");
    for args in [
        vec!["env", "list"],
        vec!["logprobs", "--text", "Player 0 plays red 1."],
        vec!["generate", "--prompt", "Hello", "--max-new-tokens", "2"],
        vec!["model", "inspect", s(&model)],
        vec!["env", "bench", "hanabi", "--episodes", "2"],
    ] {
        let out = with_closed_stdout(&args);
        let text = stderr(&out);
        assert!(!text.contains("panicked") && !text.contains("error"), "{args:?}: {text}");
        assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{args:?}: {:?}", out.status);
    }
}

/// Sets the first value of the first tensor of a safetensors file to NaN.
fn poison(file: &Path) {
    let mut bytes = std::fs::read(file).expect("read");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).expect("header");
    let (_, tensor) = header
        .as_object()
        .expect("object")
        .iter()
        .find(|(name, t)| *name != "__metadata__" && t["dtype"] == "F32")
        .expect("an F32 tensor");
    let start = 8 + header_len + tensor["data_offsets"][0].as_u64().expect("offset") as usize;
    bytes[start..start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(file, bytes).expect("write");
}

#[test]
fn non_finite_or_mistyped_adapters_are_refused_where_they_are_read() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let model = common::models_dir().join("tiny-llama");
    let adapter = tmp.path().join("agent_0");
    copy_dir(&model.join("adapters/agent_0"), &adapter);
    let logprobs =
        || troupe(&["logprobs", "--model", s(&model), "--adapter", s(&adapter), "--text", "North opens 1NT."]);
    succeeds(&logprobs());

    let config_path = adapter.join("adapter_config.json");
    let original = std::fs::read_to_string(&config_path).expect("config");
    for (value, words) in
        [("\"16\"", "is not a number"), ("null", "is not a number"), ("true", "is not a number"), ("1e308", "scale")]
    {
        std::fs::write(&config_path, original.replace("\"lora_alpha\": 8", &format!("\"lora_alpha\": {value}")))
            .expect("write");
        let line = error_line(&logprobs());
        assert!(line.contains("lora_alpha") && line.contains(words), "{value}: {line}");
    }
    std::fs::write(&config_path, &original).expect("restore");

    poison(&adapter.join("adapter_model.safetensors"));
    let line = error_line(&logprobs());
    assert!(line.contains("adapter_model.safetensors") && line.contains("non-finite value (NaN"), "{line}");
}

#[test]
fn a_checkpoint_with_non_finite_weights_is_set_aside_and_the_one_before_resumes() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let run = tmp.path().join("run");
    let config = common::tiny_hanabi_config(tmp.path(), &run, 2, false);
    succeeds(&troupe(&["train", "--config", s(&config), "--quiet"]));
    let newest = run.join("checkpoints/iteration-000002");
    let adapter = std::fs::read_dir(newest.join("adapters"))
        .expect("adapters")
        .map(|e| e.expect("entry").path())
        .find(|p| p.join("adapter_model.safetensors").is_file())
        .expect("an adapter");
    poison(&adapter.join("adapter_model.safetensors"));
    let out = troupe(&["train", "--resume", s(&run), "--set", "run.iterations=3", "--quiet"]);
    let summary = succeeds(&out);
    assert_eq!(summary["iterations"], 3);
    let text = stderr(&out);
    assert!(
        text.contains("non-finite") && text.contains("resuming from") && text.contains("iteration-000001"),
        "{text}"
    );
    assert!(run.join("checkpoints/corrupt-iteration-000002").is_dir(), "the poisoned checkpoint is set aside");
}

#[test]
fn an_external_environments_process_group_dies_with_a_killed_troupe() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let pid_file = tmp.path().join("helper.pid");
    // The environment starts a helper in its group, answers `init`, then hangs on `reset`.
    let script = format!(
        r#"sleep 1000 & echo $! > {}; read l; echo '{{"id":0,"result":{{"name":"toy","num_seats":1}}}}'; read l; sleep 1000"#,
        pid_file.display()
    );
    let command = serde_json::to_string(&["sh", "-c", &script]).expect("json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["env", "bench", "external", "--episodes", "1", "--set", &format!("command={command}")])
        .args(["--set", "timeout_s=600"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("troupe runs");
    let started = Instant::now();
    let helper = loop {
        if let Some(pid) = std::fs::read_to_string(&pid_file).ok().and_then(|t| t.trim().parse::<u32>().ok()) {
            break pid;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "the environment never started");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!gone(helper), "the helper runs while troupe does");
    child.kill().expect("SIGKILL troupe");
    let _ = child.wait();
    let mut text = String::new();
    let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut text));
    assert!(wait_gone(helper), "the helper in the environment's group outlived a SIGKILLed troupe; stderr: {text}");
}

/// A Python environment (python/troupe_env.py) that first starts a daemon, a grandchild that left
/// its group and session (fork, `setsid`, fork), which writes its pid to `pid_file`; once the
/// file is there, serves a one-move game, or hangs on `reset` when `hang` is set.
#[cfg(target_os = "linux")]
fn daemonizing_env(dir: &Path, pid_file: &Path, hang: bool) -> String {
    let module_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let script = dir.join(if hang { "hanging_env.py" } else { "daemon_env.py" });
    let source = format!(
        r#"import os, sys, time
sys.path.insert(0, {module_dir:?})
from troupe_env import Environment, serve

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open({pid_file:?} + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename({pid_file:?} + ".tmp", {pid_file:?})
        time.sleep(1000)
    os._exit(0)
os.wait()
# The daemon is started once its pid is on disk: the game waits for it, so that troupe's end
# cannot come before the daemon has written it.
while not os.path.exists({pid_file:?}):
    time.sleep(0.01)

class OneMove(Environment):
    name = "one_move"
    num_seats = 1

    def reset(self, seed):
        if {hang}:
            time.sleep(1000)
        self.done = False

    def acting_seats(self):
        return [0]

    def observation(self, seat):
        return "move"

    def legal_actions(self, seat):
        return [(0, "go")]

    def step(self, actions):
        self.done = True
        return [1.0]

    def is_terminal(self):
        return self.done

serve(lambda params: OneMove())
"#,
        module_dir = module_dir.display().to_string(),
        pid_file = pid_file.display().to_string(),
        hang = if hang { "True" } else { "False" },
    );
    std::fs::write(&script, source).expect("write the environment");
    serde_json::to_string(&["python3", s(&script)]).expect("json")
}

/// The pid `pid_file` holds, once it is written (up to 20 s).
#[cfg(target_os = "linux")]
fn read_pid(pid_file: &Path) -> u32 {
    let started = Instant::now();
    loop {
        if let Some(pid) = std::fs::read_to_string(pid_file).ok().and_then(|t| t.trim().parse().ok()) {
            return pid;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "the daemon never started");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[cfg(target_os = "linux")]
fn a_daemon_an_external_environment_started_ends_with_troupes_command() {
    let tmp = tempfile::tempdir().expect("temp dir");

    // A normal end: the benchmark plays its games and exits 0.
    let pid_file = tmp.path().join("daemon.pid");
    let command = daemonizing_env(tmp.path(), &pid_file, false);
    let out = troupe(&["env", "bench", "external", "--episodes", "2", "--set", &format!("command={command}")]);
    let summary = succeeds(&out);
    assert_eq!(summary["episodes"], 2, "{summary}");
    let daemon = read_pid(&pid_file);
    assert!(wait_gone(daemon), "the setsid daemon outlived troupe's normal end: {}", stderr(&out));

    // An end over a timeout: the environment hangs on `reset`, troupe kills it and exits 1.
    let pid_file = tmp.path().join("hanging.pid");
    let command = daemonizing_env(tmp.path(), &pid_file, true);
    let out = troupe(&[
        "env",
        "bench",
        "external",
        "--episodes",
        "1",
        "--set",
        &format!("command={command}"),
        "--set",
        "timeout_s=2",
    ]);
    let line = error_line(&out);
    assert!(line.contains("no answer to `reset` within 2.0 s"), "{line}");
    let daemon = read_pid(&pid_file);
    assert!(wait_gone(daemon), "the setsid daemon outlived troupe's timeout kill");
}
