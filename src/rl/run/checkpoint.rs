//! Training checkpoints (DESIGN.md, "Training"): everything a run needs to continue exactly as
//! if it had not stopped.
//!
//! ```text
//! RUN_DIR/checkpoints/iteration-000004/
//!     adapters/                 every agent's adapter in PEFT's layout, plus troupe.json
//!     optimizer.safetensors     AdamW moments: `<adapter>/<PEFT key>/exp_avg|exp_avg_sq`
//!     state.json                iteration, AdamW step counts, the run's RNG state
//! ```
//!
//! A checkpoint is built in a hidden staging directory beside its final name and renamed into
//! place, so a directory named `iteration-*` is always whole: a run killed while writing leaves
//! only the staging directory, which [`latest_checkpoint`] ignores and [`clean_staging`]
//! removes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::Device;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::adapters::lora::peft_key;
use crate::adapters::optim::Moments;
use crate::adapters::{AdamWState, MultiAdapterManager};
use crate::error::{Result, RunError, TroupeError};
use crate::fsutil::{write_atomic, write_dir_atomic};
use crate::model::safetensors_io::{write_safetensors, HostTensor, TensorStore};

/// The checkpoints' parent directory inside a run directory.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// The adapters' directory inside a checkpoint.
pub const ADAPTERS_DIR: &str = "adapters";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "state.json";
const FORMAT: &str = "troupe-checkpoint-1";
const PREFIX: &str = "iteration-";

/// The state of a ChaCha8 stream, as JSON can hold it (`word_pos` is a u128, written as a string).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// The 32-byte key, in hex.
    pub seed: String,
    /// The stream number.
    pub stream: u64,
    /// The position in the stream, in 32-bit words.
    pub word_pos: String,
}

impl RngState {
    /// Captures `rng`'s position.
    pub fn capture(rng: &ChaCha8Rng) -> Self {
        let seed = rng.get_seed().iter().map(|b| format!("{b:02x}")).collect();
        Self { seed, stream: rng.get_stream(), word_pos: rng.get_word_pos().to_string() }
    }

    /// The generator at the captured position. `origin` names the file in errors.
    pub fn restore(&self, origin: &Path) -> Result<ChaCha8Rng> {
        use rand::SeedableRng;
        let bad = |message: String| TroupeError::Run(RunError::Checkpoint { path: origin.to_path_buf(), message });
        if self.seed.len() != 64 {
            return Err(bad(format!("rng.seed must be 64 hex digits, found {} characters", self.seed.len())));
        }
        let mut seed = [0u8; 32];
        for (i, byte) in seed.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&self.seed[2 * i..2 * i + 2], 16)
                .map_err(|_| bad(format!("rng.seed is not hex: {:?}", self.seed)))?;
        }
        let word_pos: u128 =
            self.word_pos.parse().map_err(|_| bad(format!("rng.word_pos is not an integer: {:?}", self.word_pos)))?;
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(word_pos);
        Ok(rng)
    }
}

/// `state.json`: the scalars of a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    format: String,
    iteration: u64,
    optimizer_steps: BTreeMap<String, u64>,
    rng: RngState,
}

/// What a checkpoint restores.
pub struct Checkpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// Iterations done when it was written.
    pub iteration: u64,
    /// The run's random stream at that point.
    pub rng: ChaCha8Rng,
    /// Per adapter name: AdamW state.
    pub optimizer_states: BTreeMap<String, AdamWState>,
}

/// `RUN_DIR/checkpoints/iteration-NNNNNN`.
pub fn checkpoint_dir(run_dir: &Path, iteration: u64) -> PathBuf {
    run_dir.join(CHECKPOINTS_DIR).join(format!("{PREFIX}{iteration:06}"))
}

/// Writes the checkpoint of `iteration` atomically: adapters (PEFT), optimizer moments and
/// steps, and the RNG state. Returns its directory.
pub fn save_checkpoint(
    run_dir: &Path,
    iteration: u64,
    manager: &MultiAdapterManager,
    optimizer_states: &BTreeMap<String, AdamWState>,
    rng: &ChaCha8Rng,
) -> Result<PathBuf> {
    let dir = checkpoint_dir(run_dir, iteration);
    write_dir_atomic(&dir, |staging| write_checkpoint_files(staging, iteration, manager, optimizer_states, rng))?;
    Ok(dir)
}

