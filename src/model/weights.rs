//! Where a model's weights come from: safetensors files on disk, or tensors made in memory (the
//! built-in default model). The transformer loads through this trait and checks every shape; a
//! source that holds block-quantized matrices (GGUF) also hands them over as [`BlockMatrix`].

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor};

use super::gguf::dequant::{dequantize, GgmlType};
use super::safetensors_io::{HostTensor, TensorStore};
use crate::error::{ModelError, Result, TroupeError};

/// A matrix kept in its GGUF block format: `rows` rows of `cols` values, each row
/// `bytes.len() / rows` bytes of whole blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMatrix {
    /// The block (or float) type of every row.
    pub ggml_type: GgmlType,
    /// Number of rows (`out_features` of a projection).
    pub rows: usize,
    /// Values per row (`in_features`).
    pub cols: usize,
    /// The rows' bytes, row after row.
    pub bytes: Vec<u8>,
}

impl BlockMatrix {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }

    /// All values as f32, row-major `[rows, cols]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        dequantize(self.ggml_type, &self.bytes, &mut out);
        out
    }
}

/// A name -> tensor source with shape checking.
pub trait WeightSource {
    /// Reads the tensor `name`, which must have shape `shape`.
    fn read(&self, name: &str, shape: &[usize]) -> Result<HostTensor>;

    /// The matrix `name` (`[rows, cols]`) in the block format it is stored in, for a kept-quantized
    /// base, or `None` when the source holds floats (then the base quantizes it itself).
    fn read_blocks(&self, name: &str, rows: usize, cols: usize) -> Result<Option<BlockMatrix>> {
        let _ = (name, rows, cols);
        Ok(None)
    }
}

impl dyn WeightSource + '_ {
    /// Reads `name` (checking its shape) and uploads it to `device`.
    pub fn load<const D: usize>(&self, name: &str, shape: [usize; D], device: &Device) -> Result<Tensor<D>> {
        Ok(self.read(name, &shape)?.to_device(device))
    }
}

impl WeightSource for TensorStore {
    fn read(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        TensorStore::read(self, name, Some(shape))
    }
}

/// Tensors held in memory by name (the built-in default model before it is written anywhere).
#[derive(Clone, Debug, Default)]
pub struct MemoryWeights {
    /// Name -> tensor.
    pub tensors: BTreeMap<String, HostTensor>,
}

impl WeightSource for MemoryWeights {
    fn read(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let origin = PathBuf::from("<built-in model>");
        let tensor = self.tensors.get(name).ok_or_else(|| {
            TroupeError::Model(ModelError::MissingTensor { path: origin.clone(), tensor: name.to_string() })
        })?;
        if tensor.shape != shape {
            return Err(TroupeError::Model(ModelError::ShapeMismatch {
                path: origin,
                tensor: name.to_string(),
                expected: shape.to_vec(),
                got: tensor.shape.clone(),
            }));
        }
        Ok(tensor.clone())
    }
}
