//! The GGUF container: header, metadata and tensor directory, read with the `gguf-rs-lib` crate
//! (which validates the header, counts, alignment and every tensor's byte range against the file
//! size), and typed access to metadata values and tensor bytes with errors that name the file,
//! the key and the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gguf_rs_lib::format::metadata::{Metadata, MetadataValue};
use gguf_rs_lib::reader::file_reader::GGUFFileReader;
use gguf_rs_lib::GGUFError;

use super::dequant::GgmlType;
use crate::error::{ModelError, Result, TroupeError};

/// One tensor of the directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// The name in the file (`blk.0.attn_q.weight`).
    pub name: String,
    /// The stored type.
    pub ggml_type: GgmlType,
    /// The shape, outermost first (row-major, as PyTorch and safetensors write it; GGUF stores
    /// the dimensions innermost first, so this is the file's list reversed).
    pub shape: Vec<usize>,
}

impl TensorEntry {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the stored data.
    pub fn byte_len(&self) -> usize {
        self.ggml_type.bytes_for(self.len()).unwrap_or(0)
    }
}

/// An open GGUF file: its metadata and tensor directory; tensor bytes are read on demand.
pub struct GgufFile {
    path: PathBuf,
    metadata: Metadata,
    tensors: Vec<TensorEntry>,
    index: HashMap<String, usize>,
    reader: Mutex<GGUFFileReader<BufReader<File>>>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile").field("path", &self.path).field("tensors", &self.tensors.len()).finish()
    }
}

/// Turns the crate's error into one sentence naming the file.
fn container_error(path: &Path, err: GGUFError) -> TroupeError {
    let message = match &err {
        GGUFError::UnexpectedEof => {
            "not a complete GGUF file (truncated or corrupt): unexpected end of file".to_string()
        }
        GGUFError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            "not a complete GGUF file (truncated or corrupt): unexpected end of file".to_string()
        }
        GGUFError::InvalidMagic { .. } => format!("not a GGUF file ({err})"),
        _ => format!("not a valid GGUF file: {err}"),
    };
    TroupeError::Model(ModelError::Gguf { path: path.to_path_buf(), message })
}

impl GgufFile {
    /// Opens `path`, reads its metadata and tensor directory, and checks that every tensor has a
    /// type troupe reads and lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| TroupeError::io(path, e))?;
        let reader = GGUFFileReader::new(BufReader::new(file)).map_err(|e| container_error(path, e))?;
        let mut tensors = Vec::with_capacity(reader.tensor_count());
        let mut index = HashMap::new();
        for info in reader.tensor_infos() {
            let crate_type = info.tensor_type();
            let ggml_type = GgmlType::from_ggml_id(crate_type as u32).ok_or_else(|| {
                TroupeError::Model(ModelError::GgufTensorType {
                    path: path.to_path_buf(),
                    tensor: info.name().to_string(),
                    type_name: crate_type.name().to_string(),
                })
            })?;
            let mut shape: Vec<usize> = info.shape().dims().iter().map(|&d| d as usize).collect();
            shape.reverse();
            index.insert(info.name().to_string(), tensors.len());
            tensors.push(TensorEntry { name: info.name().to_string(), ggml_type, shape });
        }
        Ok(Self {
            path: path.to_path_buf(),
            metadata: reader.metadata().clone(),
            tensors,
            index,
            reader: Mutex::new(reader),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorEntry] {
        &self.tensors
    }

    /// The entry of tensor `name`, if the file has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The stored bytes of tensor `name` (blocks as they are in the file).
    pub fn tensor_bytes(&self, name: &str) -> Result<Vec<u8>> {
        let entry = self.tensor(name).ok_or_else(|| {
            TroupeError::Model(ModelError::MissingTensor { path: self.path.clone(), tensor: name.to_string() })
        })?;
        let mut reader = self.reader.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let data = reader.load_tensor_data(name).map_err(|e| container_error(&self.path, e))?.ok_or_else(|| {
            TroupeError::Model(ModelError::MissingTensor { path: self.path.clone(), tensor: name.to_string() })
        })?;
        let bytes = data.into_owned();
        if bytes.len() != entry.byte_len() {
            return Err(self.error(format!(
                "tensor `{name}` holds {} bytes, {} values of {} need {}",
                bytes.len(),
                entry.len(),
                entry.ggml_type.name(),
                entry.byte_len()
            )));
        }
        Ok(bytes)
    }

    /// A [`ModelError::Gguf`](crate::error::ModelError::Gguf) for this file.
    pub fn error(&self, message: impl Into<String>) -> TroupeError {
        TroupeError::Model(ModelError::Gguf { path: self.path.clone(), message: message.into() })
    }

    /// The raw metadata value of `key`, if present.
    pub fn value(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    /// Every metadata key, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.metadata.keys().cloned().collect();
        keys.sort();
        keys
    }

    fn wrong_type(&self, key: &str, wanted: &str, value: &MetadataValue) -> TroupeError {
        self.error(format!("metadata `{key}` should be {wanted}, found {}", describe(value)))
    }

    /// A string value, `None` when the key is absent.
    pub fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.value(key) {
            None => Ok(None),
            Some(MetadataValue::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong_type(key, "a string", other)),
        }
    }

    /// An unsigned integer value (any integer width; a negative one is refused).
    pub fn uint(&self, key: &str) -> Result<Option<u64>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .or_else(|| v.as_i64().and_then(|i| u64::try_from(i).ok()))
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v)),
        }
    }

    /// A float value (f32 or f64; an f32 is widened exactly).
    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong_type(key, "a number", v)),
        }
    }

    /// A boolean value.
    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong_type(key, "a boolean", v)),
        }
    }

    /// An array of strings.
    pub fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        match self.value(key) {
            None => Ok(None),
            Some(MetadataValue::Array(array)) => array
                .values
                .iter()
                .map(|v| v.as_str().ok_or_else(|| self.wrong_type(key, "an array of strings", v)))
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(other) => Err(self.wrong_type(key, "an array of strings", other)),
        }
    }

    /// An array of integers.
    pub fn ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        match self.value(key) {
            None => Ok(None),
            Some(MetadataValue::Array(array)) => array
                .values
                .iter()
                .map(|v| {
                    v.as_i64()
                        .or_else(|| v.as_u64().and_then(|u| i64::try_from(u).ok()))
                        .ok_or_else(|| self.wrong_type(key, "an array of integers", v))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(other) => Err(self.wrong_type(key, "an array of integers", other)),
        }
    }

    /// A required unsigned integer.
    pub fn require_uint(&self, key: &str) -> Result<u64> {
        self.uint(key)?.ok_or_else(|| self.error(format!("metadata `{key}` is missing")))
    }

    /// A required string.
    pub fn require_string(&self, key: &str) -> Result<&str> {
        self.string(key)?.ok_or_else(|| self.error(format!("metadata `{key}` is missing")))
    }
}

/// A short description of a metadata value for messages.
fn describe(value: &MetadataValue) -> String {
    match value {
        MetadataValue::String(s) => format!("the string {s:?}"),
        MetadataValue::Array(a) => format!("an array of {} {}", a.values.len(), a.element_type.name()),
        other => format!("{} ({})", other.to_string_representation(), other.value_type().name()),
    }
}
