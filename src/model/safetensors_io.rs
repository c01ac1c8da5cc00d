//! Reading and writing safetensors files: one file or a sharded set
//! (`model.safetensors.index.json`), f32/f16/bf16 on disk, f32 in memory. Writes are atomic.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor, TensorData};
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;

use crate::error::{ModelError, Result, TroupeError};
use crate::fsutil::write_atomic;

/// One safetensors file held in memory with its parsed (and validated) header.
struct SafetensorsFile {
    path: PathBuf,
    bytes: Vec<u8>,
    header_len: usize,
    metadata: Metadata,
}

/// A set of safetensors files read as one name -> tensor map.
pub struct TensorStore {
    /// What error messages name: the file, or the directory for a sharded checkpoint.
    origin: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Tensor name -> index into `files`.
    index: HashMap<String, usize>,
}

/// A tensor read from disk, converted to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Row-major values.
    pub values: Vec<f32>,
    /// The shape.
    pub shape: Vec<usize>,
}

impl HostTensor {
    /// Refuses a tensor holding a NaN or an infinity: `name` in file `path`, with the first
    /// such value's index (weights that are not finite give NaN log-probabilities and updates).
    pub fn check_finite(&self, path: &Path, name: &str) -> Result<()> {
        match self.values.iter().position(|value| !value.is_finite()) {
            None => Ok(()),
            Some(index) => Err(TroupeError::Model(crate::error::ModelError::Safetensors {
                path: path.to_path_buf(),
                message: format!(
                    "tensor `{name}` holds a non-finite value ({} at index {index} of {})",
                    self.values[index],
                    self.values.len()
                ),
            })),
        }
    }

    /// Uploads to `device` as a rank-`D` tensor.
    ///
    /// # Panics
    /// If `shape` does not have `D` dimensions (callers check shapes first).
    pub fn to_device<const D: usize>(&self, device: &Device) -> Tensor<D> {
        Tensor::from_data(TensorData::new(self.values.clone(), self.shape.clone()), device)
    }

    /// `tensor` read back to the host for writing, or the device's failure
    /// ([`crate::readback::Stage::Saving`]).
    pub fn read_back<const D: usize>(tensor: &Tensor<D>) -> Result<Self> {
        let values = crate::readback::to_vec(tensor.clone(), crate::readback::Stage::Saving)?;
        Ok(Self { values, shape: tensor.dims().to_vec() })
    }
}

impl TensorStore {
    /// Opens the weights of a model directory: `model.safetensors`, or every shard listed in
    /// `model.safetensors.index.json`.
    pub fn open_model_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        if single.exists() {
            return Self::open_files(std::slice::from_ref(&single), single.clone());
        }
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| TroupeError::io(&index_path, e))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| TroupeError::Json { path: index_path.clone(), message: e.to_string() })?;
            let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| TroupeError::BadValue {
                origin: Some(index_path.clone()),
                key: "weight_map".into(),
                message: "missing or not an object".into(),
            })?;
            let mut shards: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
            shards.sort();
            shards.dedup();
            let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
            return Self::open_files(&paths, dir.to_path_buf());
        }
        Err(TroupeError::io(
            &single,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no model.safetensors or model.safetensors.index.json in the model directory",
            ),
        ))
    }

    /// Opens one or more safetensors files; `origin` names the set in error messages.
    pub fn open_files(paths: &[PathBuf], origin: PathBuf) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (file_index, path) in paths.iter().enumerate() {
            let bytes = std::fs::read(path).map_err(|e| TroupeError::io(path, e))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| {
                TroupeError::Model(ModelError::Safetensors { path: path.clone(), message: describe_error(&e) })
            })?;
            for name in metadata.tensors().keys() {
                index.insert(name.clone(), file_index);
            }
            files.push(SafetensorsFile { path: path.clone(), bytes, header_len, metadata });
        }
        Ok(Self { origin, files, index })
    }

    /// The file or directory this store was read from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.index.keys().cloned().collect();
        names.sort();
        names
    }

    /// The shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let file = &self.files[*self.index.get(name)?];
        file.metadata.info(name).map(|info| info.shape.clone())
    }

    /// The stored dtype's name (`F32`, `BF16`, ...) and the number of values of a tensor, if present.
    pub fn dtype_and_len(&self, name: &str) -> Option<(String, usize)> {
        let file = &self.files[*self.index.get(name)?];
        file.metadata.info(name).map(|info| (format!("{:?}", info.dtype), info.shape.iter().product()))
    }

    /// Reads a tensor as f32, checking its shape when `expected` is given.
    pub fn read(&self, name: &str, expected: Option<&[usize]>) -> Result<HostTensor> {
        let missing =
            || TroupeError::Model(ModelError::MissingTensor { path: self.origin.clone(), tensor: name.to_string() });
        let file = &self.files[*self.index.get(name).ok_or_else(missing)?];
        let info = file.metadata.info(name).ok_or_else(missing)?;
        if let Some(expected) = expected {
            if info.shape != expected {
                return Err(TroupeError::Model(ModelError::ShapeMismatch {
                    path: file.path.clone(),
                    tensor: name.to_string(),
                    expected: expected.to_vec(),
                    got: info.shape.clone(),
                }));
            }
        }
        let start = 8 + file.header_len + info.data_offsets.0;
        let end = 8 + file.header_len + info.data_offsets.1;
        let raw = &file.bytes[start..end];
        let values = decode_f32(raw, info.dtype).ok_or_else(|| {
            TroupeError::Model(ModelError::Safetensors {
                path: file.path.clone(),
                message: format!("tensor `{name}` has dtype {:?}; troupe reads F32, F16 and BF16", info.dtype),
            })
        })?;
        Ok(HostTensor { values, shape: info.shape.clone() })
    }

    /// Reads a tensor, checks its shape, and uploads it to `device`.
    pub fn load<const D: usize>(&self, name: &str, shape: [usize; D], device: &Device) -> Result<Tensor<D>> {
        Ok(self.read(name, Some(&shape))?.to_device(device))
    }
}

