//! Mixed-adapter batches: one forward pass in which every row uses its own adapter (or none).
//!
//! For each targeted site, the factors of the adapters targeting it are stacked along the rank,
//! `A`: `[R, in]` and `B` (each adapter's block scaled by its own scale): `[out, R]`, where `R`
//! is the sum of their ranks, and the update is two products over the whole batch with a 0/1
//! mask between them that keeps, in each row, only the rank columns of that row's adapter:
//! `delta[row] = ((x[row] A^T) * mask[row]) B^T`. However many adapters are mixed, a site costs
//! two products and one multiply, the factors are stacked once per batch (not copied per row;
//! [`StackedFactors`] lets a caller whose adapters do not change stack them once for all its
//! batches), and rows without an adapter have an all-zero mask row. The mask's zeros stop every
//! gradient between a row and the factors of another adapter: each adapter's factors are given
//! exactly the sums of its own rows' gradients, which is what isolates agents' gradients by
//! construction.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::lora::{LoraAdapter, Site};
use crate::model::fused::batched_matmul;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
use crate::model::fused::gpu;
use crate::model::{LowRank, ModelConfig, Projection, ProjectionDelta};

/// The update factors of one site for the whole batch.
#[derive(Clone, Debug)]
enum SiteFactors {
    /// Every row uses the same adapter: `a`: `[r, in]`, `b_scaled`: `[out, r]`.
    Shared { a: Tensor<2>, b_scaled: Tensor<2> },
    /// Rows differ: the targeting adapters' factors stacked along the rank, `a`: `[R, in]`,
    /// `b_scaled`: `[out, R]`, and which of [`MixedLora::masks`] selects each row's columns.
    Stacked { a: Tensor<2>, b_scaled: Tensor<2>, mask: usize },
}

/// Training-time dropout on the adapters' input, with each row's own rate.
struct Dropout {
    /// Per row: the dropout probability of that row's adapter (0 for rows without one).
    rates: Vec<f64>,
    rng: RefCell<ChaCha8Rng>,
}

/// A [`ProjectionDelta`] applying a per-row choice of LoRA adapters.
pub struct MixedLora {
    /// The adapters' factors at every site, shared by batches over the same adapters.
    factors: Arc<StackedFactors>,
    /// One `[batch, R]` 0/1 mask per distinct list of stacked adapters (sites targeted by the
    /// same adapters share one): row `i` keeps the rank columns of its own adapter.
    masks: Vec<Tensor<2>>,
    /// Per row: the index of its adapter among those given to [`MixedLora::new`], or `None`.
    rows: Vec<Option<usize>>,
    dropout: Option<Dropout>,
    device: Device,
}

/// Every site's factors for one list of adapters: the part of a [`MixedLora`] that does not
/// depend on which row uses which adapter. A caller that keeps its adapters unchanged builds it
/// once and gives it to every batch over them ([`MixedLora::with_factors`]), so the factors are
/// stacked and scaled once, not at every decision round of a rollout.
#[derive(Clone, Debug)]
pub struct StackedFactors {
    sites: HashMap<Site, SiteFactors>,
    /// Per layer: its q, k and v sites' factors joined into one, where [`StackedFactors::joined`]
    /// joined them.
    joints: HashMap<usize, SiteFactors>,
    /// Per distinct list of stacked adapters, in the order the sites first use it: the list and
    /// each adapter's rank (its rank mask's layout).
    stackings: Vec<(Vec<usize>, Vec<usize>)>,
    /// The adapter every row uses, when every row uses the same one.
    shared: Option<usize>,
}

/// The scales of a stacked `B`'s rank columns: one for all, or `[1, R]`, each column its
/// adapter's.
// A handful per batch, one per list of stacked adapters: the tensor handle's size is no matter.
#[allow(clippy::large_enum_variant)]
enum ColumnScale {
    Uniform(f32),
    PerColumn(Tensor<2>),
}

