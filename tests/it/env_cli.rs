//! `troupe env ...` as users and CI call it: replaying the fixture records, benchmarking,
//! recording then replaying, and one-line errors for bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).output().expect("the troupe binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn fixture_files() -> Vec<String> {
    // `$TROUPE_FIXTURES/games` tests another copy (e.g. one fixtures/regenerate/games.py wrote).
    let dir = match std::env::var_os("TROUPE_FIXTURES").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("games"),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/games")),
    };
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .map(|p| p.display().to_string())
        .collect();
    files.sort();
    files
}

#[test]
fn replay_passes_every_fixture_record() {
    let files = fixture_files();
    let mut args = vec!["env", "replay"];
    args.extend(files.iter().map(String::as_str));
    let out = troupe(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "42 passed, 0 failed");
}

#[test]
fn replay_fails_loudly_on_a_mismatch() {
    let dir = tempfile::tempdir().expect("temp dir");
    let original = std::fs::read_to_string(&fixture_files()[2]).expect("readable");
    let first = original.lines().next().expect("a record");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, first.replacen("\"info\": 8", "\"info\": 5", 1)).expect("writable");
    let out = troupe(&["env", "replay", bad.to_str().expect("utf8")]);
    assert!(!out.status.success());
    assert_eq!(stdout(&out).trim(), "0 passed, 1 failed");
    assert!(stderr(&out).contains("bad.jsonl:1: step"), "{}", stderr(&out));
}

#[test]
fn bench_prints_json() {
    let out = troupe(&[
        "env",
        "bench",
        "hanabi",
        "--episodes",
        "20",
        "--seed",
        "3",
        "--policy",
        "rule",
        "--set",
        "players=3",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("JSON on stdout");
    for key in ["episodes", "mean_score", "std_score", "mean_length", "steps_per_second"] {
        assert!(report.get(key).is_some(), "missing {key}: {report}");
    }
    assert_eq!(report["episodes"], 20);
    assert!(report["mean_score"].as_f64().expect("number") > 5.0);
}

#[test]
fn record_then_replay() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (name, set) in [("hanabi", "variant=small"), ("bridge", "board=7")] {
        let out_file = dir.path().join(format!("{name}.jsonl"));
        let out_path = out_file.to_str().expect("utf8");
        let out = troupe(&[
            "env",
            "record",
            name,
            "--episodes",
            "5",
            "--seed",
            "11",
            "--policy",
            "random",
            "--set",
            set,
            "--out",
            out_path,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(std::fs::read_to_string(&out_file).expect("written").lines().count(), 5);
        let out = troupe(&["env", "replay", out_path]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out).trim(), "5 passed, 0 failed");
    }
}

#[test]
fn bad_input_gets_one_clear_line() {
    let cases: [(&[&str], &str); 5] = [
        (&["env", "bench", "chess", "--episodes", "1"], "unknown environment \"chess\""),
        (&["env", "bench", "hanabi", "--episodes", "1", "--set", "players=9"], "bad parameter players"),
        (&["env", "bench", "hanabi", "--episodes", "1", "--set", "players"], "expected KEY=VALUE"),
        (&["env", "bench", "hanabi", "--episodes", "1", "--policy", "genius"], "unknown policy \"genius\""),
        (&["env", "replay", "/nonexistent/games.jsonl"], "/nonexistent/games.jsonl"),
    ];
    for (args, message) in cases {
        let out = troupe(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = stderr(&out);
        let error_lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(error_lines.len(), 1, "{args:?}: {err}");
        assert!(error_lines[0].contains(message), "{args:?}: {err}");
    }
}

#[test]
fn play_reads_moves_from_stdin() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["env", "play", "bridge", "--seed", "2"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawns");
    child.stdin.take().expect("stdin").write_all(b"redouble\npass\n").expect("writes");
    let out = child.wait_with_output().expect("finishes");
    let text = stdout(&out);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(text.contains("You are North"), "{text}");
    assert!(text.contains("Not accepted: illegal action RDbl: only a doubled bid can be redoubled"), "{text}");
}

/// A one-seat Python environment (python/troupe_env.py) whose `fault` method raises.
fn faulty_env(dir: &std::path::Path, fault: &str) -> String {
    let module_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let script = dir.join(format!("faulty_{fault}.py"));
    let source = format!(
        r#"import sys
sys.path.insert(0, {module_dir:?})
from troupe_env import Environment, serve

class Faulty(Environment):
    name = "faulty"
    num_seats = 1

    def reset(self, seed):
        if {fault:?} == "reset":
            raise RuntimeError("the deck is missing")
        self.done = False

    def acting_seats(self):
        return [0]

    def observation(self, seat):
        return "o"

    def legal_actions(self, seat):
        return [(0, "go")]

    def step(self, actions):
        if {fault:?} == "step":
            raise ValueError("the table broke")
        self.done = True
        return [1.0]

    def is_terminal(self):
        return self.done

serve(lambda params: Faulty())
"#,
        module_dir = module_dir.display().to_string(),
    );
    std::fs::write(&script, source).expect("write the environment");
    serde_json::to_string(&["python3", &script.display().to_string()]).expect("json")
}

/// The one `error` line of a failed command.
fn the_error_line(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure, stdout: {}", stdout(out));
    let text = stderr(out);
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "one error line: {text}");
    lines[0].to_string()
}

#[test]
fn an_environments_failure_is_said_once_naming_its_command_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (fault, cause) in [("reset", "RuntimeError: the deck is missing"), ("step", "ValueError: the table broke")] {
        let command = faulty_env(dir.path(), fault);
        // `play` waits for the human's move at the first step: only its reset is faulted here.
        let verbs: &[&[&str]] = if fault == "reset" {
            &[&["bench", "external", "--episodes", "2"], &["play", "external"]]
        } else {
            &[&["bench", "external", "--episodes", "2"]]
        };
        for verb in verbs {
            let mut args = vec!["env"];
            args.extend_from_slice(verb);
            let set = format!("command={command}");
            args.extend(["--set", &set]);
            let line = the_error_line(&troupe(&args));
            assert_eq!(line.matches(cause).count(), 1, "the cause once: {line}");
            assert_eq!(line.matches("external environment python3").count(), 1, "the command once: {line}");
            assert!(line.contains(&format!("faulty_{fault}.py")), "{line}");
        }
        // Training on it: the same, said once, under what stopped.
        let config = dir.path().join(format!("{fault}.yaml"));
        let yaml = format!(
            "run: {{out_dir: {run}, iterations: 1}}\nenv: {{name: external, command: {command}}}\n\
             agents: {{num_agents: 1, seats: [0]}}\naction: {{mode: choice, chat_template: false}}\n\
             training: {{group_size: 2, groups_per_iteration: 1}}\n",
            run = dir.path().join(format!("run_{fault}")).display()
        );
        std::fs::write(&config, yaml).expect("write the config");
        let line = the_error_line(&troupe(&["train", "--config", config.to_str().expect("utf-8"), "--quiet"]));
        assert_eq!(line.matches(cause).count(), 1, "the cause once: {line}");
        assert_eq!(line.matches("external environment python3").count(), 1, "the command once: {line}");
        assert!(!line.contains("environment: external"), "{line}");
    }
}

#[test]
fn a_missing_parameter_is_named() {
    let line = the_error_line(&troupe(&["env", "bench", "external", "--episodes", "1"]));
    assert!(line.contains("environment external: bad parameter command: is required"), "{line}");
}
