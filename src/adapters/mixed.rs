//! Mixed-adapter batches: one forward pass in which every row uses its own adapter (or none).
//!
//! For each targeted site, the adapters' factors are stacked (ranks zero-padded to the largest,
//! scales folded into B, one all-zero slot for rows without an adapter) and gathered per row,
//! so the update is two batched matmuls whatever the number of adapters:
//! `delta[row] = (x[row] A[row]^T) B[row]^T`. The gather's backward scatters each row's
//! gradient into the factors that row selected and nowhere else, which is what isolates
//! agents' gradients by construction.

use std::cell::RefCell;
use std::collections::HashMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::lora::{LoraAdapter, Site};
use crate::model::fused::batched_matmul;
use crate::model::{ModelConfig, Projection, ProjectionDelta};

/// The update factors of one site for the whole batch.
#[derive(Clone, Debug)]
enum SiteFactors {
    /// Every row uses the same adapter: `a`: `[r, in]`, `b_scaled`: `[out, r]`.
    Shared { a: Tensor<2>, b_scaled: Tensor<2> },
    /// Rows differ: `a`: `[batch, r_max, in]`, `b_scaled`: `[batch, out, r_max]`.
    PerRow { a: Tensor<3>, b_scaled: Tensor<3> },
}

/// Training-time dropout on the adapters' input, with each row's own rate.
struct Dropout {
    /// Per row: the dropout probability of that row's adapter (0 for rows without one).
    rates: Vec<f64>,
    rng: RefCell<ChaCha8Rng>,
}

/// A [`ProjectionDelta`] applying a per-row choice of LoRA adapters.
pub struct MixedLora {
    sites: HashMap<Site, SiteFactors>,
    /// Per row: the index of its adapter among those given to [`MixedLora::new`], or `None`.
    rows: Vec<Option<usize>>,
    dropout: Option<Dropout>,
    device: Device,
}

impl MixedLora {
    /// Prepares the factors for a batch where row `i` uses `adapters[rows[i]]`, or no adapter
    /// when `rows[i]` is `None`. Differentiable: gradients reach the adapters' tensors.
    pub fn new(adapters: &[&LoraAdapter], rows: &[Option<usize>], base: &ModelConfig, device: &Device) -> Self {
        let batch = rows.len();
        let used: Vec<usize> = {
            let mut used: Vec<usize> = rows.iter().flatten().copied().collect();
            used.sort_unstable();
            used.dedup();
            used
        };
        let shared = match used.as_slice() {
            [only] if rows.iter().all(|r| r.is_some()) => Some(*only),
            _ => None,
        };
        let mut sites = HashMap::new();
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
                let (fan_in, fan_out) = projection.dims(base);
                let r_max = targeting.iter().map(|&k| adapters[k].config.r).max().unwrap_or(0);
                // Slot j < used.len() holds adapter used[j]; the last slot is all zeros.
                let mut a_slots = Vec::with_capacity(used.len() + 1);
                let mut b_slots = Vec::with_capacity(used.len() + 1);
                for &k in &used {
                    match adapters[k].pairs.get(&site) {
                        Some(pair) => {
                            let r = adapters[k].config.r;
                            let scale = adapters[k].config.scale();
                            let (mut a, mut b) = (pair.a.clone(), pair.b.clone() * scale);
                            if r < r_max {
                                a = Tensor::cat(vec![a, Tensor::zeros([r_max - r, fan_in], device)], 0);
                                b = Tensor::cat(vec![b, Tensor::zeros([fan_out, r_max - r], device)], 1);
                            }
                            a_slots.push(a);
                            b_slots.push(b);
                        }
                        None => {
                            a_slots.push(Tensor::zeros([r_max, fan_in], device));
                            b_slots.push(Tensor::zeros([fan_out, r_max], device));
                        }
                    }
                }
                a_slots.push(Tensor::zeros([r_max, fan_in], device));
                b_slots.push(Tensor::zeros([fan_out, r_max], device));
                let slot_of_row: Vec<i64> = rows
                    .iter()
                    .map(|r| match r {
                        Some(k) => used.iter().position(|u| u == k).expect("used lists every row's adapter") as i64,
                        None => used.len() as i64,
                    })
                    .collect();
                let index: Tensor<1, Int> = Tensor::from_data(TensorData::new(slot_of_row, [batch]), device);
                let a = Tensor::stack::<3>(a_slots, 0).select(0, index.clone());
                let b_scaled = Tensor::stack::<3>(b_slots, 0).select(0, index);
                sites.insert(site, SiteFactors::PerRow { a, b_scaled });
            }
        }
        Self { sites, rows: rows.to_vec(), dropout: None, device: device.clone() }
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
    fn delta_of(&self, layer: usize, projection: Projection, x: &Tensor<3>, tracked: bool) -> Option<Tensor<3>> {
        let factors = self.sites.get(&(layer, projection))?;
        let x = self.dropped(x);
        let plain = |t: &Tensor<2>| if tracked { t.clone() } else { t.clone().without_autodiff() };
        let plain3 = |t: &Tensor<3>| if tracked { t.clone() } else { t.clone().without_autodiff() };
        Some(match factors {
            SiteFactors::Shared { a, b_scaled } => {
                let (a, b_scaled) = (plain(a), plain(b_scaled));
                let [batch, seq, fan_in] = x.dims();
                let out = b_scaled.dims()[0];
                let down = batched_matmul(x.reshape([1, batch * seq, fan_in]), a.clone().transpose().unsqueeze());
                batched_matmul(down, b_scaled.clone().transpose().unsqueeze()).reshape([batch, seq, out])
            }
            SiteFactors::PerRow { a, b_scaled } => {
                batched_matmul(batched_matmul(x, plain3(a).swap_dims(1, 2)), plain3(b_scaled).swap_dims(1, 2))
            }
        })
    }
}

/// A [`MixedLora`] computed outside autodiff ([`ProjectionDelta::untracked`]).
struct Untracked<'a>(&'a MixedLora);

impl ProjectionDelta for Untracked<'_> {
    fn delta(&self, layer: usize, projection: Projection, x: &Tensor<3>) -> Option<Tensor<3>> {
        self.0.delta_of(layer, projection, x, false)
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

    /// Selects the rows' factors (differentiably: gradients of the narrowed batch reach the
    /// same adapter tensors). `None` under dropout.
    fn select_rows(&self, rows: &[usize]) -> Option<Box<dyn ProjectionDelta + '_>> {
        if self.dropout.is_some() || rows.iter().any(|&r| r >= self.rows.len()) {
            return None;
        }
        let index: Tensor<1, Int> = Tensor::from_data(
            TensorData::new(rows.iter().map(|&r| r as i64).collect::<Vec<_>>(), [rows.len()]),
            &self.device,
        );
        let sites = self
            .sites
            .iter()
            .map(|(site, factors)| {
                let narrowed = match factors {
                    SiteFactors::Shared { .. } => factors.clone(),
                    SiteFactors::PerRow { a, b_scaled } => SiteFactors::PerRow {
                        a: a.clone().select(0, index.clone()),
                        b_scaled: b_scaled.clone().select(0, index.clone()),
                    },
                };
                (*site, narrowed)
            })
            .collect();
        Some(Box::new(MixedLora {
            sites,
            rows: rows.iter().map(|&r| self.rows[r]).collect(),
            dropout: None,
            device: self.device.clone(),
        }))
    }
}
