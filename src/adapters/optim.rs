//! AdamW, one state per adapter, written for the isolation guarantee: an adapter whose agent had
//! no rows in a step (no gradient) is skipped entirely, so its weights AND its moments stay
//! bit-for-bit as they were (weight decay and moment decay never touch it). burn's optimizers
//! step a whole module; this steps exactly the adapters that received a gradient.
//!
//! An adapter's weights, gradients and moments are stepped as one flat buffer
//! ([`FlatLayout`]): the same arithmetic per element as stepping each factor, in fourteen
//! operations per adapter rather than fourteen per factor.

use std::collections::BTreeMap;

use burn::tensor::{Device, Gradients, Tensor};

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

/// Elements each factor's place in a flat buffer is aligned to (256 bytes of f32), so that a
/// device backend can hand out a factor of the buffer as a view rather than a copy.
const ALIGN: usize = 64;

/// Where one factor lies in an adapter's flat buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FlatEntry {
    site: Site,
    /// `false` for `A`, `true` for `B`.
    is_b: bool,
    dims: [usize; 2],
    offset: usize,
}

impl FlatEntry {
    fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.dims[0] * self.dims[1]
    }
}

/// An adapter's factors laid end to end in one 1-D buffer (sites in order, `A` before `B`, each
/// start aligned), so that AdamW and gradient clipping run as a few operations over all of an
/// adapter's weights instead of a dozen per factor: on a GPU each operation is a kernel launch,
/// and an adapter has hundreds of factors (224 at `qwen3-0.6b` with q,k,v,o targeted). The
/// arithmetic per element is the same either way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    entries: Vec<FlatEntry>,
    /// The buffer's length, alignment padding included.
    len: usize,
}

impl FlatLayout {
    /// The layout of `adapter`'s factors.
    pub fn of(adapter: &LoraAdapter) -> Self {
        Self::from_shapes(adapter.pairs.iter().map(|(site, pair)| (*site, pair.a.dims(), pair.b.dims())))
    }

    /// The layout of factors with these shapes, per site: `A`'s and `B`'s.
    fn from_shapes(shapes: impl IntoIterator<Item = (Site, [usize; 2], [usize; 2])>) -> Self {
        let mut entries = Vec::new();
        let mut len = 0;
        for (site, a, b) in shapes {
            for (is_b, dims) in [(false, a), (true, b)] {
                entries.push(FlatEntry { site, is_b, dims, offset: len });
                len = (len + dims[0] * dims[1]).next_multiple_of(ALIGN);
            }
        }
        Self { entries, len }
    }

    /// The buffer's length, alignment padding included.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout holds no factor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// One tensor per factor, in the layout's order, laid into one buffer (zeros in the padding).
    ///
    /// # Shapes
    /// `factors`: the layout's factors' shapes, in its order -> `[len]`
    fn flatten(&self, factors: impl IntoIterator<Item = Tensor<2>>) -> Tensor<1> {
        let mut parts = Vec::with_capacity(self.entries.len());
        let mut end = 0;
        for (entry, factor) in self.entries.iter().zip(factors) {
            let device = factor.device();
            if entry.offset > end {
                parts.push(Tensor::zeros([entry.offset - end], &device));
            }
            let range = entry.range();
            end = range.end;
            parts.push(factor.reshape([range.len()]));
        }
        if self.len > end {
            let device = parts.first().map_or_else(Device::flex, |p: &Tensor<1>| p.device());
            parts.push(Tensor::zeros([self.len - end], &device));
        }
        Tensor::cat(parts, 0)
    }

    /// `grads` (one adapter's, every site of this layout) as one buffer.
    ///
    /// # Panics
    /// When `grads` lacks a site of the layout.
    pub fn flatten_grads(&self, grads: &AdapterGrads) -> Tensor<1> {
        self.flatten(self.entries.iter().map(|e| {
            let (a, b) = &grads[&e.site];
            if e.is_b {
                b.clone()
            } else {
                a.clone()
            }
        }))
    }

    /// `adapter`'s weights (outside autodiff) as one buffer.
    ///
    /// # Panics
    /// When `adapter` lacks a site of the layout.
    pub fn flatten_adapter(&self, adapter: &LoraAdapter) -> Tensor<1> {
        self.flatten(self.entries.iter().map(|e| {
            let pair = &adapter.pairs[&e.site];
            if e.is_b { pair.b.clone() } else { pair.a.clone() }.without_autodiff()
        }))
    }

