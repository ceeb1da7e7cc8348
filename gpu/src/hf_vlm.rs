//! A vision-language model from an HF **Idefics3 / SmolVLM** checkpoint directory: the layout
//! `HuggingFaceTB/SmolVLM-256M-Instruct` and its siblings ship (`model_type` `idefics3` or
//! `smolvlm`; `Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`), whose
//! tower is the one [`crate::vision::VisionTower`] runs.
//!
//! What is read:
//!
//! | file | keys | what |
//! |---|---|---|
//! | `config.json` | `text_config` | the decoder, as an HF Llama `config.json` ([`crate::hf_config::hf_config`]); its `architectures` (`VLlama3ForCausalLM`, SmolVLM's training class) is ignored, a missing `model_type` is `llama` and a missing `rms_norm_eps` is `1e-5` (Idefics3's defaults) |
//! | `config.json` | `vision_config.{hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, image_size, patch_size, layer_norm_eps}` | the SigLIP encoder; a missing key takes transformers' `Idefics3VisionConfig` default (1152, 3072, 12, 16, 224, 32, 1e-6; SmolVLM2's configs leave some out), a missing `image_size` first `preprocessor_config.json`'s `max_image_size.longest_edge`. `hidden_act` must be tanh-GELU, `num_channels` 3 |
//! | `config.json` | `scale_factor` (default 2), `image_token_id` | the pixel-shuffle factor; the image placeholder token (when absent: the tokenizer's `<image>`), which must lie inside the decoder's vocabulary |
//! | `preprocessor_config.json` | `image_mean`, `image_std` (default 0.5 each, transformers' Idefics3 image processor's), `rescale_factor` (must be 1/255 when given) | normalization |
//! | `preprocessor_config.json` | `do_image_splitting` (absent: true, transformers' default, when the file is there), `size.longest_edge` (absent: 4 tiles), `max_image_size.longest_edge` (absent: the tower's `image_size`; must equal it) | image splitting ([`crate::vision::ImageSplitting`]); bounded to 64 sub-images an image |
//! | `tokenizer.json` | `<fake_token_around_image>`, `<global-img>`, `<row_R_col_C>` | the tokens around an image's rows (transformers' `Idefics3Processor`): required with splitting (a clear error at load when missing); without it, used when the tokenizer has the first two, as the processor wraps an unsplit image too |
//!
//! The files are read into typed structs ([`HfVlmConfig`], [`HfPreprocessorConfig`]; the
//! decoder's [`crate::hf_config::HfConfig`]) that ignore unknown keys; [`vision_config`] then
//! checks them in one place. A key of another type (`null` included) is refused with an error
//! naming it and showing what it held, a number may be written as an integer or a float, and
//! every count is bounded (1..=2²⁰) before anything is sized by it. Every tensor's shape is
//! checked against the config, errors naming the HF tensor. The tensors, and the names
//! they take in the [`TensorStore`] (those of llama.cpp's `mmproj` files, which its
//! `convert_hf_to_gguf.py` maps one to one, with no transpose or reshape):
//!
//! | HF | store |
//! |---|---|
//! | `model.text_model.{embed_tokens, layers.N.*, norm}`, `lm_head.weight` | the decoder's GGUF names, as an HF Llama checkpoint's `model.*` |
//! | `model.vision_model.embeddings.patch_embedding.{weight,bias}` (`[hidden, 3, P, P]`, the convolution's own order) | `v.patch_embd.*` |
//! | `model.vision_model.embeddings.position_embedding.weight` | `v.position_embd.weight` |
//! | `model.vision_model.encoder.layers.N.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}.*` | `v.blk.N.{ln1, attn_{q,k,v,out}, ln2, ffn_up, ffn_down}.*` |
//! | `model.vision_model.post_layernorm.*` | `v.post_ln.*` |
//! | `model.connector.modality_projection.proj.weight` | `mm.model.fc.weight` |
//!
//! Not read: `resample` (the split path resizes with Lanczos, transformers' default; the
//! unsplit path bilinearly to `image_size`), `do_resize` (always resized).

use crate::config::ModelConfig;
use crate::hf_config::{as_count, HfConfig, MAX_CONFIG_COUNT};
use crate::loose::{Loose, Object, Strict};
use crate::vision::{ImageSplitting, ImageWrapTokens, VisionConfig, VisionTower};
use crate::weights::TensorStore;
use crate::{ModelError, Result};
use serde::Deserialize;

/// The `model_type`s of the checkpoints read here.
pub const MODEL_TYPES: [&str; 2] = ["idefics3", "smolvlm"];
/// Their `architectures`.
pub const ARCHITECTURES: [&str; 2] = [
    "Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
];

/// Prefix of the decoder's tensors.
pub const TEXT_PREFIX: &str = "model.text_model.";
const VISION_PREFIX: &str = "model.vision_model.";
const CONNECTOR: &str = "model.connector.modality_projection.proj.weight";

