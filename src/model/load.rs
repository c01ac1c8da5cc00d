//! [`LoadOptions`]: which base model to load and how — a Hugging Face directory or a GGUF file,
//! or the built-in model of a preset and seed; the device; the precision of the base's matrices
//! ([`Precision`]); the base kept quantized or not. It is a run's `model:` section, and
//! [`super::Model::load`] is the one constructor every caller goes through.

use std::path::PathBuf;

use burn::tensor::{Device, FloatDType};

use super::{BaseFormat, Preset};
use crate::section::config_section;

/// `model.dtype`: the precision the frozen base's matrices (the q/k/v/o and gate/up/down
/// projections, the embedding table and the LM head) are held and multiplied in.
///
/// In `bf16` and `f16` each frozen product rounds its input to that type, multiplies with the
/// weight in it, accumulates in f32 and rounds its result to it; the residual stream, the norms,
/// attention, the LoRA factors with their gradients and AdamW moments, the log-softmax, the loss
/// and the choice normaliser stay in f32. `auto` is `bf16` on CUDA and `f32` on the CPU (there
/// the weights are widened to f32 per product, so `bf16` halves the base's memory and costs
/// time), and `f32` whenever the base is kept quantized.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// `bf16` on CUDA, `f32` on the CPU or for a kept-quantized base.
    #[default]
    Auto,
    /// bfloat16 weights and products (f32 accumulation).
    Bf16,
    /// IEEE half weights and products (f32 accumulation).
    F16,
    /// f32 throughout.
    F32,
}

impl Precision {
    /// The name as the config writes it.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Auto => "auto",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
            Precision::F32 => "f32",
        }
    }

    /// The dtype the base's matrices take on `device` (`auto`: bf16 on CUDA, f32 elsewhere),
    /// or why it cannot ([`Precision::check`]; wgpu's shaders have no bf16, and some adapters no
    /// f16).
    pub fn resolve(self, device: &Device, quantized: bool) -> std::result::Result<FloatDType, String> {
        self.check(quantized)?;
        if self == Precision::Bf16 && crate::device::is_wgpu(device) {
            return Err("bf16 needs a CUDA device (wgpu's shaders have no bf16); use f32 or f16".to_string());
        }
        // A wgpu adapter may lack f16 shaders (Mesa's lavapipe does): refuse here rather than
        // fail at the first kernel.
        if self == Precision::F16 && crate::device::is_wgpu(device) && !device.supports_dtype(FloatDType::F16) {
            return Err("f16 is not supported by this wgpu adapter (its shaders have no f16); use f32".to_string());
        }
        Ok(match self {
            Precision::Auto if quantized || !crate::device::is_cuda(device) => FloatDType::F32,
            Precision::Auto | Precision::Bf16 => FloatDType::BF16,
            Precision::F16 => FloatDType::F16,
            Precision::F32 => FloatDType::F32,
        })
    }

    /// Refuses bf16 or f16 for a quantized base (`quantized`), which has no float matrices to
    /// hold in them.
    pub fn check(self, quantized: bool) -> std::result::Result<(), String> {
        match self {
            Precision::Bf16 | Precision::F16 if quantized => Err(format!(
                "{} needs the base's matrices in floats, but model.quantized keeps them in block formats (use f32 or auto)",
                self.name()
            )),
            _ => Ok(()),
        }
    }
}

config_section! {
    /// `model:` — a Hugging Face model directory or a GGUF file, or the built-in model.
    pub struct LoadOptions {
        /// A Hugging Face model directory or a GGUF file; `null` means the built-in model of
        /// `preset`.
        pub path: Option<PathBuf> = None,
        /// The built-in model's size when `path` is null (`tiny`, `small`, ...).
        pub preset: String = "tiny".to_string(),
        /// Seed the built-in model is initialised from.
        pub seed: u64 = 0,
        /// Compute device: `cpu`, or `cuda` / `cuda:N` with the `cuda` feature.
        pub device: String = "cpu".to_string(),
        /// Precision of the frozen base's matrices: `auto` (bf16 on CUDA, f32 on the CPU),
        /// `bf16`, `f16` or `f32`; adapters, optimizer, log-softmax and loss stay in f32.
        pub dtype: Precision = Precision::Auto,
        /// Keep the base's matrices quantized (a GGUF file's own block types, Q8_0 for float
        /// weights) under the f32 adapters: a several times smaller base; CPU only.
        pub quantized: bool = false,
    }
}

impl LoadOptions {
    /// The model at `path` (a directory or a GGUF file), its base in `auto` precision.
    pub fn path(path: impl Into<PathBuf>) -> Self {
        Self { path: Some(path.into()), ..Self::default() }
    }

    /// The built-in model of `preset`, initialised from `seed`.
    pub fn builtin(preset: Preset, seed: u64) -> Self {
        let name = clap::ValueEnum::to_possible_value(&preset).map(|v| v.get_name().to_string());
        Self { preset: name.unwrap_or_default(), seed, ..Self::default() }
    }

    /// `self` with the base kept quantized (or not).
    pub fn quantized(self, quantized: bool) -> Self {
        Self { quantized, ..self }
    }

    /// `self` with the base's matrices in `dtype`.
    pub fn dtype(self, dtype: Precision) -> Self {
        Self { dtype, ..self }
    }

    /// The built-in model preset named by `preset`.
    pub fn preset(&self) -> std::result::Result<Preset, String> {
        <Preset as clap::ValueEnum>::from_str(&self.preset, true).map_err(|_| {
            let known: Vec<String> = <Preset as clap::ValueEnum>::value_variants()
                .iter()
                .filter_map(|p| clap::ValueEnum::to_possible_value(p).map(|v| v.get_name().to_string()))
                .collect();
            format!("unknown preset {:?} (known: {})", self.preset, known.join(", "))
        })
    }

    /// How the base's matrices are held.
    pub fn format(&self) -> BaseFormat {
        BaseFormat::from_flag(self.quantized)
    }
}