/// The `[rows.len(), R]` 0/1 mask for the adapters `stacked` (stacked in that order, with ranks
/// `ranks`): row `i` has ones in the columns of adapter `rows[i]`, zeros elsewhere.
fn rank_mask(stacked: &[usize], ranks: &[usize], rows: &[Option<usize>], device: &Device) -> Tensor<2> {
    let width: usize = ranks.iter().sum();
    let mut values = vec![0.0f32; rows.len() * width];
    for (row, adapter) in rows.iter().enumerate() {
        let Some(adapter) = adapter else { continue };
        let mut start = 0;
        for (&k, &r) in stacked.iter().zip(ranks) {
            if k == *adapter {
                values[row * width + start..row * width + start + r].fill(1.0);
            }
            start += r;
        }
    }
    Tensor::from_data(TensorData::new(values, [rows.len(), width]), device)
}

impl StackedFactors {
    /// The adapters a batch with these rows uses (sorted, distinct), and the one every row uses
    /// if every row uses the same one.
    pub fn layout(rows: &[Option<usize>]) -> (Vec<usize>, Option<usize>) {
        let mut used: Vec<usize> = rows.iter().flatten().copied().collect();
        used.sort_unstable();
        used.dedup();
        let shared = match used.as_slice() {
            [only] if rows.iter().all(|r| r.is_some()) => Some(*only),
            _ => None,
        };
        (used, shared)
    }

    /// The factors of `adapters[k]` for each `k` in `used` (sorted, distinct), at every site
    /// one of them targets: stacked along the rank (each `B` scaled by its adapter's scale), or,
    /// when `shared`, that one adapter's `A` and scaled `B`. Differentiable: gradients reach the
    /// adapters' tensors.
    pub fn new(
        adapters: &[&LoraAdapter],
        used: &[usize],
        shared: Option<usize>,
        base: &ModelConfig,
        device: &Device,
    ) -> Self {
        let mut sites = HashMap::new();
        let mut stackings = Vec::new();
        // By list of stacked adapters: its index in `stackings`, and its columns' scales.
        let mut stacking: HashMap<Vec<usize>, (usize, ColumnScale)> = HashMap::new();
        for layer in 0..base.num_hidden_layers {
            for projection in Projection::ALL {
                let site = (layer, projection);
                let targeting: Vec<usize> =
                    used.iter().copied().filter(|&k| adapters[k].pairs.contains_key(&site)).collect();
                if targeting.is_empty() {
                    continue;
                }
                if let Some(k) = shared {
                    let pair = &adapters[k].pairs[&site];
                    let scale = adapters[k].config.scale();
                    sites.insert(site, SiteFactors::Shared { a: pair.a.clone(), b_scaled: pair.b.clone() * scale });
                    continue;
                }
                let (mask, scale) = stacking.entry(targeting.clone()).or_insert_with(|| {
                    let ranks: Vec<usize> = targeting.iter().map(|&k| adapters[k].config.r).collect();
                    let scales: Vec<f32> = targeting.iter().map(|&k| adapters[k].config.scale() as f32).collect();
                    let scale = if scales.iter().all(|&s| s == scales[0]) {
                        ColumnScale::Uniform(scales[0])
                    } else {
                        let per_column: Vec<f32> =
                            scales.iter().zip(&ranks).flat_map(|(&s, &r)| std::iter::repeat_n(s, r)).collect();
                        let width = per_column.len();
                        ColumnScale::PerColumn(Tensor::from_data(TensorData::new(per_column, [1, width]), device))
                    };
                    stackings.push((targeting.clone(), ranks));
                    (stackings.len() - 1, scale)
                });
                let pairs: Vec<_> = targeting.iter().map(|&k| &adapters[k].pairs[&site]).collect();
                let a = Tensor::cat(pairs.iter().map(|p| p.a.clone()).collect(), 0);
                let b = Tensor::cat(pairs.iter().map(|p| p.b.clone()).collect(), 1);
                // Each B scaled by its adapter's scale, element by element as `b * scale`.
                let b_scaled = match scale {
                    ColumnScale::Uniform(scale) => b * *scale,
                    ColumnScale::PerColumn(scales) => b * scales.clone(),
                };
                let mask = *mask;
                sites.insert(site, SiteFactors::Stacked { a, b_scaled, mask });
            }
        }
        Self { sites, stackings, joints: HashMap::new(), shared }
    }

