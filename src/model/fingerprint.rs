//! A fingerprint of a base model's weights, recorded with the adapters trained on it
//! (`troupe.json`'s `base_fingerprint`) so that adapters loaded onto another base with the same
//! shapes (a different checkpoint, another seed of the built-in model) are not used silently.
//!
//! It hashes the architecture's sizes and a fixed sample of the weights (the first rows of the
//! token embeddings, the first columns of the output head, the final norm), so it costs a few
//! thousand values whatever the model's size.

use super::config::ModelConfig;
use super::host::transpose_host;
use super::transformer::CausalLm;
use super::weights::WeightSource;
use crate::error::Result;

/// Rows of the embedding matrix (and columns of the output head) hashed.
const SAMPLED_ROWS: usize = 8;

fn fnv1a(hash: &mut u64, bytes: &[u8]) {
    for byte in bytes {
        *hash ^= u64::from(*byte);
        *hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// The fingerprint of `lm`'s weights: `fnv1a64:<16 hex digits>`. The same for the base held in
/// f32, bf16 or f16, or kept quantized, so adapters move between them: a base held in bf16 or
/// f16 carries the fingerprint of its f32 weights, taken when it was loaded
/// ([`source_fingerprint`]).
pub fn base_fingerprint(lm: &CausalLm) -> String {
    if let Some(fingerprint) = lm.source_fingerprint() {
        return fingerprint.to_string();
    }
    // The same values whether the base is held in f32 or kept quantized (its blocks dequantize
    // to exactly the f32 base's weights), so adapters move between the two.
    let [vocab, _] = lm.embed_tokens.dims();
    let mut sample = lm.embed_tokens.first_rows(SAMPLED_ROWS.min(vocab));
    let [head_out, _] = lm.lm_head.dims();
    sample.extend(lm.lm_head.first_columns(SAMPLED_ROWS.min(head_out)));
    sample.extend(lm.norm.weight.to_data().convert::<f32>().try_into_vec::<f32>().unwrap_or_default());
    hash_sample(&lm.config, sample)
}

/// What [`base_fingerprint`] gives for the f32 base of `config` whose weights `source` holds.
pub(crate) fn source_fingerprint(config: &ModelConfig, source: &dyn WeightSource) -> Result<String> {
    let (vocab, hidden) = (config.vocab_size, config.hidden_size);
    let rows = SAMPLED_ROWS.min(vocab);
    let embedding = source.read("model.embed_tokens.weight", &[vocab, hidden])?.values;
    let mut sample = embedding[..rows * hidden].to_vec();
    let head_rows = if config.tie_word_embeddings {
        sample.clone()
    } else {
        source.read("lm_head.weight", &[vocab, hidden])?.values[..rows * hidden].to_vec()
    };
    sample.extend(transpose_host(&head_rows, rows, hidden));
    sample.extend(source.read("model.norm.weight", &[hidden])?.values);
    Ok(hash_sample(config, sample))
}

/// The hash of `config`'s sizes and the sampled weights.
fn hash_sample(config: &ModelConfig, sample: Vec<f32>) -> String {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for size in [config.vocab_size, config.hidden_size, config.num_hidden_layers, config.intermediate_size] {
        fnv1a(&mut hash, &(size as u64).to_le_bytes());
    }
    for value in sample {
        fnv1a(&mut hash, &value.to_bits().to_le_bytes());
    }
    format!("fnv1a64:{hash:016x}")
}
