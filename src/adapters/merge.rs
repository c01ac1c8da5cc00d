//! Merging an adapter into its base: `W' = W + scale * B A` for every targeted projection,
//! written as a plain Hugging Face model directory (for deployment where LoRA is not wanted).
//! The base is a Hugging Face directory or a GGUF file (dequantized; its config, tokenizer and
//! chat template are written as `config.json`, `tokenizer.json` and `tokenizer_config.json`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use burn::tensor::Device;
use half::f16;

use super::lora::LoraAdapter;
use crate::error::{ModelError, Result, TroupeError};
use crate::fsutil::write_dir_atomic;
use crate::model::safetensors_io::{write_f32_tensors, F32Tensor, StoredFloat, TensorStore};
use crate::model::weights::WeightSource;

/// Files of a model directory copied unchanged into the merged one, when present.
const COPIED_FILES: [&str; 5] =
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"];

/// The float type a merged model's weights are written in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MergedDtype {
    /// Each tensor in the type the base stores it in (as PEFT's `merge_and_unload` keeps the
    /// base's dtype); f32 for a GGUF base, whose blocks are dequantized.
    #[default]
    Auto,
    /// f32.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl MergedDtype {
    /// The type every tensor is written in, or `None` for `auto` (each its base's).
    fn fixed(self) -> Option<StoredFloat> {
        match self {
            Self::Auto => None,
            Self::F32 => Some(StoredFloat::F32),
            Self::Bf16 => Some(StoredFloat::Bf16),
            Self::F16 => Some(StoredFloat::F16),
        }
    }
}

/// One tensor of a base: its name, shape and the float type it is stored in.
type BaseTensor = (String, Vec<usize>, StoredFloat);

/// A base's tensors (a source to read them from, and each one's name, shape and stored type),
/// and the files written beside them (name, text).
type BaseParts = (Box<dyn WeightSource>, Vec<BaseTensor>, Vec<(&'static str, String)>);

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
    let tensors = config.tensor_shapes().into_iter().map(|(name, shape)| (name, shape, StoredFloat::F32)).collect();
    Ok((Box::new(weights), tensors, files))
}

/// The tensors of a Hugging Face model directory.
fn safetensors_parts(dir: &Path) -> Result<BaseParts> {
    let store = TensorStore::open_model_dir(dir)?;
    let tensors = store
        .names()
        .into_iter()
        .map(|name| {
            let shape = store.shape(&name).unwrap_or_default();
            // A type troupe does not read is refused by the read, before anything is written.
            let stored = store.stored_float(&name).unwrap_or(StoredFloat::F32);
            (name, shape, stored)
        })
        .collect();
    Ok((Box::new(store), tensors, Vec::new()))
}

/// Writes the model at `model_path` (a Hugging Face directory or a GGUF file) with `adapter`
/// merged in to `out` as a Hugging Face directory, its weights in `dtype`. `out` appears whole
/// or not at all. Each tensor is read, merged in f32 (`W + scale * B A`, rounded once to the
/// written type) and written in turn, so the merge holds one tensor (and its delta) in memory,
/// not the model.
pub fn merge_into_model_dir(
    model_path: &Path,
    adapter: &LoraAdapter,
    out: &Path,
    dtype: MergedDtype,
    device: &Device,
) -> Result<()> {
    let model_dir = model_path;
    let (source, base_tensors, mut side_files) = if crate::model::gguf::is_gguf_path(model_path) {
        gguf_parts(model_path)?
    } else {
        safetensors_parts(model_dir)?
    };
    // Every targeted projection is checked before anything is written.
    let shape_of: HashMap<&str, &Vec<usize>> =
        base_tensors.iter().map(|(name, shape, _)| (name.as_str(), shape)).collect();
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
    let tensors = base_tensors.iter().map(|(name, shape, stored)| {
        let written = dtype.fixed().unwrap_or(*stored);
        let values = move || {
            let mut weight = source.read(name, shape)?;
            if let Some(pair) = pairs.get(name) {
                let delta = pair.b.clone().to_device(device).matmul(pair.a.clone().to_device(device)) * scale;
                let delta = crate::readback::to_vec(delta, crate::readback::Stage::Merging)?;
                for (w, d) in weight.values.iter_mut().zip(delta) {
                    *w += d;
                }
            }
            // f16 tops out at 65504: a larger weight would be written as an infinity.
            if written == StoredFloat::F16 {
                if let Some(v) = weight.values.iter().find(|v| v.abs() > f16::MAX.to_f32()) {
                    return Err(TroupeError::BadValue {
                        origin: Some(model_dir.to_path_buf()),
                        key: "--dtype".to_string(),
                        message: format!(
                            "f16 cannot hold `{name}`'s merged weight {v} (its largest is 65504): use bf16 or f32"
                        ),
                    });
                }
            }
            Ok(Cow::Owned(weight.values))
        };
        (name.clone(), F32Tensor::fallible(shape.clone(), values).stored_as(written))
    });
    // A written type other than the base's is named in `config.json`, as transformers reads it.
    if let Some(fixed) = dtype.fixed() {
        let config_path = model_dir.join("config.json");
        let text = match side_files.iter().position(|(file, _)| *file == "config.json") {
            Some(at) => side_files.remove(at).1,
            None => std::fs::read_to_string(&config_path).map_err(|e| TroupeError::io(&config_path, e))?,
        };
        side_files.push(("config.json", with_dtype(&text, fixed, &config_path)?));
    }
    let copied_whole = !crate::model::gguf::is_gguf_path(model_path);
    write_dir_atomic(out, |staging| {
        for (file, text) in &side_files {
            let path = staging.join(file);
            std::fs::write(&path, text).map_err(|e| TroupeError::io(&path, e))?;
        }
        for file in COPIED_FILES {
            let src = model_dir.join(file);
            let written = side_files.iter().any(|(name, _)| *name == file);
            if copied_whole && !written && src.exists() {
                std::fs::copy(&src, staging.join(file)).map_err(|e| TroupeError::io(&src, e))?;
            }
        }
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        write_f32_tensors(&staging.join("model.safetensors"), tensors, Some(metadata))
    })
}

/// `config.json`'s text with its weights' type set to `dtype`: the `dtype` key transformers 5
/// writes, `torch_dtype` where the file has that (4.x) key, `dtype` where it has neither.
fn with_dtype(text: &str, dtype: StoredFloat, path: &Path) -> Result<String> {
    let mut config: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| TroupeError::Json { path: path.to_path_buf(), message: e.to_string() })?;
    let object = config.as_object_mut().ok_or_else(|| TroupeError::Json {
        path: path.to_path_buf(),
        message: "the configuration is not a JSON object".to_string(),
    })?;
    let keys: Vec<&str> = ["dtype", "torch_dtype"].into_iter().filter(|key| object.contains_key(*key)).collect();
    for key in if keys.is_empty() { vec!["dtype"] } else { keys } {
        object.insert(key.to_string(), dtype.torch_name().into());
    }
    Ok(serde_json::to_string_pretty(&config).expect("JSON serializes"))
}
