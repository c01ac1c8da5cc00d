//! Experiment tracking beyond `metrics.jsonl` (`run.report_to`): TensorBoard event files under
//! `RUN_DIR/tensorboard/`, with TRL's GRPO metric names.
//!
//! `metrics.jsonl` keeps troupe's own keys; the trackers get the same numbers under the names
//! TRL's `GRPOTrainer` logs ([`trl_scalars`]), with `agent_k/` prefixes for per-agent values,
//! so runs compare beside TRL's in the tools the field uses. The mapping is documented in
//! `docs/tracking.md`.
//!
//! An event file is a sequence of TFRecords (a little-endian `u64` length, its masked CRC-32C,
//! the bytes, their masked CRC-32C), each an `Event` protocol buffer: the first carries the file
//! version, the others a step and a summary of scalar values. The few protobuf fields needed are
//! encoded here by hand.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::metrics::IterationMetrics;
use crate::error::{Result, TroupeError};

/// The folder under a run directory that TensorBoard event files go to.
pub const TENSORBOARD_DIR: &str = "tensorboard";

/// One place a run's metrics go (`run.report_to`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportTo {
    /// `RUN_DIR/metrics.jsonl` (always written; listing it is allowed and changes nothing).
    Jsonl,
    /// TensorBoard event files in `RUN_DIR/tensorboard/`.
    Tensorboard,
}

/// The default of `run.report_to`: `metrics.jsonl` only.
pub fn default_report_to() -> Vec<ReportTo> {
    vec![ReportTo::Jsonl]
}

/// An iteration's numbers under TRL's GRPO names, in a fixed order. Where TRL has no name
/// (invalid replies, episode metrics, held-out games, timings) troupe's own key is kept,
/// grouped under `env/`, `eval/` and `perf/`.
///
/// | TRL name | from `metrics.jsonl` |
/// |---|---|
/// | `reward`, `reward_std` | mean over agents of `mean_return`, `std_return` |
/// | `agent_k/reward`, `agent_k/reward_std` | `mean_return[k]`, `std_return[k]` |
/// | `grad_norm` | global norm over adapters: the root of the summed squares of `grad_norm` |
/// | `agent_k/grad_norm` | `grad_norm["agent_k"]` (any other adapter under its own name) |
/// | `learning_rate`, `loss` | `lr`, `loss` |
/// | `kl`, `entropy`, `clip_ratio/region_mean` | `kl`, `choice_entropy`, `clip_fraction` |
/// | `completions/mean_length`, `completions/clipped_ratio`, `frac_reward_zero_std` | same keys |
/// | `turn_k/reward` | `turn_<k>_reward` |
/// | `rewards/<fn>/mean`, `rewards/<fn>/std` | same keys (each reward function by its label) |
/// | `eval/rewards/<fn>/mean`, `eval/rewards/<fn>/stderr` | `eval_rewards/<fn>/mean`, `.../stderr` |
pub fn trl_scalars(m: &IterationMetrics) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    let mean = |values: Vec<f64>| (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
    if let Some(reward) = mean(m.mean_return.values().copied().collect()) {
        out.push(("reward".into(), reward));
    }
    if let Some(std) = mean(m.std_return.values().copied().collect()) {
        out.push(("reward_std".into(), std));
    }
    for (agent, value) in &m.mean_return {
        out.push((format!("agent_{agent}/reward"), *value));
    }
    for (agent, value) in &m.std_return {
        out.push((format!("agent_{agent}/reward_std"), *value));
    }
    if !m.grad_norm.is_empty() {
        out.push(("grad_norm".into(), m.grad_norm.values().map(|n| n * n).sum::<f64>().sqrt()));
    }
    for (adapter, value) in &m.grad_norm {
        out.push((format!("{adapter}/grad_norm"), *value));
    }
    out.push(("learning_rate".into(), m.lr));
    out.push(("loss".into(), m.loss));
    out.push(("invalid_rate".into(), m.invalid_rate));
    out.push(("perf/tokens_per_second".into(), m.tokens_per_second));
    out.push(("perf/seconds".into(), m.seconds));
    for (key, value) in &m.extra {
        let name = match key.as_str() {
            "kl" => "kl".to_string(),
            "choice_entropy" => "entropy".to_string(),
            "clip_fraction" => "clip_ratio/region_mean".to_string(),
            "completions/mean_length" | "completions/clipped_ratio" | "frac_reward_zero_std" => key.clone(),
            _ if key.starts_with("rewards/") => key.clone(),
            "score" | "episode_steps" => format!("env/{key}"),
            _ => {
                if let Some(turn) = key.strip_prefix("turn_").and_then(|t| t.strip_suffix("_reward")) {
                    format!("turn_{turn}/reward")
                } else if let Some(metric) = key.strip_prefix("env_") {
                    format!("env/{metric}")
                } else if let Some(metric) = key.strip_prefix("eval_") {
                    format!("eval/{metric}")
                } else {
                    format!("perf/{key}")
                }
            }
        };
        out.push((name, *value));
    }
    out
}

/// The trackers `run.report_to` names, opened on a run directory.
#[derive(Debug, Default)]
pub struct Trackers {
    tensorboard: Option<TensorboardWriter>,
}

