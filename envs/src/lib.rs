//! troupe-envs: environments for multi-agent LLM training, with no burn dependency.
//!
//! - [`Environment`]: the plug-in trait (turn-based games and simultaneous tasks alike).
//! - [`Registry`]: names -> constructors with typed parameters; plug-ins register the same way.
//! - [`hanabi`] (DeepMind HLE's rules) and [`bridge`] (OpenSpiel's rules): games with exact rules,
//!   text observations and tolerant reply parsing.
//! - [`external`]: environments in any language, over JSON lines; [`batch`]: many episodes at once.
//! - [`policy`]: the baseline-policy trait (a game's own players live beside the game);
//!   [`runner`]: episodes, benchmarks and interactive play for any environment; [`records`]:
//!   JSONL game records, written and replayed move by move.

pub mod batch;
pub mod bridge;
pub mod coding;
pub mod environment;
pub mod error;
pub mod external;
pub mod hanabi;
pub mod policy;
pub mod records;
pub mod registry;
pub mod runner;
pub mod sandbox;
pub mod split;
pub mod text;
pub mod writing;

pub use environment::{Action, ActionError, Environment, EpisodeMetrics, LegalAction, SeatId};
pub use error::{EnvError, SandboxError};
pub use registry::{parse_params, BatchRewardFn, RegisteredReward, Registry, RewardFn, RewardInput, RewardItem};

/// Registers every environment and baseline policy this crate ships into `registry`.
pub fn register_builtins(registry: &mut Registry) {
    registry.register(
        "hanabi",
        "Hanabi with DeepMind HLE's exact rules, 2-5 players (variants full, small, very_small)",
        |p| Ok(Box::new(hanabi::HanabiEnv::from_params(p)?)),
    );
    registry.register(
        "bridge",
        "Contract bridge with OpenSpiel's rules: auction, play, duplicate scoring (or bidding only)",
        |p| Ok(Box::new(bridge::BridgeEnv::from_params(p)?)),
    );
    coding::CodingEnv::register(registry);
    writing::WritingEnv::register(registry);
    external::register(registry);
    registry.register_policy("random", "uniformly random legal moves (an empty reply in text tasks)", || {
        Box::new(policy::RandomPolicy)
    });
    registry.register_policy("rule", "a rule-based Hanabi player (plays hinted cards, hints playable ones)", || {
        Box::new(hanabi::rule_player::HanabiRulePolicy)
    });
    registry
        .register_policy("canonical", "the coding problems' reference solutions", || Box::new(coding::CanonicalPolicy));
}