/// An encoder layer's HF module names and their `mmproj` names.
const LAYER_NAMES: [(&str, &str); 8] = [
    ("layer_norm1", "ln1"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.out_proj", "attn_out"),
    ("layer_norm2", "ln2"),
    ("mlp.fc1", "ffn_up"),
    ("mlp.fc2", "ffn_down"),
];

/// transformers' `Idefics3VisionConfig` defaults, for keys a config leaves out.
const DEFAULT_HIDDEN: usize = 1152;
const DEFAULT_INTERMEDIATE: usize = 3072;
const DEFAULT_LAYERS: usize = 12;
const DEFAULT_HEADS: usize = 16;
const DEFAULT_IMAGE_SIZE: usize = 224;
const DEFAULT_PATCH: usize = 32;
const DEFAULT_EPS: f64 = 1e-6;
/// `Idefics3Config.scale_factor`'s default.
const DEFAULT_SCALE: usize = 2;
/// The Idefics3 image processor's mean and standard deviation.
const DEFAULT_MEAN_STD: [f32; 3] = [0.5; 3];

fn bad(m: String) -> ModelError {
    ModelError::BadMetadata(m)
}

fn bad_eps(shown: &dyn std::fmt::Display) -> ModelError {
    bad(format!(
        "config.json: `vision_config.layer_norm_eps` = {shown} is not in (0, 1)"
    ))
}

/// What an Idefics3 / SmolVLM `config.json` holds besides `model_type` and `architectures`
/// (read with [`crate::hf_config::HfConfig`]); the other keys are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct HfVlmConfig {
    text_config: Strict<Object<HfConfig>>,
    vision_config: Strict<Object<HfVisionConfig>>,
    scale_factor: Strict<f64>,
    image_token_id: Strict<u64>,
}

/// `config.json`'s `vision_config`: absent keys take transformers' `Idefics3VisionConfig`
/// defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct HfVisionConfig {
    hidden_size: Strict<f64>,
    intermediate_size: Strict<f64>,
    num_hidden_layers: Strict<f64>,
    num_attention_heads: Strict<f64>,
    num_channels: Strict<f64>,
    image_size: Strict<Side>,
    patch_size: Strict<Side>,
    layer_norm_eps: Strict<f64>,
    hidden_act: Strict<String>,
}

/// A side (`image_size`, `patch_size`): one count, or a square's `[n, n]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Side {
    One(f64),
    Pair(Vec<Strict<f64>>),
}

/// The keys of `preprocessor_config.json` read here; the others are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct HfPreprocessorConfig {
    image_mean: Strict<Vec<f64>>,
    image_std: Strict<Vec<f64>>,
    rescale_factor: Strict<f64>,
    do_image_splitting: Strict<bool>,
    size: Strict<Object<LongestEdge>>,
    max_image_size: Strict<Object<LongestEdge>>,
}

/// `preprocessor_config.json`'s `size` and `max_image_size`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct LongestEdge {
    longest_edge: Strict<f64>,
}

const CONFIG: &str = "config.json";
const PREPROCESSOR: &str = "preprocessor_config.json";

/// Whether a `config.json` is an Idefics3 / SmolVLM checkpoint's: its `model_type`, or the first
/// of its `architectures`, is one of those read here.
pub fn is_vlm_config(c: &HfConfig) -> bool {
    c.model_type().is_some_and(|t| MODEL_TYPES.contains(&t))
        || c.first_architecture()
            .is_some_and(|a| ARCHITECTURES.contains(&a))
}

/// The decoder's architecture from `config.json`'s `text_config`.
///
/// # Errors
/// [`ModelError::BadMetadata`] naming the key; [`ModelError::UnsupportedArchitecture`].
pub fn text_config(v: &HfVlmConfig) -> Result<ModelConfig> {
    let Strict::Is(Object(t)) = &v.text_config else {
        return Err(bad(
            "config.json: `text_config` is missing or not an object".into(),
        ));
    };
    let mut t = t.clone();
    // `VLlama3ForCausalLM`: the class SmolVLM was trained with, a Llama.
    t.architectures = None;
    t.model_type
        .get_or_insert_with(|| Loose::Is("llama".into()));
    t.rms_norm_eps.get_or_insert(Loose::Is(1e-5));
    t.model_config("config.json: text_config")
}

/// `key` of `file` as a count (1..=2^20), `None` when absent.
fn count(field: &Strict<f64>, file: &str, key: &str) -> Result<Option<usize>> {
    match field {
        Strict::Absent => Ok(None),
        Strict::Is(x) => match as_count(*x, MAX_CONFIG_COUNT) {
            Some(n) => Ok(Some(n)),
            None => Err(not_a_count(file, key, x)),
        },
        Strict::Not(shown) => Err(not_a_count(file, key, shown)),
    }
}

fn not_a_count(file: &str, key: &str, shown: &dyn std::fmt::Display) -> ModelError {
    bad(format!(
        "{file}: `{key}` = {shown} is not a count in 1..=2^20"
    ))
}

/// A side of `vision_config` (`key`), `None` when absent.
fn side(field: &Strict<Side>, key: &str) -> Result<Option<usize>> {
    let name = format!("vision_config.{key}");
    let one = |x: &Strict<f64>| count(x, CONFIG, &name);
    match field {
        Strict::Absent => Ok(None),
        Strict::Is(Side::One(x)) => one(&Strict::Is(*x)),
        Strict::Is(Side::Pair(pair)) => match pair.as_slice() {
            [x, y] => match (one(x)?, one(y)?) {
                (Some(x), Some(y)) if x != y => Err(bad(format!(
                    "config.json: `{name}` = [{x}, {y}] is not square (the tower takes square images)"
                ))),
                (x, _) => Ok(x),
            },
            _ => Err(bad(format!(
                "config.json: `{name}` is not a count or a pair"
            ))),
        },
        Strict::Not(shown) => Err(not_a_count(CONFIG, &name, shown)),
    }
}

