//! `RUN_DIR/metrics.jsonl`: one JSON line per training iteration (DESIGN.md, "Training").
//!
//! A record is a line ending in a newline. [`MetricsWriter`] appends each line with one write and
//! syncs it, so a killed run leaves at most one partial last line; [`read_metrics`] ignores such
//! a tail, [`MetricsWriter::open`] cuts it off before appending, and [`truncate_to`] drops the
//! iterations after the checkpoint a run resumes from. Numbers that are not finite (a NaN loss)
//! are written as `null` and read back as NaN.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Result, TroupeError};
use crate::fsutil::write_atomic;
use crate::rl::trainer::IterationStats;

/// The metrics file's name inside a run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// `RUN_DIR/metrics.jsonl`.
pub fn metrics_path(run_dir: &Path) -> PathBuf {
    run_dir.join(METRICS_FILE)
}

/// One iteration's line. Returns are keyed by agent id (`"0"`, `"1"`, ... in JSON), gradient
/// norms by adapter name (`agent_0`, ..., or `shared`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IterationMetrics {
    /// The iteration number (1-based), as the trainer and its checkpoints count them.
    pub iteration: u64,
    /// Mean return of each agent's seats over the iteration's episodes.
    #[serde(deserialize_with = "map_or_nan")]
    pub mean_return: BTreeMap<usize, f64>,
    /// Standard deviation of each agent's return over the iteration's episodes.
    #[serde(deserialize_with = "map_or_nan")]
    pub std_return: BTreeMap<usize, f64>,
    /// Fraction of replies that were not legal actions.
    #[serde(deserialize_with = "f64_or_nan")]
    pub invalid_rate: f64,
    /// The policy loss (summed over agents).
    #[serde(deserialize_with = "f64_or_nan")]
    pub loss: f64,
    /// Each adapter's gradient norm before clipping (adapters that got no gradient are absent).
    #[serde(deserialize_with = "map_or_nan")]
    pub grad_norm: BTreeMap<String, f64>,
    /// The learning rate used this iteration (after warmup scaling).
    #[serde(deserialize_with = "f64_or_nan")]
    pub lr: f64,
    /// Generated tokens per second of rollout.
    #[serde(deserialize_with = "f64_or_nan")]
    pub tokens_per_second: f64,
    /// Wall-clock seconds of the iteration.
    #[serde(deserialize_with = "f64_or_nan")]
    pub seconds: f64,
    /// Anything else worth a curve (KL, episode metrics such as `score`, scheme counts).
    #[serde(default, deserialize_with = "map_or_nan")]
    pub extra: BTreeMap<String, f64>,
}

impl From<&IterationStats> for IterationMetrics {
    /// The trainer's statistics as a metrics line; the mean environment score, the mean
    /// episode length and (when on) the KL estimate go to `extra` as `score`,
    /// `episode_steps` and `kl`.
    fn from(stats: &IterationStats) -> Self {
        let mut extra: BTreeMap<String, f64> =
            [("score".to_string(), stats.mean_score), ("episode_steps".to_string(), stats.mean_episode_steps)]
                .into_iter()
                .collect();
        if let Some(kl) = stats.kl {
            extra.insert("kl".to_string(), kl);
        }
        if let Some(fraction) = stats.clip_fraction {
            extra.insert("clip_fraction".to_string(), fraction);
        }
        for (phase, seconds) in &stats.phase_seconds {
            extra.insert(format!("seconds_{phase}"), *seconds);
        }
        if let Some(entropy) = stats.choice_entropy {
            extra.insert("choice_entropy".to_string(), entropy);
        }
        for (name, mean) in &stats.env_metrics {
            if name != "score" {
                extra.insert(format!("env_{name}"), *mean);
            }
        }
        extra.extend(stats.trl.iter().map(|(k, v)| (k.clone(), *v)));
        for (phase, flops) in &stats.phase_flops {
            extra.insert(format!("gflop_{phase}"), flops / 1e9);
            if let Some(seconds) = stats.phase_seconds.get(phase).filter(|s| **s > 0.0) {
                extra.insert(format!("gflop_per_second_{phase}"), flops / 1e9 / seconds);
            }
        }
        const MIB: f64 = 1024.0 * 1024.0;
        for (phase, memory) in &stats.phase_memory {
            extra.insert(format!("memory_mib_{phase}"), memory.in_use as f64 / MIB);
        }
        if let Some(reserved) = stats.phase_memory.values().map(|m| m.reserved).max() {
            extra.insert("memory_reserved_mib".to_string(), reserved as f64 / MIB);
        }
        Self {
            iteration: stats.iteration,
            mean_return: stats.mean_return.clone(),
            std_return: stats.std_return.clone(),
            invalid_rate: stats.invalid_rate,
            loss: stats.loss,
            grad_norm: stats.grad_norm.clone(),
            lr: stats.lr,
            tokens_per_second: stats.rollout_tokens_per_second,
            seconds: stats.seconds,
            extra,
        }
    }
}

