//! troupe: train teams of LLM agents sharing one frozen base model.
//!
//! See DESIGN.md for the architecture. Modules follow the data flow:
//! [`model`] (config, transformer, loading), [`generate`] (batched generation, sampling and
//! scoring), [`rl`] (training config, rewards, metrics, plots), [`cli`] (the `troupe` command
//! line).

pub mod adapters;
pub mod cli;
pub mod device;
pub mod error;
pub mod fsutil;
pub mod generate;
pub mod model;
pub mod profile;
pub mod readback;
pub mod rl;
mod section;

pub use error::{EnvironmentError, ModelError, Result, RunError, TroupeError};

/// The environments crate, re-exported so a plug-in crate needs only `troupe` as a dependency.
pub use troupe_envs;