/// Three finite floats at `key` of `preprocessor_config.json`, `default` when absent.
fn triple(field: &Strict<Vec<f64>>, key: &str, default: [f32; 3]) -> Result<[f32; 3]> {
    let err = || {
        bad(format!(
            "preprocessor_config.json: `{key}` must be 3 numbers"
        ))
    };
    match field {
        Strict::Absent => Ok(default),
        Strict::Is(items) => items
            .iter()
            .map(|&x| Some(x as f32).filter(|f| f.is_finite()))
            .collect::<Option<Vec<f32>>>()
            .and_then(|v| v.try_into().ok())
            .ok_or_else(err),
        Strict::Not(_) => Err(err()),
    }
}

/// Image splitting from `preprocessor_config.json` (see the module docs), for a tower of
/// `image_size`.
fn splitting(
    pre: Option<&HfPreprocessorConfig>,
    image_size: usize,
) -> Result<Option<ImageSplitting>> {
    let Some(pre) = pre else {
        return Ok(None);
    };
    match &pre.do_image_splitting {
        Strict::Absent | Strict::Is(true) => {}
        Strict::Is(false) => return Ok(None),
        Strict::Not(other) => {
            return Err(bad(format!(
                "preprocessor_config.json: `do_image_splitting` = {other} is not a boolean"
            )))
        }
    }
    let edge = |field: &Strict<Object<LongestEdge>>, key: &str| -> Result<Option<usize>> {
        match field {
            Strict::Absent => Ok(None),
            Strict::Is(Object(e)) if !matches!(e.longest_edge, Strict::Absent) => {
                count(&e.longest_edge, PREPROCESSOR, &format!("{key}.longest_edge"))
            }
            _ => Err(bad(format!(
                "preprocessor_config.json: `{key}` has no `longest_edge` (height/width sizes are not supported with do_image_splitting)"
            ))),
        }
    };
    let tile_size = edge(&pre.max_image_size, "max_image_size")?.unwrap_or(image_size);
    let longest_edge = edge(&pre.size, "size")?.unwrap_or(4 * tile_size);
    Ok(Some(ImageSplitting {
        longest_edge,
        tile_size,
    }))
}