/// A number, or NaN for `null` (serde_json writes non-finite numbers as `null`).
fn f64_or_nan<'de, D: Deserializer<'de>>(deserializer: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

/// A map of numbers, `null` values read as NaN.
fn map_or_nan<'de, D, K>(deserializer: D) -> std::result::Result<BTreeMap<K, f64>, D::Error>
where
    D: Deserializer<'de>,
    K: Deserialize<'de> + Ord,
{
    let map = BTreeMap::<K, Option<f64>>::deserialize(deserializer)?;
    Ok(map.into_iter().map(|(k, v)| (k, v.unwrap_or(f64::NAN))).collect())
}

/// What [`read_metrics`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricsLog {
    /// The complete records, in file order.
    pub records: Vec<IterationMetrics>,
    /// Whether a partial last line (a run killed mid-write) was ignored.
    pub truncated_tail: bool,
}

/// The complete lines of a metrics file (with their 1-based line numbers; blank lines skipped)
/// and whether a partial tail followed them.
struct Lines {
    lines: Vec<(usize, String)>,
    truncated_tail: bool,
}

fn read_lines(path: &Path) -> Result<Lines> {
    let bytes = std::fs::read(path).map_err(|e| TroupeError::io(path, e))?;
    let complete_len = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let truncated_tail = complete_len < bytes.len();
    let text = std::str::from_utf8(&bytes[..complete_len])
        .map_err(|e| TroupeError::Json { path: path.to_path_buf(), message: format!("not UTF-8: {e}") })?;
    let lines = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| (i + 1, line.to_string()))
        .collect();
    Ok(Lines { lines, truncated_tail })
}

fn parse_line(path: &Path, number: usize, line: &str) -> Result<IterationMetrics> {
    serde_json::from_str(line)
        .map_err(|e| TroupeError::Json { path: path.to_path_buf(), message: format!("line {number}: {e}") })
}

/// Reads a metrics file. A partial last line is ignored (and reported in
/// [`MetricsLog::truncated_tail`]); a malformed complete line is an error naming its number.
pub fn read_metrics(path: &Path) -> Result<MetricsLog> {
    let Lines { lines, truncated_tail } = read_lines(path)?;
    let records = lines.iter().map(|(number, line)| parse_line(path, *number, line)).collect::<Result<_>>()?;
    Ok(MetricsLog { records, truncated_tail })
}

/// Keeps the records of iterations `<= iteration` in `RUN_DIR/metrics.jsonl` (what a run
/// resuming from the checkpoint of that iteration has done), rewriting the file atomically and
/// dropping any partial tail. Kept lines are byte-for-byte as written. Returns how many records
/// were kept; a missing file keeps none and is not an error.
pub fn truncate_to(run_dir: &Path, iteration: u64) -> Result<usize> {
    let path = metrics_path(run_dir);
    if !path.exists() {
        return Ok(0);
    }
    let Lines { lines, .. } = read_lines(&path)?;
    let mut kept = String::new();
    let mut count = 0;
    for (number, line) in &lines {
        if parse_line(&path, *number, line)?.iteration <= iteration {
            kept.push_str(line);
            kept.push('\n');
            count += 1;
        }
    }
    write_atomic(&path, kept.as_bytes())?;
    Ok(count)
}

/// Appends one line per iteration to `RUN_DIR/metrics.jsonl`.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: File,
}

