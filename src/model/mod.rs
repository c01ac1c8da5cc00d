//! The frozen base model: `config.json` parsing, safetensors and GGUF loading, the
//! Llama/Qwen2/Qwen3 transformer, the tokenizer with its chat template, and the built-in default
//! model.

pub mod builtin;
pub mod config;
pub mod fingerprint;
pub mod fused;
pub mod gguf;
mod host;
pub mod inspect;
pub mod layers;
pub mod quant;
pub mod safetensors_io;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

use std::path::{Path, PathBuf};

use burn::tensor::Device;

pub use builtin::Preset;
pub use config::{ModelConfig, ModelType};
pub use layers::{Projection, ProjectionDelta};
pub use quant::BaseFormat;
pub use tokenizer::{ChatMessage, TextTokenizer};
pub use transformer::{AttentionLayout, CausalLm, ForwardArgs, KvCache, SequenceLayout};

use crate::error::{Result, TroupeError};
use layers::WeightLoader;
use safetensors_io::TensorStore;
use weights::WeightSource;

/// A model ready to use: the transformer and its tokenizer.
#[derive(Clone, Debug)]
pub struct Model {
    /// The transformer.
    pub lm: CausalLm,
    /// The tokenizer, EOS ids and chat template.
    pub tokenizer: TextTokenizer,
    /// The directory or GGUF file it was loaded from (`None` for the built-in model).
    pub dir: Option<PathBuf>,
}

impl Model {
    /// Loads a Hugging Face model directory, or a GGUF file, onto `device`.
    pub fn from_path(path: &Path, device: &Device) -> Result<Self> {
        Self::from_path_as(path, device, BaseFormat::F32)
    }

    /// [`Model::from_path`] with the base in `format` (f32, or kept quantized).
    pub fn from_path_as(path: &Path, device: &Device, format: BaseFormat) -> Result<Self> {
        if gguf::is_gguf_path(path) {
            Self::from_gguf_as(path, device, format)
        } else {
            Self::from_dir_as(path, device, format)
        }
    }

    /// Loads a GGUF file onto `device`, its weights dequantized to f32.
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self> {
        Self::from_gguf_as(path, device, BaseFormat::F32)
    }

    /// [`Model::from_gguf`] with the base in `format` (kept quantized: in the file's own types).
    pub fn from_gguf_as(path: &Path, device: &Device, format: BaseFormat) -> Result<Self> {
        let (config, tokenizer, weights) = gguf::open(path)?;
        let lm = CausalLm::load_as(config, &WeightLoader { source: &weights, device, format })?;
        Ok(Self { lm, tokenizer, dir: Some(path.to_path_buf()) })
    }

    /// Loads a Hugging Face model directory onto `device`.
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self> {
        Self::from_dir_as(dir, device, BaseFormat::F32)
    }

    /// [`Model::from_dir`] with the base in `format` (kept quantized: Q8_0 made from its floats).
    pub fn from_dir_as(dir: &Path, device: &Device, format: BaseFormat) -> Result<Self> {
        if dir.is_file() {
            return Err(TroupeError::io(
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "is a file but not a GGUF file (a model is a Hugging Face directory or a .gguf file)",
                ),
            ));
        }
        if !dir.is_dir() {
            return Err(TroupeError::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "model directory not found"),
            ));
        }
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let store = TensorStore::open_model_dir(dir)?;
        let tokenizer = TextTokenizer::from_model_dir(dir, &config.eos_token_ids)?;
        let lm = CausalLm::load_as(config, &WeightLoader { source: &store, device, format })?;
        Ok(Self { lm, tokenizer, dir: Some(dir.to_path_buf()) })
    }

    /// The built-in model of `preset`, initialised from `seed`, in memory.
    pub fn builtin(preset: Preset, seed: u64, device: &Device) -> Result<Self> {
        Self::builtin_as(preset, seed, device, BaseFormat::F32)
    }

    /// [`Model::builtin`] with the base in `format` (kept quantized: Q8_0 made from its floats).
    pub fn builtin_as(preset: Preset, seed: u64, device: &Device, format: BaseFormat) -> Result<Self> {
        let config = preset.config();
        let weights = builtin::init_weights(&config, seed);
        let source: &dyn WeightSource = &weights;
        let lm = CausalLm::load_as(config, &WeightLoader { source, device, format })?;
        Ok(Self { lm, tokenizer: builtin::builtin_tokenizer()?, dir: None })
    }

    /// `from_path` when a path is given, else the tiny built-in model with seed 0.
    pub fn from_dir_or_default(dir: Option<&Path>, device: &Device) -> Result<Self> {
        Self::from_dir_or_default_as(dir, device, BaseFormat::F32)
    }

    /// [`Model::from_dir_or_default`] with the base in `format`.
    pub fn from_dir_or_default_as(dir: Option<&Path>, device: &Device, format: BaseFormat) -> Result<Self> {
        match dir {
            Some(dir) => Self::from_path_as(dir, device, format),
            None => Self::builtin_as(Preset::Tiny, 0, device, format),
        }
    }
}
