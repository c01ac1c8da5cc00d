//! [`AttentionKernel`]: which kernel computes attention on a GPU (`runtime.attention`,
//! `TROUPE_ATTENTION` for the benchmarks).
//!
//! On the CPU the choice changes nothing: troupe's fused attention ([`super::fused::attention`])
//! runs, which never holds more scores than one block of queries. On a GPU burn offers two
//! kernels for a forward no gradient flows through (rollouts, generation, scoring, evaluation):
//!
//! - `materialized`: burn's attention as troupe has always called it there: separate kernels
//!   (two products, the masked softmax), the scores `[rows, heads, queries, keys]` held in memory;
//! - `flash`: burn-cubecl's flash kernel (cubek's `unit` routine, f32 tiles and accumulators):
//!   one kernel, an online softmax over blocks of keys, no score matrix in memory
//!   ([`super::fused::flash`]).
//!
//! A differentiable forward (the update's) keeps the materialized kernel, whose backward burn
//! has. On an H200 in bf16 `flash` ran at 0.54-0.80x of `materialized`'s tokens/s at prefill
//! and decoding (`docs/gpu.md`), so `auto` is `materialized`. A decoding step over a prompt held
//! once per group ([`super::prompt_cache`]) runs that cache's own attention whatever the choice.

use serde::{Deserialize, Serialize};

/// `runtime.attention`: the attention kernel off the CPU, for a forward without gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernel {
    /// `materialized`, the faster of the two on an H200.
    #[default]
    Auto,
    /// burn-cubecl's flash kernel where it launches (it falls back to `materialized`, with a
    /// warning naming why, where it does not).
    Flash,
    /// burn's attention with the scores materialised (separate kernels).
    Materialized,
}

impl AttentionKernel {
    /// The name as the config writes it.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Auto => "auto",
            AttentionKernel::Flash => "flash",
            AttentionKernel::Materialized => "materialized",
        }
    }

    /// Whether a forward without gradients on a GPU runs the flash kernel (`auto`: not yet).
    pub fn runs_flash(self) -> bool {
        match self {
            AttentionKernel::Flash => true,
            AttentionKernel::Auto | AttentionKernel::Materialized => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_yaml_and_the_command_line() {
        for kernel in [AttentionKernel::Auto, AttentionKernel::Flash, AttentionKernel::Materialized] {
            let yaml = serde_yaml::to_string(&kernel).unwrap();
            assert_eq!(yaml.trim(), kernel.name());
            assert_eq!(serde_yaml::from_str::<AttentionKernel>(&yaml).unwrap(), kernel);
            assert_eq!(<AttentionKernel as clap::ValueEnum>::from_str(kernel.name(), true), Ok(kernel));
        }
        assert!(!AttentionKernel::default().runs_flash(), "auto is the materialized kernel, the faster as measured");
        assert!(AttentionKernel::Flash.runs_flash());
    }
}
