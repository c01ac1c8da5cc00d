//! Typed errors of the environments crate ([`EnvError`], [`SandboxError`]). An action's refusal,
//! [`ActionError`], is part of the [`crate::Environment`] contract and lives beside it.

use thiserror::Error;

use crate::environment::ActionError;

/// Errors building an environment from its name and parameters.
#[derive(Debug, Error)]
pub enum EnvError {
    /// No environment of that name is registered.
    #[error("unknown environment {name:?} (registered: {known})")]
    UnknownEnv {
        /// The name asked for.
        name: String,
        /// The registered names, comma-separated.
        known: String,
    },
    /// A parameter is missing, of the wrong type, unknown or out of range.
    #[error("environment {env}: bad parameter {field}: {message}")]
    BadParam {
        /// The environment name.
        env: String,
        /// The parameter's name (or `params` when the whole value is wrong).
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A data file (dataset, problem set, game record) could not be read.
    #[error("{path}: {message}")]
    Data {
        /// The file.
        path: String,
        /// What is wrong, naming the line or field where known.
        message: String,
    },
    /// No baseline policy of that name exists.
    #[error("unknown policy {name:?} (known: {known})")]
    UnknownPolicy {
        /// The name asked for.
        name: String,
        /// The known policy names, comma-separated.
        known: String,
    },
    /// A policy cannot act in this environment or state.
    #[error("policy {policy} in environment {env}: {message}")]
    Policy {
        /// The policy's name.
        policy: String,
        /// The environment's name.
        env: String,
        /// Why it cannot act.
        message: String,
    },
    /// An external environment process failed to start, crashed, hung or broke the protocol.
    #[error("external environment {command}: {message}")]
    External {
        /// The process's command line.
        command: String,
        /// What went wrong, with the offending message and the end of its stderr where known.
        message: String,
    },
    /// An environment refused an action while running an episode.
    // The cause is part of the message and deliberately not a `source`: a chain printed whole
    // (`{:#}`) would show it twice.
    #[error("environment {env}: {error}")]
    Action {
        /// The environment's name.
        env: String,
        /// Why the action was refused.
        error: ActionError,
    },
}

/// Errors of the sandbox itself (never of the code it runs: whatever that code does comes back
/// as a [`crate::sandbox::RunOutput`]).
#[derive(Debug, Error)]
pub enum SandboxError {
    /// No Python interpreter could be found or started.
    #[error("python interpreter {python:?}: {message}")]
    Interpreter {
        /// The interpreter path or name that was tried.
        python: String,
        /// What went wrong.
        message: String,
    },
    /// A sandbox setting is out of range.
    #[error("sandbox setting {field}: {message}")]
    BadConfig {
        /// The setting's name.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The operating system refused a step of starting an evaluation (temp dir, pipe, spawn).
    // The OS error is part of the message, not a `source`, so a chain is not printed twice.
    #[error("sandbox could not {action}: {error}")]
    Io {
        /// What was being done.
        action: String,
        /// The OS error.
        error: std::io::Error,
    },
    /// The platform has no sandbox implementation (troupe's sandbox needs Linux).
    #[error("the code sandbox needs Linux")]
    Unsupported,
}