    /// The same factors, with each layer's q, k and v sites also joined into one (used by
    /// [`ProjectionDelta::joint_delta`]): `A` the sites' `A`s stacked along the rank, `B` their
    /// scaled `B`s on the diagonal of a block matrix, `[q + k + v, R_q + R_k + R_v]`, zeros
    /// elsewhere (all-zero rows for a part no adapter targets), and for mixed rows one rank mask
    /// over the three sites' columns. A layer's three deltas then cost two products, one
    /// multiply and one add to the stacked q/k/v output, instead of that for each site: a
    /// decoding step on a GPU is bound by its kernel launches. A layer is joined where at least
    /// two of its three sites are targeted and the joined rank is at most
    /// `max(hidden / 8, 64)`, so that the block matrix's zeros cost little beside the q/k/v
    /// product. For constant factors: the joint ones are outside autodiff.
    pub fn joined(mut self, base: &ModelConfig, device: &Device) -> Self {
        let max_rank = (base.hidden_size / 8).max(64);
        for layer in 0..base.num_hidden_layers {
            let parts: Vec<(Option<&SiteFactors>, usize)> =
                JOINED.iter().map(|&p| (self.sites.get(&(layer, p)), p.dims(base).1)).collect();
            let targeted: Vec<&SiteFactors> = parts.iter().filter_map(|(f, _)| *f).collect();
            let rank: usize = targeted.iter().map(|f| f.a().dims()[0]).sum();
            if targeted.len() < 2 || rank > max_rank {
                continue;
            }
            let a = Tensor::cat(targeted.iter().map(|f| f.a().clone().without_autodiff()).collect(), 0);
            let mut before = 0;
            let rows: Vec<Tensor<2>> = parts
                .iter()
                .map(|&(factors, width)| {
                    let Some(factors) = factors else { return Tensor::zeros([width, rank], device) };
                    let b = factors.b_scaled().clone().without_autodiff();
                    let r = b.dims()[1];
                    let mut pieces = Vec::with_capacity(3);
                    if before > 0 {
                        pieces.push(Tensor::zeros([width, before], device));
                    }
                    pieces.push(b);
                    if before + r < rank {
                        pieces.push(Tensor::zeros([width, rank - before - r], device));
                    }
                    before += r;
                    Tensor::cat(pieces, 1)
                })
                .collect();
            let b_scaled = Tensor::cat(rows, 0);
            let joint = match targeted[0] {
                SiteFactors::Shared { .. } => SiteFactors::Shared { a, b_scaled },
                SiteFactors::Stacked { .. } => {
                    // The mask of the sites' stackings side by side, in their order.
                    let (mut list, mut ranks) = (Vec::new(), Vec::new());
                    for factors in &targeted {
                        if let SiteFactors::Stacked { mask, .. } = factors {
                            list.extend_from_slice(&self.stackings[*mask].0);
                            ranks.extend_from_slice(&self.stackings[*mask].1);
                        }
                    }
                    let mask = match self.stackings.iter().position(|(l, r)| *l == list && *r == ranks) {
                        Some(index) => index,
                        None => {
                            self.stackings.push((list, ranks));
                            self.stackings.len() - 1
                        }
                    };
                    SiteFactors::Stacked { a, b_scaled, mask }
                }
            };
            self.joints.insert(layer, joint);
        }
        self
    }
}

/// The sites [`StackedFactors::joined`] joins, in the order the model stacks their projection.
const JOINED: [Projection; 3] = [Projection::Q, Projection::K, Projection::V];

impl SiteFactors {
    /// `A`: `[R, in]`.
    fn a(&self) -> &Tensor<2> {
        match self {
            SiteFactors::Shared { a, .. } | SiteFactors::Stacked { a, .. } => a,
        }
    }

    /// The scaled `B`: `[out, R]`.
    fn b_scaled(&self) -> &Tensor<2> {
        match self {
            SiteFactors::Shared { b_scaled, .. } | SiteFactors::Stacked { b_scaled, .. } => b_scaled,
        }
    }
}

impl MixedLora {
    /// Prepares the factors for a batch where row `i` uses `adapters[rows[i]]`, or no adapter
    /// when `rows[i]` is `None`. Differentiable: gradients reach the adapters' tensors.
    pub fn new(adapters: &[&LoraAdapter], rows: &[Option<usize>], base: &ModelConfig, device: &Device) -> Self {
        let (used, shared) = StackedFactors::layout(rows);
        let factors = StackedFactors::new(adapters, &used, shared, base, device);
        Self::with_factors(Arc::new(factors), rows, device)
    }

