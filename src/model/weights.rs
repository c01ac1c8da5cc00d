//! Where a model's weights come from: safetensors files on disk, or tensors made in memory (the
//! built-in default model). The transformer loads through this trait and checks every shape.

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor};

use super::gguf::BlockMatrix;
use super::safetensors_io::{HostTensor, TensorStore};
use crate::error::{ModelError, Result, TroupeError};

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
