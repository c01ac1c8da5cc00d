//! Reading and writing safetensors files: one file or a sharded set
//! (`model.safetensors.index.json`), f32/f16/bf16 on disk, f32 in memory. Files are mapped,
//! not read whole, and written a tensor at a time, so neither side holds a file's bytes in
//! memory. Writes are atomic.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor, TensorData};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, View};
use safetensors::{SafeTensorError, SafeTensors};

use crate::error::{ModelError, Result, TroupeError};
use crate::fsutil::write_atomic_with;

/// One safetensors file mapped into memory, with its parsed (and validated) header.
struct SafetensorsFile {
    path: PathBuf,
    bytes: Mmap,
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
            let file = std::fs::File::open(path).map_err(|e| TroupeError::io(path, e))?;
            // SAFETY: the map is read only. Another process truncating or rewriting the file
            // while it is mapped would change what is read (or end the process with SIGBUS),
            // as with every loader that maps weights (transformers' `safe_open`, candle);
            // troupe itself replaces files by renaming a new one over them, which leaves a
            // mapped file as it was.
            let bytes = unsafe { Mmap::map(&file) }.map_err(|e| TroupeError::io(path, e))?;
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

    /// The float type a tensor is stored in, if present and one troupe reads.
    pub fn stored_float(&self, name: &str) -> Option<StoredFloat> {
        let file = &self.files[*self.index.get(name)?];
        file.metadata.info(name).and_then(|info| StoredFloat::of(info.dtype))
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
        let values = decode_f32(&file.bytes[start..end], info.dtype);
        // The pages just read are dropped from this process's memory: a model is read once,
        // tensor by tensor, so a load holds no more than the tensor it converts (the page
        // cache may keep them). SAFETY: the map is read only and never written, so dropping its
        // pages loses nothing; a later read faults them in again from the file. Advice only: a
        // failure changes nothing that is read.
        #[cfg(unix)]
        let _ = unsafe { file.bytes.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        let values = values.ok_or_else(|| {
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

/// The float types troupe reads and writes in safetensors files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StoredFloat {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl StoredFloat {
    /// The stored type of safetensors' `dtype`, or `None` for one troupe does not read.
    pub fn of(dtype: Dtype) -> Option<Self> {
        match dtype {
            Dtype::F32 => Some(Self::F32),
            Dtype::F16 => Some(Self::F16),
            Dtype::BF16 => Some(Self::Bf16),
            _ => None,
        }
    }

    /// safetensors' name for it.
    pub fn dtype(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::F16 => Dtype::F16,
            Self::Bf16 => Dtype::BF16,
        }
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// transformers' name for it (`config.json`'s `dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::Bf16 => "bfloat16",
        }
    }

    /// `values` as little-endian bytes of this type (safetensors' byte order), each rounded to
    /// nearest, ties to even, as `torch.Tensor.to` rounds.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(values.len() * self.size());
        match self {
            Self::F32 => values.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
            Self::F16 => values.iter().for_each(|v| bytes.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
            Self::Bf16 => values.iter().for_each(|v| bytes.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
        }
        bytes
    }
}

/// A tensor to write, given as f32 values and stored as f32 (or, with [`F32Tensor::stored_as`],
/// f16 or bf16): its shape and what gives its values, asked for only when the file reaches the
/// tensor, so a file is written holding one tensor's bytes at a time.
pub struct F32Tensor<'a> {
    shape: Vec<usize>,
    stored: StoredFloat,
    values: Box<dyn Fn() -> Result<Cow<'a, [f32]>> + 'a>,
    /// What went wrong giving the values, kept for [`write_f32_tensors`] to return (safetensors
    /// asks a tensor for bytes and cannot be told it has none).
    failure: RefCell<Option<Failure>>,
}

/// Why a tensor being written had no bytes to give.
enum Failure {
    /// Its values did not come.
    Error(TroupeError),
    /// It was given this many values, not as many as its shape holds.
    Count(usize),
}

impl<'a> F32Tensor<'a> {
    /// A tensor of `shape` whose values `values` gives (as many as the shape holds).
    pub fn new(shape: Vec<usize>, values: impl Fn() -> Cow<'a, [f32]> + 'a) -> Self {
        Self::fallible(shape, move || Ok(values()))
    }

    /// A tensor whose values may fail to come (read from a file, computed): the failure ends
    /// the write and nothing is left on disk.
    pub fn fallible(shape: Vec<usize>, values: impl Fn() -> Result<Cow<'a, [f32]>> + 'a) -> Self {
        Self { shape, stored: StoredFloat::F32, values: Box::new(values), failure: RefCell::new(None) }
    }

    /// The same tensor, written as `stored` (its values rounded to it).
    pub fn stored_as(self, stored: StoredFloat) -> Self {
        Self { stored, ..self }
    }
}

/// A tensor as [`write_f32_tensors`] hands it to safetensors: once any tensor of the file has
/// failed to give its values, the ones after it are not asked for theirs (the file is removed,
/// so reading or computing them would be wasted).
struct Writing<'t, 'a> {
    tensor: &'t F32Tensor<'a>,
    failed: &'t Cell<bool>,
}

impl View for Writing<'_, '_> {
    fn dtype(&self) -> Dtype {
        self.tensor.stored.dtype()
    }

    fn shape(&self) -> &[usize] {
        &self.tensor.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let tensor = self.tensor;
        let expected = tensor.shape.iter().product::<usize>();
        if !self.failed.get() {
            match (tensor.values)() {
                Ok(values) if values.len() == expected => return Cow::Owned(tensor.stored.encode(&values)),
                Ok(values) => *tensor.failure.borrow_mut() = Some(Failure::Count(values.len())),
                Err(e) => *tensor.failure.borrow_mut() = Some(Failure::Error(e)),
            }
            self.failed.set(true);
        }
        // The write has failed and its file is removed: nothing more is asked or written.
        Cow::Borrowed(&[])
    }

    fn data_len(&self) -> usize {
        self.tensor.shape.iter().product::<usize>() * self.tensor.stored.size()
    }
}

/// Writes f32 tensors to a safetensors file atomically (temp file + rename), with optional
/// string metadata (`{"format": "pt"}` is what PEFT and transformers write).
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let tensors = tensors
        .iter()
        .map(|(name, t)| (name.clone(), F32Tensor::new(t.shape.clone(), || Cow::Borrowed(t.values.as_slice()))));
    write_f32_tensors(path, tensors, metadata)
}

/// Writes `tensors` to a safetensors file atomically, in safetensors' order (by name), each
/// tensor's values asked for as the file reaches it.
pub fn write_f32_tensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (String, F32Tensor<'a>)>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let tensors: Vec<(String, F32Tensor<'a>)> = tensors.into_iter().collect();
    let failed = Cell::new(false);
    write_atomic_with(path, |tmp| {
        let views = tensors.iter().map(|(name, tensor)| (name.as_str(), Writing { tensor, failed: &failed }));
        let written = safetensors::serialize_to_file(views, metadata, tmp);
        // A tensor's failure is the cause of whatever the writer then ran into.
        match tensors.iter().find_map(|(name, t)| Some((name, t, t.failure.take()?))) {
            None => written.map_err(|e| match e {
                SafeTensorError::IoError(e) => TroupeError::io(path, e),
                e => TroupeError::Model(ModelError::Safetensors { path: path.to_path_buf(), message: e.to_string() }),
            }),
            Some((_, _, Failure::Error(e))) => Err(e),
            Some((name, t, Failure::Count(n))) => Err(TroupeError::Model(ModelError::Safetensors {
                path: path.to_path_buf(),
                message: format!(
                    "tensor `{name}` holds {n} values for shape {:?} ({})",
                    t.shape,
                    t.shape.iter().product::<usize>()
                ),
            })),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file troupe replaces while it is mapped (a new checkpoint renamed over the old one)
    /// is read as it was when it was opened.
    #[test]
    fn a_mapped_file_replaced_by_a_write_reads_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let tensor = |v: f32| BTreeMap::from([("a".to_string(), HostTensor { values: vec![v; 3], shape: vec![3] })]);
        write_safetensors(&path, &tensor(1.0), None).unwrap();
        let store = TensorStore::open_files(std::slice::from_ref(&path), path.clone()).unwrap();
        write_safetensors(&path, &tensor(2.0), None).unwrap();
        assert_eq!(store.read("a", None).unwrap().values, vec![1.0; 3]);
        // Read twice: the pages dropped after the first read come back from the file.
        assert_eq!(store.read("a", None).unwrap().values, vec![1.0; 3]);
        let reopened = TensorStore::open_files(std::slice::from_ref(&path), path.clone()).unwrap();
        assert_eq!(reopened.read("a", None).unwrap().values, vec![2.0; 3]);
    }

    #[test]
    fn values_that_do_not_fill_their_shape_are_refused_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let tensors = BTreeMap::from([("w".to_string(), HostTensor { values: vec![0.5; 5], shape: vec![2, 3] })]);
        let err = write_safetensors(&path, &tensors, None).unwrap_err().to_string();
        assert!(err.contains("t.safetensors") && err.contains("`w` holds 5 values for shape [2, 3] (6)"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no file, no temp file");
    }

    /// A tensor whose values fail to come (a read, a device) ends the write with that error,
    /// after the tensors before it were written, leaves no file behind, and the tensors after
    /// it are not asked for their values.
    #[test]
    fn a_tensor_that_fails_ends_the_write_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let asked = RefCell::new(Vec::new());
        let counted = |name: &'static str, values: Vec<f32>| {
            let asked = &asked;
            F32Tensor::new(vec![values.len()], move || {
                asked.borrow_mut().push(name);
                Cow::Owned(values.clone())
            })
        };
        let tensors = vec![
            ("a".to_string(), counted("a", vec![1.0, 2.0])),
            (
                "b".to_string(),
                F32Tensor::fallible(vec![2], || {
                    Err(TroupeError::io(Path::new("base.bin"), std::io::ErrorKind::UnexpectedEof.into()))
                }),
            ),
            ("c".to_string(), counted("c", vec![3.0])),
        ];
        let err = write_f32_tensors(&path, tensors, None).unwrap_err().to_string();
        assert!(err.contains("base.bin"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no file, no temp file");
        assert_eq!(*asked.borrow(), ["a"], "`c`, after the failure, is not asked for its values");
    }

    /// A tensor stored as bf16 or f16 is written in that type, each value rounded to nearest
    /// with ties to even (as `torch.Tensor.to` rounds), and reads back as the rounded values.
    #[test]
    fn tensors_are_written_in_the_type_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        // 1 + 2^-8 lies halfway between bf16's 1 and 1 + 2^-7: the tie goes to the even 1.
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: to the even 1 + 2^-6.
        let values = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), -0.1, 70000.0];
        let tensors = vec![
            ("b".to_string(), F32Tensor::new(vec![4], || Cow::Owned(values.to_vec())).stored_as(StoredFloat::Bf16)),
            ("h".to_string(), F32Tensor::new(vec![2, 2], || Cow::Owned(values.to_vec())).stored_as(StoredFloat::F16)),
            ("f".to_string(), F32Tensor::new(vec![4], || Cow::Owned(values.to_vec()))),
        ];
        write_f32_tensors(&path, tensors, None).unwrap();
        let store = TensorStore::open_files(std::slice::from_ref(&path), path.clone()).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, 8 + store.files[0].header_len + 4 * (2 + 2 + 4));
        assert_eq!(store.stored_float("b"), Some(StoredFloat::Bf16));
        assert_eq!(store.stored_float("h"), Some(StoredFloat::F16));
        assert_eq!(store.stored_float("f"), Some(StoredFloat::F32));
        let bf16 = store.read("b", None).unwrap().values;
        assert_eq!(bf16[..2], [1.0, 1.0 + 2f32.powi(-6)]);
        assert_eq!(bf16[2..], [half::bf16::from_f32(-0.1).to_f32(), 70144.0]);
        // f16 holds the first two exactly (10 fraction bits); its largest finite value is
        // 65504, so 70000 overflows to infinity.
        let f16 = store.read("h", Some(&[2, 2])).unwrap().values;
        assert_eq!(f16, [values[0], values[1], half::f16::from_f32(-0.1).to_f32(), f32::INFINITY]);
        assert_eq!(store.read("f", None).unwrap().values, values);
    }

    /// An empty file is refused with the reason, not mapped and misread.
    #[test]
    fn an_empty_file_is_not_a_safetensors_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.safetensors");
        std::fs::write(&path, b"").unwrap();
        let err = TensorStore::open_files(std::slice::from_ref(&path), path.clone()).err().unwrap().to_string();
        assert!(err.contains("empty.safetensors") && err.contains("not a complete safetensors file"), "{err}");
    }

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