/// The tower's configuration from `config.json` (`v`), `preprocessor_config.json` (`pre`, when
/// the directory has one) and the decoder `text`, checked (every count bounded before anything
/// is sized by it); `token_id` looks a token up in the tokenizer (`<image>`, the image token
/// when `config.json` names none, and the wrapper tokens of image splitting).
///
/// # Errors
/// [`ModelError::BadMetadata`] naming the key that is out of bounds, of another type, malformed
/// or inconsistent, an image or wrapper token outside the decoder's vocabulary, or splitting
/// with a tokenizer that lacks its wrapper tokens.
pub fn vision_config(
    v: &HfVlmConfig,
    pre: Option<&HfPreprocessorConfig>,
    text: &ModelConfig,
    token_id: &dyn Fn(&str) -> Option<u32>,
) -> Result<VisionConfig> {
    let tokenizer_image = token_id("<image>").filter(|&t| (t as usize) < text.vocab_size);
    let absent = HfVisionConfig::default();
    let vc = match &v.vision_config {
        Strict::Is(Object(vc)) => vc,
        Strict::Absent => &absent,
        Strict::Not(_) => return Err(bad("config.json: `vision_config` is not an object".into())),
    };
    // Without preprocessor_config.json its keys read as absent; only splitting tells the two
    // apart (off without the file).
    let no_file = HfPreprocessorConfig::default();
    let p = pre.unwrap_or(&no_file);
    let vcount = |field: &Strict<f64>, key: &str, default: usize| -> Result<usize> {
        Ok(count(field, CONFIG, &format!("vision_config.{key}"))?.unwrap_or(default))
    };
    let act = match &vc.hidden_act {
        Strict::Absent => None,
        Strict::Is(a) if matches!(a.as_str(), "gelu_pytorch_tanh" | "gelu_new") => None,
        Strict::Is(a) => Some(format!("{a:?}")),
        Strict::Not(shown) => Some(shown.to_string()),
    };
    if let Some(act) = act {
        return Err(bad(format!(
            "config.json: `vision_config.hidden_act` = {act} is not supported (the tower runs tanh-GELU, `gelu_pytorch_tanh`)"
        )));
    }
    if vcount(&vc.num_channels, "num_channels", 3)? != 3 {
        return Err(bad(
            "config.json: `vision_config.num_channels` must be 3 (RGB)".into(),
        ));
    }
    let image_size = match side(&vc.image_size, "image_size")? {
        Some(s) => s,
        None => match &p.max_image_size {
            Strict::Is(Object(m)) => {
                count(&m.longest_edge, PREPROCESSOR, "max_image_size.longest_edge")?
                    .unwrap_or(DEFAULT_IMAGE_SIZE)
            }
            Strict::Absent | Strict::Not(_) => DEFAULT_IMAGE_SIZE,
        },
    };
    let eps = match &vc.layer_norm_eps {
        Strict::Absent => DEFAULT_EPS,
        Strict::Is(x) if *x > 0.0 && *x < 1.0 => *x,
        Strict::Is(x) => return Err(bad_eps(x)),
        Strict::Not(shown) => return Err(bad_eps(shown)),
    };
    let rescale = match &p.rescale_factor {
        Strict::Absent => None,
        Strict::Is(r) if (r * 255.0 - 1.0).abs() < 1e-6 => None,
        Strict::Is(r) => Some(r.to_string()),
        Strict::Not(shown) => Some(shown.to_string()),
    };
    if let Some(r) = rescale {
        return Err(bad(format!(
            "preprocessor_config.json: `rescale_factor` = {r} is not supported (pixels are rescaled by 1/255)"
        )));
    }
    let not_a_token_id = |shown: &dyn std::fmt::Display| {
        bad(format!(
            "config.json: `image_token_id` = {shown} is not a token id"
        ))
    };
    let image_token_id = match &v.image_token_id {
        Strict::Is(id) => {
            let id = u32::try_from(*id).map_err(|_| not_a_token_id(id))?;
            if let Some(tok) = tokenizer_image.filter(|&tok| tok != id) {
                tracing::warn!(
                    config = id,
                    tokenizer = tok,
                    "config.json's image_token_id is not the tokenizer's <image>; using config.json's"
                );
            }
            id
        }
        Strict::Not(shown) => return Err(not_a_token_id(shown)),
        Strict::Absent => tokenizer_image.ok_or_else(|| {
            bad("config.json names no `image_token_id` and the tokenizer has no `<image>`".into())
        })?,
    };
    if image_token_id as usize >= text.vocab_size {
        return Err(bad(format!(
            "config.json: `image_token_id` = {image_token_id} is outside the decoder's vocabulary of {}",
            text.vocab_size
        )));
    }
    let splitting = splitting(pre, image_size)?;
    if let Some(s) = &splitting {
        // Bounded before the tile tokens, as many as the grid has cells, are looked up.
        s.validate(image_size)?;
    }
    let wrap = match &splitting {
        Some(s) => Some(
            ImageWrapTokens::lookup(token_id, s.max_grid_side()).map_err(|name| {
                bad(format!(
                    "preprocessor_config.json turns image splitting on (do_image_splitting), but the tokenizer has no `{name}` token: the prompt of a split image needs it (transformers' Idefics3Processor)"
                ))
            })?,
        ),
        None => ImageWrapTokens::lookup(token_id, 0).ok(),
    };
    if let Some(bad_id) = wrap
        .iter()
        .flat_map(|w| w.ids())
        .find(|&t| t as usize >= text.vocab_size)
    {
        return Err(bad(format!(
            "the tokenizer's image wrapper token {bad_id} is outside the decoder's vocabulary of {}",
            text.vocab_size
        )));
    }
    let cfg = VisionConfig {
        image_size,
        patch_size: side(&vc.patch_size, "patch_size")?.unwrap_or(DEFAULT_PATCH),
        hidden_size: vcount(&vc.hidden_size, "hidden_size", DEFAULT_HIDDEN)?,
        num_layers: vcount(&vc.num_hidden_layers, "num_hidden_layers", DEFAULT_LAYERS)?,
        num_heads: vcount(
            &vc.num_attention_heads,
            "num_attention_heads",
            DEFAULT_HEADS,
        )?,
        intermediate_size: vcount(
            &vc.intermediate_size,
            "intermediate_size",
            DEFAULT_INTERMEDIATE,
        )?,
        layer_norm_eps: eps as f32,
        scale_factor: count(&v.scale_factor, CONFIG, "scale_factor")?.unwrap_or(DEFAULT_SCALE),
        text_hidden_size: text.hidden_size,
        image_mean: triple(&p.image_mean, "image_mean", DEFAULT_MEAN_STD)?,
        image_std: triple(&p.image_std, "image_std", DEFAULT_MEAN_STD)?,
        image_token_id,
        splitting,
        wrap,
    };
    if cfg.image_std.iter().any(|s| *s <= 0.0) {
        return Err(bad(
            "preprocessor_config.json: `image_std` must be positive".into(),
        ));
    }
    cfg.validate()?;
    Ok(cfg)
}

/// The store name of a checkpoint tensor: the decoder's GGUF names for `model.text_model.*`
/// and `lm_head.weight` (layers below `text_layers`), the `mmproj` names for the tower and the
/// connector (every layer index, so that layers past the config's count are seen); `None`
/// for a tensor nothing reads.
pub fn tensor_name(hf: &str, text_layers: usize) -> Option<String> {
    if let Some(name) = crate::weights::hf_text_name(hf, TEXT_PREFIX, text_layers) {
        return Some(name);
    }
    if hf == CONNECTOR {
        return Some("mm.model.fc.weight".into());
    }
    let rest = hf.strip_prefix(VISION_PREFIX)?;
    let fixed = match rest {
        "embeddings.patch_embedding.weight" => Some("v.patch_embd.weight"),
        "embeddings.patch_embedding.bias" => Some("v.patch_embd.bias"),
        "embeddings.position_embedding.weight" => Some("v.position_embd.weight"),
        "post_layernorm.weight" => Some("v.post_ln.weight"),
        "post_layernorm.bias" => Some("v.post_ln.bias"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.into());
    }
    let (layer, name) = rest.strip_prefix("encoder.layers.")?.split_once('.')?;
    let i: usize = layer.parse().ok()?;
    if layer != i.to_string() {
        return None;
    }
    let (module, kind) = name.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let (_, gg) = LAYER_NAMES.iter().find(|(h, _)| *h == module)?;
    Some(format!("v.blk.{i}.{gg}.{kind}"))
}

