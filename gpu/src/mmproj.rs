//! A vision tower from an `mmproj` GGUF: the vision half of a vision-language model as
//! llama.cpp ships it, beside the decoder's own GGUF (`model.mmproj`, `--mmproj FILE`).
//!
//! The file's `clip.*` metadata gives the tower's shape and preprocessing:
//!
//! | key | what |
//! |---|---|
//! | `clip.projector_type` | must be `idefics3` (SmolVLM's connector: pixel shuffle, then one linear map) — the layout [`crate::vision::VisionTower`] runs |
//! | `clip.has_vision_encoder` | must not be false |
//! | `clip.vision.image_size`, `clip.vision.patch_size` | the square input and its patches |
//! | `clip.vision.embedding_length`, `clip.vision.feed_forward_length`, `clip.vision.block_count`, `clip.vision.attention.head_count`, `clip.vision.attention.layer_norm_epsilon` | the SigLIP encoder |
//! | `clip.vision.image_mean`, `clip.vision.image_std` | normalization (3 floats each) |
//! | `clip.vision.projector.scale_factor` | the pixel-shuffle factor |
//!
//! Its tensors carry the names [`crate::vision`] reads (`v.patch_embd.*`, `v.blk.N.*`,
//! `v.post_ln.*`, `mm.model.fc.weight`); every shape is checked against the metadata and the
//! decoder's hidden size. The image placeholder token is the decoder vocabulary's `<image>`
//! (SmolVLM's), or the file's [`IMAGE_TOKEN_KEY`] when it names one.
//!
//! Not read yet: SmolVLM's image splitting (tiles plus a global image) and its
//! `<fake_token_around_image>` / `<global-img>` wrapping; an image is one global image whose
//! rows are the `<image>` placeholders.

use crate::config::ModelConfig;
use crate::tokenizer::Tokenizer;
use crate::vision::{VisionConfig, VisionTower};
use crate::weights::TensorStore;
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file;
use std::path::Path;

/// pdserve's metadata key for the image placeholder token, for decoders whose vocabulary has
/// no `<image>` token (the synthetic VLM's).
pub const IMAGE_TOKEN_KEY: &str = "pdserve.vision.image_token_id";
/// The connector layout the tower implements.
pub const PROJECTOR_TYPE: &str = "idefics3";

fn num(content: &gguf_file::Content, key: &str) -> Result<f64> {
    use gguf_file::Value::*;
    let bad = || ModelError::BadMetadata(format!("mmproj: `{key}` is missing or not a number"));
    Ok(match content.metadata.get(key).ok_or_else(bad)? {
        U8(v) => f64::from(*v),
        I8(v) => f64::from(*v),
        U16(v) => f64::from(*v),
        I16(v) => f64::from(*v),
        U32(v) => f64::from(*v),
        I32(v) => f64::from(*v),
        U64(v) => *v as f64,
        I64(v) => *v as f64,
        F32(v) => f64::from(*v),
        F64(v) => *v,
        _ => return Err(bad()),
    })
}

fn count(content: &gguf_file::Content, key: &str) -> Result<usize> {
    let v = num(content, key)?;
    if !(v >= 1.0 && v.fract() == 0.0 && v <= f64::from(1u32 << 20)) {
        return Err(ModelError::BadMetadata(format!(
            "mmproj: `{key}` = {v} is not a count in 1..=2^20"
        )));
    }
    Ok(v as usize)
}

fn triple(content: &gguf_file::Content, key: &str) -> Result<[f32; 3]> {
    use gguf_file::Value;
    let bad = || ModelError::BadMetadata(format!("mmproj: `{key}` must be 3 floats"));
    let Some(Value::Array(items)) = content.metadata.get(key) else {
        return Err(bad());
    };
    let vals: Vec<f32> = items
        .iter()
        .map(|v| match v {
            Value::F32(f) if f.is_finite() => Ok(*f),
            _ => Err(bad()),
        })
        .collect::<Result<_>>()?;
    vals.try_into().map_err(|_| bad())
}