/// Little-endian bytes of `dtype` to f32 values, or `None` for an unsupported dtype.
fn decode_f32(raw: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::F16 => raw.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::BF16 => raw.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        _ => return None,
    })
}

/// Turns safetensors' error into a sentence a user can act on.
fn describe_error(err: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match err {
        E::MetadataIncompleteBuffer | E::HeaderTooSmall | E::InvalidHeaderLength => {
            format!("not a complete safetensors file (truncated or corrupt): {err}")
        }
        _ => format!("not a valid safetensors file: {err}"),
    }
}

/// Writes f32 tensors to a safetensors file atomically (temp file + rename), with optional
/// string metadata (`{"format": "pt"}` is what PEFT and transformers write).
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let bytes_per_tensor: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(name, t)| {
            let bytes: Vec<u8> = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.clone(), bytes, t.shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes_per_tensor
        .iter()
        .map(|(name, bytes, shape)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), bytes)
                .expect("byte length matches shape by construction");
            (name.clone(), view)
        })
        .collect();
    let serialized = safetensors::serialize(views, metadata).map_err(|e| {
        TroupeError::Model(ModelError::Safetensors { path: path.to_path_buf(), message: e.to_string() })
    })?;
    write_atomic(path, &serialized)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_shape_check() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let mut tensors = BTreeMap::new();
        tensors.insert("a".to_string(), HostTensor { values: vec![1.0, -2.5, 3.0, 4.0], shape: vec![2, 2] });
        write_safetensors(&path, &tensors, None).unwrap();
        let store = TensorStore::open_files(std::slice::from_ref(&path), path.clone()).unwrap();
        assert_eq!(store.read("a", Some(&[2, 2])).unwrap(), tensors["a"]);
        let err = store.read("a", Some(&[4])).unwrap_err().to_string();
        assert!(err.contains("`a` has shape [2, 2], expected [4]"), "{err}");
        let err = store.read("b", None).unwrap_err().to_string();
        assert!(err.contains("tensor `b` is missing"), "{err}");
    }

    #[test]
    fn truncated_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let mut tensors = BTreeMap::new();
        tensors.insert("a".to_string(), HostTensor { values: vec![0.0; 64], shape: vec![64] });
        write_safetensors(&path, &tensors, None).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
        let err = TensorStore::open_files(std::slice::from_ref(&path), path.clone()).err().unwrap().to_string();
        assert!(err.contains("t.safetensors") && err.contains("truncated"), "{err}");
    }

    #[test]
    fn decodes_half_precision() {
        let bf = half::bf16::from_f32(1.5).to_le_bytes();
        assert_eq!(decode_f32(&bf, Dtype::BF16).unwrap(), vec![1.5]);
        let f = half::f16::from_f32(-0.25).to_le_bytes();
        assert_eq!(decode_f32(&f, Dtype::F16).unwrap(), vec![-0.25]);
        assert!(decode_f32(&[0, 0], Dtype::I16).is_none());
    }
}
