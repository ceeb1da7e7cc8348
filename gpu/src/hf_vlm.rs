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
//! Every count is bounded (1..=2²⁰) before anything is sized by it, and every tensor's shape
//! is checked against the config, errors naming the HF tensor. The tensors, and the names
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
use crate::vision::{ImageSplitting, ImageWrapTokens, VisionConfig, VisionTower};
use crate::weights::TensorStore;
use crate::{ModelError, Result};
use serde_json::Value;

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

/// Whether a parsed `config.json` is an Idefics3 / SmolVLM checkpoint's.
pub fn is_vlm_config(v: &Value) -> bool {
    let model_type = v.get("model_type").and_then(Value::as_str);
    let arch = v
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str);
    model_type.is_some_and(|t| MODEL_TYPES.contains(&t))
        || arch.is_some_and(|a| ARCHITECTURES.contains(&a))
}

/// The decoder's architecture from `config.json`'s `text_config`.
///
/// # Errors
/// [`ModelError::BadMetadata`] naming the key; [`ModelError::UnsupportedArchitecture`].
pub fn text_config(v: &Value) -> Result<ModelConfig> {
    let Some(Value::Object(t)) = v.get("text_config") else {
        return Err(bad(
            "config.json: `text_config` is missing or not an object".into(),
        ));
    };
    let mut t = t.clone();
    // `VLlama3ForCausalLM`: the class SmolVLM was trained with, a Llama.
    t.remove("architectures");
    t.entry("model_type").or_insert_with(|| "llama".into());
    t.entry("rms_norm_eps").or_insert_with(|| 1e-5.into());
    crate::hf_config::hf_config_value(&Value::Object(t), "config.json: text_config")
}

/// A count at `obj[key]` (`what` names it), `default` when absent.
fn count(obj: Option<&Value>, what: &str, key: &str, default: usize) -> Result<usize> {
    match obj.and_then(|o| o.get(key)) {
        None => Ok(default),
        Some(v) => bounded(v, &format!("{what}{key}")),
    }
}

fn bounded(v: &Value, name: &str) -> Result<usize> {
    match v.as_f64() {
        Some(x) if x >= 1.0 && x.fract() == 0.0 && x <= crate::hf_config::MAX_CONFIG_COUNT => {
            Ok(x as usize)
        }
        _ => Err(bad(format!(
            "config.json: `{name}` = {v} is not a count in 1..=2^20"
        ))),
    }
}

/// A side (`image_size`, `patch_size`): one count, or a square's `[n, n]`.
fn side(obj: Option<&Value>, key: &str) -> Result<Option<usize>> {
    let name = format!("vision_config.{key}");
    match obj.and_then(|o| o.get(key)) {
        None => Ok(None),
        Some(Value::Array(a)) => match a.as_slice() {
            [x, y] => {
                let (x, y) = (bounded(x, &name)?, bounded(y, &name)?);
                if x != y {
                    return Err(bad(format!(
                        "config.json: `{name}` = [{x}, {y}] is not square (the tower takes square images)"
                    )));
                }
                Ok(Some(x))
            }
            _ => Err(bad(format!(
                "config.json: `{name}` is not a count or a pair"
            ))),
        },
        Some(v) => bounded(v, &name).map(Some),
    }
}

/// Three finite floats at `pre[key]` (`preprocessor_config.json`), `default` when absent.
fn triple(pre: Option<&Value>, key: &str, default: [f32; 3]) -> Result<[f32; 3]> {
    let Some(v) = pre.and_then(|p| p.get(key)) else {
        return Ok(default);
    };
    let err = || {
        bad(format!(
            "preprocessor_config.json: `{key}` must be 3 numbers"
        ))
    };
    let items = v.as_array().ok_or_else(err)?;
    let vals: Vec<f32> = items
        .iter()
        .map(|x| {
            x.as_f64()
                .map(|f| f as f32)
                .filter(|f| f.is_finite())
                .ok_or_else(err)
        })
        .collect::<Result<_>>()?;
    vals.try_into().map_err(|_| err())
}

/// Image splitting from `preprocessor_config.json` (see the module docs), for a tower of
/// `image_size`.
fn splitting(pre: Option<&Value>, image_size: usize) -> Result<Option<ImageSplitting>> {
    let Some(pre) = pre else {
        return Ok(None);
    };
    match pre.get("do_image_splitting") {
        None | Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => return Ok(None),
        Some(other) => {
            return Err(bad(format!(
                "preprocessor_config.json: `do_image_splitting` = {other} is not a boolean"
            )))
        }
    }
    let edge = |key: &str| -> Result<Option<usize>> {
        match pre.get(key).map(|m| m.get("longest_edge")) {
            None => Ok(None),
            Some(Some(e)) => Ok(Some(bounded(
                e,
                &format!("preprocessor {key}.longest_edge"),
            )?)),
            Some(None) => Err(bad(format!(
                "preprocessor_config.json: `{key}` has no `longest_edge` (height/width sizes are not supported with do_image_splitting)"
            ))),
        }
    };
    let tile_size = edge("max_image_size")?.unwrap_or(image_size);
    let longest_edge = edge("size")?.unwrap_or(4 * tile_size);
    Ok(Some(ImageSplitting {
        longest_edge,
        tile_size,
    }))
}

