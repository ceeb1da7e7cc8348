//! Seeded random-weight models of the Llama architecture, in any shape, for fast tests of TP
//! splits, heterogeneous layouts and the serving stack with no download.
//!
//! `synthetic:NAME[,key=value...]` — presets `tiny` (4 layers, 4 heads, 2 KV heads),
//! `small` (4 layers, 8 heads, 4 KV heads) and `mha` (2 layers, 4 heads, 4 KV heads); keys
//! `layers`, `heads`, `kv_heads`, `head_dim`, `hidden`, `ffn`, `vocab`, `context`, `seed`,
//! `bias` (0/1: Qwen2-style QKV bias) override the preset.
//!
//! `vision=1` makes it a **synthetic vision-language model**: the same decoder plus a seeded
//! SigLIP vision tower and Idefics3 connector (SmolVLM's layout, [`crate::vision`]) of a tiny
//! shape — 32×32 images, 4×4 patches, 64-wide features, 2 layers, 4 heads, pixel shuffle 2,
//! so an image is 16 decoder positions — whose image placeholder token is id 259 (the first
//! id past the byte-level tokenizer's). Its weights are random: it tests every path of image
//! input, it describes no image. `vision_size`, `vision_patch`, `vision_hidden` and
//! `vision_layers` change the tower's shape (a heavier encoder for benchmarks: 224, 16, 384
//! and 6 make an image 49 positions of a few GFLOP, closer to SmolVLM's tower).
//!
//! `split=1` (with `vision=1`) turns on SmolVLM's **image splitting** ([`crate::vision`]):
//! `size.longest_edge` twice the tower's image size, tiles of its image size (a 64×48 image
//! is 2×2 tiles of 32 plus the global image), and the tokenizer gets the wrapper tokens as
//! added special tokens — `<image>` = 259, `<fake_token_around_image>` = 260, `<global-img>` = 261,
//! `<row_R_col_C>` = 262.. row-major (R, C up to 2).

use crate::config::{ModelConfig, RopeScaling, RopeStyle};
use crate::vision::VisionConfig;
use crate::weights::TensorStore;
use crate::{ModelError, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

/// A parsed `synthetic:` model spec.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// The spec as written (used as the model name).
    pub name: String,
    /// The architecture.
    pub config: ModelConfig,
    /// Weight seed.
    pub seed: u64,
    /// The vision tower of a synthetic VLM (`vision=1`).
    pub vision: Option<VisionConfig>,
}

/// The placeholder token id of a synthetic VLM's image rows.
pub const SYNTHETIC_IMAGE_TOKEN: u32 = 259;
/// The first wrapper token of a synthetic VLM with image splitting (`split=1`):
/// `<fake_token_around_image>`, then `<global-img>`, then the `<row_R_col_C>` tokens.
pub const SYNTHETIC_WRAP_TOKENS: u32 = 260;

/// The wrapper tokens (id, text) of a synthetic VLM with image splitting whose grids go up to
/// `side`×`side`.
fn synthetic_wrap_tokens(side: usize) -> Vec<(u32, String)> {
    let mut names = vec![
        crate::vision::FAKE_TOKEN_AROUND_IMAGE.to_string(),
        crate::vision::GLOBAL_IMAGE_TOKEN.to_string(),
    ];
    for r in 1..=side {
        for c in 1..=side {
            names.push(crate::vision::tile_token_name(r, c));
        }
    }
    names
        .into_iter()
        .enumerate()
        .map(|(i, n)| (SYNTHETIC_WRAP_TOKENS + i as u32, n))
        .collect()
}

