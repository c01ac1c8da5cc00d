//! The frozen base model: `config.json` parsing, safetensors and GGUF loading, the
//! Llama/Qwen2/Qwen3 transformer, the tokenizer with its chat template, and the built-in default
//! model.

pub mod attention_kernel;
pub mod builtin;
pub mod checkpoint;
pub mod config;
pub mod fingerprint;
pub mod fused;
pub mod gguf;
pub mod head;
mod host;
pub mod inspect;
mod kv_cache_dtype;
pub mod layers;
pub mod load;
pub mod matmul_kernel;
pub mod prompt_cache;
pub mod quant;
pub mod safetensors_io;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

use std::path::{Path, PathBuf};

use burn::tensor::Device;

pub use attention_kernel::AttentionKernel;
pub use builtin::Preset;
pub use config::{ModelConfig, ModelType};
pub use kv_cache_dtype::KvCacheDtype;
pub use layers::{LowRank, Projection, ProjectionDelta};
pub use load::{LoadOptions, Precision};
pub use matmul_kernel::MatmulKernel;
pub use prompt_cache::PromptCache;
pub use quant::BaseFormat;
pub use tokenizer::{ChatMessage, TextTokenizer};
pub use transformer::{AttentionLayout, CausalLm, ForwardArgs, KvCache, SequenceLayout, GPU_WIDTH_STEP};

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
    /// Loads the model `options` name onto `device`: a Hugging Face model directory or a GGUF
    /// file, or the built-in model of a preset and seed; the base's matrices in
    /// `options.dtype` (resolved for `device`: [`Precision::resolve`]) or kept quantized (a GGUF
    /// file's own block types, Q8_0 made from float weights). `options.device` is the caller's
    /// to parse ([`crate::device::parse_device`]).
    pub fn load(options: &LoadOptions, device: &Device) -> Result<Self> {
        let format = options.format();
        let dtype = options.dtype.resolve(device, options.quantized).map_err(|message| TroupeError::BadValue {
            origin: None,
            key: "model.dtype".to_string(),
            message,
        })?;
        let Some(path) = &options.path else {
            let preset = options.preset().map_err(|message| TroupeError::BadValue {
                origin: None,
                key: "model.preset".to_string(),
                message,
            })?;
            let config = preset.config();
            let weights = builtin::init_weights(&config, options.seed);
            let source: &dyn WeightSource = &weights;
            let lm = CausalLm::load_as(config, &WeightLoader { source, device, format, dtype })?;
            return Ok(Self { lm, tokenizer: builtin::builtin_tokenizer()?, dir: None });
        };
        if gguf::is_gguf_path(path) {
            let (config, tokenizer, weights) = gguf::open(path)?;
            let lm = CausalLm::load_as(config, &WeightLoader { source: &weights, device, format, dtype })?;
            return Ok(Self { lm, tokenizer, dir: Some(path.to_path_buf()) });
        }
        check_model_dir(path)?;
        let config = ModelConfig::from_file(&path.join("config.json"))?;
        let store = TensorStore::open_model_dir(path)?;
        let tokenizer = TextTokenizer::from_model_dir(path, &config.eos_token_ids)?;
        let lm = CausalLm::load_as(config, &WeightLoader { source: &store, device, format, dtype })?;
        Ok(Self { lm, tokenizer, dir: Some(path.to_path_buf()) })
    }

    /// The configuration of the model at `path` (a Hugging Face directory's `config.json`, or
    /// a GGUF file's metadata), without reading its weights.
    pub fn read_config(path: &Path) -> Result<ModelConfig> {
        if gguf::is_gguf_path(path) {
            return gguf::read_config(path);
        }
        check_model_dir(path)?;
        ModelConfig::from_file(&path.join("config.json"))
    }

    /// A Hugging Face model directory or a GGUF file, its base in `auto` precision (f32 on the
    /// CPU, bf16 on CUDA) ([`Model::load`]).
    pub fn from_path(path: &Path, device: &Device) -> Result<Self> {
        Self::load(&LoadOptions::path(path), device)
    }

    /// The built-in model of `preset`, initialised from `seed`, in `auto` precision (f32 on the
    /// CPU, bf16 on CUDA) ([`Model::load`]).
    pub fn builtin(preset: Preset, seed: u64, device: &Device) -> Result<Self> {
        Self::load(&LoadOptions::builtin(preset, seed), device)
    }
}

/// Refuses a model path that is not a directory (a GGUF file is told apart before), naming it.
fn check_model_dir(path: &Path) -> Result<()> {
    if path.is_file() {
        return Err(TroupeError::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "is a file but not a GGUF file (a model is a Hugging Face directory or a .gguf file)",
            ),
        ));
    }
    if !path.is_dir() {
        return Err(TroupeError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "model directory not found"),
        ));
    }
    Ok(())
}