/// The tower's configuration from an mmproj file's metadata, for a decoder of hidden size
/// `text_hidden` whose image placeholder is `image_token` (`None`: the file must name it).
///
/// # Errors
/// [`ModelError::BadMetadata`] naming the key that is missing, malformed, or of another
/// projector type.
pub fn vision_config(
    content: &gguf_file::Content,
    text_hidden: usize,
    image_token: Option<u32>,
) -> Result<VisionConfig> {
    let projector = match content.metadata.get("clip.projector_type") {
        Some(gguf_file::Value::String(s)) => s.clone(),
        _ => {
            return Err(ModelError::BadMetadata(
                "mmproj: `clip.projector_type` is missing (not an mmproj file?)".into(),
            ))
        }
    };
    if projector != PROJECTOR_TYPE {
        return Err(ModelError::BadMetadata(format!(
            "mmproj: projector type `{projector}` is not supported (pdserve runs `{PROJECTOR_TYPE}`, SmolVLM's)"
        )));
    }
    if let Some(gguf_file::Value::Bool(false)) = content.metadata.get("clip.has_vision_encoder") {
        return Err(ModelError::BadMetadata(
            "mmproj: the file has no vision encoder (clip.has_vision_encoder = false)".into(),
        ));
    }
    let image_token_id = match (content.metadata.get(IMAGE_TOKEN_KEY), image_token) {
        (Some(_), _) => {
            let v = num(content, IMAGE_TOKEN_KEY)?;
            if !(v >= 0.0 && v.fract() == 0.0 && v <= f64::from(u32::MAX)) {
                return Err(ModelError::BadMetadata(format!(
                    "mmproj: `{IMAGE_TOKEN_KEY}` = {v} is not a token id"
                )));
            }
            v as u32
        }
        (None, Some(t)) => t,
        (None, None) => {
            return Err(ModelError::BadMetadata(
                "the decoder's vocabulary has no `<image>` token and the mmproj file names none: not a vision-language pair".into(),
            ))
        }
    };
    let eps = num(content, "clip.vision.attention.layer_norm_epsilon")?;
    if !(eps > 0.0 && eps < 1.0) {
        return Err(ModelError::BadMetadata(format!(
            "mmproj: layer_norm_epsilon {eps} is not in (0, 1)"
        )));
    }
    let cfg = VisionConfig {
        image_size: count(content, "clip.vision.image_size")?,
        patch_size: count(content, "clip.vision.patch_size")?,
        hidden_size: count(content, "clip.vision.embedding_length")?,
        num_layers: count(content, "clip.vision.block_count")?,
        num_heads: count(content, "clip.vision.attention.head_count")?,
        intermediate_size: count(content, "clip.vision.feed_forward_length")?,
        layer_norm_eps: eps as f32,
        scale_factor: count(content, "clip.vision.projector.scale_factor")?,
        text_hidden_size: text_hidden,
        image_mean: triple(content, "clip.vision.image_mean")?,
        image_std: triple(content, "clip.vision.image_std")?,
        image_token_id,
        // llama.cpp's converter records no splitting settings pdserve reads: an image is one
        // global image, its rows unwrapped.
        splitting: None,
        wrap: None,
    };
    if cfg.image_std.iter().any(|s| *s <= 0.0) {
        return Err(ModelError::BadMetadata(
            "mmproj: clip.vision.image_std must be positive".into(),
        ));
    }
    cfg.validate()?;
    Ok(cfg)
}

/// The vision tower of the mmproj file at `path`, for the decoder `text` with `tokenizer`.
///
/// # Errors
/// [`ModelError::NotFound`], a file that is not GGUF ([`ModelError::Corrupt`]), metadata as
/// [`vision_config`], a missing tensor or a shape that does not fit.
pub fn load_mmproj(path: &Path, text: &ModelConfig, tokenizer: &Tokenizer) -> Result<VisionTower> {
    let (content, mut reader) = crate::weights::open_gguf(path)?;
    let image_token = tokenizer
        .token_to_id("<image>")
        .filter(|&t| (t as usize) < text.vocab_size);
    let cfg = vision_config(&content, text.hidden_size, image_token)?;
    if cfg.image_token_id as usize >= text.vocab_size {
        return Err(ModelError::BadMetadata(format!(
            "mmproj: image token {} is outside the decoder's vocabulary of {}",
            cfg.image_token_id, text.vocab_size
        )));
    }
    let store = TensorStore::from_gguf(&content, &mut reader, path)?;
    VisionTower::from_store(&cfg, &store)
}