    /// A batch over factors built for its rows' [`StackedFactors::layout`] (the same adapters,
    /// the same shared one; checked in debug builds): only the rows' rank masks are made.
    pub fn with_factors(factors: Arc<StackedFactors>, rows: &[Option<usize>], device: &Device) -> Self {
        debug_assert!(
            factors.shared.is_none_or(|k| rows.iter().all(|r| *r == Some(k))),
            "factors shared by every row need rows that all use their adapter"
        );
        let masks = factors.stackings.iter().map(|(stacked, ranks)| rank_mask(stacked, ranks, rows, device)).collect();
        Self { factors, masks, rows: rows.to_vec(), dropout: None, device: device.clone() }
    }

    /// Applies dropout to the adapters' input (training only): row `i` with probability
    /// `rates[i]` (its adapter's `lora_dropout`), masks drawn from a `ChaCha8Rng` seeded with
    /// `seed`. The base path never sees dropout.
    pub fn with_dropout(mut self, rates: Vec<f64>, seed: u64) -> Self {
        if rates.iter().any(|p| *p > 0.0) {
            self.dropout = Some(Dropout { rates, rng: RefCell::new(ChaCha8Rng::seed_from_u64(seed)) });
        }
        self
    }

    fn dropped(&self, x: &Tensor<3>) -> Tensor<3> {
        let Some(dropout) = &self.dropout else { return x.clone() };
        let dims = x.dims();
        let per_row = dims[1] * dims[2];
        let mut rng = dropout.rng.borrow_mut();
        let mut mask = Vec::with_capacity(dims[0] * per_row);
        for row in 0..dims[0] {
            let keep = 1.0 - dropout.rates.get(row).copied().unwrap_or(0.0);
            mask.extend((0..per_row).map(|_| if rng.random::<f64>() < keep { (1.0 / keep) as f32 } else { 0.0 }));
        }
        x.clone() * Tensor::<3>::from_data(TensorData::new(mask, dims), &self.device)
    }
}

impl MixedLora {
    /// [`ProjectionDelta::delta`], with the factors outside autodiff unless `tracked`.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in]` -> `[batch, seq, out]`
    fn delta_of(&self, layer: usize, projection: Projection, x: &Tensor<3>, tracked: bool) -> Option<Tensor<3>> {
        let factors = self.factors.sites.get(&(layer, projection))?;
        Some(self.apply(factors, self.dropped(x), tracked, None))
    }

    /// [`ProjectionDelta::low_rank`], with the factors outside autodiff unless `tracked`: none
    /// under dropout, for an input under autodiff or where the factors stay in the graph.
    fn low_rank_of(&self, layer: usize, projection: Projection, x: &Tensor<3>, tracked: bool) -> Option<LowRank> {
        if x.is_autodiff() || self.dropout.is_some() {
            return None;
        }
        let factors = self.factors.sites.get(&(layer, projection))?;
        let plain = |t: &Tensor<2>| if tracked { t.clone() } else { t.clone().without_autodiff() };
        let (a, b_scaled) = (plain(factors.a()), plain(factors.b_scaled()));
        if a.is_autodiff() || b_scaled.is_autodiff() {
            return None;
        }
        let mask = match factors {
            SiteFactors::Shared { .. } => None,
            SiteFactors::Stacked { mask, .. } => Some(self.masks[*mask].clone()),
        };
        Some(LowRank { a, b_scaled, mask })
    }

    /// [`ProjectionDelta::joint_delta`] for the q/k/v parts: the layer's joint factors
    /// ([`StackedFactors::joined`]), for an input outside autodiff and without dropout.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in]` -> `[batch, seq, q + k + v]`
    fn joint_of(&self, layer: usize, parts: &[(Projection, usize)], x: &Tensor<3>) -> Option<Tensor<3>> {
        let factors = self.joint_factors(layer, parts, x)?;
        Some(self.apply(factors, x.clone(), false, None))
    }

    /// [`ProjectionDelta::joint_sum`] for the q/k/v parts: `base()` plus [`MixedLora::joint_of`]'s
    /// delta, one kernel for both over a decoding step's few rows on a GPU.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in]`, `base()`: `[batch, seq, q + k + v]` -> like `base()`
    fn joint_sum_of(
        &self,
        layer: usize,
        parts: &[(Projection, usize)],
        x: &Tensor<3>,
        base: &dyn Fn() -> Tensor<3>,
    ) -> Option<Tensor<3>> {
        let factors = self.joint_factors(layer, parts, x)?;
        let base = base();
        Some(self.apply(factors, x.clone(), false, Some(base)))
    }