/// Fills `dir` with a checkpoint's files (what [`save_checkpoint`] does inside its staging
/// directory; a run killed part-way through leaves exactly such a partial directory).
pub fn write_checkpoint_files(
    dir: &Path,
    iteration: u64,
    manager: &MultiAdapterManager,
    optimizer_states: &BTreeMap<String, AdamWState>,
    rng: &ChaCha8Rng,
) -> Result<()> {
    manager.save_adapters(&dir.join(ADAPTERS_DIR))?;
    let mut tensors = BTreeMap::new();
    let mut optimizer_steps = BTreeMap::new();
    for (name, state) in optimizer_states {
        optimizer_steps.insert(name.clone(), state.step);
        for (&site, (a, b)) in &state.moments() {
            for (factor, moments) in [('A', a), ('B', b)] {
                let key = format!("{name}/{}", peft_key(site, factor));
                tensors.insert(format!("{key}/exp_avg"), HostTensor::read_back(&moments.m)?);
                tensors.insert(format!("{key}/exp_avg_sq"), HostTensor::read_back(&moments.v)?);
            }
        }
    }
    write_safetensors(&dir.join(OPTIMIZER_FILE), &tensors, None)?;
    let state = StateFile { format: FORMAT.to_string(), iteration, optimizer_steps, rng: RngState::capture(rng) };
    let json = serde_json::to_vec_pretty(&state).expect("the state serialises");
    write_atomic(&dir.join(STATE_FILE), &json)
}

/// Every complete checkpoint of a run, oldest first, as (iteration, directory). Staging
/// directories and unrelated entries are skipped.
pub fn list_checkpoints(run_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let parent = run_dir.join(CHECKPOINTS_DIR);
    if !parent.exists() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&parent).map_err(|e| TroupeError::io(&parent, e))? {
        let entry = entry.map_err(|e| TroupeError::io(&parent, e))?;
        let name = entry.file_name();
        let Some(number) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else { continue };
        if let Ok(iteration) = number.parse::<u64>() {
            out.push((iteration, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The newest complete checkpoint of a run, if any.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<(u64, PathBuf)>> {
    Ok(list_checkpoints(run_dir)?.pop())
}

/// Removes staging directories that a killed checkpoint write left behind. Returns how many.
pub fn clean_staging(run_dir: &Path) -> Result<usize> {
    let parent = run_dir.join(CHECKPOINTS_DIR);
    if !parent.exists() {
        return Ok(0);
    }
    let mut removed = 0;
    for entry in std::fs::read_dir(&parent).map_err(|e| TroupeError::io(&parent, e))? {
        let entry = entry.map_err(|e| TroupeError::io(&parent, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let leftover = name.starts_with('.') && (name.contains(".staging-") || name.contains(".old-"));
        if leftover {
            std::fs::remove_dir_all(entry.path()).map_err(|e| TroupeError::io(entry.path(), e))?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Reads the checkpoint in `dir` into `manager` (adapters) and returns the rest. The manager is
/// changed only when everything has been read.
pub fn load_checkpoint(dir: &Path, manager: &mut MultiAdapterManager, device: &Device) -> Result<Checkpoint> {
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(|e| TroupeError::io(&state_path, e))?;
    let state: StateFile = serde_json::from_str(&text)
        .map_err(|e| TroupeError::Json { path: state_path.clone(), message: e.to_string() })?;
    if state.format != FORMAT {
        return Err(TroupeError::Run(RunError::Checkpoint {
            path: state_path,
            message: format!("format {:?} is not {FORMAT:?}", state.format),
        }));
    }
    let rng = state.rng.restore(&state_path)?;
    let optimizer_path = dir.join(OPTIMIZER_FILE);
    let store = TensorStore::open_files(std::slice::from_ref(&optimizer_path), optimizer_path.clone())?;
    let mut loaded = manager.clone();
    loaded.load_adapters(&dir.join(ADAPTERS_DIR))?;
    let mut optimizer_states = BTreeMap::new();
    for (name, &step) in &state.optimizer_steps {
        let adapter = loaded.adapter_by_name(name).ok_or_else(|| {
            TroupeError::Run(RunError::Checkpoint {
                path: state_path.clone(),
                message: format!("optimizer_steps names adapter {name:?}, which the checkpoint's adapters lack"),
            })
        })?;
        let mut moments = BTreeMap::new();
        for (&site, pair) in &adapter.pairs {
            let read = |factor: char, shape: Vec<usize>| -> Result<Moments> {
                let key = format!("{name}/{}", peft_key(site, factor));
                let m = store.read(&format!("{key}/exp_avg"), Some(&shape))?;
                let v = store.read(&format!("{key}/exp_avg_sq"), Some(&shape))?;
                m.check_finite(&optimizer_path, &format!("{key}/exp_avg"))?;
                v.check_finite(&optimizer_path, &format!("{key}/exp_avg_sq"))?;
                Ok(Moments { m: m.to_device(device), v: v.to_device(device) })
            };
            let a = read('A', pair.a.dims().to_vec())?;
            let b = read('B', pair.b.dims().to_vec())?;
            moments.insert(site, (a, b));
        }
        optimizer_states.insert(name.clone(), AdamWState::from_moments(step, &moments));
    }
    *manager = loaded;
    Ok(Checkpoint { dir: dir.to_path_buf(), iteration: state.iteration, rng, optimizer_states })
}
