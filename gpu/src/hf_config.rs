//! An HF `config.json`'s decoder architecture ([`hf_config`]): a leaf the checkpoint loaders
//! ([`crate::loader`], [`crate::hf_vlm`]) share.
//!
//! The file is read into [`HfConfig`], whose fields are lenient (`Loose`): unknown keys are
//! ignored, and a key of another type (HF configs write `null` for many) reads as absent, so
//! that an optional key takes its default and a required one is refused by name. Its
//! `model_config` then checks it in one place: every count is bounded before anything is sized
//! by it. A number may be written as an integer or a float (`1e6` or `1000000`; `2048.0` is a
//! count, `2048.5` is not).

use crate::config::{ModelConfig, RopeScaling, RopeStyle};
use crate::loose::{parse_object, Loose};
use crate::{ModelError, Result};
use serde::Deserialize;

/// The keys of an HF `config.json` (or of a vision-language model's `text_config`) pdserve
/// reads; the loader reads one to tell a vision-language checkpoint
/// ([`crate::hf_vlm::is_vlm_config`]) before `model_config` checks it.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct HfConfig {
    pub(crate) architectures: Option<Loose<Vec<Loose<String>>>>,
    pub(crate) model_type: Option<Loose<String>>,
    pub(crate) vocab_size: Option<Loose<f64>>,
    pub(crate) hidden_size: Option<Loose<f64>>,
    pub(crate) num_hidden_layers: Option<Loose<f64>>,
    pub(crate) num_attention_heads: Option<Loose<f64>>,
    pub(crate) num_key_value_heads: Option<Loose<f64>>,
    pub(crate) head_dim: Option<Loose<f64>>,
    pub(crate) intermediate_size: Option<Loose<f64>>,
    pub(crate) rms_norm_eps: Option<Loose<f64>>,
    pub(crate) rope_theta: Option<Loose<f64>>,
    pub(crate) max_position_embeddings: Option<Loose<f64>>,
    pub(crate) attention_bias: Option<Loose<bool>>,
    pub(crate) rope_scaling: Option<Loose<HfRopeScaling>>,
}

/// `config.json`'s `rope_scaling`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct HfRopeScaling {
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
    parse_object::<HfConfig>(text)
        .map_err(|e| ModelError::BadMetadata(format!("config.json: {e}")))?
        .model_config("config.json")
}

/// The most a count in `config.json` (sizes, layers, heads) may be.
pub(crate) const MAX_CONFIG_COUNT: f64 = (1u64 << 20) as f64;
/// The most `max_position_embeddings` may be.
const MAX_CONTEXT: f64 = (1u64 << 30) as f64;

/// `x` as a count in `1..=max` (a whole number), or `None`: the one check every model-file
/// loader (HF configs, GGUF metadata) makes before anything is sized by a count.
pub(crate) fn as_count(x: f64, max: f64) -> Option<usize> {
    (x >= 1.0 && x.fract() == 0.0 && x <= max).then_some(x as usize)
}

impl HfConfig {
    /// `model_type`, when it is a string.
    pub(crate) fn model_type(&self) -> Option<&str> {
        self.model_type
            .as_ref()
            .and_then(Loose::get_ref)
            .map(String::as_str)
    }

    /// The first of `architectures`, when it is a string.
    pub(crate) fn first_architecture(&self) -> Option<&str> {
        let first = self.architectures.as_ref()?.get_ref()?.first()?;
        first.get_ref().map(String::as_str)
    }

    /// The decoder's architecture, checked: the first of `architectures` (else `model_type`)
    /// picks it, and every count is bounded before anything is sized by it. `ctx` names the
    /// config in errors (`config.json`, or a vision-language model's `text_config`).
    ///
    /// # Errors
    /// [`ModelError::UnsupportedArchitecture`]; [`ModelError::BadMetadata`] naming the key
    /// that is missing, of another type or out of bounds.
    pub(crate) fn model_config(self, ctx: &str) -> Result<ModelConfig> {
        let arch = self.first_architecture().or_else(|| self.model_type());
        let (name, qkv_bias) = match arch.unwrap_or_default() {
            "LlamaForCausalLM" | "llama" | "MistralForCausalLM" | "mistral" => ("llama", false),
            "Qwen2ForCausalLM" | "qwen2" => ("qwen2", true),
            other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
        };
        let num = |x: Option<Loose<f64>>| x.and_then(Loose::get);
        // Every count is bounded before anything is sized by it.
        let bounded = |x: f64, k: &str, max: f64| -> Result<usize> {
            as_count(x, max).ok_or_else(|| {
                ModelError::BadMetadata(format!("{ctx}: `{k}` = {x} is not a count in 1..={max}"))
            })
        };
        let need_max = |x: Option<Loose<f64>>, k: &str, max: f64| match num(x) {
            Some(x) => bounded(x, k, max),
            None => Err(ModelError::BadMetadata(format!("{ctx}: `{k}`"))),
        };
        let need = |x: Option<Loose<f64>>, k: &str| need_max(x, k, MAX_CONFIG_COUNT);
        let optional = |x: Option<Loose<f64>>, k: &str| -> Result<Option<usize>> {
            num(x).map(|x| bounded(x, k, MAX_CONFIG_COUNT)).transpose()
        };
        let hidden = need(self.hidden_size, "hidden_size")?;
        let heads = need(self.num_attention_heads, "num_attention_heads")?;
        let rope_scaling = match self.rope_scaling {
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
                            .unwrap_or(8192)
                            as usize,
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
            vocab_size: need(self.vocab_size, "vocab_size")?,
            hidden_size: hidden,
            num_layers: need(self.num_hidden_layers, "num_hidden_layers")?,
            num_heads: heads,
            num_kv_heads: optional(self.num_key_value_heads, "num_key_value_heads")?
                .unwrap_or(heads),
            head_dim: optional(self.head_dim, "head_dim")?.unwrap_or(hidden / heads.max(1)),
            intermediate_size: need(self.intermediate_size, "intermediate_size")?,
            rms_norm_eps: num(self.rms_norm_eps).unwrap_or(1e-6) as f32,
            rope_theta: num(self.rope_theta).unwrap_or(10_000.0) as f32,
            rope_scaling,
            rope_style: RopeStyle::Half,
            context_length: need_max(
                self.max_position_embeddings,
                "max_position_embeddings",
                MAX_CONTEXT,
            )?,
            qkv_bias: self.attention_bias.and_then(Loose::get).unwrap_or(qkv_bias),
            rope_freq_factors: None,
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small Llama `config.json` with `edit` applied.
    fn llama(edit: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut v = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 512,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "max_position_embeddings": 1024,
            "torch_dtype": "float32",
            "tie_word_embeddings": true,
        });
        edit(&mut v);
        v.to_string()
    }

