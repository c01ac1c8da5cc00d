//! `config.json` parsing: the Hugging Face fields of Llama, Qwen2 and Qwen3 causal LMs, in both
//! the transformers 4.x layout (`rope_theta` at top level) and the 5.x one (`rope_parameters`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{ModelError, Result, TroupeError};

/// The architectures troupe implements (`model_type` in `config.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelType {
    /// Llama: optional `attention_bias` on q,k,v,o and `mlp_bias`.
    Llama,
    /// Qwen2: biases on q,k,v (none on o).
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k (`q_norm`, `k_norm`), explicit `head_dim`.
    Qwen3,
}

impl ModelType {
    /// The name as `config.json` writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::Qwen2 => "qwen2",
            ModelType::Qwen3 => "qwen3",
        }
    }

    /// The `architectures` entry transformers uses for this type.
    pub fn architecture(self) -> &'static str {
        match self {
            ModelType::Llama => "LlamaForCausalLM",
            ModelType::Qwen2 => "Qwen2ForCausalLM",
            ModelType::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// A resolved model configuration: every field the transformer needs, defaults applied.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The architecture.
    pub model_type: ModelType,
    /// Rows of the embedding and of the LM head.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Width of one head (may differ from hidden_size / heads, as in Qwen3).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Longest position the model was trained for.
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the o projection.
    pub o_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// End-of-sequence ids from `config.json` (`generation_config.json` may add more).
    pub eos_token_ids: Vec<u32>,
}

/// `config.json` as Hugging Face writes it; unknown fields are ignored.
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    eos_token_id: Option<Value>,
}