    /// The layer's joint q/k/v factors, where they apply to `x`: outside autodiff, without
    /// dropout, for exactly the q/k/v parts whose widths the factors give.
    fn joint_factors(&self, layer: usize, parts: &[(Projection, usize)], x: &Tensor<3>) -> Option<&SiteFactors> {
        if x.is_autodiff() || self.dropout.is_some() || !parts.iter().map(|&(p, _)| p).eq(JOINED) {
            return None;
        }
        let factors = self.factors.joints.get(&layer)?;
        let width: usize = parts.iter().map(|&(_, width)| width).sum();
        (factors.b_scaled().dims()[0] == width).then_some(factors)
    }

    /// `((x A^T) * mask) B_scaled^T` for one site's (or a joint's) factors, with the factors
    /// outside autodiff unless `tracked`, added to `base` when given.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in]`, `base`: `[batch, seq, out]` -> `[batch, seq, out]`
    fn apply(&self, factors: &SiteFactors, x: Tensor<3>, tracked: bool, base: Option<Tensor<3>>) -> Tensor<3> {
        let plain = |t: &Tensor<2>| if tracked { t.clone() } else { t.clone().without_autodiff() };
        let [batch, seq, fan_in] = x.dims();
        let (a, b_scaled, mask) = match factors {
            SiteFactors::Shared { a, b_scaled } => (plain(a), plain(b_scaled), None),
            SiteFactors::Stacked { a, b_scaled, mask } => (plain(a), plain(b_scaled), Some(&self.masks[*mask])),
        };
        let [rank, _] = a.dims();
        let out = b_scaled.dims()[0];
        // A decoding step's few rows on a GPU: one kernel for the two products and the mask.
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        if batch * seq <= gpu::LORA_DELTA_MAX_ROWS {
            let rows = x.clone().reshape([batch * seq, fan_in]);
            let onto = base.as_ref().map(|b| b.clone().reshape([batch * seq, out]));
            if gpu::lora_delta_takes(&rows, &a, &b_scaled, mask, onto.as_ref()) {
                return gpu::lora_delta(&rows, &a, &b_scaled, mask, seq, onto.as_ref()).reshape([batch, seq, out]);
            }
        }
        // [1, batch * seq, in] x [1, in, R] -> [1, batch * seq, R]
        let down = batched_matmul(x.reshape([1, batch * seq, fan_in]), a.transpose().unsqueeze());
        let down = match mask {
            Some(mask) => {
                (down.reshape([batch, seq, rank]) * mask.clone().unsqueeze_dim(1)).reshape([1, batch * seq, rank])
            }
            None => down,
        };
        let delta = batched_matmul(down, b_scaled.transpose().unsqueeze()).reshape([batch, seq, out]);
        match base {
            Some(base) => base + delta,
            None => delta,
        }
    }
}

/// A [`MixedLora`] computed outside autodiff ([`ProjectionDelta::untracked`]).
struct Untracked<'a>(&'a MixedLora);

impl ProjectionDelta for Untracked<'_> {
    fn delta(&self, layer: usize, projection: Projection, x: &Tensor<3>) -> Option<Tensor<3>> {
        self.0.delta_of(layer, projection, x, false)
    }

    fn joint_delta(&self, layer: usize, parts: &[(Projection, usize)], x: &Tensor<3>) -> Option<Tensor<3>> {
        self.0.joint_of(layer, parts, x)
    }

    fn low_rank(&self, layer: usize, projection: Projection, x: &Tensor<3>) -> Option<LowRank> {
        self.0.low_rank_of(layer, projection, x, false)
    }

    fn joint_sum(
        &self,
        layer: usize,
        parts: &[(Projection, usize)],
        x: &Tensor<3>,
        base: &dyn Fn() -> Tensor<3>,
    ) -> Option<Tensor<3>> {
        self.0.joint_sum_of(layer, parts, x, base)
    }

    fn random_position(&self) -> Option<u128> {
        self.0.random_position()
    }

    fn rewind(&self, position: u128) {
        self.0.rewind(position);
    }
}

