//! Raw tensors as they sit in a checkpoint file: name, dtype, shape and a byte range of a
//! memory-mapped (or in-memory) buffer. Nothing here interprets the numbers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::CheckpointError;

/// Element types that can appear in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    U32,
    U8,
    I8,
    I32,
    I64,
    F8E4M3,
    Bool,
}

impl DType {
    /// The safetensors header spelling.
    pub fn from_safetensors(s: &str) -> Option<DType> {
        Some(match s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "U32" => DType::U32,
            "U8" => DType::U8,
            "I8" => DType::I8,
            "I32" => DType::I32,
            "I64" => DType::I64,
            "F8_E4M3" => DType::F8E4M3,
            "BOOL" => DType::Bool,
            _ => return None,
        })
    }
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::U32 => "U32",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F8E4M3 => "F8_E4M3",
            DType::Bool => "BOOL",
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::I8 | DType::F8E4M3 | DType::Bool => 1,
            DType::I64 => 8,
        }
    }
}

/// A shared, immutable byte range: a slice of a memory-mapped file or of an owned buffer.
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Bytes {
        debug_assert!(start + len <= (*owner).as_ref().len());
        Bytes { owner, start, len }
    }
    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let len = v.len();
        Bytes {
            owner: Arc::new(v),
            start: 0,
            len,
        }
    }
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A sub-range of this range; the caller guarantees it lies inside.
    pub fn slice(&self, start: usize, len: usize) -> Bytes {
        assert!(start + len <= self.len, "byte slice out of range");
        Bytes {
            owner: self.owner.clone(),
            start: self.start + start,
            len,
        }
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} B)", self.len)
    }
}

/// One tensor of a checkpoint.
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Bytes,
    /// The file it came from, for error messages.
    pub file: PathBuf,
}

impl RawTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Values converted to f32 (for small tensors: norms, biases, conv weights).
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let b = self.data.as_slice();
        Ok(match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(CheckpointError::DType {
                    tensor: name.to_string(),
                    file: self.file.display().to_string(),
                    expected: "F32, BF16 or F16".into(),
                    found: other.safetensors_name().into(),
                })
            }
        })
    }
}

/// All tensors of a checkpoint by name.
#[derive(Debug, Default)]
pub struct TensorStore {
    pub tensors: BTreeMap<String, RawTensor>,
    /// Where the checkpoint came from, for error messages.
    pub source: String,
}

impl TensorStore {
    pub fn get(&self, name: &str) -> Result<&RawTensor, CheckpointError> {
        self.tensors
            .get(name)
            .ok_or_else(|| CheckpointError::Missing {
                tensor: name.to_string(),
                location: self.source.clone(),
            })
    }
    /// The tensor with the given shape, or an error naming tensor, file and both shapes.
    pub fn get_shaped(&self, name: &str, shape: &[usize]) -> Result<&RawTensor, CheckpointError> {
        let t = self.get(name)?;
        if t.shape != shape {
            return Err(CheckpointError::Shape {
                tensor: name.to_string(),
                file: t.file.display().to_string(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}
