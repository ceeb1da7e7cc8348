//! An HF `config.json`'s decoder architecture ([`hf_config`]): a leaf the checkpoint loaders
//! ([`crate::loader`], [`crate::hf_vlm`]) share. Every count is bounded before anything is
//! sized by it.

use crate::config::{ModelConfig, RopeScaling, RopeStyle};
use crate::loose::Loose;
use crate::{ModelError, Result};
use serde::Deserialize;

/// The fields of an HF `config.json` pdserve reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct HfConfig {
    architectures: Option<Loose<Vec<Loose<String>>>>,
    model_type: Option<Loose<String>>,
    vocab_size: Option<Loose<f64>>,
    hidden_size: Option<Loose<f64>>,
    num_hidden_layers: Option<Loose<f64>>,
    num_attention_heads: Option<Loose<f64>>,
    num_key_value_heads: Option<Loose<f64>>,
    head_dim: Option<Loose<f64>>,
    intermediate_size: Option<Loose<f64>>,
    rms_norm_eps: Option<Loose<f64>>,
    rope_theta: Option<Loose<f64>>,
    max_position_embeddings: Option<Loose<f64>>,
    attention_bias: Option<Loose<bool>>,
    rope_scaling: Option<Loose<HfRopeScaling>>,
}

/// `config.json`'s `rope_scaling`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct HfRopeScaling {
    rope_type: Option<Loose<String>>,
    #[serde(rename = "type")]
    kind: Option<Loose<String>>,
    factor: Option<Loose<f64>>,
    low_freq_factor: Option<Loose<f64>>,
    high_freq_factor: Option<Loose<f64>>,
    original_max_position_embeddings: Option<Loose<u64>>,
}

/// Parses an HF `config.json`.
///
/// # Errors
/// [`ModelError::UnsupportedArchitecture`] or [`ModelError::BadMetadata`] naming the field.
pub fn hf_config(text: &str) -> Result<ModelConfig> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| ModelError::BadMetadata(format!("config.json: {e}")))?;
    hf_config_value(&v, "config.json")
}

/// The most a count in `config.json` (sizes, layers, heads) may be.
pub(crate) const MAX_CONFIG_COUNT: f64 = (1u64 << 20) as f64;
/// The most `max_position_embeddings` may be.
const MAX_CONTEXT: f64 = (1u64 << 30) as f64;

/// A decoder's architecture from a parsed HF config (`config.json`, or a vision-language
/// model's `text_config`, which `ctx` names in errors).
pub(crate) fn hf_config_value(v: &serde_json::Value, ctx: &str) -> Result<ModelConfig> {
    // Read through the `Value`: a list is no config (serde's structs would take one).
    let c = match v.is_object().then(|| HfConfig::deserialize(v)) {
        Some(Ok(c)) => c,
        Some(Err(e)) => return Err(ModelError::BadMetadata(format!("{ctx}: {e}"))),
        None => HfConfig::default(),
    };
    let arch = c
        .architectures
        .and_then(Loose::get)
        .and_then(|a| a.into_iter().next())
        .and_then(Loose::get)
        .or_else(|| c.model_type.and_then(Loose::get))
        .unwrap_or_default();
    let (name, qkv_bias) = match arch.as_str() {
        "LlamaForCausalLM" | "llama" | "MistralForCausalLM" | "mistral" => ("llama", false),
        "Qwen2ForCausalLM" | "qwen2" => ("qwen2", true),
        other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
    };
    let num = |x: Option<Loose<f64>>| x.and_then(Loose::get);
    // Every count is bounded before anything is sized by it.
    let bounded = |x: f64, k: &str, max: f64| -> Result<usize> {
        if !(x >= 1.0 && x.fract() == 0.0 && x <= max) {
            return Err(ModelError::BadMetadata(format!(
                "{ctx}: `{k}` = {x} is not a count in 1..={max}"
            )));
        }
        Ok(x as usize)
    };
    let need_max = |x: Option<Loose<f64>>, k: &str, max: f64| match num(x) {
        Some(x) => bounded(x, k, max),
        None => Err(ModelError::BadMetadata(format!("{ctx}: `{k}`"))),
    };
    let need = |x: Option<Loose<f64>>, k: &str| need_max(x, k, MAX_CONFIG_COUNT);
    let optional = |x: Option<Loose<f64>>, k: &str| -> Result<Option<usize>> {
        num(x).map(|x| bounded(x, k, MAX_CONFIG_COUNT)).transpose()
    };
    let hidden = need(c.hidden_size, "hidden_size")?;
    let heads = need(c.num_attention_heads, "num_attention_heads")?;
    let rope_scaling = match c.rope_scaling {
        Some(s) => {
            let s = s.get().unwrap_or_default();
            let kind = s
                .rope_type
                .and_then(Loose::get)
                .or_else(|| s.kind.and_then(Loose::get))
                .unwrap_or_default();
            let f = |x: Option<Loose<f64>>| num(x).unwrap_or(1.0) as f32;
            match kind.as_str() {
                "linear" => RopeScaling::Linear {
                    factor: f(s.factor),
                },
                "llama3" => RopeScaling::Llama3 {
                    factor: f(s.factor),
                    low_freq_factor: f(s.low_freq_factor),
                    high_freq_factor: f(s.high_freq_factor),
                    original_max_position: s
                        .original_max_position_embeddings
                        .and_then(Loose::get)
                        .unwrap_or(8192) as usize,
                },
                "default" => RopeScaling::None,
                other => {
                    return Err(ModelError::BadMetadata(format!(
                        "{ctx}: unsupported rope_scaling `{other}`"
                    )))
                }
            }
        }
        None => RopeScaling::None,
    };
    let config = ModelConfig {
        architecture: name.to_string(),
        vocab_size: need(c.vocab_size, "vocab_size")?,
        hidden_size: hidden,
        num_layers: need(c.num_hidden_layers, "num_hidden_layers")?,
        num_heads: heads,
        num_kv_heads: optional(c.num_key_value_heads, "num_key_value_heads")?.unwrap_or(heads),
        head_dim: optional(c.head_dim, "head_dim")?.unwrap_or(hidden / heads.max(1)),
        intermediate_size: need(c.intermediate_size, "intermediate_size")?,
        rms_norm_eps: num(c.rms_norm_eps).unwrap_or(1e-6) as f32,
        rope_theta: num(c.rope_theta).unwrap_or(10_000.0) as f32,
        rope_scaling,
        rope_style: RopeStyle::Half,
        context_length: need_max(
            c.max_position_embeddings,
            "max_position_embeddings",
            MAX_CONTEXT,
        )?,
        qkv_bias: c.attention_bias.and_then(Loose::get).unwrap_or(qkv_bias),
        rope_freq_factors: None,
    };
    config.validate()?;
    Ok(config)
}