    /// The factors of `flat`, per site (`A`, `B`): views of the buffer where the backend allows.
    ///
    /// # Shapes
    /// `flat`: `[len]` -> per site `[r, in]` and `[out, r]`
    fn unflatten(&self, flat: &Tensor<1>) -> BTreeMap<Site, (Tensor<2>, Tensor<2>)> {
        let mut out = BTreeMap::new();
        for pair in self.entries.chunks(2) {
            let factor = |e: &FlatEntry| flat.clone().slice([e.range()]).reshape(e.dims);
            out.insert(pair[0].site, (factor(&pair[0]), factor(&pair[1])));
        }
        out
    }
}

/// An adapter's AdamW moments, laid out as its weights are.
#[derive(Clone, Debug)]
struct FlatMoments {
    layout: FlatLayout,
    /// `[len]`
    m: Tensor<1>,
    /// `[len]`
    v: Tensor<1>,
}

/// One adapter's optimizer state.
#[derive(Clone, Debug, Default)]
pub struct AdamWState {
    /// Steps taken (bias correction uses it).
    pub step: u64,
    /// The moments of every factor (none before the first step).
    flat: Option<FlatMoments>,
}

impl AdamWState {
    /// A state of `step` steps with these moments (per site: `A`'s and `B`'s), as a checkpoint
    /// holds them.
    pub fn from_moments(step: u64, moments: &BTreeMap<Site, (Moments, Moments)>) -> Self {
        if moments.is_empty() {
            return Self { step, flat: None };
        }
        let layout = FlatLayout::from_shapes(moments.iter().map(|(site, (a, b))| (*site, a.m.dims(), b.m.dims())));
        let factors = |first: bool| {
            moments.values().flat_map(move |(a, b)| {
                let pick = |x: &Moments| if first { x.m.clone() } else { x.v.clone() };
                [pick(a), pick(b)]
            })
        };
        let (m, v) = (layout.flatten(factors(true)), layout.flatten(factors(false)));
        Self { step, flat: Some(FlatMoments { layout, m, v }) }
    }

    /// The moments per site (`A`'s and `B`'s); empty before the first step.
    pub fn moments(&self) -> BTreeMap<Site, (Moments, Moments)> {
        let Some(flat) = &self.flat else { return BTreeMap::new() };
        let (m, v) = (flat.layout.unflatten(&flat.m), flat.layout.unflatten(&flat.v));
        m.into_iter()
            .zip(v.into_values())
            .map(|((site, (ma, mb)), (va, vb))| (site, (Moments { m: ma, v: va }, Moments { m: mb, v: vb })))
            .collect()
    }

    /// The moments in `layout` (the adapter's): as held when the layouts agree; otherwise a
    /// factor keeps its moments where its site and shape are unchanged and starts at zero.
    fn moments_in(&self, layout: &FlatLayout, device: &Device) -> (Tensor<1>, Tensor<1>) {
        match &self.flat {
            Some(flat) if &flat.layout == layout => (flat.m.clone(), flat.v.clone()),
            None => (Tensor::zeros([layout.len], device), Tensor::zeros([layout.len], device)),
            Some(_) => {
                let old = self.moments();
                let keep = |e: &FlatEntry| {
                    old.get(&e.site)
                        .map(|(a, b)| if e.is_b { b } else { a })
                        .filter(|x| x.m.dims() == e.dims)
                        .cloned()
                        .unwrap_or_else(|| Moments {
                            m: Tensor::zeros(e.dims, device),
                            v: Tensor::zeros(e.dims, device),
                        })
                };
                let moments = layout.entries.chunks(2).map(|p| (p[0].site, (keep(&p[0]), keep(&p[1])))).collect();
                let flat = Self::from_moments(self.step, &moments).flat.expect("a layout with factors");
                (flat.m, flat.v)
            }
        }
    }
}

/// What one AdamW step gives: the updated adapter and its weights as one buffer.
#[derive(Clone, Debug)]
pub struct FlatStep {
    /// The adapter after the step (outside autodiff; its factors view `params`).
    pub adapter: LoraAdapter,
    /// `[len]`: every weight of `adapter`, in its [`FlatLayout`].
    pub params: Tensor<1>,
}

/// The gradients one adapter received: per site, dL/dA and dL/dB (outside autodiff).
pub type AdapterGrads = BTreeMap<Site, (Tensor<2>, Tensor<2>)>;

/// Reads the gradients of a trainable adapter's leaves. `None` when none of its tensors took
/// part in the loss (its agent had no rows).
pub fn adapter_grads(trainable: &LoraAdapter, grads: &Gradients) -> Option<AdapterGrads> {
    summed_adapter_grads(trainable, std::slice::from_ref(grads))
}

