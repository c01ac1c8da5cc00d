//! [`LoadOptions`]: which base model to load and how — a Hugging Face directory or a GGUF file,
//! or the built-in model of a preset and seed; the device; the base kept quantized or not. It
//! is a run's `model:` section, and [`super::Model::load`] is the one constructor every caller
//! goes through.

use std::path::PathBuf;

use super::{BaseFormat, Preset};
use crate::section::config_section;

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
        /// Keep the base's matrices quantized (a GGUF file's own block types, Q8_0 for float
        /// weights) under the f32 adapters: a several times smaller base; CPU only.
        pub quantized: bool = false,
    }
}

impl LoadOptions {
    /// The model at `path` (a directory or a GGUF file), its base in f32.
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