/// Every tensor of the tower and connector of `cfg`: its HF name, its store name and its
/// shape, layer by layer (lazily: nothing is sized by the layer count).
pub fn vision_tensors(
    cfg: &VisionConfig,
) -> impl Iterator<Item = (String, String, Vec<usize>)> + '_ {
    let (h, p, f) = (cfg.hidden_size, cfg.patch_size, cfg.intermediate_size);
    let v = |s: &str| format!("{VISION_PREFIX}{s}");
    let head = [
        (v("embeddings.patch_embedding.weight"), vec![h, 3, p, p]),
        (v("embeddings.patch_embedding.bias"), vec![h]),
        (
            v("embeddings.position_embedding.weight"),
            vec![cfg.num_patches(), h],
        ),
    ];
    let layers = (0..cfg.num_layers).flat_map(move |i| {
        LAYER_NAMES.iter().flat_map(move |(module, _)| {
            let (w, b) = match *module {
                "layer_norm1" | "layer_norm2" => (vec![h], vec![h]),
                "mlp.fc1" => (vec![f, h], vec![f]),
                "mlp.fc2" => (vec![h, f], vec![h]),
                _ => (vec![h, h], vec![h]),
            };
            let n = |k: &str| format!("{VISION_PREFIX}encoder.layers.{i}.{module}.{k}");
            [(n("weight"), w), (n("bias"), b)]
        })
    });
    let r2 = cfg.scale_factor * cfg.scale_factor;
    let tail = [
        (v("post_layernorm.weight"), vec![h]),
        (v("post_layernorm.bias"), vec![h]),
        (CONNECTOR.to_string(), vec![cfg.text_hidden_size, h * r2]),
    ];
    head.into_iter()
        .chain(layers)
        .chain(tail)
        .filter_map(|(hf, shape)| tensor_name(&hf, 0).map(|name| (hf, name, shape)))
}