impl MetricsWriter {
    /// Opens (creating `run_dir` and the file if needed) for appending. A partial last line left
    /// by a killed run is cut off first, so the next record starts on a line of its own.
    pub fn open(run_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(run_dir).map_err(|e| TroupeError::io(run_dir, e))?;
        let path = metrics_path(run_dir);
        let io = |e| TroupeError::io(&path, e);
        let mut file = OpenOptions::new().read(true).append(true).create(true).open(&path).map_err(io)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io)?;
        let complete_len = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        if complete_len < bytes.len() {
            file.set_len(complete_len as u64).map_err(io)?;
            file.sync_data().map_err(io)?;
        }
        Ok(Self { path, file })
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `metrics` as one line, written in one call and synced to disk.
    pub fn append(&mut self, metrics: &IterationMetrics) -> Result<()> {
        let mut line = serde_json::to_string(metrics)
            .map_err(|e| TroupeError::Json { path: self.path.clone(), message: e.to_string() })?;
        line.push('\n');
        self.file.write_all(line.as_bytes()).map_err(|e| TroupeError::io(&self.path, e))?;
        self.file.flush().map_err(|e| TroupeError::io(&self.path, e))?;
        self.file.sync_data().map_err(|e| TroupeError::io(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::memory::DeviceMemory;

    fn record(iteration: u64) -> IterationMetrics {
        let per_agent = |base: f64| (0..2).map(|a| (a, base + a as f64)).collect();
        IterationMetrics {
            iteration,
            mean_return: per_agent(iteration as f64 * 0.5),
            std_return: per_agent(0.25),
            invalid_rate: 0.5 / (iteration as f64 + 1.0),
            loss: -0.125 * iteration as f64,
            grad_norm: [("agent_0".to_string(), 1.5), ("agent_1".to_string(), 2.5)].into_iter().collect(),
            lr: 1e-4,
            tokens_per_second: 321.5,
            seconds: 2.75,
            extra: [("score".to_string(), 3.0)].into_iter().collect(),
        }
    }

    #[test]
    fn lines_round_trip_with_agent_keys() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = MetricsWriter::open(dir.path()).unwrap();
        for i in 1..=3 {
            writer.append(&record(i)).unwrap();
        }
        let text = std::fs::read_to_string(writer.path()).unwrap();
        assert_eq!(text.lines().count(), 3);
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["mean_return"]["1"], 1.5, "per-agent maps are keyed by agent id");
        assert_eq!(first["extra"]["score"], 3.0);
        assert_eq!(first["grad_norm"]["agent_1"], 2.5);
        let log = read_metrics(writer.path()).unwrap();
        assert_eq!(log, MetricsLog { records: (1..=3).map(record).collect(), truncated_tail: false });
    }

    #[test]
    fn nan_is_written_as_null_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = MetricsWriter::open(dir.path()).unwrap();
        let mut nan = record(1);
        nan.loss = f64::NAN;
        nan.grad_norm.insert("agent_0".to_string(), f64::INFINITY);
        writer.append(&nan).unwrap();
        let text = std::fs::read_to_string(writer.path()).unwrap();
        assert!(text.contains("\"loss\":null"), "{text}");
        let back = &read_metrics(writer.path()).unwrap().records[0];
        assert!(back.loss.is_nan() && back.grad_norm["agent_0"].is_nan());
        assert_eq!(back.grad_norm["agent_1"], 2.5);
    }