    fn message(text: &str) -> String {
        match hf_config(text).unwrap_err() {
            ModelError::BadMetadata(m) => m,
            other => panic!("not BadMetadata: {other}"),
        }
    }

    #[test]
    fn numbers_read_as_integers_or_floats_and_unknown_keys_are_ignored() {
        let c = hf_config(&llama(|_| {})).unwrap();
        assert_eq!(
            (c.vocab_size, c.hidden_size, c.num_kv_heads, c.head_dim),
            (512, 64, 2, 16)
        );
        assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-6, 10_000.0));
        for (theta, eps, hidden) in [
            (
                serde_json::json!(500000),
                serde_json::json!(1e-5),
                serde_json::json!(64),
            ),
            (
                serde_json::json!(5e5),
                serde_json::json!(0.00001),
                serde_json::json!(64.0),
            ),
        ] {
            let c = hf_config(&llama(|v| {
                v["rope_theta"] = theta.clone();
                v["rms_norm_eps"] = eps.clone();
                v["hidden_size"] = hidden.clone();
            }))
            .unwrap();
            assert_eq!(
                (c.rope_theta, c.rms_norm_eps, c.hidden_size),
                (5e5, 1e-5, 64)
            );
        }
    }

    #[test]
    fn required_counts_of_another_type_or_out_of_bounds_are_refused_by_name() {
        for (key, value, want) in [
            (
                "hidden_size",
                serde_json::json!("64"),
                "config.json: `hidden_size`",
            ),
            (
                "hidden_size",
                serde_json::json!(null),
                "config.json: `hidden_size`",
            ),
            (
                "vocab_size",
                serde_json::json!(0),
                "`vocab_size` = 0 is not a count",
            ),
            (
                "num_hidden_layers",
                serde_json::json!(2.5),
                "`num_hidden_layers` = 2.5",
            ),
            (
                "num_attention_heads",
                serde_json::json!(1e12),
                "`num_attention_heads`",
            ),
            ("head_dim", serde_json::json!(-16), "`head_dim` = -16"),
            (
                "max_position_embeddings",
                serde_json::json!(1u64 << 31),
                "`max_position_embeddings`",
            ),
        ] {
            let m = message(&llama(|v| v[key] = value.clone()));
            assert!(m.contains(want), "{key} = {value}: want `{want}` in {m}");
        }
        let m = message(&llama(|v| {
            v.as_object_mut().unwrap().remove("intermediate_size");
        }));
        assert_eq!(m, "config.json: `intermediate_size`");
    }

    #[test]
    fn optional_keys_of_another_type_take_their_defaults() {
        let c = hf_config(&llama(|v| {
            v["rope_theta"] = "fast".into();
            v["num_key_value_heads"] = serde_json::Value::Null;
            v["rope_scaling"] = serde_json::Value::Null;
            v["attention_bias"] = 1.into();
        }))
        .unwrap();
        assert_eq!(
            (c.rope_theta, c.num_kv_heads, c.qkv_bias),
            (10_000.0, 4, false)
        );
        assert_eq!(c.rope_scaling, RopeScaling::None);
    }

    #[test]
    fn the_architecture_comes_from_architectures_then_model_type() {
        let qwen = hf_config(&llama(|v| {
            v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"])
        }));
        assert_eq!(qwen.unwrap().architecture, "qwen2");
        // A first entry that is no string falls back on `model_type`.
        let c = hf_config(&llama(|v| {
            v["architectures"] = serde_json::json!([7, "Qwen2ForCausalLM"])
        }));
        assert_eq!(c.unwrap().architecture, "llama");
        let e = hf_config(&llama(|v| {
            v["architectures"] = serde_json::json!(["GPT2LMHeadModel"])
        }));
        assert!(matches!(e, Err(ModelError::UnsupportedArchitecture(a)) if a == "GPT2LMHeadModel"));
        let c = hf_config(&llama(|v| {
            v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1.0, "high_freq_factor": 4});
        }))
        .unwrap();
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192
            }
        );
    }

    #[test]
    fn a_file_that_is_no_object_is_refused() {
        let m = message("[1, 2]");
        assert!(m.starts_with("config.json: invalid type: sequence"), "{m}");
        assert!(message("{").starts_with("config.json: EOF"));
    }
}