impl ProjectionDelta for MixedLora {
    /// # Shapes
    /// `x`: `[batch, seq, in]` -> `[batch, seq, out]`
    fn delta(&self, layer: usize, projection: Projection, x: &Tensor<3>) -> Option<Tensor<3>> {
        self.delta_of(layer, projection, x, true)
    }

    /// The q/k/v parts' deltas as one, where the factors were joined ([`StackedFactors::joined`])
    /// and `x` is outside autodiff, without dropout.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in]` -> `[batch, seq, q + k + v]`
    fn joint_delta(&self, layer: usize, parts: &[(Projection, usize)], x: &Tensor<3>) -> Option<Tensor<3>> {
        self.joint_of(layer, parts, x)
    }

    /// The site's factors, where they and `x` are outside autodiff, without dropout.
    fn low_rank(&self, layer: usize, projection: Projection, x: &Tensor<3>) -> Option<LowRank> {
        self.low_rank_of(layer, projection, x, true)
    }

    /// The q/k/v parts' stacked output plus their joint delta, one kernel for the delta and the
    /// sum over a decoding step's few rows on a GPU.
    ///
    /// # Shapes
    /// `x`: `[batch, seq, in]`, `base()`: `[batch, seq, q + k + v]` -> like `base()`
    fn joint_sum(
        &self,
        layer: usize,
        parts: &[(Projection, usize)],
        x: &Tensor<3>,
        base: &dyn Fn() -> Tensor<3>,
    ) -> Option<Tensor<3>> {
        self.joint_sum_of(layer, parts, x, base)
    }

