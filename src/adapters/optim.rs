//! AdamW, one state per adapter, written for the isolation guarantee: an adapter whose agent had
//! no rows in a step (no gradient) is skipped entirely, so its weights AND its moments stay
//! bit-for-bit as they were (weight decay and moment decay never touch it). burn's optimizers
//! step a whole module; this steps exactly the adapters that received a gradient.

use std::collections::BTreeMap;

use burn::tensor::{Gradients, Tensor};

use super::lora::{LoraAdapter, LoraPair, Site};

crate::section::config_section! {
    /// AdamW hyper-parameters: PyTorch's betas and epsilon; no weight decay, as TRL's and
    /// transformers' trainers default. A run's `training.optimizer:` section.
    pub struct AdamWConfig {
        /// Peak learning rate (after the warm-up; `training.lr_final_fraction` sets the decay).
        pub lr: f64 = 1e-4,
        /// First-moment decay, in [0, 1).
        pub beta1: f64 = 0.9,
        /// Second-moment decay, in [0, 1).
        pub beta2: f64 = 0.999,
        /// Added to the denominator.
        pub eps: f64 = 1e-8,
        /// Decoupled weight decay.
        pub weight_decay: f64 = 0.0,
    }
}

/// The moments of one factor.
#[derive(Clone, Debug)]
pub struct Moments {
    /// First moment (same shape as the factor).
    pub m: Tensor<2>,
    /// Second moment.
    pub v: Tensor<2>,
}

/// One adapter's optimizer state.
#[derive(Clone, Debug, Default)]
pub struct AdamWState {
    /// Steps taken (bias correction uses it).
    pub step: u64,
    /// Per site: the moments of A and of B.
    pub moments: BTreeMap<Site, (Moments, Moments)>,
}

/// The gradients one adapter received: per site, dL/dA and dL/dB (outside autodiff).
pub type AdapterGrads = BTreeMap<Site, (Tensor<2>, Tensor<2>)>;

/// Reads the gradients of a trainable adapter's leaves. `None` when none of its tensors took
/// part in the loss (its agent had no rows).
pub fn adapter_grads(trainable: &LoraAdapter, grads: &Gradients) -> Option<AdapterGrads> {
    let mut out = BTreeMap::new();
    let mut any = false;
    for (site, pair) in &trainable.pairs {
        let ga = pair.a.grad(grads);
        let gb = pair.b.grad(grads);
        any |= ga.is_some() || gb.is_some();
        let zeros = |t: &Tensor<2>| Tensor::zeros(t.dims(), &t.device()).without_autodiff();
        out.insert(*site, (ga.unwrap_or_else(|| zeros(&pair.a)), gb.unwrap_or_else(|| zeros(&pair.b))));
    }
    any.then_some(out)
}

/// All-zero gradients for every factor of `adapter` (outside autodiff): what
/// [`adapter_grads`] reads for an adapter whose rows all had a zero loss weight.
pub fn zero_grads(adapter: &LoraAdapter) -> AdapterGrads {
    let zeros = |t: &Tensor<2>| Tensor::zeros(t.dims(), &t.device()).without_autodiff();
    adapter.pairs.iter().map(|(site, pair)| (*site, (zeros(&pair.a), zeros(&pair.b)))).collect()
}

/// Squared L2 norm of all gradients of one adapter.
pub fn grad_norm_squared(grads: &AdapterGrads) -> f64 {
    grads
        .values()
        .map(|(a, b)| {
            let sa: f32 = a.clone().square().sum().into_scalar();
            let sb: f32 = b.clone().square().sum().into_scalar();
            f64::from(sa) + f64::from(sb)
        })
        .sum()
}

/// Scales every gradient by `factor` (gradient clipping).
pub fn scale_grads(grads: AdapterGrads, factor: f64) -> AdapterGrads {
    grads.into_iter().map(|(site, (a, b))| (site, (a * factor, b * factor))).collect()
}

impl AdamWConfig {
    /// One AdamW step of `adapter` (outside autodiff) with `grads` at learning rate `lr`,
    /// returning the updated adapter; `state` advances.
    pub fn step(&self, adapter: &LoraAdapter, grads: &AdapterGrads, state: &mut AdamWState, lr: f64) -> LoraAdapter {
        state.step += 1;
        let t = state.step as i32;
        let bias1 = 1.0 - self.beta1.powi(t);
        let bias2 = 1.0 - self.beta2.powi(t);
        let mut pairs = BTreeMap::new();
        for (site, pair) in &adapter.pairs {
            let (ga, gb) = &grads[site];
            let zeros = |t: &Tensor<2>| Moments { m: t.zeros_like(), v: t.zeros_like() };
            let (ma, mb) = state.moments.entry(*site).or_insert_with(|| (zeros(&pair.a), zeros(&pair.b)));
            let a = self.update(pair.a.clone().without_autodiff(), ga.clone(), ma, lr, bias1, bias2);
            let b = self.update(pair.b.clone().without_autodiff(), gb.clone(), mb, lr, bias1, bias2);
            pairs.insert(*site, LoraPair { a, b });
        }
        LoraAdapter { config: adapter.config.clone(), pairs }
    }

    fn update(
        &self,
        param: Tensor<2>,
        grad: Tensor<2>,
        moments: &mut Moments,
        lr: f64,
        bias1: f64,
        bias2: f64,
    ) -> Tensor<2> {
        moments.m = moments.m.clone() * self.beta1 + grad.clone() * (1.0 - self.beta1);
        moments.v = moments.v.clone() * self.beta2 + grad.square() * (1.0 - self.beta2);
        let denom = (moments.v.clone() / bias2).sqrt() + self.eps;
        param * (1.0 - lr * self.weight_decay) - (moments.m.clone() / denom) * (lr / bias1)
    }
}