impl SyntheticSpec {
    /// Parses what follows `synthetic:`.
    ///
    /// # Errors
    /// [`ModelError::BadMetadata`] for an unknown preset or key, or a bad value.
    pub fn parse(spec: &str) -> Result<Self> {
        let mut parts = spec.split(',');
        let preset = parts.next().unwrap_or("tiny");
        let (layers, heads, kv_heads) = match preset {
            "tiny" | "" => (4, 4, 2),
            "small" => (4, 8, 4),
            "mha" => (2, 4, 4),
            other => {
                return Err(ModelError::BadMetadata(format!(
                    "unknown synthetic preset `{other}` (tiny, small, mha)"
                )))
            }
        };
        let mut c = ModelConfig {
            architecture: "llama".into(),
            vocab_size: 320,
            hidden_size: heads * 32,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: 32,
            intermediate_size: heads * 64,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            rope_style: RopeStyle::Half,
            context_length: 1024,
            qkv_bias: false,
            rope_freq_factors: None,
        };
        let mut seed = 42;
        let mut vision = false;
        let mut split = false;
        let (mut v_size, mut v_patch, mut v_hidden, mut v_layers) = (32, 4, 64, 2);
        for kv in parts {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                ModelError::BadMetadata(format!("synthetic option `{kv}` is not key=value"))
            })?;
            let n: usize = v.parse().map_err(|_| {
                ModelError::BadMetadata(format!("synthetic option `{k}` needs a number, got `{v}`"))
            })?;
            match k {
                "layers" => c.num_layers = n,
                "heads" => c.num_heads = n,
                "kv_heads" => c.num_kv_heads = n,
                "head_dim" => c.head_dim = n,
                "hidden" => c.hidden_size = n,
                "ffn" => c.intermediate_size = n,
                "vocab" => c.vocab_size = n,
                "context" => c.context_length = n,
                "seed" => seed = n as u64,
                "bias" => c.qkv_bias = n != 0,
                "vision" => vision = n != 0,
                "split" => split = n != 0,
                "vision_size" => v_size = n,
                "vision_patch" => v_patch = n,
                "vision_hidden" => v_hidden = n,
                "vision_layers" => v_layers = n,
                other => {
                    return Err(ModelError::BadMetadata(format!(
                        "unknown synthetic option `{other}`"
                    )))
                }
            }
        }
        if c.vocab_size < 259 {
            return Err(ModelError::BadMetadata(
                "synthetic vocab must be ≥ 259 (the byte-level tokenizer's size)".into(),
            ));
        }
        c.validate()?;
        let vision = if vision {
            if c.vocab_size <= SYNTHETIC_IMAGE_TOKEN as usize {
                return Err(ModelError::BadMetadata(
                    "a synthetic VLM needs vocab > 259 (its image token is 259)".into(),
                ));
            }
            let splitting = split.then_some(crate::vision::ImageSplitting {
                longest_edge: 2 * v_size,
                tile_size: v_size,
            });
            let wrap = match &splitting {
                Some(s) => {
                    let tokens = synthetic_wrap_tokens(s.max_grid_side());
                    let last = tokens.last().map_or(0, |(id, _)| *id as usize);
                    if last >= c.vocab_size {
                        return Err(ModelError::BadMetadata(format!(
                            "a synthetic VLM with image splitting needs vocab > {last} (its wrapper tokens)"
                        )));
                    }
                    let wrap = crate::vision::ImageWrapTokens::lookup(
                        |name| tokens.iter().find(|(_, n)| n == name).map(|(id, _)| *id),
                        s.max_grid_side(),
                    )
                    .map_err(|m| ModelError::BadMetadata(format!("synthetic token {m}")))?;
                    Some(wrap)
                }
                None => None,
            };
            let v = VisionConfig {
                image_size: v_size,
                patch_size: v_patch,
                hidden_size: v_hidden,
                num_layers: v_layers,
                num_heads: 4,
                intermediate_size: 2 * v_hidden,
                layer_norm_eps: 1e-6,
                scale_factor: 2,
                text_hidden_size: c.hidden_size,
                image_mean: [0.5; 3],
                image_std: [0.5; 3],
                image_token_id: SYNTHETIC_IMAGE_TOKEN,
                splitting,
                wrap,
            };
            v.validate()?;
            Some(v)
        } else if split {
            return Err(ModelError::BadMetadata(
                "synthetic option `split` needs `vision=1`".into(),
            ));
        } else {
            None
        };
        Ok(Self {
            name: format!("synthetic:{spec}"),
            config: c,
            seed,
            vision,
        })
    }

    /// The model's tokenizer: the byte-level one ([`crate::tokenizer::Tokenizer::byte_level_synthetic`]),
    /// with the wrapper tokens of image splitting (`split=1`) as added special tokens.
    pub fn tokenizer(&self) -> crate::tokenizer::Tokenizer {
        match self.vision.as_ref().and_then(|v| v.splitting) {
            Some(s) => {
                // `<image>` too, so the added ids run on without a gap (as a tokenizer.json
                // written and read again keeps them).
                let tokens = synthetic_wrap_tokens(s.max_grid_side());
                let extra: Vec<(u32, &str)> = std::iter::once((SYNTHETIC_IMAGE_TOKEN, "<image>"))
                    .chain(tokens.iter().map(|(id, n)| (*id, n.as_str())))
                    .collect();
                crate::tokenizer::Tokenizer::byte_level_synthetic_with(&extra)
            }
            None => crate::tokenizer::Tokenizer::byte_level_synthetic(),
        }
    }

    /// Builds the seeded f32 weights, by GGUF tensor name.
    ///
    /// # Errors
    /// Only on a tensor-library failure.
    pub fn build(&self) -> Result<TensorStore> {
        let c = &self.config;
        let mut normal = normal_sampler(self.seed);
        let (d, hd, f) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let mut t: HashMap<String, Arc<QTensor>> = HashMap::new();
        let mut put = |name: String, data: Vec<f32>, shape: &[usize]| -> Result<()> {
            let tensor = Tensor::from_vec(data, shape, &Device::Cpu)?;
            t.insert(name, Arc::new(QTensor::quantize(&tensor, GgmlDType::F32)?));
            Ok(())
        };
        put(
            "token_embd.weight".into(),
            normal(c.vocab_size * d, 1.0),
            &[c.vocab_size, d],
        )?;
        let ones =
            |n: usize, noise: Vec<f32>| -> Vec<f32> { (0..n).map(|i| 1.0 + noise[i]).collect() };
        for i in 0..c.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let sd = 1.0 / (d as f32).sqrt();
            put(n("attn_norm.weight"), ones(d, normal(d, 0.1)), &[d])?;
            put(n("ffn_norm.weight"), ones(d, normal(d, 0.1)), &[d])?;
            put(
                n("attn_q.weight"),
                normal(c.num_heads * hd * d, sd),
                &[c.num_heads * hd, d],
            )?;
            put(
                n("attn_k.weight"),
                normal(c.num_kv_heads * hd * d, sd),
                &[c.num_kv_heads * hd, d],
            )?;
            put(
                n("attn_v.weight"),
                normal(c.num_kv_heads * hd * d, sd),
                &[c.num_kv_heads * hd, d],
            )?;
            let so = 1.0 / ((c.num_heads * hd) as f32).sqrt();
            put(
                n("attn_output.weight"),
                normal(d * c.num_heads * hd, so),
                &[d, c.num_heads * hd],
            )?;
            put(n("ffn_gate.weight"), normal(f * d, sd), &[f, d])?;
            put(n("ffn_up.weight"), normal(f * d, sd), &[f, d])?;
            put(
                n("ffn_down.weight"),
                normal(d * f, 1.0 / (f as f32).sqrt()),
                &[d, f],
            )?;
            if c.qkv_bias {
                put(
                    n("attn_q.bias"),
                    normal(c.num_heads * hd, 0.1),
                    &[c.num_heads * hd],
                )?;
                put(
                    n("attn_k.bias"),
                    normal(c.num_kv_heads * hd, 0.1),
                    &[c.num_kv_heads * hd],
                )?;
                put(
                    n("attn_v.bias"),
                    normal(c.num_kv_heads * hd, 0.1),
                    &[c.num_kv_heads * hd],
                )?;
            }
        }
        put("output_norm.weight".into(), ones(d, normal(d, 0.1)), &[d])?;
        // A sharper output layer than the embedding keeps greedy choices well separated.
        put(
            "output.weight".into(),
            normal(c.vocab_size * d, 3.0 / (d as f32).sqrt()),
            &[c.vocab_size, d],
        )?;
        Ok(TensorStore::from_map(t, self.name.clone()))
    }
}