/// [`adapter_grads`] summed over several backward passes (activation checkpointing's, one a
/// decoder layer, each reaching only that layer's factors): a factor's gradients are added
/// where a pass holds one, and a factor no pass reaches is zero, filled once. `None` when no
/// pass reaches any of the adapter's tensors.
pub fn summed_adapter_grads(trainable: &LoraAdapter, sets: &[Gradients]) -> Option<AdapterGrads> {
    let sum = |t: &Tensor<2>| sets.iter().filter_map(|grads| t.grad(grads)).reduce(|acc, g| acc + g);
    let mut out = BTreeMap::new();
    let mut any = false;
    for (site, pair) in &trainable.pairs {
        let (ga, gb) = (sum(&pair.a), sum(&pair.b));
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

/// The squared L2 norm of all gradients of each adapter, read back from the device at once.
/// Each factor is summed on its own and the sums are added in f64, site by site.
///
/// # Errors
/// [`crate::TroupeError::Device`] when the device failed (the backward that made the gradients).
pub fn grad_norms_squared<'a>(grads: impl IntoIterator<Item = &'a AdapterGrads>) -> crate::Result<Vec<f64>> {
    let grads: Vec<&AdapterGrads> = grads.into_iter().collect();
    let sums: Vec<Tensor<1>> = grads
        .iter()
        .flat_map(|g| g.values())
        .flat_map(|(a, b)| [a.clone().square().sum(), b.clone().square().sum()])
        .collect();
    if sums.is_empty() {
        return Ok(vec![0.0; grads.len()]);
    }
    let sums = crate::readback::to_vec(Tensor::cat(sums, 0), crate::readback::Stage::Update)?;
    let mut next = sums.chunks_exact(2);
    Ok(grads.iter().map(|g| next.by_ref().take(g.len()).map(|ab| f64::from(ab[0]) + f64::from(ab[1])).sum()).collect())
}

impl AdamWConfig {
    /// One AdamW step of `adapter` (outside autodiff) with `grads` at learning rate `lr`,
    /// returning the updated adapter; `state` advances.
    pub fn step(&self, adapter: &LoraAdapter, grads: &AdapterGrads, state: &mut AdamWState, lr: f64) -> LoraAdapter {
        let layout = FlatLayout::of(adapter);
        let grad = (!layout.is_empty()).then(|| layout.flatten_grads(grads));
        match grad {
            Some(grad) => self.step_flat(adapter, &layout, grad, state, lr).adapter,
            None => {
                state.step += 1;
                adapter.frozen()
            }
        }
    }

    /// One AdamW step of `adapter`, whose layout is `layout` (not empty), with its gradients
    /// as one buffer: fourteen element-wise operations over all of its weights.
    ///
    /// # Shapes
    /// `grad`: `[layout.len()]`
    pub fn step_flat(
        &self,
        adapter: &LoraAdapter,
        layout: &FlatLayout,
        grad: Tensor<1>,
        state: &mut AdamWState,
        lr: f64,
    ) -> FlatStep {
        state.step += 1;
        let t = state.step as i32;
        let bias1 = 1.0 - self.beta1.powi(t);
        let bias2 = 1.0 - self.beta2.powi(t);
        let params = layout.flatten_adapter(adapter);
        let (m, v) = state.moments_in(layout, &grad.device());
        let m = m * self.beta1 + grad.clone() * (1.0 - self.beta1);
        let v = v * self.beta2 + grad.square() * (1.0 - self.beta2);
        let denom = (v.clone() / bias2).sqrt() + self.eps;
        let params = params * (1.0 - lr * self.weight_decay) - (m.clone() / denom) * (lr / bias1);
        let pairs = layout.unflatten(&params).into_iter().map(|(site, (a, b))| (site, LoraPair { a, b })).collect();
        state.flat = Some(FlatMoments { layout: layout.clone(), m, v });
        FlatStep { adapter: LoraAdapter { config: adapter.config.clone(), pairs }, params }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::adapters::AdapterConfig;
    use crate::model::Projection;

    fn random(rng: &mut ChaCha8Rng, dims: [usize; 2]) -> Tensor<2> {
        let values: Vec<f32> = (0..dims[0] * dims[1]).map(|_| rng.random_range(-1.0..1.0)).collect();
        Tensor::from_data(TensorData::new(values, dims), &Device::flex())
    }

    /// Factors whose sizes are not multiples of the alignment, so the buffer has padding.
    fn sites() -> Vec<(Site, [usize; 2], [usize; 2])> {
        vec![
            ((0, Projection::Q), [3, 10], [7, 3]),
            ((0, Projection::V), [3, 10], [5, 3]),
            ((1, Projection::O), [3, 7], [10, 3]),
        ]
    }

    fn adapter(rng: &mut ChaCha8Rng, sites: &[(Site, [usize; 2], [usize; 2])]) -> LoraAdapter {
        let pairs =
            sites.iter().map(|&(site, a, b)| (site, LoraPair { a: random(rng, a), b: random(rng, b) })).collect();
        LoraAdapter { config: AdapterConfig::default(), pairs }
    }

    fn grads(rng: &mut ChaCha8Rng, sites: &[(Site, [usize; 2], [usize; 2])]) -> AdapterGrads {
        sites.iter().map(|&(site, a, b)| (site, (random(rng, a), random(rng, b)))).collect()
    }

    fn bytes(t: &Tensor<2>) -> Vec<u8> {
        t.to_data().into_bytes().to_vec()
    }

    /// AdamW on one factor, operation by operation as the flat step does it.
    fn reference_update(
        config: &AdamWConfig,
        param: Tensor<2>,
        grad: Tensor<2>,
        moments: &mut Moments,
        lr: f64,
        step: i32,
    ) -> Tensor<2> {
        let (bias1, bias2) = (1.0 - config.beta1.powi(step), 1.0 - config.beta2.powi(step));
        moments.m = moments.m.clone() * config.beta1 + grad.clone() * (1.0 - config.beta1);
        moments.v = moments.v.clone() * config.beta2 + grad.square() * (1.0 - config.beta2);
        let denom = (moments.v.clone() / bias2).sqrt() + config.eps;
        param * (1.0 - lr * config.weight_decay) - (moments.m.clone() / denom) * (lr / bias1)
    }

    #[test]
    fn the_flat_step_is_the_per_factor_step_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let sites = sites();
        let layout = FlatLayout::from_shapes(sites.clone());
        assert!(layout.len() > sites.iter().map(|(_, a, b)| a[0] * a[1] + b[0] * b[1]).sum::<usize>(), "padded");
        let config = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
        let mut flat = adapter(&mut rng, &sites);
        let mut reference = flat.clone();
        let mut state = AdamWState::default();
        let mut moments: BTreeMap<Site, (Moments, Moments)> = BTreeMap::new();
        for step in 1..=3 {
            let g = grads(&mut rng, &sites);
            let lr = 1e-2 * f64::from(step);
            flat = config.step(&flat, &g, &mut state, lr);
            let mut pairs = BTreeMap::new();
            for (site, pair) in &reference.pairs {
                let zeros = |t: &Tensor<2>| Moments { m: t.zeros_like(), v: t.zeros_like() };
                let (ma, mb) = moments.entry(*site).or_insert_with(|| (zeros(&pair.a), zeros(&pair.b)));
                let a = reference_update(&config, pair.a.clone(), g[site].0.clone(), ma, lr, step);
                let b = reference_update(&config, pair.b.clone(), g[site].1.clone(), mb, lr, step);
                pairs.insert(*site, LoraPair { a, b });
            }
            reference = LoraAdapter { config: reference.config.clone(), pairs };
            assert_eq!(state.step, step as u64);
            for (site, pair) in &reference.pairs {
                assert_eq!(pair.a.dims(), flat.pairs[site].a.dims());
                assert_eq!(bytes(&pair.a), bytes(&flat.pairs[site].a), "step {step} {site:?} A");
                assert_eq!(bytes(&pair.b), bytes(&flat.pairs[site].b), "step {step} {site:?} B");
            }
            let held = state.moments();
            assert_eq!(held.len(), moments.len());
            for (site, (a, b)) in &moments {
                let (ha, hb) = &held[site];
                for (want, got) in [(&a.m, &ha.m), (&a.v, &ha.v), (&b.m, &hb.m), (&b.v, &hb.v)] {
                    assert_eq!(bytes(want), bytes(got), "step {step} {site:?} moments");
                }
            }
        }
    }

    #[test]
    fn moments_round_trip_and_survive_a_new_site() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let sites = sites();
        let config = AdamWConfig::default();
        let start = adapter(&mut rng, &sites);
        let mut state = AdamWState::default();
        let stepped = config.step(&start, &grads(&mut rng, &sites), &mut state, 1e-2);
        // Through a checkpoint's form and back, the next step is the same.
        let mut restored = AdamWState::from_moments(state.step, &state.moments());
        let g = grads(&mut rng, &sites);
        let (mut kept, mut copy) = (state.clone(), restored.clone());
        let a = config.step(&stepped, &g, &mut kept, 1e-2);
        let b = config.step(&stepped, &g, &mut copy, 1e-2);
        for site in a.pairs.keys() {
            assert_eq!(bytes(&a.pairs[site].a), bytes(&b.pairs[site].a));
            assert_eq!(bytes(&a.pairs[site].b), bytes(&b.pairs[site].b));
        }
        // An adapter with one more site: the old sites keep their moments, the new one starts at zero.
        let mut grown_sites = sites.clone();
        grown_sites.push(((1, Projection::K), [3, 7], [4, 3]));
        let grown = adapter(&mut rng, &grown_sites);
        let layout = FlatLayout::of(&grown);
        let (m, v) = restored.moments_in(&layout, &Device::flex());
        restored.flat = Some(FlatMoments { layout, m, v });
        let before = state.moments();
        let after = restored.moments();
        for (site, (a, b)) in &before {
            assert_eq!(bytes(&a.m), bytes(&after[site].0.m));
            assert_eq!(bytes(&b.v), bytes(&after[site].1.v));
        }
        let new = &after[&(1, Projection::K)];
        assert!(
            new.0.m.clone().abs().sum().into_scalar::<f32>() == 0.0
                && new.1.v.clone().abs().sum().into_scalar::<f32>() == 0.0
        );
    }

    #[test]
    fn norms_are_read_per_adapter() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let sites = sites();
        let (g1, g2) = (grads(&mut rng, &sites), grads(&mut rng, &sites[..1]));
        let by_hand = |g: &AdapterGrads| -> f64 {
            g.values()
                .map(|(a, b)| {
                    let sq = |t: &Tensor<2>| -> f64 {
                        t.to_data().try_to_vec::<f32>().unwrap().iter().map(|v| f64::from(*v) * f64::from(*v)).sum()
                    };
                    sq(a) + sq(b)
                })
                .sum()
        };
        let norms = grad_norms_squared([&g1, &g2]).unwrap();
        assert_eq!(norms.len(), 2);
        for (got, want) in norms.iter().zip([by_hand(&g1), by_hand(&g2)]) {
            assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
        }
    }

    #[test]
    fn several_passes_gradients_sum_per_factor_and_are_zero_where_none_reaches() {
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        let sites = sites();
        let mut trainable = adapter(&mut rng, &sites);
        for pair in trainable.pairs.values_mut() {
            pair.a = pair.a.clone().autodiff().require_grad();
            pair.b = pair.b.clone().autodiff().require_grad();
        }
        let w = grads(&mut rng, &sites);
        let (s0, s1, s2) = (sites[0].0, sites[1].0, sites[2].0);
        let p = &trainable.pairs;
        let weighted = |t: &Tensor<2>, w: &Tensor<2>| (t.clone() * w.clone().autodiff()).sum();
        // A pass reaching none of the adapter's factors.
        let elsewhere =
            || (Tensor::<2>::ones([2, 2], &Device::flex()).autodiff().require_grad() * 3.0).sum().backward();
        let passes = [
            weighted(&p[&s0].a, &w[&s0].0).backward(),
            elsewhere(),
            (weighted(&p[&s0].b, &w[&s0].1) + weighted(&p[&s1].a, &w[&s1].0)).backward(),
            (weighted(&p[&s0].a, &w[&s0].0) * 2.0).backward(),
        ];
        let summed = summed_adapter_grads(&trainable, &passes).expect("some pass reaches the adapter");
        let values = |t: &Tensor<2>| t.to_data().try_to_vec::<f32>().unwrap();
        let close = |got: &Tensor<2>, want: Vec<f32>, what: &str| {
            let got = values(got);
            assert_eq!(got.len(), want.len(), "{what}");
            assert!(got.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 1e-6), "{what}: {got:?} vs {want:?}");
        };
        close(&summed[&s0].0, values(&w[&s0].0).iter().map(|v| 3.0 * v).collect(), "A of the first site, twice");
        close(&summed[&s0].1, values(&w[&s0].1), "B of the first site");
        close(&summed[&s1].0, values(&w[&s1].0), "A of the second site");
        for (t, what) in [
            (&summed[&s1].1, "B of the second site"),
            (&summed[&s2].0, "A of the third"),
            (&summed[&s2].1, "B of the third"),
        ] {
            close(t, vec![0.0; t.dims().iter().product()], what);
        }
        // One pass alone is what `adapter_grads` reads; none reaching the adapter gives nothing.
        let once = adapter_grads(&trainable, &passes[2]).unwrap();
        assert_eq!(values(&once[&s1].0), values(&w[&s1].0));
        assert!(summed_adapter_grads(&trainable, &[elsewhere()]).is_none());
        assert!(summed_adapter_grads(&trainable, &[]).is_none());
    }
}
