//! Every row of `fixtures/games/bridge_score_table.csv` (OpenSpiel's duplicate scorer)
//! matches troupe's scorer exactly.

use troupe_envs::bridge::{score, Contract};

#[test]
fn every_row_of_the_score_table() {
    // `$TROUPE_FIXTURES/games` tests another copy (e.g. one fixtures/regenerate/games.py wrote).
    let dir = std::env::var("TROUPE_FIXTURES")
        .ok()
        .filter(|dir| !dir.is_empty())
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures").to_string());
    let path = format!("{dir}/games/bridge_score_table.csv");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let mut rows = 0;
    let mut mismatches = Vec::new();
    for (n, line) in text.lines().enumerate().skip(1).filter(|(_, l)| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f.len(), 6, "line {}: {line}", n + 1);
        let level: u8 = f[0].parse().expect("level");
        let denomination = ["C", "D", "H", "S", "NT"].iter().position(|d| *d == f[1]).expect("denomination") as u8;
        let doubled: u8 = f[2].parse().expect("dbl");
        let tricks: u32 = f[3].parse().expect("tricks");
        let vulnerable = f[4] == "1";
        let expected: i32 = f[5].parse().expect("score");
        let got = score(&Contract { level, denomination, doubled, declarer: 0 }, tricks, vulnerable);
        if got != expected {
            mismatches.push(format!("line {}: {line}: got {got}", n + 1));
        }
        rows += 1;
    }
    assert!(
        mismatches.is_empty(),
        "{} of {rows} rows differ: {:#?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(20)]
    );
    assert_eq!(rows, 2940, "7 levels x 5 denominations x 3 x 14 tricks x 2");
}
