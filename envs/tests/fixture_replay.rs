//! Every game record in `fixtures/games/` (played by OpenSpiel's HLE and bridge) replays
//! move by move: every legal list, counter and final score matches.

use std::path::PathBuf;

use troupe_envs::records::{replay_file, ReplayReport};

/// `fixtures/games`, or `$TROUPE_FIXTURES/games` to test another copy (e.g. one just written by
/// `fixtures/regenerate/games.py`).
fn fixtures() -> PathBuf {
    match std::env::var_os("TROUPE_FIXTURES").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("games"),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/games")),
    }
}

fn replay(name: &str) -> ReplayReport {
    let path = fixtures().join(name);
    let report = replay_file(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    assert!(report.failures.is_empty(), "{name}: {:#?}", report.failures);
    assert!(report.passed > 0, "{name} holds no records");
    report
}

#[test]
fn hanabi_full_2p() {
    assert_eq!(replay("hanabi_full_2p.jsonl").passed, 12);
}

#[test]
fn hanabi_full_4p() {
    assert_eq!(replay("hanabi_full_4p.jsonl").passed, 6);
}

#[test]
fn hanabi_random_2p() {
    assert_eq!(replay("hanabi_random_2p.jsonl").passed, 6);
}

#[test]
fn hanabi_small_3p() {
    assert_eq!(replay("hanabi_small_3p.jsonl").passed, 6);
}

#[test]
fn bridge_play() {
    assert_eq!(replay("bridge_play.jsonl").passed, 8);
}

#[test]
fn bridge_play_vulnerable() {
    assert_eq!(replay("bridge_play_vul.jsonl").passed, 4);
}

#[test]
fn every_fixture_file_replays() {
    let mut total = ReplayReport::default();
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .expect("fixtures directory")
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "expected the six record files, found {files:?}");
    for file in files {
        total.merge(replay_file(&file).expect("readable"));
    }
    assert_eq!(total.failed, 0, "{:#?}", total.failures);
    assert_eq!(total.passed, 42);
}

#[test]
fn a_tampered_record_fails_with_the_step_named() {
    let path = fixtures().join("hanabi_full_2p.jsonl");
    let line = std::fs::read_to_string(&path).expect("readable").lines().next().expect("a record").to_string();
    // Claim the first move left 2 life tokens.
    let tampered = line.replacen("\"life\": 3", "\"life\": 2", 1);
    let err = troupe_envs::records::replay_line(&tampered).unwrap_err();
    assert!(err.contains("step 10") && err.contains("life tokens"), "{err}");
    let bridge = std::fs::read_to_string(fixtures().join("bridge_play.jsonl")).expect("readable");
    let first = bridge.lines().next().expect("a record");
    let tampered = first.replacen("\"a\": 56, \"s\": \"1D\"", "\"a\": 57, \"s\": \"1H\"", 1);
    assert!(troupe_envs::records::replay_line(&tampered).is_err());
}
