//! The optimizer phase: per adapter, the gradient norm checked and clipped, then one AdamW step
//! ([`crate::adapters::optim`]). An adapter that got no gradient is not touched, moments
//! included; a non-finite gradient anywhere, or a step whose new weights are not finite, stops
//! the step before any adapter moves.

use std::collections::BTreeMap;

use super::objective::LossStats;
use crate::adapters::optim::{grad_norms_squared, AdapterGrads, FlatLayout, FlatStep};
use crate::adapters::{AdamWConfig, AdamWState, MultiAdapterManager};
use crate::error::{ModelError, Result, RunError, TroupeError};

/// The agents' optimizers: AdamW's settings, the clipping norm, and one state per adapter.
#[derive(Clone, Debug, Default)]
pub struct AgentOptimizers {
    /// AdamW's settings (its `lr` is the peak; each step is given its own rate).
    pub adamw: AdamWConfig,
    /// Per-adapter gradient-norm clip (0: none).
    pub max_grad_norm: f64,
    /// Per adapter name: AdamW state.
    pub states: BTreeMap<String, AdamWState>,
}

impl AgentOptimizers {
    /// Fresh optimizers (no state yet).
    pub fn new(adamw: AdamWConfig, max_grad_norm: f64) -> Self {
        Self { adamw, max_grad_norm, states: BTreeMap::new() }
    }

    /// One clipped AdamW step per adapter in `grads` at learning rate `lr`. Every norm is
    /// checked before any adapter moves, so a non-finite gradient changes nothing. Returns each
    /// adapter's gradient norm before clipping.
    pub fn step(
        &mut self,
        manager: &mut MultiAdapterManager,
        grads: BTreeMap<String, AdapterGrads>,
        lr: f64,
    ) -> Result<BTreeMap<String, f64>> {
        let mut grad_norm = BTreeMap::new();
        for (name, squared) in grads.keys().zip(grad_norms_squared(grads.values())?) {
            let norm = squared.sqrt();
            if !norm.is_finite() {
                return Err(TroupeError::Run(RunError::NonFinite {
                    message: format!("adapter {name} has a non-finite gradient ({norm}); stopped before any update"),
                }));
            }
            grad_norm.insert(name.clone(), norm);
        }
        let mut stepped = Vec::with_capacity(grads.len());
        for (name, g) in grads {
            let norm = grad_norm[&name];
            let agent = manager
                .agent_ids()
                .into_iter()
                .find(|a| manager.adapter_name(*a).map(|n| n == name).unwrap_or(false))
                .ok_or_else(|| TroupeError::Model(ModelError::UnknownAdapter { name: name.clone() }))?;
            let adapter = manager.adapter(agent)?;
            let mut state = self.states.get(&name).cloned().unwrap_or_default();
            let layout = FlatLayout::of(adapter);
            if layout.is_empty() {
                state.step += 1;
                stepped.push((agent, name, adapter.frozen(), state));
                continue;
            }
            let mut grad = layout.flatten_grads(&g);
            if self.max_grad_norm > 0.0 && norm > self.max_grad_norm {
                grad = grad * (self.max_grad_norm / norm);
            }
            let FlatStep { adapter: updated, params } = self.adamw.step_flat(adapter, &layout, grad, &mut state, lr);
            // The sum of the magnitudes of all the weights: NaN or infinite when any weight is
            // (one number read back from the device per step).
            let magnitude =
                f64::from(crate::readback::to_scalar(params.abs().sum(), crate::readback::Stage::Optimizer)?);
            if !magnitude.is_finite() {
                return Err(TroupeError::non_finite(format!(
                    "adapter {name}'s weights after the step at learning rate {lr:e} are not finite \
                     (sum of magnitudes {magnitude}); stopped before any adapter moved"
                )));
            }
            stepped.push((agent, name, updated, state));
        }
        for (agent, name, updated, state) in stepped {
            manager.set_adapter(agent, updated)?;
            self.states.insert(name, state);
        }
        Ok(grad_norm)
    }
}

/// The fraction of measured units whose importance ratio lay outside the clip range, when the
/// objective measured any.
pub fn clip_fraction(stats: &LossStats) -> Option<f64> {
    (stats.ratio_units > 0).then(|| stats.clipped_units as f64 / stats.ratio_units as f64)
}
