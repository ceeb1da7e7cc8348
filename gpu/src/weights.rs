//! Reading weights (GGUF or HF safetensors) and cutting them into tensor-parallel shards.
//!
//! Tensors are addressed by their GGUF names (`blk.3.attn_q.weight`); safetensors names are
//! mapped onto those. Sharding works on the stored bytes (a quantized row is a run of blocks),
//! so a shard of a Q4_1 tensor is still exactly the same Q4_1 data, and any format conversion
//! ([`WeightFormat`]) happens after the cut, per rank.

use crate::{ModelError, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How matmul weights are stored in memory: the config's `model.weights` enum (`auto`,
/// `native`, `q8_0` (alias `q8`), `f32`).
pub use pdserve_runtime::config::WeightFormat;

/// Tensor types the CPU backend runs.
pub fn supported_dtype(dtype: GgmlDType) -> bool {
    matches!(
        dtype,
        GgmlDType::F32
            | GgmlDType::F16
            | GgmlDType::BF16
            | GgmlDType::Q4_0
            | GgmlDType::Q4_1
            | GgmlDType::Q5_0
            | GgmlDType::Q5_1
            | GgmlDType::Q8_0
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K
    )
}

/// All tensors of a model, by GGUF name, held once in memory and shared by every rank while
/// the shards are cut.
#[derive(Debug)]
pub struct TensorStore {
    tensors: HashMap<String, Arc<QTensor>>,
    origin: PathBuf,
}

impl TensorStore {
    /// Builds a store from already-loaded tensors (synthetic models, tests).
    pub fn from_map(tensors: HashMap<String, Arc<QTensor>>, origin: impl Into<PathBuf>) -> Self {
        Self {
            tensors,
            origin: origin.into(),
        }
    }

    /// Reads every tensor of a GGUF file.
    ///
    /// # Errors
    /// [`ModelError::Corrupt`] when a tensor cannot be read;
    /// [`ModelError::UnsupportedTensorType`] for a type the CPU backend does not run.
    pub fn from_gguf(
        content: &gguf_file::Content,
        reader: &mut (impl std::io::Read + std::io::Seek),
        path: &Path,
    ) -> Result<Self> {
        let mut tensors = HashMap::new();
        for (name, info) in &content.tensor_infos {
            if !supported_dtype(info.ggml_dtype) {
                return Err(ModelError::UnsupportedTensorType {
                    name: name.clone(),
                    dtype: format!("{:?}", info.ggml_dtype),
                });
            }
            let t =
                content
                    .tensor(reader, name, &Device::Cpu)
                    .map_err(|e| ModelError::Corrupt {
                        path: path.to_path_buf(),
                        reason: format!("tensor {name}: {e}"),
                    })?;
            tensors.insert(name.clone(), Arc::new(t));
        }
        Ok(Self {
            tensors,
            origin: path.to_path_buf(),
        })
    }

    /// Reads every `*.safetensors` file of an HF checkpoint directory, renaming tensors to
    /// their GGUF names.
    ///
    /// # Errors
    /// [`ModelError::Corrupt`] for an unreadable file; [`ModelError::UnsupportedTensorType`]
    /// for a dtype other than f32/f16/bf16.
    pub fn from_safetensors_dir(dir: &Path, num_layers: usize) -> Result<Self> {
        Self::from_safetensors_dir_with(dir, |hf| hf_text_name(hf, "model.", num_layers))
    }

    /// Reads every `*.safetensors` file of an HF checkpoint directory, keeping the tensors
    /// `rename` gives a name (their name in the store) and skipping the others.
    ///
    /// # Errors
    /// As [`TensorStore::from_safetensors_dir`].
    pub fn from_safetensors_dir_with(
        dir: &Path,
        rename: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Corrupt {
                path: dir.to_path_buf(),
                reason: "no *.safetensors files in the directory".into(),
            });
        }
        let mut tensors = HashMap::new();
        for file in &files {
            let loaded = candle_core::safetensors::load(file, &Device::Cpu).map_err(|e| {
                ModelError::Corrupt {
                    path: file.clone(),
                    reason: e.to_string(),
                }
            })?;
            for (hf_name, t) in loaded {
                let Some(name) = rename(&hf_name) else {
                    tracing::debug!(tensor = %hf_name, "ignoring tensor not used by the model");
                    continue;
                };
                let t = match t.dtype() {
                    DType::F32 => t,
                    DType::F16 | DType::BF16 => t.to_dtype(DType::F32)?,
                    other => {
                        return Err(ModelError::UnsupportedTensorType {
                            name: hf_name,
                            dtype: format!("{other:?}"),
                        })
                    }
                };
                tensors.insert(name, Arc::new(QTensor::quantize(&t, GgmlDType::F32)?));
            }
        }
        Ok(Self {
            tensors,
            origin: dir.to_path_buf(),
        })
    }

    /// Moves the tensors whose names start with one of `prefixes` into a store of their own
    /// (a vision tower's, out of a vision-language checkpoint's single store).
    pub fn take_prefixed(&mut self, prefixes: &[&str]) -> TensorStore {
        let names: Vec<String> = self
            .tensors
            .keys()
            .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
            .cloned()
            .collect();
        let tensors = names
            .into_iter()
            .filter_map(|n| self.tensors.remove_entry(&n))
            .collect();
        TensorStore {
            tensors,
            origin: self.origin.clone(),
        }
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A tensor by GGUF name.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`].
    pub fn get(&self, name: &str) -> Result<&Arc<QTensor>> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// A tensor, checked against the shape the architecture expects.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] or [`ModelError::BadShape`].
    pub fn get_shaped(&self, name: &str, expected: &[usize]) -> Result<&Arc<QTensor>> {
        let t = self.get(name)?;
        if t.shape().dims() != expected {
            return Err(ModelError::BadShape {
                name: name.to_string(),
                actual: t.shape().dims().to_vec(),
                expected: expected.to_vec(),
            });
        }
        Ok(t)
    }

    /// A 1-D tensor as f32 values.
    ///
    /// # Errors
    /// As [`TensorStore::get_shaped`].
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.get_shaped(name, &[len])?;
        Ok(t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
    }

    /// Names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// Where the tensors came from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }
}

/// The HF Llama/Qwen2 tensor names and their GGUF names within a layer.
pub(crate) const HF_LAYER_NAMES: [(&str, &str); 12] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

/// The GGUF name of an HF decoder tensor whose names start with `prefix` (`model.` for a
/// causal LM, `model.text_model.` for a vision-language model's decoder); `lm_head.weight`
/// has none. `None`: a tensor the decoder does not use, or a layer at or past `num_layers`.
pub(crate) fn hf_text_name(hf: &str, prefix: &str, num_layers: usize) -> Option<String> {
    if hf == "lm_head.weight" {
        return Some("output.weight".into());
    }
    let rest = hf.strip_prefix(prefix)?;
    match rest {
        "embed_tokens.weight" => return Some("token_embd.weight".into()),
        "norm.weight" => return Some("output_norm.weight".into()),
        _ => {}
    }
    let (layer, name) = rest.strip_prefix("layers.")?.split_once('.')?;
    let i: usize = layer.parse().ok().filter(|i| *i < num_layers)?;
    if layer != i.to_string() {
        return None;
    }
    let (_, gg) = HF_LAYER_NAMES.iter().find(|(h, _)| *h == name)?;
    Some(format!("blk.{i}.{gg}"))
}

/// Bytes of one row of a 2-D quantized tensor, and elements per quantization block.
fn row_geometry(t: &QTensor) -> Result<(usize, usize, usize, usize)> {
    let (rows, cols) = t.shape().dims2()?;
    let bs = t.dtype().block_size();
    if !cols.is_multiple_of(bs) {
        return Err(ModelError::BadShape {
            name: "(row not a whole number of quantization blocks)".into(),
            actual: vec![rows, cols],
            expected: vec![rows, cols.div_ceil(bs) * bs],
        });
    }
    let row_bytes = cols / bs * t.dtype().type_size();
    Ok((rows, cols, bs, row_bytes))
}

fn from_bytes(bytes: Vec<u8>, dtype: GgmlDType, shape: (usize, usize)) -> Result<QTensor> {
    let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &Device::Cpu, dtype)?;
    Ok(QTensor::new(storage, shape)?)
}

/// Rows `range` of a 2-D tensor (output features: a column-parallel cut), bytes untouched.
///
/// # Errors
/// When the tensor is not 2-D or the range is out of bounds.
pub fn slice_rows(t: &QTensor, range: Range<usize>) -> Result<QTensor> {
    let (rows, cols, _, row_bytes) = row_geometry(t)?;
    if range.end > rows || range.start > range.end {
        return Err(ModelError::InvalidBatch(format!(
            "row slice {range:?} of {rows} rows"
        )));
    }
    let data = t.data()?;
    let bytes = data[range.start * row_bytes..range.end * row_bytes].to_vec();
    from_bytes(bytes, t.dtype(), (range.len(), cols))
}

/// Columns `range` of a 2-D tensor (input features: a row-parallel cut). Cuts on quantization
/// block boundaries keep the bytes untouched; other cuts go through f32.
///
/// # Errors
/// When the tensor is not 2-D or the range is out of bounds.
pub fn slice_cols(t: &QTensor, range: Range<usize>) -> Result<QTensor> {
    let (rows, cols, bs, row_bytes) = row_geometry(t)?;
    if range.end > cols || range.start > range.end {
        return Err(ModelError::InvalidBatch(format!(
            "column slice {range:?} of {cols} columns"
        )));
    }
    if !range.start.is_multiple_of(bs) || !range.end.is_multiple_of(bs) {
        let f = t
            .dequantize(&Device::Cpu)?
            .narrow(1, range.start, range.len())?
            .contiguous()?;
        return Ok(QTensor::quantize(&f, GgmlDType::F32)?);
    }
    let ts = t.dtype().type_size();
    let (b0, b1) = (range.start / bs * ts, range.end / bs * ts);
    let data = t.data()?;
    let mut bytes = Vec::with_capacity(rows * (b1 - b0));
    for r in 0..rows {
        bytes.extend_from_slice(&data[r * row_bytes + b0..r * row_bytes + b1]);
    }
    from_bytes(bytes, t.dtype(), (rows, range.len()))
}

/// Stacks 2-D tensors of one dtype and row length along the rows (fuses Q/K/V or gate/up so
/// one matmul computes them all). Mixed dtypes are brought to f32 first.
///
/// # Errors
/// When the tensors have different row lengths.
pub fn concat_rows(parts: &[QTensor]) -> Result<QTensor> {
    let cols = parts[0].shape().dims2()?.1;
    let same = parts.iter().all(|p| p.dtype() == parts[0].dtype());
    if !same {
        let fs = parts
            .iter()
            .map(|p| p.dequantize(&Device::Cpu))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let cat = Tensor::cat(&fs, 0)?;
        return Ok(QTensor::quantize(&cat, GgmlDType::F32)?);
    }
    let mut bytes = Vec::new();
    let mut rows = 0;
    for p in parts {
        let (r, c) = p.shape().dims2()?;
        if c != cols {
            return Err(ModelError::InvalidBatch(format!(
                "concat of rows {c} != {cols}"
            )));
        }
        rows += r;
        bytes.extend_from_slice(&p.data()?);
    }
    from_bytes(bytes, parts[0].dtype(), (rows, cols))
}

/// What `format` means for `store`'s weights: everything but `auto` as given. `auto` is
/// [`WeightFormat::Native`] when every matmul weight is Q4_0, Q4_1 or Q8_0 — the file's own
/// values on llama.cpp's arithmetic, tp- and batch-invariant, on every CPU (on AVX-512 VNNI
/// since its prefill tile holds sixteen rows per register: 3.5× llama-bench's pp512 there,
/// ~0.75× the packed kernel's; docs/benchmarks.md, "One default weight path") — and
/// [`WeightFormat::Packed`] otherwise (Q5_* and k-quants requantized to Q8_0, floats on
/// candle's matmuls: formats `native` was never measured on or leaves to candle).
pub fn resolve(format: WeightFormat, store: &TensorStore) -> WeightFormat {
    if format != WeightFormat::Auto {
        return format;
    }
    // Only the block formats: float weights run on candle's matmuls either way, and there
    // `packed` fuses Q|K|V and gate|up into one matmul each, which `native` does not.
    let all_native = store.names().filter(|n| is_matmul_weight(n)).all(|n| {
        store.get(n).is_ok_and(|t| {
            matches!(
                t.dtype(),
                GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q8_0
            )
        })
    });
    if all_native {
        WeightFormat::Native
    } else {
        WeightFormat::Packed
    }
}

/// Whether a GGUF tensor name is a weight some matmul reads: a layer's projections, the
/// output head, and the token embedding (the head when the two are tied).
fn is_matmul_weight(name: &str) -> bool {
    const LAYER: [&str; 7] = [
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    name == "output.weight"
        || name == "token_embd.weight"
        || (name.starts_with("blk.") && LAYER.iter().any(|l| name.ends_with(l)))
}

/// Brings a matmul weight to the in-memory format.
///
/// # Errors
/// On a tensor-library failure.
pub fn convert(t: QTensor, format: WeightFormat) -> Result<QTensor> {
    let cols = t.shape().dims2()?.1;
    let target = match format {
        WeightFormat::Native => return Ok(t),
        WeightFormat::F32 => GgmlDType::F32,
        WeightFormat::Q8_0 => GgmlDType::Q8_0,
        // Q4_0 and Q4_1 keep their exact values on the packed kernel where the CPU runs it
        // (`quant::PackedQ8`); elsewhere, and for the other sub-8-bit formats, Q8_0.
        // (`auto` is resolved before this; left unresolved it means `packed`.)
        WeightFormat::Packed | WeightFormat::Auto => match t.dtype() {
            GgmlDType::Q4_0 | GgmlDType::Q4_1 if crate::quant::PackedQ8::supported() => {
                return Ok(t)
            }
            GgmlDType::Q4_0
            | GgmlDType::Q4_1
            | GgmlDType::Q5_0
            | GgmlDType::Q5_1
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K => GgmlDType::Q8_0,
            _ => return Ok(t),
        },
    };
    if t.dtype() == target || (target == GgmlDType::Q8_0 && !cols.is_multiple_of(32)) {
        return Ok(t);
    }
    let f = t.dequantize(&Device::Cpu)?;
    Ok(QTensor::quantize(&f, target)?)
}

/// Opens a GGUF file and reads its metadata and tensor table (not the tensors).
///
/// # Errors
/// [`ModelError::NotFound`], or [`ModelError::Corrupt`] for a file that is not GGUF.
pub(crate) fn open_gguf(
    path: &Path,
) -> Result<(gguf_file::Content, std::io::BufReader<std::fs::File>)> {
    let corrupt = |reason: String| ModelError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ModelError::NotFound {
            path: path.to_path_buf(),
        },
        _ => corrupt(e.to_string()),
    })?;
    let mut reader = std::io::BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader)
        .map_err(|e| corrupt(format!("not a valid GGUF file: {e}")))?;
    Ok((content, reader))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(rows: usize, cols: usize, dtype: GgmlDType) -> QTensor {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&t, dtype).unwrap()
    }

    fn deq(t: &QTensor) -> Vec<Vec<f32>> {
        t.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap()
    }

    #[test]
    fn quantized_cuts_equal_cuts_of_the_dequantized_tensor() {
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::F32] {
            let t = sample(6, 128, dtype);
            let full = deq(&t);
            let rows = deq(&slice_rows(&t, 2..5).unwrap());
            assert_eq!(rows, full[2..5].to_vec());
            let cols = deq(&slice_cols(&t, 32..96).unwrap());
            for (r, row) in cols.iter().enumerate() {
                assert_eq!(row.as_slice(), &full[r][32..96]);
            }
            let cat =
                deq(
                    &concat_rows(&[slice_rows(&t, 0..2).unwrap(), slice_rows(&t, 2..6).unwrap()])
                        .unwrap(),
                );
            assert_eq!(cat, full);
        }
    }

    #[test]
    fn unaligned_column_cut_goes_through_f32() {
        let t = sample(2, 64, GgmlDType::Q8_0);
        let full = deq(&t);
        let cut = slice_cols(&t, 10..40).unwrap();
        assert_eq!(cut.dtype(), GgmlDType::F32);
        assert_eq!(deq(&cut)[1].as_slice(), &full[1][10..40]);
    }
}
