//! GGUF files (the llama.cpp / Ollama format) of the Llama, Qwen2 and Qwen3 families: the
//! container ([`container`], read with the `gguf-rs-lib` crate), ggml's block formats
//! ([`dequant`]), the model configuration ([`config`]) and tokenizer ([`tokenizer`]) from the
//! metadata, and the tensors under Hugging Face names ([`weights`]).

pub mod config;
pub mod container;
pub mod dequant;
pub mod tokenizer;
pub mod weights;

use std::io::Read;
use std::path::Path;

pub use container::{GgufFile, TensorEntry};
pub use dequant::GgmlType;
pub use weights::GgufWeights;

use crate::error::Result;
use crate::model::{ModelConfig, TextTokenizer};

/// Whether `path` is a GGUF file (a regular file that starts with the magic `GGUF`).
pub fn is_gguf_file(path: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == b"GGUF"
}

/// Whether `path` should be read as a GGUF file: named `*.gguf`, or starting with the magic.
pub fn is_gguf_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) || is_gguf_file(path)
}

/// A GGUF file's model configuration, read from its metadata (no tensor is read).
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    config::read_config(&GgufFile::open(path)?)
}

/// Opens a GGUF file and reads its configuration, tokenizer and tensor directory.
pub fn open(path: &Path) -> Result<(ModelConfig, TextTokenizer, GgufWeights)> {
    let file = GgufFile::open(path)?;
    let config = config::read_config(&file)?;
    let tokenizer = tokenizer::read_tokenizer(&file, &config.eos_token_ids)?;
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(file.error(format!(
            "the tokenizer has {} tokens but the model's vocabulary is {}",
            tokenizer.vocab_size(),
            config.vocab_size
        )));
    }
    let weights = GgufWeights::new(file, &config);
    Ok((config, tokenizer, weights))
}