    fn untracked(&self) -> Option<Box<dyn ProjectionDelta + '_>> {
        Some(Box::new(Untracked(self)))
    }

    fn random_position(&self) -> Option<u128> {
        self.dropout.as_ref().map(|d| d.rng.borrow().get_word_pos())
    }

    fn rewind(&self, position: u128) {
        if let Some(dropout) = &self.dropout {
            dropout.rng.borrow_mut().set_word_pos(position);
        }
    }

    /// The row's adapter, as its slot among the adapters of this batch (rows without one share
    /// a key); `None` under dropout, where every row draws its own masks.
    fn row_key(&self, row: usize) -> Option<u64> {
        if self.dropout.is_some() {
            return None;
        }
        let slot = *self.rows.get(row)?;
        Some(slot.map_or(0, |s| s as u64 + 1))
    }

    /// The same factors with the rows' masks (gradients of the narrowed batch reach the same
    /// adapter tensors). `None` under dropout.
    fn select_rows(&self, rows: &[usize]) -> Option<Box<dyn ProjectionDelta + '_>> {
        if self.dropout.is_some() || rows.iter().any(|&r| r >= self.rows.len()) {
            return None;
        }
        let index: Tensor<1, Int> = Tensor::from_data(
            TensorData::new(rows.iter().map(|&r| r as i64).collect::<Vec<_>>(), [rows.len()]),
            &self.device,
        );
        let masks = self.masks.iter().map(|mask| mask.clone().select(0, index.clone())).collect();
        Some(Box::new(MixedLora {
            factors: self.factors.clone(),
            masks,
            rows: rows.iter().map(|&r| self.rows[r]).collect(),
            dropout: None,
            device: self.device.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::AdapterConfig;
    use crate::model::Preset;

    /// An adapter on `targets` with rank `r` and random factors (B too, so deltas are not zero).
    fn adapter(
        r: usize,
        alpha: f64,
        rslora: bool,
        targets: Vec<Projection>,
        seed: u64,
        base: &ModelConfig,
    ) -> LoraAdapter {
        let config = AdapterConfig {
            r,
            lora_alpha: alpha,
            use_rslora: rslora,
            target_modules: targets,
            ..AdapterConfig::default()
        };
        let device = Device::flex();
        let mut adapter = LoraAdapter::init(config, base, seed, &device);
        let mut rng = ChaCha8Rng::seed_from_u64(seed + 100);
        for pair in adapter.pairs.values_mut() {
            let dims = pair.b.dims();
            let values: Vec<f32> = (0..dims[0] * dims[1]).map(|_| rng.random_range(-0.5..0.5)).collect();
            pair.b = Tensor::from_data(TensorData::new(values, dims), &device);
        }
        adapter
    }

    fn host(t: Tensor<3>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_into_vec::<f32>().unwrap()
    }

    /// Each row's delta is its own adapter's `scale (x A^T) B^T` (f64 on the host), zero where
    /// its adapter does not target the site or it has none, whatever the other rows use: three
    /// adapters with different ranks, scales and targets, a row without an adapter.
    #[test]
    fn every_row_gets_its_own_adapters_delta() {
        let base = Preset::Tiny.config();
        let device = Device::flex();
        let adapters = [
            adapter(4, 8.0, false, vec![Projection::Q, Projection::V], 1, &base),
            adapter(8, 16.0, true, vec![Projection::Q, Projection::O], 2, &base),
            adapter(2, 2.0, false, vec![Projection::Q], 3, &base),
        ];
        let refs: Vec<&LoraAdapter> = adapters.iter().collect();
        let rows = [Some(0), Some(1), None, Some(2), Some(0)];
        let mixed = MixedLora::new(&refs, &rows, &base, &device);
        let seq = 3;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for projection in [Projection::Q, Projection::V, Projection::O, Projection::Down] {
            let (fan_in, fan_out) = projection.dims(&base);
            let x: Vec<f32> = (0..rows.len() * seq * fan_in).map(|_| rng.random_range(-1.0..1.0)).collect();
            let input = Tensor::<3>::from_data(TensorData::new(x.clone(), [rows.len(), seq, fan_in]), &device);
            let Some(delta) = mixed.delta(1, projection, &input) else {
                assert_eq!(projection, Projection::Down, "no adapter targets down_proj");
                continue;
            };
            assert_eq!(delta.dims(), [rows.len(), seq, fan_out]);
            let got = host(delta);
            for (row, adapter) in rows.iter().enumerate() {
                let pair = adapter.and_then(|k| adapters[k].pairs.get(&(1, projection)).map(|p| (k, p)));
                for t in 0..seq {
                    let xs = &x[(row * seq + t) * fan_in..][..fan_in];
                    let expected: Vec<f64> = match pair {
                        None => vec![0.0; fan_out],
                        Some((k, pair)) => {
                            let a = pair.a.clone().into_data().try_into_vec::<f32>().unwrap();
                            let b = pair.b.clone().into_data().try_into_vec::<f32>().unwrap();
                            let r = adapters[k].config.r;
                            let down: Vec<f64> = (0..r)
                                .map(|j| (0..fan_in).map(|i| xs[i] as f64 * a[j * fan_in + i] as f64).sum())
                                .collect();
                            let scale = adapters[k].config.scale();
                            (0..fan_out)
                                .map(|o| scale * (0..r).map(|j| down[j] * b[o * r + j] as f64).sum::<f64>())
                                .collect()
                        }
                    };
                    let got = &got[(row * seq + t) * fan_out..][..fan_out];
                    for (g, e) in got.iter().zip(&expected) {
                        assert!(
                            (*g as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "{projection:?} row {row} token {t}: {g} against {e}"
                        );
                        if pair.is_none() {
                            assert_eq!(*g, 0.0, "{projection:?} row {row}: a row without the site's adapter");
                        }
                    }
                }
            }
        }
        // Sites targeted by the same adapters share one mask: {0, 1, 2} at q, {0} at v, {1} at o.
        assert_eq!(mixed.masks.len(), 3);
    }

    /// A layer's joined q/k/v factors give, as one tensor, each part's own delta side by side
    /// (zeros for a part no adapter targets), for mixed rows, rows on one adapter, and a narrowed
    /// batch; a layer with one targeted part is not joined, and an input under autodiff or other
    /// parts get no joint delta.
    #[test]
    fn joined_qkv_deltas_are_the_parts_deltas_side_by_side() {
        let base = Preset::Tiny.config();
        let device = Device::flex();
        let adapters = [
            adapter(4, 8.0, false, vec![Projection::Q, Projection::V], 1, &base),
            adapter(2, 16.0, true, vec![Projection::Q, Projection::K, Projection::V, Projection::O], 2, &base),
            adapter(4, 8.0, false, vec![Projection::Q, Projection::O], 3, &base),
        ];
        let refs: Vec<&LoraAdapter> = adapters.iter().collect();
        let parts: Vec<(Projection, usize)> = JOINED.iter().map(|&p| (p, p.dims(&base).1)).collect();
        let (fan_in, _) = Projection::Q.dims(&base);
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let seq = 3;
        let check = |mixed: &dyn ProjectionDelta, x: &Tensor<3>, what: &str| {
            let batch = x.dims()[0];
            let joint = mixed.joint_delta(1, &parts, x).unwrap_or_else(|| panic!("{what}: joined"));
            let separate: Vec<Tensor<3>> = parts
                .iter()
                .map(|&(p, w)| mixed.delta(1, p, x).unwrap_or_else(|| Tensor::zeros([batch, seq, w], &device)))
                .collect();
            let (joint, separate) = (host(joint), host(Tensor::cat(separate, 2)));
            assert_eq!(joint.len(), separate.len(), "{what}");
            for (i, (j, s)) in joint.iter().zip(&separate).enumerate() {
                assert!((j - s).abs() <= 1e-5 * (1.0 + s.abs()), "{what}: value {i}: {j} against {s}");
            }
        };
        for rows in [vec![Some(0), None, Some(1), Some(0), Some(2)], vec![Some(1); 3], vec![Some(0); 2]] {
            let (used, shared) = StackedFactors::layout(&rows);
            let factors = StackedFactors::new(&refs, &used, shared, &base, &device).joined(&base, &device);
            let mixed = MixedLora::with_factors(Arc::new(factors), &rows, &device);
            let values: Vec<f32> = (0..rows.len() * seq * fan_in).map(|_| rng.random_range(-1.0..1.0)).collect();
            let x = Tensor::<3>::from_data(TensorData::new(values, [rows.len(), seq, fan_in]), &device);
            check(&mixed, &x, &format!("rows {rows:?}"));
            if rows.len() > 2 {
                let picked = [2usize, 0];
                let narrowed = mixed.select_rows(&picked).unwrap();
                let index = Tensor::<1, Int>::from_data(TensorData::new(vec![2i64, 0], [2]), &device);
                check(narrowed.as_ref(), &x.clone().select(0, index), &format!("rows {rows:?} narrowed"));
            }
            assert!(mixed.joint_delta(1, &parts, &x.clone().autodiff().require_grad()).is_none(), "under autodiff");
            assert!(mixed.joint_delta(1, &parts[..2], &x).is_none(), "q and k alone");
        }
        // Rows all on the adapter of q and o: one q/k/v part targeted, nothing joined.
        let rows = [Some(2), Some(2)];
        let factors = StackedFactors::new(&refs, &[2], Some(2), &base, &device).joined(&base, &device);
        let mixed = MixedLora::with_factors(Arc::new(factors), &rows, &device);
        let x = Tensor::<3>::zeros([2, seq, fan_in], &device);
        assert!(mixed.joint_delta(1, &parts, &x).is_none());
    }

    /// A narrowed batch applies the rows' own adapters.
    #[test]
    fn selected_rows_keep_their_adapters() {
        let base = Preset::Tiny.config();
        let device = Device::flex();
        let adapters = [
            adapter(4, 8.0, false, vec![Projection::Q], 1, &base),
            adapter(8, 8.0, false, vec![Projection::Q], 2, &base),
        ];
        let refs: Vec<&LoraAdapter> = adapters.iter().collect();
        let rows = [Some(0), Some(1), None, Some(1)];
        let mixed = MixedLora::new(&refs, &rows, &base, &device);
        let (fan_in, _) = Projection::Q.dims(&base);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let x: Vec<f32> = (0..rows.len() * 2 * fan_in).map(|_| rng.random_range(-1.0..1.0)).collect();
        let input = Tensor::<3>::from_data(TensorData::new(x, [rows.len(), 2, fan_in]), &device);
        let full = host(mixed.delta(0, Projection::Q, &input).unwrap());
        let picked = [3usize, 0, 2];
        let narrowed = mixed.select_rows(&picked).unwrap();
        let index = Tensor::<1, Int>::from_data(TensorData::new(vec![3i64, 0, 2], [3]), &device);
        let part = host(narrowed.delta(0, Projection::Q, &input.select(0, index)).unwrap());
        let width = full.len() / rows.len();
        for (i, &row) in picked.iter().enumerate() {
            assert_eq!(&part[i * width..][..width], &full[row * width..][..width], "row {row}");
        }
        assert_eq!(narrowed.row_key(0), mixed.row_key(3));
    }
}