/// The tower's configuration from `config.json` (`v`), `preprocessor_config.json` (`pre`, when
/// the directory has one) and the decoder `text`; `token_id` looks a token up in the
/// tokenizer (`<image>`, the image token when `config.json` names none, and the wrapper
/// tokens of image splitting).
///
/// # Errors
/// [`ModelError::BadMetadata`] naming the key that is out of bounds, malformed or
/// inconsistent, an image or wrapper token outside the decoder's vocabulary, or splitting
/// with a tokenizer that lacks its wrapper tokens.
pub fn vision_config(
    v: &Value,
    pre: Option<&Value>,
    text: &ModelConfig,
    token_id: &dyn Fn(&str) -> Option<u32>,
) -> Result<VisionConfig> {
    let tokenizer_image = token_id("<image>").filter(|&t| (t as usize) < text.vocab_size);
    let vc = match v.get("vision_config") {
        Some(o @ Value::Object(_)) => Some(o),
        None => None,
        Some(_) => return Err(bad("config.json: `vision_config` is not an object".into())),
    };
    let w = "vision_config.";
    if let Some(act) = vc.and_then(|o| o.get("hidden_act")) {
        if !matches!(act.as_str(), Some("gelu_pytorch_tanh" | "gelu_new")) {
            return Err(bad(format!(
                "config.json: `vision_config.hidden_act` = {act} is not supported (the tower runs tanh-GELU, `gelu_pytorch_tanh`)"
            )));
        }
    }
    if count(vc, w, "num_channels", 3)? != 3 {
        return Err(bad(
            "config.json: `vision_config.num_channels` must be 3 (RGB)".into(),
        ));
    }
    let image_size = match side(vc, "image_size")? {
        Some(s) => s,
        None => {
            let edge = pre
                .and_then(|p| p.get("max_image_size"))
                .and_then(|m| m.get("longest_edge"));
            match edge {
                Some(e) => bounded(e, "preprocessor max_image_size.longest_edge")?,
                None => DEFAULT_IMAGE_SIZE,
            }
        }
    };
    let eps = match vc.and_then(|o| o.get("layer_norm_eps")) {
        None => DEFAULT_EPS,
        Some(e) => match e.as_f64() {
            Some(x) if x > 0.0 && x < 1.0 => x,
            _ => {
                return Err(bad(format!(
                    "config.json: `vision_config.layer_norm_eps` = {e} is not in (0, 1)"
                )))
            }
        },
    };
    if let Some(r) = pre.and_then(|p| p.get("rescale_factor")) {
        if !r.as_f64().is_some_and(|r| (r * 255.0 - 1.0).abs() < 1e-6) {
            return Err(bad(format!(
                "preprocessor_config.json: `rescale_factor` = {r} is not supported (pixels are rescaled by 1/255)"
            )));
        }
    }
    let image_token_id = match v.get("image_token_id") {
        Some(t) => {
            let id = t
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    bad(format!(
                        "config.json: `image_token_id` = {t} is not a token id"
                    ))
                })?;
            if let Some(tok) = tokenizer_image.filter(|&tok| tok != id) {
                tracing::warn!(
                    config = id,
                    tokenizer = tok,
                    "config.json's image_token_id is not the tokenizer's <image>; using config.json's"
                );
            }
            id
        }
        None => tokenizer_image.ok_or_else(|| {
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
        patch_size: side(vc, "patch_size")?.unwrap_or(DEFAULT_PATCH),
        hidden_size: count(vc, w, "hidden_size", DEFAULT_HIDDEN)?,
        num_layers: count(vc, w, "num_hidden_layers", DEFAULT_LAYERS)?,
        num_heads: count(vc, w, "num_attention_heads", DEFAULT_HEADS)?,
        intermediate_size: count(vc, w, "intermediate_size", DEFAULT_INTERMEDIATE)?,
        layer_norm_eps: eps as f32,
        scale_factor: count(Some(v), "", "scale_factor", DEFAULT_SCALE)?,
        text_hidden_size: text.hidden_size,
        image_mean: triple(pre, "image_mean", DEFAULT_MEAN_STD)?,
        image_std: triple(pre, "image_std", DEFAULT_MEAN_STD)?,
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
        let pre = serde_json::json!({"max_image_size": {"longest_edge": 512}, "do_image_splitting": false});
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
        let c = vision_config(&v, Some(&serde_json::json!({})), &text, &tokens).unwrap();
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
            let e = vision_config(&v, Some(&pre), &text, &tokens).unwrap_err();
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        // Without splitting, the tokens wrap an image when the tokenizer has them.
        let off = serde_json::json!({"do_image_splitting": false});
        let c = vision_config(&v, Some(&off), &text, &tokens).unwrap();
        assert_eq!(c.wrap.map(|w| (w.around, w.grid_side)), Some((301, 0)));
    }
}
