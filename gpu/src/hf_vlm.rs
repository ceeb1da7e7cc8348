//! A vision-language model from an HF **Idefics3 / SmolVLM** checkpoint directory: the layout
//! `HuggingFaceTB/SmolVLM-256M-Instruct` and its siblings ship (`model_type` `idefics3` or
//! `smolvlm`; `Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`), whose
//! tower is the one [`crate::vision::VisionTower`] runs.
//!
//! What is read:
//!
//! | file | keys | what |
//! |---|---|---|
//! | `config.json` | `text_config` | the decoder, as an HF Llama `config.json` ([`crate::loader::hf_config`]); its `architectures` (`VLlama3ForCausalLM`, SmolVLM's training class) is ignored, a missing `model_type` is `llama` and a missing `rms_norm_eps` is `1e-5` (Idefics3's defaults) |
//! | `config.json` | `vision_config.{hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, image_size, patch_size, layer_norm_eps}` | the SigLIP encoder; a missing key takes transformers' `Idefics3VisionConfig` default (1152, 3072, 12, 16, 224, 32, 1e-6; SmolVLM2's configs leave some out), a missing `image_size` first `preprocessor_config.json`'s `max_image_size.longest_edge`. `hidden_act` must be tanh-GELU, `num_channels` 3 |
//! | `config.json` | `scale_factor` (default 2), `image_token_id` | the pixel-shuffle factor; the image placeholder token (when absent: the tokenizer's `<image>`), which must lie inside the decoder's vocabulary |
//! | `preprocessor_config.json` | `image_mean`, `image_std` (default 0.5 each, transformers' Idefics3 image processor's), `rescale_factor` (must be 1/255 when given) | normalization |
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
//! Not read: SmolVLM's image splitting (`do_image_splitting`, `size.longest_edge`: tiles plus a
//! global image) and its `<fake_token_around_image>` / `<global-img>` wrapping; an image is one
//! global image of `image_size`, whose rows are the image token.

use crate::config::ModelConfig;
use crate::vision::{VisionConfig, VisionTower};
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
    crate::loader::hf_config_value(&Value::Object(t), "config.json: text_config")
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
        Some(x) if x >= 1.0 && x.fract() == 0.0 && x <= crate::loader::MAX_CONFIG_COUNT => {
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

/// The tower's configuration from `config.json` (`v`), `preprocessor_config.json` (`pre`, when
/// the directory has one) and the decoder `text`; `tokenizer_image` is the tokenizer's
/// `<image>` id, the image token when `config.json` names none.
///
/// # Errors
/// [`ModelError::BadMetadata`] naming the key that is out of bounds, malformed or
/// inconsistent, or an image token outside the decoder's vocabulary.
pub fn vision_config(
    v: &Value,
    pre: Option<&Value>,
    text: &ModelConfig,
    tokenizer_image: Option<u32>,
) -> Result<VisionConfig> {
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
        let pre = serde_json::json!({"max_image_size": {"longest_edge": 512}});
        let c = vision_config(&v, Some(&pre), &text, None).unwrap();
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
        assert!(vision_config(&none, None, &text, None).is_err());
        let c = vision_config(&none, None, &text, Some(7)).unwrap();
        assert_eq!(
            (c.image_token_id, c.patch_size, c.hidden_size),
            (7, 32, 1152)
        );
    }
}
