//! A GGUF file as a [`WeightSource`]: troupe asks for Hugging Face tensor names, gets them
//! dequantized to f32 (or as raw blocks for the kept-quantized base), with llama.cpp's Q/K row
//! permutation of Llama files undone.
//!
//! llama.cpp's converter stores a Llama model's `q_proj` and `k_proj` rows permuted (per head,
//! from the rotate-half layout transformers uses to the interleaved pairs of ggml's rope). As
//! transformers' GGUF loader does, troupe reverses it: within each head of width `2 * dim`, HF row
//! `half * dim + i` is file row `2 * i + half`. Whole rows move, so the same reordering applies to
//! quantized rows without touching a block.

use super::config::gguf_name;
use super::container::{GgufFile, TensorEntry};
use super::dequant::dequantize;
use crate::error::{ModelError, Result, TroupeError};
use crate::model::safetensors_io::HostTensor;
use crate::model::weights::{BlockMatrix, WeightSource};
use crate::model::{ModelConfig, ModelType};

/// Reorders the rows of a Llama `q_proj` / `k_proj` (weight or bias) from llama.cpp's
/// interleaved layout back to transformers' rotate-half one. `row_len` is the length of one row
/// in `T`s; `heads` the number of heads the rows split into.
pub fn unpermute_rows<T: Copy>(data: &[T], row_len: usize, heads: usize) -> Vec<T> {
    let rows = data.len() / row_len.max(1);
    let dim = rows / heads / 2;
    let mut out = Vec::with_capacity(data.len());
    for head in 0..heads {
        for half in 0..2 {
            for i in 0..dim {
                let row = head * 2 * dim + 2 * i + half;
                out.extend_from_slice(&data[row * row_len..(row + 1) * row_len]);
            }
        }
    }
    out
}

/// The tensors of a Llama / Qwen2 / Qwen3 GGUF file under their Hugging Face names.
#[derive(Debug)]
pub struct GgufWeights {
    file: GgufFile,
    model_type: ModelType,
    num_attention_heads: usize,
    num_key_value_heads: usize,
}

impl GgufWeights {
    /// Wraps an open file whose configuration is `config`.
    pub fn new(file: GgufFile, config: &ModelConfig) -> Self {
        Self {
            file,
            model_type: config.model_type,
            num_attention_heads: config.num_attention_heads,
            num_key_value_heads: config.num_key_value_heads,
        }
    }

    /// The file.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// The directory entry for the HF name `name`, checked against `shape`.
    fn entry(&self, name: &str, shape: &[usize]) -> Result<&TensorEntry> {
        let missing = || {
            TroupeError::Model(ModelError::MissingTensor {
                path: self.file.path().to_path_buf(),
                tensor: name.to_string(),
            })
        };
        let gguf = gguf_name(name).ok_or_else(missing)?;
        let entry = self.file.tensor(&gguf).ok_or_else(|| {
            TroupeError::Model(ModelError::MissingTensor { path: self.file.path().to_path_buf(), tensor: gguf.clone() })
        })?;
        if entry.shape != shape {
            return Err(TroupeError::Model(ModelError::ShapeMismatch {
                path: self.file.path().to_path_buf(),
                tensor: gguf,
                expected: shape.to_vec(),
                got: entry.shape.clone(),
            }));
        }
        Ok(entry)
    }

    /// The number of heads whose rows llama.cpp permuted in tensor `name`, if it did.
    fn permuted_heads(&self, name: &str) -> Option<usize> {
        if self.model_type != ModelType::Llama {
            return None;
        }
        if name.contains(".self_attn.q_proj.") {
            Some(self.num_attention_heads)
        } else if name.contains(".self_attn.k_proj.") {
            Some(self.num_key_value_heads)
        } else {
            None
        }
    }

    /// Reads the matrix `name` (`[rows, cols]`) in its stored block format, rows in the Hugging
    /// Face order.
    pub fn read_blocks(&self, name: &str, rows: usize, cols: usize) -> Result<BlockMatrix> {
        let entry = self.entry(name, &[rows, cols])?;
        let ggml_type = entry.ggml_type;
        let mut bytes = self.file.tensor_bytes(&entry.name)?;
        if let Some(heads) = self.permuted_heads(name) {
            bytes = unpermute_rows(&bytes, bytes.len() / rows, heads);
        }
        Ok(BlockMatrix { ggml_type, rows, cols, bytes })
    }
}

impl WeightSource for GgufWeights {
    fn read(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let entry = self.entry(name, shape)?;
        let bytes = self.file.tensor_bytes(&entry.name)?;
        let mut values = vec![0.0f32; entry.len()];
        dequantize(entry.ggml_type, &bytes, &mut values);
        if let Some(heads) = self.permuted_heads(name) {
            let row_len = if shape.len() == 2 { shape[1] } else { 1 };
            values = unpermute_rows(&values, row_len, heads);
        }
        Ok(HostTensor { values, shape: shape.to_vec() })
    }

    fn read_blocks(&self, name: &str, rows: usize, cols: usize) -> Result<Option<BlockMatrix>> {
        GgufWeights::read_blocks(self, name, rows, cols).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: reshape(heads, 2, dim, ...).swapaxes(1, 2): file row (h, i, half) holds HF
        // row (h, half, i). Two heads of width 6 (dim 3), rows labelled by their HF index.
        let (heads, dim) = (2, 3);
        let hf: Vec<usize> = (0..heads * 2 * dim).collect();
        let mut file = vec![0; hf.len()];
        for h in 0..heads {
            for half in 0..2 {
                for i in 0..dim {
                    file[h * 2 * dim + 2 * i + half] = hf[h * 2 * dim + half * dim + i];
                }
            }
        }
        assert_eq!(unpermute_rows(&file, 1, heads), hf);
        let wide: Vec<usize> = file.iter().flat_map(|&r| [r, r]).collect();
        assert_eq!(unpermute_rows(&wide, 2, heads), hf.iter().flat_map(|&r| [r, r]).collect::<Vec<_>>());
    }
}
