//! The model configuration from a GGUF file's metadata (llama.cpp's key names,
//! `{arch}.embedding_length`, `{arch}.attention.head_count`, ...), and the map from troupe's
//! (Hugging Face) tensor names to GGUF's (`model.layers.0.self_attn.q_proj.weight` ->
//! `blk.0.attn_q.weight`).

use super::container::GgufFile;
use crate::error::{Result, TroupeError};
use crate::model::{ModelConfig, ModelType};

/// The architectures troupe reads, by their `general.architecture` name.
fn model_type(file: &GgufFile) -> Result<(ModelType, String)> {
    let arch = file.require_string("general.architecture")?.to_string();
    let model_type = match arch.as_str() {
        "llama" => ModelType::Llama,
        "qwen2" => ModelType::Qwen2,
        "qwen3" => ModelType::Qwen3,
        _ => {
            return Err(TroupeError::BadValue {
                origin: Some(file.path().to_path_buf()),
                key: "general.architecture".into(),
                message: format!("{arch:?} is not supported (supported: llama, qwen2, qwen3)"),
            })
        }
    };
    Ok((model_type, arch))
}

/// Reads the configuration of a Llama / Qwen2 / Qwen3 GGUF file. Biases and tied embeddings are
/// read off the tensor directory (a file has `blk.0.attn_q.bias` or not, `output.weight` or not),
/// as transformers' GGUF loader does; the EOS ids are the tokenizer's (`tokenizer.ggml.eos_token_id`
/// and, where present, `tokenizer.ggml.eot_token_id`).
pub fn read_config(file: &GgufFile) -> Result<ModelConfig> {
    let (model_type, arch) = model_type(file)?;
    let key = |name: &str| format!("{arch}.{name}");
    let positive = |name: &str| -> Result<usize> {
        match file.require_uint(&key(name))? {
            0 => Err(file.error(format!("metadata `{}` must be positive", key(name)))),
            v => Ok(v as usize),
        }
    };
    let hidden_size = positive("embedding_length")?;
    let num_attention_heads = positive("attention.head_count")?;
    let num_key_value_heads = match file.uint(&key("attention.head_count_kv"))? {
        Some(0) => return Err(file.error(format!("metadata `{}` must be positive", key("attention.head_count_kv")))),
        Some(v) => v as usize,
        None => num_attention_heads,
    };
    if num_attention_heads % num_key_value_heads != 0 {
        return Err(file.error(format!(
            "metadata `{}` = {num_key_value_heads} does not divide `{}` = {num_attention_heads}",
            key("attention.head_count_kv"),
            key("attention.head_count")
        )));
    }
    let head_dim = match file.uint(&key("attention.key_length"))? {
        Some(d) => d as usize,
        None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
        None => {
            return Err(file.error(format!(
            "metadata `{}` is missing and `{}` {hidden_size} is not a multiple of the head count {num_attention_heads}",
            key("attention.key_length"),
            key("embedding_length")
        )))
        }
    };
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(file.error(format!("head width {head_dim} must be positive and even for rotary embeddings")));
    }
    if let Some(value_length) = file.uint(&key("attention.value_length"))? {
        if value_length as usize != head_dim {
            return Err(file.error(format!(
                "metadata `{}` {value_length} differs from the key width {head_dim} (not supported)",
                key("attention.value_length")
            )));
        }
    }
    if let Some(rope_dims) = file.uint(&key("rope.dimension_count"))? {
        if rope_dims as usize != head_dim {
            return Err(file.error(format!(
                "metadata `{}` {rope_dims} differs from the head width {head_dim} (partial rotary embeddings are not supported)",
                key("rope.dimension_count")
            )));
        }
    }
    if let Some(kind) = file.string(&key("rope.scaling.type"))? {
        if kind != "none" {
            return Err(file.error(format!(
                "metadata `{}` {kind:?} is not supported (only the default rotary embedding)",
                key("rope.scaling.type")
            )));
        }
    }
    let rope_theta = file.float(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(file.error(format!("metadata `{}` {rope_theta} is not a positive number", key("rope.freq_base"))));
    }
    let rms_norm_eps = file.float(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6);
    let vocab_size = match file.uint(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => file.strings("tokenizer.ggml.tokens")?.map(|t| t.len()).ok_or_else(|| {
            file.error(format!("metadata `{}` and `tokenizer.ggml.tokens` are both missing", key("vocab_size")))
        })?,
    };
    let has = |name: &str| file.tensor(name).is_some();
    let attention_bias = has("blk.0.attn_q.bias");
    let (qkv_bias, o_bias, mlp_bias) = match model_type {
        ModelType::Qwen2 => (true, false, false),
        ModelType::Qwen3 => (attention_bias, has("blk.0.attn_output.bias"), false),
        ModelType::Llama => (attention_bias, has("blk.0.attn_output.bias"), has("blk.0.ffn_up.bias")),
    };
    let mut eos_token_ids = Vec::new();
    for name in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(id) = file.uint(name)? {
            if !eos_token_ids.contains(&(id as u32)) {
                eos_token_ids.push(id as u32);
            }
        }
    }
    Ok(ModelConfig {
        model_type,
        vocab_size,
        hidden_size,
        intermediate_size: positive("feed_forward_length")?,
        num_hidden_layers: positive("block_count")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps,
        rope_theta,
        max_position_embeddings: file.uint(&key("context_length"))?.map_or(4096, |v| v as usize),
        tie_word_embeddings: !has("output.weight"),
        qkv_bias,
        o_bias,
        mlp_bias,
        eos_token_ids,
    })
}

/// The GGUF name of a tensor troupe names as Hugging Face does, or `None` for a name GGUF files
/// do not have.
pub fn gguf_name(hf_name: &str) -> Option<String> {
    match hf_name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let short = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{short}.{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_llama_cpp() {
        assert_eq!(gguf_name("model.layers.12.self_attn.q_proj.weight").unwrap(), "blk.12.attn_q.weight");
        assert_eq!(gguf_name("model.layers.0.self_attn.k_proj.bias").unwrap(), "blk.0.attn_k.bias");
        assert_eq!(gguf_name("model.layers.3.mlp.down_proj.weight").unwrap(), "blk.3.ffn_down.weight");
        assert_eq!(gguf_name("model.layers.1.self_attn.k_norm.weight").unwrap(), "blk.1.attn_k_norm.weight");
        assert_eq!(gguf_name("lm_head.weight").unwrap(), "output.weight");
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
    }
}
