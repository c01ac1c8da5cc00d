//! Merging an adapter into its base: `W' = W + scale * B A` for every targeted projection,
//! written as a plain Hugging Face model directory (for deployment where LoRA is not wanted).
//! The base is a Hugging Face directory or a GGUF file (dequantized; its config, tokenizer and
//! chat template are written as `config.json`, `tokenizer.json` and `tokenizer_config.json`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use burn::tensor::Device;

use super::lora::LoraAdapter;
use crate::error::{ModelError, Result, TroupeError};
use crate::fsutil::write_dir_atomic;
use crate::model::safetensors_io::{write_f32_tensors, F32Tensor, TensorStore};
use crate::model::weights::WeightSource;

/// Files of a model directory copied unchanged into the merged one, when present.
const COPIED_FILES: [&str; 5] =
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"];

/// A base's tensors (a source to read them from, and each one's name and shape), and the
/// files written beside them (name, text).
type BaseParts = (Box<dyn WeightSource>, Vec<(String, Vec<usize>)>, Vec<(&'static str, String)>);

/// The tensors of a GGUF base (read dequantized), and its configuration and tokenizer as
/// Hugging Face files.
fn gguf_parts(path: &Path) -> Result<BaseParts> {
    let (config, tokenizer, weights) = crate::model::gguf::open(path)?;
    let eos = config.eos_token_ids.first().copied().unwrap_or(0);
    let json = |value: serde_json::Value| serde_json::to_string_pretty(&value).expect("JSON serializes");
    let tokenizer_json = tokenizer
        .inner()
        .to_string(true)
        .map_err(|e| TroupeError::Model(ModelError::Tokenizer { path: path.to_path_buf(), message: e.to_string() }))?;
    let mut tokenizer_config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.eos_token(),
        "bos_token": if tokenizer.bos_token().is_empty() { serde_json::Value::Null } else { tokenizer.bos_token().into() },
    });
    if let Some(template) = &tokenizer.chat_template {
        tokenizer_config["chat_template"] = template.clone().into();
    }
    let files = vec![
        ("config.json", json(config.to_hf_json(eos))),
        ("generation_config.json", json(serde_json::json!({"eos_token_id": config.eos_token_ids}))),
        ("tokenizer.json", tokenizer_json),
        ("tokenizer_config.json", json(tokenizer_config)),
    ];
    Ok((Box::new(weights), config.tensor_shapes(), files))
}

/// The tensors of a Hugging Face model directory.
fn safetensors_parts(dir: &Path) -> Result<BaseParts> {
    let store = TensorStore::open_model_dir(dir)?;
    let shapes = store
        .names()
        .into_iter()
        .map(|name| {
            let shape = store.shape(&name).unwrap_or_default();
            (name, shape)
        })
        .collect();
    Ok((Box::new(store), shapes, Vec::new()))
}

/// Writes the model at `model_path` (a Hugging Face directory or a GGUF file) with `adapter`
/// merged in to `out` as a Hugging Face directory (f32 weights). `out` appears whole or not at
/// all. Each tensor is read, merged and written in turn, so the merge holds one tensor (and its
/// delta) in memory, not the model.
pub fn merge_into_model_dir(model_path: &Path, adapter: &LoraAdapter, out: &Path, device: &Device) -> Result<()> {
    let model_dir = model_path;
    let (source, shapes, side_files) = if crate::model::gguf::is_gguf_path(model_path) {
        gguf_parts(model_path)?
    } else {
        safetensors_parts(model_dir)?
    };
    // Every targeted projection is checked before anything is written.
    let shape_of: HashMap<&str, &Vec<usize>> = shapes.iter().map(|(name, shape)| (name.as_str(), shape)).collect();
    let mut pairs = HashMap::new();
    for ((layer, projection), pair) in &adapter.pairs {
        let name = format!("model.layers.{layer}.{}.weight", projection.path());
        let shape = *shape_of.get(name.as_str()).ok_or_else(|| {
            TroupeError::Model(ModelError::MissingTensor { path: model_dir.to_path_buf(), tensor: name.clone() })
        })?;
        let expected = vec![pair.b.dims()[0], pair.a.dims()[1]];
        if *shape != expected {
            return Err(TroupeError::Model(ModelError::ShapeMismatch {
                path: model_dir.to_path_buf(),
                tensor: name,
                expected,
                got: shape.clone(),
            }));
        }
        pairs.insert(name, pair);
    }
    let scale = adapter.config.scale();
    let (source, pairs) = (source.as_ref(), &pairs);
    let tensors = shapes.iter().map(|(name, shape)| {
        let values = move || {
            let mut weight = source.read(name, shape)?;
            if let Some(pair) = pairs.get(name) {
                let delta = pair.b.clone().to_device(device).matmul(pair.a.clone().to_device(device)) * scale;
                let delta = crate::readback::to_vec(delta, crate::readback::Stage::Saving)?;
                for (w, d) in weight.values.iter_mut().zip(delta) {
                    *w += d;
                }
            }
            Ok(Cow::Owned(weight.values))
        };
        (name.clone(), F32Tensor::fallible(shape.clone(), values))
    });
    write_dir_atomic(out, |staging| {
        for (file, text) in &side_files {
            let path = staging.join(file);
            std::fs::write(&path, text).map_err(|e| TroupeError::io(&path, e))?;
        }
        for file in COPIED_FILES {
            let src = model_dir.join(file);
            if side_files.is_empty() && src.exists() {
                std::fs::copy(&src, staging.join(file)).map_err(|e| TroupeError::io(&src, e))?;
            }
        }
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        write_f32_tensors(&staging.join("model.safetensors"), tensors, Some(metadata))
    })
}