impl Trackers {
    /// Opens the trackers `report_to` lists in `run_dir` (`jsonl` needs nothing here: the
    /// metrics writer owns it).
    pub fn open(run_dir: &Path, report_to: &[ReportTo]) -> Result<Self> {
        let tensorboard = if report_to.contains(&ReportTo::Tensorboard) {
            Some(TensorboardWriter::create(&run_dir.join(TENSORBOARD_DIR))?)
        } else {
            None
        };
        Ok(Self { tensorboard })
    }

    /// Logs one iteration's metrics to every tracker, at step `metrics.iteration`.
    pub fn log(&mut self, metrics: &IterationMetrics) -> Result<()> {
        if let Some(writer) = &mut self.tensorboard {
            writer.write_scalars(metrics.iteration as i64, &trl_scalars(metrics))?;
        }
        Ok(())
    }
}

/// Appends TensorBoard events to a new `events.out.tfevents.*` file (one per process that
/// writes; TensorBoard reads every file of a folder, and a resumed run's later events for a step
/// replace the earlier ones on its charts).
#[derive(Debug)]
pub struct TensorboardWriter {
    path: PathBuf,
    file: File,
}

impl TensorboardWriter {
    /// Creates `dir` if needed and a new event file in it, starting with the version record.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| TroupeError::io(dir, e))?;
        let now = wall_time();
        let name = format!("events.out.tfevents.{}.troupe.{}", now as u64, std::process::id());
        let path = dir.join(name);
        let file = File::create(&path).map_err(|e| TroupeError::io(&path, e))?;
        let mut writer = Self { path, file };
        let mut event = Vec::new();
        encode_double(&mut event, 1, now);
        encode_bytes(&mut event, 3, b"brain.Event:2");
        writer.write_record(&event)?;
        Ok(writer)
    }

    /// The event file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event holding `scalars` at `step`, flushed and synced. Values that are not
    /// finite are written as they are (TensorBoard shows NaN).
    pub fn write_scalars(&mut self, step: i64, scalars: &[(String, f64)]) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut entry = Vec::new();
            encode_bytes(&mut entry, 1, tag.as_bytes());
            encode_key(&mut entry, 2, WIRE_FIXED32);
            entry.extend_from_slice(&(*value as f32).to_le_bytes());
            encode_bytes(&mut summary, 1, &entry);
        }
        let mut event = Vec::new();
        encode_double(&mut event, 1, wall_time());
        encode_key(&mut event, 2, WIRE_VARINT);
        encode_varint(&mut event, step as u64);
        encode_bytes(&mut event, 5, &summary);
        self.write_record(&event)?;
        self.file.sync_data().map_err(|e| TroupeError::io(&self.path, e))
    }

    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        let length = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&length);
        record.extend_from_slice(&masked_crc(&length).to_le_bytes());
        record.extend_from_slice(data);
        record.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file.write_all(&record).map_err(|e| TroupeError::io(&self.path, e))?;
        self.file.flush().map_err(|e| TroupeError::io(&self.path, e))
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// TFRecord's checksum: CRC-32C, rotated right by 15 bits, plus a constant.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_BYTES: u8 = 2;
const WIRE_FIXED32: u8 = 5;

fn encode_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn encode_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    encode_varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn encode_double(out: &mut Vec<u8>, field: u32, value: f64) {
    encode_key(out, field, WIRE_FIXED64);
    out.extend_from_slice(&value.to_le_bytes());
}

fn encode_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    encode_key(out, field, WIRE_BYTES);
    encode_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow() {
        // CRC-32C of "123456789" is 0xE3069283 (RFC 3720's check value); masked as TFRecord does.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn varints_encode_as_protobuf_does() {
        let mut out = Vec::new();
        encode_varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
    }

    #[test]
    fn trl_names_cover_agents_and_extras() {
        let mut m = IterationMetrics {
            iteration: 3,
            mean_return: [(0, 1.0), (1, 3.0)].into_iter().collect(),
            std_return: [(0, 0.5), (1, 0.5)].into_iter().collect(),
            grad_norm: [("agent_0".to_string(), 3.0), ("agent_1".to_string(), 4.0)].into_iter().collect(),
            lr: 1e-3,
            ..Default::default()
        };
        m.extra.insert("clip_fraction".into(), 0.25);
        m.extra.insert("env_hints".into(), 2.0);
        m.extra.insert("eval_score".into(), 7.0);
        m.extra.insert("turn_1_reward".into(), 0.5);
        m.extra.insert("rewards/same_length/mean".into(), -0.25);
        m.extra.insert("eval_rewards/same_length/stderr".into(), 0.125);
        let scalars: std::collections::BTreeMap<String, f64> = trl_scalars(&m).into_iter().collect();
        assert_eq!(scalars["reward"], 2.0);
        assert_eq!(scalars["agent_1/reward"], 3.0);
        assert_eq!(scalars["grad_norm"], 5.0);
        assert_eq!(scalars["agent_0/grad_norm"], 3.0);
        assert_eq!(scalars["learning_rate"], 1e-3);
        assert_eq!(scalars["clip_ratio/region_mean"], 0.25);
        assert_eq!(scalars["env/hints"], 2.0);
        assert_eq!(scalars["eval/score"], 7.0);
        assert_eq!(scalars["turn_1/reward"], 0.5);
        assert_eq!(scalars["rewards/same_length/mean"], -0.25);
        assert_eq!(scalars["eval/rewards/same_length/stderr"], 0.125);
    }
}
