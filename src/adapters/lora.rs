//! One LoRA adapter: a low-rank pair `(A: [r, in], B: [out, r])` per targeted projection of
//! every layer, with PEFT's initialisation and tensor names.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::{Device, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::config::AdapterConfig;
use crate::error::{ModelError, Result, TroupeError};
use crate::model::safetensors_io::HostTensor;
use crate::model::{ModelConfig, Projection};

/// The two factors of one projection's update `delta(x) = scale * (x A^T) B^T`.
#[derive(Clone, Debug)]
pub struct LoraPair {
    /// `lora_A.weight`: `[r, in_features]`
    pub a: Tensor<2>,
    /// `lora_B.weight`: `[out_features, r]`
    pub b: Tensor<2>,
}

/// Where one pair sits: decoder layer and projection.
pub type Site = (usize, Projection);

/// A LoRA adapter for a given base model.
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    /// Rank, alpha, targets, dropout.
    pub config: AdapterConfig,
    /// One pair per (layer, targeted projection).
    pub pairs: BTreeMap<Site, LoraPair>,
}

/// PEFT's tensor name of a factor (`A` or `B`) at a site.
pub fn peft_key(site: Site, factor: char) -> String {
    format!("base_model.model.model.layers.{}.{}.lora_{factor}.weight", site.0, site.1.path())
}

/// Parses a PEFT tensor name back into its site and factor.
fn parse_peft_key(key: &str) -> Option<(Site, char)> {
    let rest = key.strip_prefix("base_model.model.model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (path, factor) = if let Some(path) = rest.strip_suffix(".lora_A.weight") {
        (path, 'A')
    } else {
        (rest.strip_suffix(".lora_B.weight")?, 'B')
    };
    let projection = Projection::ALL.into_iter().find(|p| p.path() == path)?;
    Some(((layer, projection), factor))
}

