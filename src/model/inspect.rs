//! `troupe model inspect`: what a model directory or GGUF file holds (architecture, parameter
//! count, tensor types) and how much memory its weights take in each mode, without loading them.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use super::gguf::{self, GgufFile};
use super::safetensors_io::TensorStore;
use super::ModelConfig;
use crate::error::Result;

/// Bytes the f32 base holds for `config`: every parameter as f32 (a tied LM head is the
/// embedding's own tensor).
pub fn f32_bytes(config: &ModelConfig) -> u64 {
    4 * config.num_parameters() as u64
}

/// Bytes a kept-quantized base (`--quantized`) holds for a float checkpoint of `config`: every
/// matrix in Q8_0 (f32 where its rows are not whole 32-value blocks), a tied LM head sharing the
/// embedding's blocks, norms and biases in f32.
pub fn quantized_float_bytes(config: &ModelConfig) -> u64 {
    config
        .tensor_shapes()
        .iter()
        .map(|(_, shape)| match shape.as_slice() {
            [rows, cols] if cols % 32 == 0 => (rows * cols / 32 * 34) as u64,
            other => 4 * other.iter().product::<usize>() as u64,
        })
        .sum()
}

/// Counts and values of each stored type, by type name.
#[derive(Default)]
struct TypeCounts(BTreeMap<String, (usize, usize)>);

impl TypeCounts {
    fn add(&mut self, name: &str, values: usize) {
        let entry = self.0.entry(name.to_string()).or_default();
        entry.0 += 1;
        entry.1 += values;
    }

    fn to_json(&self) -> Value {
        self.0
            .iter()
            .map(|(name, (tensors, values))| (name.clone(), json!({"tensors": tensors, "values": values})))
            .collect()
    }
}

/// The JSON description of a GGUF file.
fn describe_gguf(path: &Path) -> Result<Value> {
    let file = GgufFile::open(path)?;
    let config = gguf::config::read_config(&file)?;
    let mut types = TypeCounts::default();
    let mut stored = 0u64;
    for entry in file.tensors() {
        types.add(entry.ggml_type.name(), entry.len());
        stored += entry.byte_len() as u64;
    }
    // What a kept-quantized base (`--quantized`) holds: the matrices (projections, embedding, an
    // untied LM head; a tied head shares the embedding's blocks) in their stored block formats
    // and the 1-D tensors (norms, biases) in f32.
    let quantized: u64 =
        file.tensors().iter().map(|e| if e.shape.len() >= 2 { e.byte_len() as u64 } else { 4 * e.len() as u64 }).sum();
    Ok(json!({
        "path": path,
        "format": "gguf",
        "architecture": config.model_type.as_str(),
        "name": file.string("general.name")?,
        "parameters": config.num_parameters(),
        "config": config_json(&config),
        "tokenizer": {
            "model": file.string("tokenizer.ggml.model")?,
            "pre": file.string("tokenizer.ggml.pre")?,
            "tokens": file.strings("tokenizer.ggml.tokens")?.map(|t| t.len()),
            "special_ids": gguf::tokenizer::special_ids(&file)?,
            "chat_template": file.string("tokenizer.chat_template")?.is_some(),
        },
        "tensors": file.tensors().len(),
        "tensor_types": types.to_json(),
        "file_tensor_bytes": stored,
        "memory_bytes": {"f32": f32_bytes(&config), "quantized": quantized},
    }))
}

/// The JSON description of a Hugging Face directory.
fn describe_dir(dir: &Path) -> Result<Value> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let store = TensorStore::open_model_dir(dir)?;
    let mut types = TypeCounts::default();
    for name in store.names() {
        let (dtype, values) = store.dtype_and_len(&name).expect("a listed tensor");
        types.add(&dtype, values);
    }
    Ok(json!({
        "path": dir,
        "format": "safetensors",
        "architecture": config.model_type.as_str(),
        "parameters": config.num_parameters(),
        "config": config_json(&config),
        "tensors": store.names().len(),
        "tensor_types": types.to_json(),
        "memory_bytes": {"f32": f32_bytes(&config), "quantized": quantized_float_bytes(&config)},
    }))
}

fn config_json(config: &ModelConfig) -> Value {
    json!({
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_ids": config.eos_token_ids,
    })
}

/// Describes the model at `path` (a GGUF file or a Hugging Face directory) as JSON.
pub fn describe(path: &Path) -> Result<Value> {
    if gguf::is_gguf_path(path) {
        describe_gguf(path)
    } else {
        describe_dir(path)
    }
}