impl SyntheticSpec {
    /// Builds the seeded f32 weights of the vision tower (`vision=1`), by the `mmproj` names
    /// of [`crate::vision`]; `None` for a text-only spec. Seeded apart from the decoder's.
    ///
    /// # Errors
    /// Only on a tensor-library failure.
    pub fn build_vision(&self) -> Result<Option<TensorStore>> {
        let Some(v) = &self.vision else {
            return Ok(None);
        };
        let mut normal = normal_sampler(self.seed ^ 0x5649_5349_4f4e);
        let mut t: HashMap<String, Arc<QTensor>> = HashMap::new();
        let mut put = |name: String, data: Vec<f32>, shape: &[usize]| -> Result<()> {
            let tensor = Tensor::from_vec(data, shape, &Device::Cpu)?;
            t.insert(name, Arc::new(QTensor::quantize(&tensor, GgmlDType::F32)?));
            Ok(())
        };
        let (h, p, f) = (v.hidden_size, v.patch_size, v.intermediate_size);
        let sd = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        put(
            "v.patch_embd.weight".into(),
            normal(h * 3 * p * p, sd(3 * p * p)),
            &[h, 3, p, p],
        )?;
        put("v.patch_embd.bias".into(), normal(h, 0.1), &[h])?;
        put(
            "v.position_embd.weight".into(),
            normal(v.num_patches() * h, 0.5),
            &[v.num_patches(), h],
        )?;
        let ones = |noise: Vec<f32>| -> Vec<f32> { noise.into_iter().map(|x| 1.0 + x).collect() };
        for i in 0..v.num_layers {
            let n = |s: &str| format!("v.blk.{i}.{s}");
            for ln in ["ln1", "ln2"] {
                put(n(&format!("{ln}.weight")), ones(normal(h, 0.1)), &[h])?;
                put(n(&format!("{ln}.bias")), normal(h, 0.1), &[h])?;
            }
            for (name, out, inp) in [
                ("attn_q", h, h),
                ("attn_k", h, h),
                ("attn_v", h, h),
                ("attn_out", h, h),
                ("ffn_up", f, h),
                ("ffn_down", h, f),
            ] {
                put(
                    n(&format!("{name}.weight")),
                    normal(out * inp, sd(inp)),
                    &[out, inp],
                )?;
                put(n(&format!("{name}.bias")), normal(out, 0.1), &[out])?;
            }
        }
        put("v.post_ln.weight".into(), ones(normal(h, 0.1)), &[h])?;
        put("v.post_ln.bias".into(), normal(h, 0.1), &[h])?;
        let r2 = v.scale_factor * v.scale_factor;
        put(
            "mm.model.fc.weight".into(),
            normal(v.text_hidden_size * h * r2, sd(h * r2)),
            &[v.text_hidden_size, h * r2],
        )?;
        Ok(Some(TensorStore::from_map(
            t,
            format!("{}#vision", self.name),
        )))
    }
}

