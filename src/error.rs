//! The library's typed errors, by layer: a value the user gave ([`TroupeError::BadValue`]: a
//! config key, a `--set`, a field of a JSON file, an argument), the model and its files
//! ([`ModelError`]), environments and rewards ([`EnvironmentError`]), and the run on disk and
//! its training ([`RunError`]); plus the I/O and JSON failures every layer shares. The binary adds
//! context with `anyhow`.

use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong in troupe, by layer.
#[derive(Debug, Error)]
pub enum TroupeError {
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error (shown in the message, not chained, so it is printed once).
        error: std::io::Error,
    },
    /// A JSON file is malformed or a field has the wrong type.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// serde's message (names the field, line and column).
        message: String,
    },
    /// A value the user gave that troupe cannot use: a key of a YAML config or of `--set`
    /// (`origin` the file), a field of a JSON file (`config.json`, `adapter_config.json`), a
    /// setting named by its config key, or an argument of a library call. The message names the
    /// key and what is wrong.
    #[error("{}{message}", value_prefix(.origin, .key))]
    BadValue {
        /// The file the value came from, when there is one.
        origin: Option<PathBuf>,
        /// The dotted key or field (`training.group_size`, `agents.seats[2]`, `lora_alpha`);
        /// empty when the whole document is at fault (a YAML syntax error).
        key: String,
        /// What is wrong (serde's message for a wrong type or an unknown field).
        message: String,
    },
    /// The model: its config, weights, tokenizer, chat template or adapters.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// An environment, a coding protocol or a reward function.
    #[error(transparent)]
    Environment(#[from] EnvironmentError),
    /// The run directory, its checkpoints, or a training step.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The device (a GPU) failed a computation, most often for want of memory: found when its
    /// results were read back ([`crate::readback`]).
    #[error("the device failed while {during}: {reason}")]
    Device {
        /// What troupe was computing (`decoding`, `scoring`, `computing the update`, `stepping the
        /// optimizer`, `saving the adapters`).
        during: &'static str,
        /// The failure in one line, with what to change when it is a want of memory.
        reason: String,
    },
}

/// Loading and using the model: `config.json`, the weights (safetensors, GGUF), the tokenizer,
/// the chat template, the agents' adapters.
#[derive(Debug, Error)]
pub enum ModelError {
    /// `model_type` names an architecture troupe does not implement.
    #[error("{path}: unsupported model_type {model_type:?} (supported: llama, qwen2, qwen3)")]
    UnsupportedModelType {
        /// The config file.
        path: PathBuf,
        /// The value found.
        model_type: String,
    },
    /// A safetensors file is truncated, corrupt or has an unsupported dtype.
    #[error("{path}: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("{path}: tensor `{tensor}` is missing")]
    MissingTensor {
        /// The checkpoint (file or directory).
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
    },
    /// A tensor has a different shape than the config implies.
    #[error("{path}: tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The checkpoint (file or directory).
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape on disk.
        got: Vec<usize>,
    },
    /// A GGUF file is truncated or corrupt, or its metadata is missing a key, has a key of the
    /// wrong type, or describes something troupe cannot load.
    #[error("{}: {message}", .path.display())]
    Gguf {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong (names the metadata key or tensor).
        message: String,
    },
    /// A GGUF tensor is stored in a block format troupe does not read.
    #[error("{}: tensor `{tensor}` has type {type_name}, which troupe does not read (it reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)", .path.display())]
    GgufTensorType {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor's name in the file (`blk.0.attn_q.weight`).
        tensor: String,
        /// The ggml type's name (`IQ2_XXS`).
        type_name: String,
    },
    /// The tokenizer file could not be loaded or used.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// The tokenizer file (or the model directory for built-in tokenizers).
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template could not be parsed or rendered.
    #[error("chat template: {message}")]
    ChatTemplate {
        /// What is wrong.
        message: String,
    },
    /// An agent id has no adapter.
    #[error("agent {agent} has no adapter (agents with adapters: {known})")]
    UnknownAgent {
        /// The agent id asked for.
        agent: usize,
        /// The agent ids that have one.
        known: String,
    },
    /// A gradient or optimizer state names an adapter the manager does not hold.
    #[error("no adapter is named {name:?}")]
    UnknownAdapter {
        /// The adapter name asked for.
        name: String,
    },
}