impl LoraAdapter {
    /// A fresh adapter with PEFT's initialisation: A uniform in ±1/sqrt(in) (Kaiming-uniform
    /// with a = sqrt(5)), B zero, so the adapter starts as the identity on the base's output.
    pub fn init(config: AdapterConfig, base: &ModelConfig, seed: u64, device: &Device) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut pairs = BTreeMap::new();
        for layer in 0..base.num_hidden_layers {
            for &projection in &config.target_modules {
                let (fan_in, fan_out) = projection.dims(base);
                let bound = 1.0 / (fan_in as f32).sqrt();
                let a: Vec<f32> = (0..config.r * fan_in).map(|_| rng.random_range(-bound..bound)).collect();
                pairs.insert(
                    (layer, projection),
                    LoraPair {
                        a: Tensor::from_data(TensorData::new(a, [config.r, fan_in]), device),
                        b: Tensor::zeros([fan_out, config.r], device),
                    },
                );
            }
        }
        Self { config, pairs }
    }

    /// The adapter's tensors by PEFT name, read back to the host; a device's failure (one the
    /// update left unread) is an error, not a panic.
    pub fn to_host(&self) -> Result<BTreeMap<String, HostTensor>> {
        let mut out = BTreeMap::new();
        for (&site, pair) in &self.pairs {
            for (factor, tensor) in [('A', &pair.a), ('B', &pair.b)] {
                out.insert(peft_key(site, factor), HostTensor::read_back(tensor)?);
            }
        }
        Ok(out)
    }

    /// Builds an adapter from PEFT-named tensors, checking every site against the base model:
    /// a tensor for an unknown layer or module, a missing factor, or a shape that does not fit
    /// `base` is an error naming the tensor. `origin` names the file in messages.
    pub fn from_host(
        config: AdapterConfig,
        tensors: &BTreeMap<String, HostTensor>,
        base: &ModelConfig,
        origin: &Path,
        device: &Device,
    ) -> Result<Self> {
        let mut found: BTreeMap<Site, (Option<&HostTensor>, Option<&HostTensor>)> = BTreeMap::new();
        for (key, tensor) in tensors {
            let (site, factor) = parse_peft_key(key).ok_or_else(|| {
                TroupeError::Model(ModelError::Safetensors {
                    path: origin.to_path_buf(),
                    message: format!("unexpected tensor `{key}` (not a LoRA factor of a known module)"),
                })
            })?;
            if site.0 >= base.num_hidden_layers {
                return Err(TroupeError::Model(ModelError::Safetensors {
                    path: origin.to_path_buf(),
                    message: format!(
                        "tensor `{key}` is for layer {} but the base model has {} layers (an adapter made for another base?)",
                        site.0, base.num_hidden_layers
                    ),
                }));
            }
            if !config.target_modules.contains(&site.1) {
                return Err(TroupeError::Model(ModelError::Safetensors {
                    path: origin.to_path_buf(),
                    message: format!(
                        "tensor `{key}` targets {} which target_modules does not list",
                        site.1.module_name()
                    ),
                }));
            }
            let entry = found.entry(site).or_default();
            if factor == 'A' {
                entry.0 = Some(tensor);
            } else {
                entry.1 = Some(tensor);
            }
        }
        let mut pairs = BTreeMap::new();
        for layer in 0..base.num_hidden_layers {
            for &projection in &config.target_modules {
                let site = (layer, projection);
                let (fan_in, fan_out) = projection.dims(base);
                let (a, b) = found.get(&site).copied().unwrap_or((None, None));
                let check = |tensor: Option<&HostTensor>, factor: char, expected: [usize; 2]| -> Result<Tensor<2>> {
                    let name = peft_key(site, factor);
                    let tensor = tensor.ok_or_else(|| {
                        TroupeError::Model(ModelError::MissingTensor {
                            path: origin.to_path_buf(),
                            tensor: name.clone(),
                        })
                    })?;
                    if tensor.shape != expected {
                        return Err(TroupeError::Model(ModelError::ShapeMismatch {
                            path: origin.to_path_buf(),
                            tensor: name,
                            expected: expected.to_vec(),
                            got: tensor.shape.clone(),
                        }));
                    }
                    Ok(tensor.to_device(device))
                };
                let a = check(a, 'A', [config.r, fan_in])?;
                let b = check(b, 'B', [fan_out, config.r])?;
                pairs.insert(site, LoraPair { a, b });
            }
        }
        Ok(Self { config, pairs })
    }

    /// Number of trainable parameters.
    pub fn num_parameters(&self) -> usize {
        self.pairs.values().map(|p| p.a.dims().iter().product::<usize>() + p.b.dims().iter().product::<usize>()).sum()
    }

    /// This adapter's tensors as fresh autodiff leaves that require gradients. The frozen base
    /// stays outside autodiff: burn treats its tensors as constants, so it never gets a gradient.
    pub fn trainable(&self) -> Self {
        let leaf = |t: &Tensor<2>| t.clone().without_autodiff().autodiff().require_grad();
        let pairs =
            self.pairs.iter().map(|(site, pair)| (*site, LoraPair { a: leaf(&pair.a), b: leaf(&pair.b) })).collect();
        Self { config: self.config.clone(), pairs }
    }

    /// This adapter's tensors outside autodiff (for inference, or after a training step).
    pub fn frozen(&self) -> Self {
        let plain = |t: &Tensor<2>| t.clone().without_autodiff();
        let pairs =
            self.pairs.iter().map(|(site, pair)| (*site, LoraPair { a: plain(&pair.a), b: plain(&pair.b) })).collect();
        Self { config: self.config.clone(), pairs }
    }

    /// Moves every tensor to `device`.
    pub fn to_device(&self, device: &Device) -> Self {
        let pairs = self
            .pairs
            .iter()
            .map(|(site, pair)| {
                (*site, LoraPair { a: pair.a.clone().to_device(device), b: pair.b.clone().to_device(device) })
            })
            .collect();
        Self { config: self.config.clone(), pairs }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_keys_round_trip() {
        for projection in Projection::ALL {
            for factor in ['A', 'B'] {
                let key = peft_key((3, projection), factor);
                assert_eq!(parse_peft_key(&key), Some(((3, projection), factor)));
            }
        }
        assert_eq!(peft_key((0, Projection::Q), 'A'), "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
        assert_eq!(parse_peft_key("base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight"), None);
    }
}