/// Writes a synthetic model as a GGUF file (`llama` architecture) with its matmul weights
/// stored as `dtype`, tokenizer and all, so loaders can be tested on every tensor type.
/// GGUF `llama` files use interleaved RoPE, so Q/K rows are permuted as llama.cpp's converter
/// does; the file computes the same function as the in-memory model.
///
/// # Errors
/// I/O and tensor-library failures; models with a QKV bias (not a `llama` GGUF feature).
pub fn write_gguf(spec: &SyntheticSpec, path: &std::path::Path, dtype: GgmlDType) -> Result<()> {
    use candle_core::quantized::gguf_file::Value;
    let c = &spec.config;
    if c.qkv_bias {
        return Err(ModelError::BadMetadata(
            "QKV bias cannot be written as a llama GGUF".into(),
        ));
    }
    let store = spec.build()?;
    let tok = crate::tokenizer::Tokenizer::byte_level_synthetic();
    let vocab = tok.inner().get_vocab(true);
    let mut tokens = vec![String::new(); vocab.len()];
    for (s, id) in vocab {
        tokens[id as usize] = s;
    }
    let mut types = vec![1i32; tokens.len()];
    types[256..].iter_mut().for_each(|t| *t = 3);
    // Pad the vocabulary to the model's size with unused control tokens.
    while tokens.len() < c.vocab_size {
        types.push(3);
        tokens.push(format!("<|unused{}|>", tokens.len()));
    }
    let a = "llama";
    let u = |v: usize| Value::U32(v as u32);
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        ("general.name".into(), Value::String(spec.name.clone())),
        (format!("{a}.context_length"), u(c.context_length)),
        (format!("{a}.embedding_length"), u(c.hidden_size)),
        (format!("{a}.block_count"), u(c.num_layers)),
        (format!("{a}.feed_forward_length"), u(c.intermediate_size)),
        (format!("{a}.attention.head_count"), u(c.num_heads)),
        (format!("{a}.attention.head_count_kv"), u(c.num_kv_heads)),
        (format!("{a}.attention.key_length"), u(c.head_dim)),
        (format!("{a}.rope.dimension_count"), u(c.head_dim)),
        (format!("{a}.rope.freq_base"), Value::F32(c.rope_theta)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(256)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(257)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = store_names(&store);
    names.sort();
    for name in names {
        let t = store.get(name)?;
        let f = t.dequantize(&Device::Cpu)?;
        let f = if name.ends_with("attn_q.weight") {
            permute_for_interleaved(&f, c.num_heads, c.head_dim)?
        } else if name.ends_with("attn_k.weight") {
            permute_for_interleaved(&f, c.num_kv_heads, c.head_dim)?
        } else {
            f
        };
        let is_matrix = f.rank() == 2;
        let target = if is_matrix && f.dim(1)?.is_multiple_of(dtype.block_size()) {
            dtype
        } else {
            GgmlDType::F32
        };
        tensors.push((name.clone(), QTensor::quantize(&f, target)?));
    }
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    candle_core::quantized::gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
    Ok(())
}

/// Writes a synthetic VLM's vision tower (`vision=1`) as an `mmproj` GGUF ([`crate::mmproj`]):
/// the `clip.*` metadata of its shape, the image token under
/// [`crate::mmproj::IMAGE_TOKEN_KEY`] (the synthetic vocabulary has no `<image>`), and its f32
/// tensors — so a decoder GGUF from [`write_gguf`] plus this file load as the same VLM.
///
/// # Errors
/// A spec without `vision=1`; I/O and tensor-library failures.
pub fn write_mmproj(spec: &SyntheticSpec, path: &std::path::Path) -> Result<()> {
    use candle_core::quantized::gguf_file::Value;
    let (Some(v), Some(store)) = (&spec.vision, spec.build_vision()?) else {
        return Err(ModelError::BadMetadata(
            "an mmproj file needs a synthetic VLM (vision=1)".into(),
        ));
    };
    let u = |n: usize| Value::U32(n as u32);
    let floats = |f: [f32; 3]| Value::Array(f.iter().map(|x| Value::F32(*x)).collect());
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("clip".into())),
        (
            "general.name".into(),
            Value::String(format!("{}#vision", spec.name)),
        ),
        (
            "clip.projector_type".into(),
            Value::String(crate::mmproj::PROJECTOR_TYPE.into()),
        ),
        ("clip.has_vision_encoder".into(), Value::Bool(true)),
        ("clip.vision.image_size".into(), u(v.image_size)),
        ("clip.vision.patch_size".into(), u(v.patch_size)),
        ("clip.vision.embedding_length".into(), u(v.hidden_size)),
        (
            "clip.vision.feed_forward_length".into(),
            u(v.intermediate_size),
        ),
        ("clip.vision.block_count".into(), u(v.num_layers)),
        ("clip.vision.attention.head_count".into(), u(v.num_heads)),
        (
            "clip.vision.attention.layer_norm_epsilon".into(),
            Value::F32(v.layer_norm_eps),
        ),
        ("clip.vision.image_mean".into(), floats(v.image_mean)),
        ("clip.vision.image_std".into(), floats(v.image_std)),
        (
            "clip.vision.projector.scale_factor".into(),
            u(v.scale_factor),
        ),
        (
            crate::mmproj::IMAGE_TOKEN_KEY.into(),
            Value::U32(v.image_token_id),
        ),
    ];
    let mut names: Vec<&String> = store_names(&store);
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|name| {
            let f = store.get(name)?.dequantize(&Device::Cpu)?;
            Ok((name.clone(), QTensor::quantize(&f, GgmlDType::F32)?))
        })
        .collect::<Result<_>>()?;
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    candle_core::quantized::gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
    Ok(())
}

