//! Training (DESIGN.md, "Training (MAGRPO)"; `docs/ARCHITECTURE.md` walks it in data-flow
//! order). The folders are the stages:
//!
//! - [`config`]: the run's YAML config (sections, validation, `--set` overrides, the resume
//!   guard, checks against the model);
//! - [`rollout`]: batched episodes, one action mode per config ([`rollout::action`]);
//! - [`credit`]: rewards and reward processors, shaping, returns and advantages, the
//!   [`credit::batch::TrainBatch`] the update trains on;
//! - [`update`] and [`objective`]: the loss's forward and backward; [`optimizer`]: clipping and
//!   AdamW per adapter;
//! - [`trainer`]: orders the phases of one iteration;
//! - [`run`]: the run directory (config, metrics, checkpoints, lock, plots);
//! - [`eval`]: held-out evaluation.

pub mod config;
pub mod credit;
pub mod crossplay;
pub mod eval;
pub mod flops;
pub mod objective;
pub mod optimizer;
pub mod protocol_writer;
pub mod rollout;
pub mod run;
pub mod trainer;
pub mod trl_stats;
pub mod update;
pub mod warmup;

pub use config::TrainConfig;
pub use credit::rewards::{RewardFunction, RewardPipeline, RewardProcessor};
pub use run::metrics::{IterationMetrics, MetricsWriter};
