//! Training (DESIGN.md, "Training (MAGRPO)"): the run's config, batched rollouts, rewards and
//! reward processors, credit assignment, the policy loss, the trainer's iteration, metrics and
//! learning-curve plots.

pub mod advantage;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod config_file;
pub mod config_guard;
pub mod crossplay;
pub mod eval;
pub mod external_reward;
pub mod flops;
pub mod limits;
pub mod lock;
pub mod metrics;
pub mod objective;
pub mod optimizer;
pub mod overrides;
pub mod plot;
pub mod preflight;
pub mod protocol_writer;
pub mod rewards;
pub mod rollout;
pub mod run;
pub mod trainer;
pub mod update;
pub mod warmup;

pub use config::TrainConfig;
pub use metrics::{IterationMetrics, MetricsWriter};
pub use rewards::{RewardFunction, RewardPipeline, RewardProcessor};