/// Reads an `eos_token_id` value: an integer, a list of integers, or null.
pub(crate) fn parse_token_ids(value: Option<&Value>) -> Option<Vec<u32>> {
    match value? {
        Value::Number(n) => n.as_u64().map(|id| vec![id as u32]),
        Value::Array(items) => items.iter().map(|v| v.as_u64().map(|id| id as u32)).collect(),
        _ => None,
    }
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TroupeError::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parses `config.json` text; `path` is used in error messages only.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| TroupeError::Json { path: path.to_path_buf(), message: e.to_string() })?;
        let field_error = |field: &str, message: &str| TroupeError::BadValue {
            origin: Some(path.to_path_buf()),
            key: field.to_string(),
            message: message.to_string(),
        };
        let required = |value: Option<usize>, field: &str| -> Result<usize> {
            match value {
                Some(0) => Err(field_error(field, "must be positive")),
                Some(v) => Ok(v),
                None => Err(field_error(field, "missing")),
            }
        };
        let model_type_name = raw.model_type.clone().ok_or_else(|| field_error("model_type", "missing"))?;
        let model_type = match model_type_name.as_str() {
            "llama" => ModelType::Llama,
            "qwen2" => ModelType::Qwen2,
            "qwen3" => ModelType::Qwen3,
            _ => {
                return Err(TroupeError::Model(ModelError::UnsupportedModelType {
                    path: path.to_path_buf(),
                    model_type: model_type_name,
                }))
            }
        };
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(field_error("hidden_act", &format!("{act:?} is not supported (only silu)")));
            }
        }
        let hidden_size = required(raw.hidden_size, "hidden_size")?;
        let num_attention_heads = required(raw.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads =
            required(raw.num_key_value_heads.or(Some(num_attention_heads)), "num_key_value_heads")?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(field_error(
                "num_key_value_heads",
                &format!("{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"),
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => required(Some(d), "head_dim")?,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(field_error(
                        "head_dim",
                        "missing, and hidden_size is not a multiple of num_attention_heads",
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(field_error("head_dim", "must be even for rotary embeddings"));
        }
        let rope_theta = Self::rope_theta(&raw, path)?;
        let (qkv_bias, o_bias, mlp_bias) = match model_type {
            ModelType::Qwen2 => (true, false, false),
            ModelType::Qwen3 => {
                let bias = raw.attention_bias.unwrap_or(false);
                (bias, bias, false)
            }
            ModelType::Llama => {
                let bias = raw.attention_bias.unwrap_or(false);
                (bias, bias, raw.mlp_bias.unwrap_or(false))
            }
        };
        Ok(Self {
            model_type,
            vocab_size: required(raw.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: required(raw.intermediate_size, "intermediate_size")?,
            num_hidden_layers: required(raw.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            eos_token_ids: parse_token_ids(raw.eos_token_id.as_ref()).unwrap_or_default(),
        })
    }

    /// `rope_theta` from the top level (4.x) or `rope_parameters` (5.x); only the default
    /// (unscaled) rotary embedding is implemented, so a scaling type is refused by name.
    fn rope_theta(raw: &RawConfig, path: &Path) -> Result<f64> {
        let field_error = |field: &str, message: String| TroupeError::BadValue {
            origin: Some(path.to_path_buf()),
            key: field.to_string(),
            message,
        };
        for (field, params) in [("rope_parameters", &raw.rope_parameters), ("rope_scaling", &raw.rope_scaling)] {
            if let Some(Value::Object(map)) = params {
                let kind = map.get("rope_type").or_else(|| map.get("type")).and_then(Value::as_str);
                if let Some(kind) = kind {
                    if kind != "default" {
                        return Err(field_error(
                            &format!("{field}.rope_type"),
                            format!("{kind:?} is not supported (only the default rotary embedding)"),
                        ));
                    }
                }
            }
        }
        let nested = match &raw.rope_parameters {
            Some(Value::Object(map)) => map.get("rope_theta").and_then(Value::as_f64),
            _ => None,
        };
        let theta = nested.or(raw.rope_theta).unwrap_or(10_000.0);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(field_error("rope_theta", format!("{theta} is not a positive number")));
        }
        Ok(theta)
    }

    /// Every tensor of a Hugging Face checkpoint of this configuration, with its shape
    /// (`model.embed_tokens.weight` first, `lm_head.weight` last when untied).
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let mut shapes = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for layer in 0..self.num_hidden_layers {
            let prefix = format!("model.layers.{layer}");
            shapes.push((format!("{prefix}.input_layernorm.weight"), vec![h]));
            shapes.push((format!("{prefix}.post_attention_layernorm.weight"), vec![h]));
            if self.model_type == ModelType::Qwen3 {
                shapes.push((format!("{prefix}.self_attn.q_norm.weight"), vec![self.head_dim]));
                shapes.push((format!("{prefix}.self_attn.k_norm.weight"), vec![self.head_dim]));
            }
            for projection in super::Projection::ALL {
                let (input, output) = projection.dims(self);
                let path = format!("{prefix}.{}", projection.path());
                shapes.push((format!("{path}.weight"), vec![output, input]));
                let bias = match projection {
                    super::Projection::Q | super::Projection::K | super::Projection::V => self.qkv_bias,
                    super::Projection::O => self.o_bias,
                    _ => self.mlp_bias,
                };
                if bias {
                    shapes.push((format!("{path}.bias"), vec![output]));
                }
            }
        }
        shapes.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            shapes.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        shapes
    }

    /// Total parameter count (embedding counted once when tied).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut attention = h * q + 2 * h * kv + q * h;
        if self.qkv_bias {
            attention += q + 2 * kv;
        }
        if self.o_bias {
            attention += h;
        }
        if self.model_type == ModelType::Qwen3 {
            attention += 2 * self.head_dim;
        }
        let mut mlp = 3 * h * self.intermediate_size;
        if self.mlp_bias {
            mlp += 2 * self.intermediate_size + h;
        }
        let layer = attention + mlp + 2 * h;
        let embeddings = self.vocab_size * h * if self.tie_word_embeddings { 1 } else { 2 };
        self.num_hidden_layers * layer + embeddings + h
    }

    /// The `config.json` transformers writes for this configuration (5.x layout, which 4.x
    /// versions also read).
    pub fn to_hf_json(&self, eos_token_id: u32) -> Value {
        let mut json = serde_json::json!({
            "architectures": [self.model_type.architecture()],
            "model_type": self.model_type.as_str(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "attention_dropout": 0.0,
            "bos_token_id": Value::Null,
            "eos_token_id": eos_token_id,
            "pad_token_id": Value::Null,
            "use_cache": true,
            "dtype": "float32",
            "torch_dtype": "float32",
        });
        if self.model_type == ModelType::Llama {
            json["mlp_bias"] = Value::Bool(self.mlp_bias);
        }
        if self.model_type == ModelType::Qwen2 {
            json.as_object_mut().expect("object").remove("attention_bias");
        }
        json
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(text, Path::new("config.json"))
    }

    const BASE: &str = r#""vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2"#;

    #[test]
    fn reads_rope_theta_from_either_layout() {
        let old = parse(&format!(r#"{{"model_type": "qwen2", {BASE}, "rope_theta": 5.0}}"#)).unwrap();
        assert_eq!(old.rope_theta, 5.0);
        let new = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_parameters": {{"rope_theta": 7.0, "rope_type": "default"}}}}"#
        ))
        .unwrap();
        assert_eq!(new.rope_theta, 7.0);
        assert_eq!(new.head_dim, 4);
        assert_eq!(new.num_key_value_heads, 2);
    }

    #[test]
    fn names_missing_and_bad_fields() {
        let err = parse(r#"{"model_type": "qwen3", "vocab_size": 3}"#).unwrap_err().to_string();
        assert!(err.contains("hidden_size") && err.contains("missing"), "{err}");
        let err = parse(&format!(r#"{{"model_type": "gpt2", {BASE}}}"#)).unwrap_err().to_string();
        assert!(err.contains("unsupported model_type \"gpt2\""), "{err}");
        let err =
            parse(&format!(r#"{{"model_type": "llama", {BASE}, "num_key_value_heads": 3}}"#)).unwrap_err().to_string();
        assert!(err.contains("num_key_value_heads"), "{err}");
        let err = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("rope_scaling.rope_type") && err.contains("yarn"), "{err}");
        let err = parse("{not json").unwrap_err().to_string();
        assert!(err.starts_with("config.json:"), "{err}");
    }

    #[test]
    fn biases_follow_the_family() {
        let q2 = parse(&format!(r#"{{"model_type": "qwen2", {BASE}}}"#)).unwrap();
        assert!(q2.qkv_bias && !q2.o_bias && !q2.mlp_bias);
        let llama =
            parse(&format!(r#"{{"model_type": "llama", {BASE}, "attention_bias": true, "mlp_bias": true}}"#)).unwrap();
        assert!(llama.qkv_bias && llama.o_bias && llama.mlp_bias);
    }

    #[test]
    fn eos_ids_accept_int_or_list() {
        let one = parse(&format!(r#"{{"model_type": "qwen3", {BASE}, "eos_token_id": 4}}"#)).unwrap();
        assert_eq!(one.eos_token_ids, vec![4]);
        let many = parse(&format!(r#"{{"model_type": "qwen3", {BASE}, "eos_token_id": [1, 2]}}"#)).unwrap();
        assert_eq!(many.eos_token_ids, vec![1, 2]);
    }
}