    #[test]
    fn trainer_stats_become_a_line() {
        let stats = IterationStats {
            iteration: 4,
            mean_return: [(0, 1.0), (1, 2.0)].into_iter().collect(),
            std_return: [(0, 0.5), (1, 0.0)].into_iter().collect(),
            mean_score: 3.5,
            invalid_rate: 0.25,
            loss: -0.5,
            grad_norm: [("shared".to_string(), 0.75)].into_iter().collect(),
            lr: 2e-4,
            rollout_tokens_per_second: 800.0,
            seconds: 1.5,
            kl: Some(0.125),
            clip_fraction: None,
            mean_episode_steps: 6.0,
            phase_seconds: [("rollout".to_string(), 1.0), ("update".to_string(), 0.5)].into_iter().collect(),
            phase_flops: [("rollout".to_string(), 4e9)].into_iter().collect(),
            phase_memory: [
                ("decode".to_string(), DeviceMemory { in_use: 3 << 20, reserved: 8 << 20 }),
                ("backward".to_string(), DeviceMemory { in_use: 5 << 20, reserved: 6 << 20 }),
            ]
            .into_iter()
            .collect(),
            env_metrics: [("score".to_string(), 3.5), ("plays".to_string(), 2.0)].into_iter().collect(),
            choice_entropy: Some(1.25),
            trl: [("frac_reward_zero_std".to_string(), 0.5)].into_iter().collect(),
        };
        let line = IterationMetrics::from(&stats);
        assert_eq!(line.extra["frac_reward_zero_std"], 0.5);
        assert_eq!(line.iteration, 4);
        assert_eq!(line.mean_return, stats.mean_return);
        assert_eq!(line.grad_norm["shared"], 0.75);
        assert_eq!((line.tokens_per_second, line.seconds, line.lr), (800.0, 1.5, 2e-4));
        assert_eq!(line.extra["score"], 3.5);
        assert_eq!(line.extra["episode_steps"], 6.0);
        assert_eq!(line.extra["kl"], 0.125);
        assert_eq!((line.extra["seconds_rollout"], line.extra["seconds_update"]), (1.0, 0.5));
        assert_eq!((line.extra["gflop_rollout"], line.extra["gflop_per_second_rollout"]), (4.0, 4.0));
        assert_eq!((line.extra["env_plays"], line.extra["choice_entropy"]), (2.0, 1.25));
        assert_eq!((line.extra["memory_mib_decode"], line.extra["memory_mib_backward"]), (3.0, 5.0));
        assert_eq!(line.extra["memory_reserved_mib"], 8.0);
        let on_the_cpu = IterationMetrics::from(&IterationStats { kl: None, phase_memory: BTreeMap::new(), ..stats });
        assert!(!on_the_cpu.extra.contains_key("kl"));
        assert!(!on_the_cpu.extra.keys().any(|k| k.starts_with("memory_")));
    }

    #[test]
    fn a_partial_last_line_is_ignored_then_cut() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = MetricsWriter::open(dir.path()).unwrap();
        writer.append(&record(1)).unwrap();
        writer.append(&record(2)).unwrap();
        drop(writer);
        // A run killed in the middle of its third line.
        let path = metrics_path(dir.path());
        let third = serde_json::to_string(&record(3)).unwrap();
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(&third.as_bytes()[..third.len() / 2]).unwrap();
        drop(file);
        let log = read_metrics(&path).unwrap();
        assert_eq!(log.records, vec![record(1), record(2)]);
        assert!(log.truncated_tail);
        // Reopening cuts the tail, so the next record is a line of its own.
        let mut writer = MetricsWriter::open(dir.path()).unwrap();
        writer.append(&record(3)).unwrap();
        let log = read_metrics(&path).unwrap();
        assert_eq!(log, MetricsLog { records: (1..=3).map(record).collect(), truncated_tail: false });
    }

    #[test]
    fn a_malformed_complete_line_names_its_number() {
        let dir = tempfile::tempdir().unwrap();
        let path = metrics_path(dir.path());
        let good = serde_json::to_string(&record(1)).unwrap();
        std::fs::write(&path, format!("{good}\n{{\"iteration\": \"two\"}}\n")).unwrap();
        let err = read_metrics(&path).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl: line 2:"), "{err}");
        let err = read_metrics(&dir.path().join("absent.jsonl")).unwrap_err().to_string();
        assert!(err.contains("absent.jsonl"), "{err}");
    }

    #[test]
    fn truncate_to_drops_iterations_after_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(truncate_to(dir.path(), 3).unwrap(), 0, "no file yet");
        let mut writer = MetricsWriter::open(dir.path()).unwrap();
        for i in 1..=5 {
            writer.append(&record(i)).unwrap();
        }
        drop(writer);
        let path = metrics_path(dir.path());
        let before = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{before}{{\"iteration\":6,\"mea")).unwrap();
        assert_eq!(truncate_to(dir.path(), 3).unwrap(), 3);
        let after = std::fs::read_to_string(&path).unwrap();
        let expected: String = before.lines().take(3).map(|l| format!("{l}\n")).collect();
        assert_eq!(after, expected, "kept lines are byte-identical, the partial tail is gone");
        // Resumed iterations 4 and 5 append after the kept ones.
        let mut writer = MetricsWriter::open(dir.path()).unwrap();
        writer.append(&record(4)).unwrap();
        writer.append(&record(5)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), before);
    }
}