fn store_names(store: &TensorStore) -> Vec<&String> {
    store.names().collect()
}

/// HF (half-split) Q/K rows → llama.cpp's interleaved order: row `h·d + s·d/2 + j` moves to
/// `h·d + 2j + s`.
fn permute_for_interleaved(w: &Tensor, heads: usize, head_dim: usize) -> Result<Tensor> {
    let cols = w.dim(1)?;
    Ok(w.reshape((heads, 2, head_dim / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((heads * head_dim, cols))?)
}

/// Writes a synthetic model as an HF checkpoint directory: `config.json`,
/// `model.safetensors` (f32, or `f16` when asked) and `tokenizer.json`. A synthetic VLM
/// (`vision=1`) is written as an HF Idefics3 / SmolVLM checkpoint ([`crate::hf_vlm`]): the
/// decoder under `model.text_model.*` and `text_config`, the tower and connector under their HF
/// names and `vision_config`, `scale_factor` and `image_token_id`, and a
/// `preprocessor_config.json` with its mean and standard deviation — so the directory loads as
/// the same VLM.
///
/// # Errors
/// I/O and tensor-library failures.
pub fn write_safetensors_dir(spec: &SyntheticSpec, dir: &std::path::Path, f16: bool) -> Result<()> {
    let c = &spec.config;
    std::fs::create_dir_all(dir)?;
    let store = spec.build()?;
    let vision = match (&spec.vision, spec.build_vision()?) {
        (Some(v), Some(vstore)) => Some((v, vstore)),
        _ => None,
    };
    // A VLM's decoder sits under `model.text_model.` (HF `Idefics3Model.text_model`).
    let prefix = if vision.is_some() {
        crate::hf_vlm::TEXT_PREFIX
    } else {
        "model."
    };
    let mut out = HashMap::new();
    let mut renames: Vec<(String, String)> = vec![
        (
            "token_embd.weight".into(),
            format!("{prefix}embed_tokens.weight"),
        ),
        ("output_norm.weight".into(), format!("{prefix}norm.weight")),
        ("output.weight".into(), "lm_head.weight".into()),
    ];
    for i in 0..c.num_layers {
        for (h, g) in crate::weights::HF_LAYER_NAMES {
            renames.push((format!("blk.{i}.{g}"), format!("{prefix}layers.{i}.{h}")));
        }
    }
    let mut put = |t: &QTensor, hf: String| -> Result<()> {
        let t = t.dequantize(&Device::Cpu)?;
        let t = if f16 {
            t.to_dtype(candle_core::DType::F16)?
        } else {
            t
        };
        out.insert(hf, t);
        Ok(())
    };
    for (g, h) in renames {
        if store.contains(&g) {
            put(store.get(&g)?, h)?;
        }
    }
    if let Some((v, vstore)) = &vision {
        for (hf, name, _) in crate::hf_vlm::vision_tensors(v) {
            put(vstore.get(&name)?, hf)?;
        }
    }
    candle_core::safetensors::save(&out, dir.join("model.safetensors"))?;
    let arch = if c.qkv_bias {
        "Qwen2ForCausalLM"
    } else {
        "LlamaForCausalLM"
    };
    // HF transformers finds the model class by `model_type`; a file without `output.weight`
    // ties the LM head to the embedding.
    let model_type = if c.qkv_bias { "qwen2" } else { "llama" };
    let tied = !store.contains("output.weight");
    let torch_dtype = if f16 { "float16" } else { "float32" };
    let text = serde_json::json!({
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.context_length,
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
    });
    let config = match &vision {
        None => text,
        Some((v, _)) => {
            let json = |name: &str, value: &serde_json::Value| -> Result<()> {
                std::fs::write(
                    dir.join(name),
                    serde_json::to_string_pretty(value).unwrap_or_default(),
                )?;
                Ok(())
            };
            json(
                "preprocessor_config.json",
                &serde_json::json!({
                    "image_processor_type": "Idefics3ImageProcessor",
                    "processor_class": "Idefics3Processor",
                    "do_convert_rgb": true,
                    "do_resize": true,
                    "do_rescale": true,
                    "rescale_factor": 1.0 / 255.0,
                    "do_normalize": true,
                    "image_mean": v.image_mean,
                    "image_std": v.image_std,
                    "do_image_splitting": v.splitting.is_some(),
                    "max_image_size": {"longest_edge": v.image_size},
                    "size": {"longest_edge": v.splitting.map_or(v.image_size, |s| s.longest_edge)},
                    "resample": 1,
                }),
            )?;
            serde_json::json!({
                "architectures": [crate::hf_vlm::ARCHITECTURES[0]],
                "model_type": crate::hf_vlm::MODEL_TYPES[0],
                "image_token_id": v.image_token_id,
                "scale_factor": v.scale_factor,
                "tie_word_embeddings": tied,
                "torch_dtype": torch_dtype,
                "text_config": text,
                "vision_config": {
                    "model_type": "idefics3_vision",
                    "hidden_size": v.hidden_size,
                    "intermediate_size": v.intermediate_size,
                    "num_hidden_layers": v.num_layers,
                    "num_attention_heads": v.num_heads,
                    "image_size": v.image_size,
                    "patch_size": v.patch_size,
                    "layer_norm_eps": v.layer_norm_eps,
                    "hidden_act": "gelu_pytorch_tanh",
                    "num_channels": 3,
                },
            })
        }
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )?;
    spec.tokenizer().save_with_config(dir, None)?;
    Ok(())
}

/// Seeded normal samples: `normal(n, std)` draws `n` values of mean 0 and standard deviation
/// `std` (Box-Muller: two uniforms give one standard normal).
fn normal_sampler(seed: u64) -> impl FnMut(usize, f32) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    move |n: usize, std: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u1: f32 = rng.random::<f32>().max(1e-7);
                let u2: f32 = rng.random::<f32>();
                std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_overrides_parse() {
        let s = SyntheticSpec::parse("tiny").unwrap();
        assert_eq!(
            (
                s.config.num_layers,
                s.config.num_heads,
                s.config.num_kv_heads
            ),
            (4, 4, 2)
        );
        let s = SyntheticSpec::parse("small,layers=2,seed=7").unwrap();
        assert_eq!(
            (s.config.num_layers, s.config.num_kv_heads, s.seed),
            (2, 4, 7)
        );
        assert!(SyntheticSpec::parse("huge").is_err());
        assert!(SyntheticSpec::parse("tiny,wat=3").is_err());
        assert!(SyntheticSpec::parse("tiny,heads=3").is_err()); // 3 heads over 2 KV heads
    }

    #[test]
    fn weights_are_seeded() {
        let a = SyntheticSpec::parse("tiny,layers=1")
            .unwrap()
            .build()
            .unwrap();
        let b = SyntheticSpec::parse("tiny,layers=1")
            .unwrap()
            .build()
            .unwrap();
        let c = SyntheticSpec::parse("tiny,layers=1,seed=1")
            .unwrap()
            .build()
            .unwrap();
        let v = |s: &TensorStore| s.vector("blk.0.attn_norm.weight", 128).unwrap();
        assert_eq!(v(&a), v(&b));
        assert_ne!(v(&a), v(&c));
    }
}
