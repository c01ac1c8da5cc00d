//! The library's typed errors. The binary adds context with `anyhow`.

use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong loading, building or running a model.
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
    /// A config field is missing or has a value troupe cannot use.
    #[error("{path}: field `{field}`: {message}")]
    ConfigField {
        /// The config file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
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
    /// An environment could not be built, reset or asked for a policy (its own typed error,
    /// chained).
    #[error("environment: {0}")]
    Env(#[from] troupe_envs::EnvError),
    /// The coding task's inference-only protocols could not run.
    #[error(transparent)]
    Protocol(#[from] troupe_envs::coding::protocols::ProtocolError),
    /// An environment failed or refused a step inside a rollout or an evaluation.
    #[error("{env}: {message}")]
    EnvStep {
        /// The environment's name.
        env: String,
        /// What it said, with the joint action, step and seed where known.
        message: String,
    },
    /// A setting of the trainer, the rollouts or the evaluation (named by its config key) that
    /// cannot be used as given.
    #[error("`{key}`: {message}")]
    Setting {
        /// The config key (`action.mode`, `rewards.functions[0].weight`, `training.objective.kind`).
        key: String,
        /// What is wrong.
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
    /// An argument of a library call is out of range (an empty batch, a token id beyond the vocab, ...).
    #[error("invalid argument `{name}`: {message}")]
    InvalidArgument {
        /// The argument.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A training config (YAML) is malformed, names an unknown key, or holds a value troupe
    /// cannot use.
    #[error("{}: {}{message}", .path.display(), key_prefix(.key))]
    Config {
        /// The config file (or `--set` for an override that is itself malformed).
        path: PathBuf,
        /// The dotted key (`training.group_size`, `agents.seats[2]`); empty when the whole
        /// document is at fault (a YAML syntax error).
        key: String,
        /// What is wrong (serde's message for a wrong type or an unknown field).
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

/// `key: ` for a non-empty key, nothing for an empty one.
fn key_prefix(key: &str) -> String {
    if key.is_empty() {
        String::new()
    } else {
        format!("{key}: ")
    }
}

/// Result with [`TroupeError`].
pub type Result<T, E = TroupeError> = std::result::Result<T, E>;

impl TroupeError {
    /// An [`TroupeError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), error: source }
    }

    /// A [`TroupeError::Setting`] for config key `key`.
    pub fn setting(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Setting { key: key.into(), message: message.into() }
    }

    /// A [`TroupeError::Reward`] of reward function `function`.
    pub fn reward(function: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Reward { function: function.into(), message: message.into() }
    }

    /// A [`TroupeError::EnvStep`] of environment `env`.
    pub fn env_step(env: impl Into<String>, message: impl Into<String>) -> Self {
        Self::EnvStep { env: env.into(), message: message.into() }
    }

    /// An [`TroupeError::InvalidArgument`].
    pub fn invalid(name: &str, message: impl Into<String>) -> Self {
        Self::InvalidArgument { name: name.to_string(), message: message.into() }
    }
}