/// Takes the tower's tensors out of `store` (read with [`tensor_name`]) and builds the tower,
/// checking first that the checkpoint has every tensor of `cfg` in its shape and no encoder
/// layer past `cfg.num_layers`.
///
/// # Errors
/// [`ModelError::MissingTensor`] / [`ModelError::BadShape`] naming the HF tensor;
/// [`ModelError::BadMetadata`] for layers the config does not count.
pub fn take_tower(cfg: &VisionConfig, store: &mut TensorStore) -> Result<VisionTower> {
    let extra = store
        .names()
        .filter_map(|n| n.strip_prefix("v.blk.")?.split_once('.')?.0.parse().ok())
        .filter(|&i: &usize| i >= cfg.num_layers)
        .max();
    if let Some(i) = extra {
        return Err(bad(format!(
            "config.json: `vision_config.num_hidden_layers` is {} but the checkpoint has encoder layer {i} ({VISION_PREFIX}encoder.layers.{i}.*)",
            cfg.num_layers
        )));
    }
    for (hf, name, shape) in vision_tensors(cfg) {
        let t = store
            .get(&name)
            .map_err(|_| ModelError::MissingTensor(hf.clone()))?;
        if t.shape().dims() != shape.as_slice() {
            return Err(ModelError::BadShape {
                name: hf,
                actual: t.shape().dims().to_vec(),
                expected: shape,
            });
        }
    }
    let tower = store.take_prefixed(&["v.", "mm."]);
    VisionTower::from_store(cfg, &tower)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loose::parse_object;

    /// A `config.json`, read as the loader reads it.
    fn config_json(v: serde_json::Value) -> HfVlmConfig {
        parse_object(&v.to_string()).unwrap()
    }

    /// A `preprocessor_config.json`, read as the loader reads it.
    fn preprocessor_json(v: serde_json::Value) -> HfPreprocessorConfig {
        parse_object(&v.to_string()).unwrap()
    }

    #[test]
    fn names_map_as_llama_cpp_maps_them() {
        let n = |s: &str| tensor_name(s, 2);
        assert_eq!(
            n("model.vision_model.encoder.layers.11.self_attn.out_proj.bias").as_deref(),
            Some("v.blk.11.attn_out.bias")
        );
        assert_eq!(
            n("model.vision_model.encoder.layers.0.mlp.fc1.weight").as_deref(),
            Some("v.blk.0.ffn_up.weight")
        );
        assert_eq!(
            n("model.vision_model.embeddings.patch_embedding.weight").as_deref(),
            Some("v.patch_embd.weight")
        );
        assert_eq!(n(CONNECTOR).as_deref(), Some("mm.model.fc.weight"));
        assert_eq!(
            n("model.text_model.layers.1.self_attn.o_proj.weight").as_deref(),
            Some("blk.1.attn_output.weight")
        );
        assert_eq!(
            n("model.text_model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(n("lm_head.weight").as_deref(), Some("output.weight"));
        // Past the decoder's layers, unknown modules, odd indices: nothing.
        assert_eq!(n("model.text_model.layers.2.mlp.up_proj.weight"), None);
        assert_eq!(
            n("model.vision_model.encoder.layers.0.mlp.fc3.weight"),
            None
        );
        assert_eq!(
            n("model.vision_model.encoder.layers.01.mlp.fc1.weight"),
            None
        );
        assert_eq!(n("model.layers.0.mlp.up_proj.weight"), None);
    }

    #[test]
    fn missing_vision_keys_take_transformers_defaults() {
        let text = crate::synthetic::SyntheticSpec::parse("tiny")
            .unwrap()
            .config;
        let v = serde_json::json!({
            "model_type": "smolvlm",
            "image_token_id": 300,
            "vision_config": {"hidden_size": 768, "num_attention_heads": 12, "patch_size": 16},
        });
        let v = config_json(v);
        let pre = serde_json::json!({"max_image_size": {"longest_edge": 512}, "do_image_splitting": false});
        let pre = preprocessor_json(pre);
        let c = vision_config(&v, Some(&pre), &text, &|_| None).unwrap();
        assert_eq!((c.splitting, c.wrap.clone()), (None, None));
        assert_eq!(
            (
                c.image_size,
                c.num_layers,
                c.intermediate_size,
                c.scale_factor
            ),
            (512, 12, 3072, 2)
        );
        assert_eq!(c.tokens_per_image(), 256);
        // No image token anywhere is refused; the tokenizer's `<image>` stands in.
        let none =
            serde_json::json!({"model_type": "idefics3", "vision_config": {"image_size": 64}});
        let none = config_json(none);
        assert!(vision_config(&none, None, &text, &|_| None).is_err());
        let c = vision_config(&none, None, &text, &|n| (n == "<image>").then_some(7)).unwrap();
        assert_eq!(
            (c.image_token_id, c.patch_size, c.hidden_size),
            (7, 32, 1152)
        );
    }

    #[test]
    fn image_splitting_comes_from_the_preprocessor_and_needs_the_wrapper_tokens() {
        use crate::vision::{tile_token_name, ImageSplitting, FAKE_TOKEN_AROUND_IMAGE};
        let text = crate::synthetic::SyntheticSpec::parse("tiny")
            .unwrap()
            .config;
        let v = serde_json::json!({
            "model_type": "smolvlm",
            "image_token_id": 300,
            "vision_config": {"hidden_size": 64, "num_attention_heads": 4, "patch_size": 16, "image_size": 512},
        });
        let v = config_json(v);
        // SmolVLM-256M's settings: up to 4x4 tiles of 512 (`<row_4_col_4>`).
        let names: Vec<String> = [FAKE_TOKEN_AROUND_IMAGE.to_string(), "<global-img>".into()]
            .into_iter()
            .chain((1..=4).flat_map(|r| (1..=4).map(move |c| tile_token_name(r, c))))
            .collect();
        let tokens = |n: &str| names.iter().position(|x| x == n).map(|i| 301 + i as u32);
        let pre = serde_json::json!({
            "do_image_splitting": true,
            "size": {"longest_edge": 2048},
            "max_image_size": {"longest_edge": 512},
        });
        let pre = preprocessor_json(pre);
        let c = vision_config(&v, Some(&pre), &text, &tokens).unwrap();
        assert_eq!(
            c.splitting,
            Some(ImageSplitting {
                longest_edge: 2048,
                tile_size: 512
            })
        );
        let wrap = c.wrap.clone().unwrap();
        assert_eq!((wrap.around, wrap.global, wrap.grid_side), (301, 302, 4));
        assert_eq!(wrap.tile(4, 4), Some(318));
        assert_eq!(c.max_sub_images(), 17);
        // Absent keys: splitting on (transformers' default), tiles of the tower's size, 4 of
        // them on the longest edge.
        let c = vision_config(
            &v,
            Some(&preprocessor_json(serde_json::json!({}))),
            &text,
            &tokens,
        )
        .unwrap();
        assert_eq!(c.splitting.unwrap().longest_edge, 2048);
        // A tokenizer without the wrapper tokens is refused by name.
        let e = vision_config(&v, Some(&pre), &text, &|_| None).unwrap_err();
        assert!(e.to_string().contains("<row_1_col_1>"), "{e}");
        let few = |n: &str| {
            if n == "<row_4_col_4>" {
                None
            } else {
                tokens(n)
            }
        };
        let e = vision_config(&v, Some(&pre), &text, &few).unwrap_err();
        assert!(e.to_string().contains("<row_4_col_4>"), "{e}");
        // Tiles of another size than the tower's, too many tiles, a bad flag.
        for (pre, what) in [
            (
                serde_json::json!({"max_image_size": {"longest_edge": 384}}),
                "image size 512",
            ),
            (
                serde_json::json!({"size": {"longest_edge": 4096}}),
                "more than 64 sub-images",
            ),
            (
                serde_json::json!({"do_image_splitting": "yes"}),
                "not a boolean",
            ),
            (
                serde_json::json!({"size": {"height": 4}}),
                "no `longest_edge`",
            ),
        ] {
            let e = vision_config(&v, Some(&preprocessor_json(pre)), &text, &tokens).unwrap_err();
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        // Without splitting, the tokens wrap an image when the tokenizer has them.
        let off = serde_json::json!({"do_image_splitting": false});
        let off = preprocessor_json(off);
        let c = vision_config(&v, Some(&off), &text, &tokens).unwrap();
        assert_eq!(c.wrap.map(|w| (w.around, w.grid_side)), Some((301, 0)));
    }

    #[test]
    fn a_vlm_is_told_by_model_type_or_its_first_architecture() {
        let is = |v: serde_json::Value| {
            is_vlm_config(&parse_object::<HfConfig>(&v.to_string()).unwrap())
        };
        assert!(is(serde_json::json!({"model_type": "smolvlm"})));
        assert!(is(
            serde_json::json!({"architectures": ["Idefics3ForConditionalGeneration"]})
        ));
        assert!(is(
            serde_json::json!({"architectures": [3], "model_type": "idefics3"})
        ));
        assert!(!is(
            serde_json::json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        ));
        assert!(!is(
            serde_json::json!({"architectures": ["LlamaForCausalLM", ARCHITECTURES[0]]})
        ));
        assert!(!is(serde_json::json!({"model_type": ["smolvlm"]})));
    }

    #[test]
    fn text_config_is_a_llama_with_idefics3_defaults() {
        let text = serde_json::json!({
            "architectures": ["VLlama3ForCausalLM"],
            "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 1024,
        });
        let c = text_config(&config_json(
            serde_json::json!({"text_config": text.clone()}),
        ))
        .unwrap();
        assert_eq!((c.architecture.as_str(), c.rms_norm_eps), ("llama", 1e-5));
        let mut qwen = text.clone();
        qwen["model_type"] = "qwen2".into();
        qwen["rms_norm_eps"] = 1e-6.into();
        let c = text_config(&config_json(serde_json::json!({"text_config": qwen}))).unwrap();
        assert_eq!((c.architecture.as_str(), c.rms_norm_eps), ("qwen2", 1e-6));
        let mut wrong = text;
        wrong["hidden_size"] = "64".into();
        for (v, want) in [
            (
                serde_json::json!({"text_config": wrong}),
                "config.json: text_config: `hidden_size`",
            ),
            (
                serde_json::json!({"text_config": [1]}),
                "`text_config` is missing or not an object",
            ),
            (
                serde_json::json!({"text_config": null}),
                "`text_config` is missing or not an object",
            ),
            (
                serde_json::json!({}),
                "`text_config` is missing or not an object",
            ),
        ] {
            let e = text_config(&config_json(v.clone()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{v}: want `{want}` in {e}");
        }
    }

    #[test]
    fn vision_numbers_read_as_integers_or_floats() {
        let text = crate::synthetic::SyntheticSpec::parse("tiny")
            .unwrap()
            .config;
        let v = config_json(serde_json::json!({
            "model_type": "smolvlm",
            "image_token_id": 300,
            "scale_factor": 2.0,
            "vision_config": {
                "hidden_size": 64.0, "num_attention_heads": 4, "image_size": [64.0, 64],
                "patch_size": 16.0, "layer_norm_eps": 1e-5, "num_channels": 3.0,
                "hidden_act": "gelu_new", "model_type": "idefics3_vision",
            },
        }));
        let pre = preprocessor_json(serde_json::json!({
            "do_image_splitting": false, "rescale_factor": 0.00392156862745098,
            "image_mean": [0, 0.5, 1], "image_std": [1, 0.5, 0.25],
        }));
        let c = vision_config(&v, Some(&pre), &text, &|_| None).unwrap();
        assert_eq!(
            (
                c.hidden_size,
                c.image_size,
                c.patch_size,
                c.scale_factor,
                c.layer_norm_eps
            ),
            (64, 64, 16, 2, 1e-5)
        );
        assert_eq!(
            (c.image_mean, c.image_std),
            ([0.0, 0.5, 1.0], [1.0, 0.5, 0.25])
        );
    }

    #[test]
    fn keys_of_another_type_are_refused_by_name() {
        let text = crate::synthetic::SyntheticSpec::parse("tiny")
            .unwrap()
            .config;
        let base = serde_json::json!({
            "model_type": "smolvlm",
            "image_token_id": 300,
            "vision_config": {"hidden_size": 64, "num_attention_heads": 4, "patch_size": 16, "image_size": 64},
        });
        let off = serde_json::json!({"do_image_splitting": false});
        let config_cases: [(&str, serde_json::Value, &str); 14] = [
            (
                "hidden_size",
                "64".into(),
                r#"config.json: `vision_config.hidden_size` = "64" is not a count"#,
            ),
            (
                "patch_size",
                serde_json::Value::Null,
                "`vision_config.patch_size` = null is not a count",
            ),
            (
                "num_hidden_layers",
                2.5.into(),
                "`vision_config.num_hidden_layers` = 2.5 is not a count",
            ),
            (
                "intermediate_size",
                0.into(),
                "`vision_config.intermediate_size` = 0 is not a count",
            ),
            (
                "image_size",
                serde_json::json!([64, 32]),
                "`vision_config.image_size` = [64, 32] is not square",
            ),
            (
                "image_size",
                serde_json::json!([64, 64, 64]),
                "`vision_config.image_size` is not a count or a pair",
            ),
            (
                "image_size",
                serde_json::json!([64, "64"]),
                r#"`vision_config.image_size` = "64" is not a count"#,
            ),
            (
                "image_size",
                serde_json::json!({"height": 64}),
                r#"`vision_config.image_size` = {"height":64} is not a count"#,
            ),
            (
                "hidden_act",
                3.into(),
                "`vision_config.hidden_act` = 3 is not supported",
            ),
            (
                "hidden_act",
                "relu".into(),
                r#"`vision_config.hidden_act` = "relu" is not supported"#,
            ),
            (
                "layer_norm_eps",
                "1e-6".into(),
                r#"`vision_config.layer_norm_eps` = "1e-6" is not in (0, 1)"#,
            ),
            (
                "layer_norm_eps",
                1.into(),
                "`vision_config.layer_norm_eps` = 1 is not in (0, 1)",
            ),
            (
                "num_channels",
                1.into(),
                "`vision_config.num_channels` must be 3",
            ),
            (
                "num_channels",
                true.into(),
                "`vision_config.num_channels` = true is not a count",
            ),
        ];
        let top_cases: [(&str, serde_json::Value, &str); 6] = [
            (
                "vision_config",
                serde_json::json!([64]),
                "`vision_config` is not an object",
            ),
            (
                "vision_config",
                serde_json::Value::Null,
                "`vision_config` is not an object",
            ),
            (
                "image_token_id",
                300.0.into(),
                "`image_token_id` = 300 is not a token id",
            ),
            (
                "image_token_id",
                "300".into(),
                r#"`image_token_id` = "300" is not a token id"#,
            ),
            (
                "image_token_id",
                (1u64 << 32).into(),
                "`image_token_id` = 4294967296 is not a token id",
            ),
            (
                "scale_factor",
                serde_json::Value::Null,
                "config.json: `scale_factor` = null is not a count",
            ),
        ];
        let edits = config_cases
            .into_iter()
            .map(|(k, x, want)| (Some("vision_config"), k, x, want))
            .chain(top_cases.into_iter().map(|(k, x, want)| (None, k, x, want)));
        for (within, key, value, want) in edits {
            let mut v = base.clone();
            match within {
                Some(o) => v[o][key] = value.clone(),
                None => v[key] = value.clone(),
            }
            let e = vision_config(
                &config_json(v),
                Some(&preprocessor_json(off.clone())),
                &text,
                &|_| None,
            )
            .unwrap_err();
            assert!(
                matches!(e, ModelError::BadMetadata(_)),
                "{key} = {value}: {e}"
            );
            assert!(
                e.to_string().contains(want),
                "{key} = {value}: want `{want}` in {e}"
            );
        }
        let pre_cases = [
            (
                serde_json::json!({"image_mean": [0.5, 0.5], "do_image_splitting": false}),
                "`image_mean` must be 3 numbers",
            ),
            (
                serde_json::json!({"image_std": ["a", 0.5, 0.5], "do_image_splitting": false}),
                "`image_std` must be 3 numbers",
            ),
            (
                serde_json::json!({"image_std": 0.5, "do_image_splitting": false}),
                "`image_std` must be 3 numbers",
            ),
            (
                serde_json::json!({"rescale_factor": "1/255"}),
                r#"`rescale_factor` = "1/255" is not supported"#,
            ),
            (
                serde_json::json!({"do_image_splitting": null}),
                "`do_image_splitting` = null is not a boolean",
            ),
            (
                serde_json::json!({"max_image_size": {"longest_edge": "64"}}),
                r#"preprocessor_config.json: `max_image_size.longest_edge` = "64" is not a count"#,
            ),
            (
                serde_json::json!({"size": {"longest_edge": 0}}),
                "`size.longest_edge` = 0 is not a count",
            ),
            (
                serde_json::json!({"size": 256}),
                "`size` has no `longest_edge`",
            ),
            (
                serde_json::json!({"size": {"longest_edge": 8192}}),
                "size.longest_edge 8192 is not in 1..=4096",
            ),
        ];
        for (pre, want) in pre_cases {
            let e = vision_config(
                &config_json(base.clone()),
                Some(&preprocessor_json(pre.clone())),
                &text,
                &|_| None,
            )
            .unwrap_err();
            assert!(e.to_string().contains(want), "{pre}: want `{want}` in {e}");
        }
        // Without `image_size`, `max_image_size.longest_edge` stands in, checked as a count.
        let mut v = base;
        v["vision_config"]
            .as_object_mut()
            .unwrap()
            .remove("image_size");
        let pre = serde_json::json!({"do_image_splitting": false, "max_image_size": {"longest_edge": -64}});
        let e = vision_config(
            &config_json(v),
            Some(&preprocessor_json(pre)),
            &text,
            &|_| None,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("`max_image_size.longest_edge` = -64 is not a count"),
            "{e}"
        );
    }
}