/// Environments (built-in, plug-in or external), the coding task's protocols and reward
/// functions.
#[derive(Debug, Error)]
pub enum EnvironmentError {
    /// An environment could not be built, reset or asked for a policy (its own typed error,
    /// whose message names the environment, its command or the file).
    #[error("{0}")]
    Env(troupe_envs::EnvError),
    /// The coding task's inference-only protocols could not run.
    #[error(transparent)]
    Protocol(troupe_envs::coding::protocols::ProtocolError),
    /// An environment failed or refused a step inside a rollout or an evaluation.
    #[error("{env}: {message}")]
    EnvStep {
        /// The environment's name.
        env: String,
        /// What it said, with the joint action, step and seed where known.
        message: String,
    },
    /// A reward function failed or gave a value the trainer cannot use.
    #[error("reward function `{function}`: {message}")]
    Reward {
        /// The reward function's name (`external <command>` for an external one).
        function: String,
        /// What went wrong.
        message: String,
    },
    /// A reward function reads an episode metric the environment does not report.
    #[error("reward function `{function}` reads the metric `{metric}`, which the environment does not report (it reports: {known})")]
    MissingMetric {
        /// The reward function.
        function: String,
        /// The metric it reads.
        metric: String,
        /// The metrics the episode has.
        known: String,
    },
}

/// A training run: its directory, checkpoints and lock, a training step, its plots.
#[derive(Debug, Error)]
pub enum RunError {
    /// A training checkpoint (or the run directory holding it) is missing, incomplete or
    /// malformed.
    #[error("{}: {message}", .path.display())]
    Checkpoint {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Training stopped because the loss or a gradient stopped being a finite number.
    #[error("{message}")]
    NonFinite {
        /// What went non-finite, at which iteration.
        message: String,
    },
    /// Another process holds the run directory (a trainer still running there).
    #[error("{}: in use by another troupe process (pid {}); wait for it to finish or stop it, then try again", .path.display(), .holder.map_or_else(|| "unknown".to_string(), |pid| pid.to_string()))]
    RunInUse {
        /// The run directory.
        path: PathBuf,
        /// The holder's process id, as it wrote it in the lock file (None when not yet written).
        holder: Option<u32>,
    },
    /// A plot could not be drawn or encoded.
    #[error("plot {path}: {message}")]
    Plot {
        /// The image file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl From<troupe_envs::EnvError> for TroupeError {
    fn from(err: troupe_envs::EnvError) -> Self {
        Self::Environment(EnvironmentError::Env(err))
    }
}

impl From<troupe_envs::coding::protocols::ProtocolError> for TroupeError {
    fn from(err: troupe_envs::coding::protocols::ProtocolError) -> Self {
        Self::Environment(EnvironmentError::Protocol(err))
    }
}

/// What comes before a bad value's message: `FILE: KEY: `, `FILE: ` (an empty key), or
/// `` `KEY`: `` (from no file).
fn value_prefix(origin: &Option<PathBuf>, key: &str) -> String {
    match (origin, key.is_empty()) {
        (Some(path), true) => format!("{}: ", path.display()),
        (Some(path), false) => format!("{}: {key}: ", path.display()),
        (None, true) => String::new(),
        (None, false) => format!("`{key}`: "),
    }
}

/// Result with [`TroupeError`].
pub type Result<T, E = TroupeError> = std::result::Result<T, E>;

impl TroupeError {
    /// An [`TroupeError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), error: source }
    }

    /// A [`TroupeError::BadValue`] of `key` in the file `origin`.
    pub fn config(origin: impl Into<PathBuf>, key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::BadValue { origin: Some(origin.into()), key: key.into(), message: message.into() }
    }

    /// A [`TroupeError::BadValue`] of the setting `key` (a config key, from no file in
    /// particular).
    pub fn setting(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::BadValue { origin: None, key: key.into(), message: message.into() }
    }

    /// A [`TroupeError::BadValue`] of the argument `name` of a library call.
    pub fn invalid(name: &str, message: impl Into<String>) -> Self {
        Self::setting(name, message)
    }

    /// An [`EnvironmentError::Reward`] of reward function `function`.
    pub fn reward(function: impl Into<String>, message: impl Into<String>) -> Self {
        EnvironmentError::Reward { function: function.into(), message: message.into() }.into()
    }

    /// An [`EnvironmentError::EnvStep`] of environment `env`.
    pub fn env_step(env: impl Into<String>, message: impl Into<String>) -> Self {
        EnvironmentError::EnvStep { env: env.into(), message: message.into() }.into()
    }

    /// A [`RunError::NonFinite`].
    pub fn non_finite(message: impl Into<String>) -> Self {
        RunError::NonFinite { message: message.into() }.into()
    }

    /// A [`RunError::Checkpoint`] of `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        RunError::Checkpoint { path: path.into(), message: message.into() }.into()
    }
}
