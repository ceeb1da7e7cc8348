//! Text ⇄ token ids for Llama-family models.
//!
//! [`Tokenizer`] wraps a `tokenizers::Tokenizer` built from one of three sources:
//!
//! - **GGUF metadata** ([`Tokenizer::from_gguf`]): the vocabulary, merges, token types and the
//!   pre-tokenizer name (`tokenizer.ggml.pre`) are turned into the equivalent Hugging Face
//!   pipeline, reproducing llama.cpp's tokenization (its pre-tokenizer regexes are applied in
//!   sequence, each splitting the pieces the previous one left; CONTROL and USER_DEFINED tokens
//!   are matched as whole tokens before any of that). candle's own GGUF tokenizer is not used:
//!   it adds a prefix space that llama.cpp does not.
//! - **`tokenizer.json`** ([`Tokenizer::from_hf_file`]) with an optional `tokenizer_config.json`
//!   beside it for BOS/EOS, `add_bos_token` and the chat template.
//! - **A synthetic byte-level vocabulary** ([`Tokenizer::byte_level_synthetic`]) for seeded test
//!   models: 256 byte tokens plus three ChatML specials.
//!
//! [`DecodeStream`] turns generated ids into text one token at a time, holding back bytes of a
//! multi-byte character until the character is complete.

use std::any::Any;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::quantized::gguf_file;
use serde_json::{json, Map, Value as Json};

use crate::loose::Loose;
use crate::{ModelError, Result};
use serde::Deserialize;

/// GGUF token type of a normal vocabulary entry.
const TOKEN_TYPE_NORMAL: i64 = 1;
/// GGUF token type of the unknown token.
const TOKEN_TYPE_UNKNOWN: i64 = 2;
/// GGUF token type of a control token (`<|im_start|>`, `<s>` ...): special, skipped on decode.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF token type of a user-defined added token: matched whole, kept on decode.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Texts of tokens that end generation when a model defines them as special tokens (the same
/// list llama.cpp uses to collect its end-of-generation ids).
const EOG_TEXTS: &[&str] = &[
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "</s>",
];

/// A tokenizer plus the model facts that go with it (BOS/EOS ids, whether BOS is added, the
/// chat template found next to it). Cheap to clone.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eos_ids: Vec<u32>,
    pad_id: Option<u32>,
    add_bos: bool,
    vocab_size: usize,
    chat_template: Option<String>,
    /// Indexes that other modules build once from the whole vocabulary (the grammar
    /// compiler's token trie, [`crate::grammar`]), at most one of each type, shared by every
    /// clone: see [`Tokenizer::derived`].
    derived: Arc<Mutex<Vec<Arc<dyn Any + Send + Sync>>>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

/// The GPT-2 byte → printable character table used by byte-level BPE vocabularies.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).expect("valid code point");
            n += 1;
            c
        };
    }
    table
}

/// The pre-tokenizer regexes llama.cpp applies (in order) for a `tokenizer.ggml.pre` name.
///
/// # Errors
/// `ModelError::Tokenizer` for a name this module does not know.
pub fn pre_tokenizer_regexes(pre: &str) -> Result<Vec<&'static str>> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Ok(match pre {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            vec![r"\p{N}", GPT2]
        }
        "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" | "trillion" => vec![GPT2],
        "llama3" | "llama-bpe" | "llama-v3" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
            vec![LLAMA3]
        }
        "qwen2" | "stablelm2" | "deepseek-r1-qwen" | "megrez" | "hunyuan" => vec![QWEN2],
        "default" => vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
        other => {
            return Err(ModelError::Tokenizer(format!(
                "unsupported pre-tokenizer `{other}` (supported: smollm, gpt2, llama3/llama-bpe, \
                 qwen2, default and their aliases)"
            )))
        }
    })
}

fn meta<'a>(content: &'a gguf_file::Content, key: &str) -> Option<&'a gguf_file::Value> {
    content.metadata.get(key)
}

fn meta_int(value: &gguf_file::Value) -> Option<i64> {
    use gguf_file::Value as V;
    Some(match value {
        V::U8(v) => i64::from(*v),
        V::I8(v) => i64::from(*v),
        V::U16(v) => i64::from(*v),
        V::I16(v) => i64::from(*v),
        V::U32(v) => i64::from(*v),
        V::I32(v) => i64::from(*v),
        V::U64(v) => i64::try_from(*v).ok()?,
        V::I64(v) => *v,
        _ => return None,
    })
}

fn meta_u32(content: &gguf_file::Content, key: &str) -> Result<Option<u32>> {
    match meta(content, key) {
        None => Ok(None),
        Some(v) => meta_int(v)
            .and_then(|i| u32::try_from(i).ok())
            .map(Some)
            .ok_or_else(|| ModelError::BadMetadata(key.to_string())),
    }
}

fn meta_bool(content: &gguf_file::Content, key: &str) -> Result<Option<bool>> {
    match meta(content, key) {
        None => Ok(None),
        Some(gguf_file::Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => meta_int(v)
            .map(|i| Some(i != 0))
            .ok_or_else(|| ModelError::BadMetadata(key.to_string())),
    }
}

fn meta_str<'a>(content: &'a gguf_file::Content, key: &str) -> Result<Option<&'a str>> {
    match meta(content, key) {
        None => Ok(None),
        Some(gguf_file::Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ModelError::BadMetadata(key.to_string())),
    }
}

fn meta_str_array(content: &gguf_file::Content, key: &str) -> Result<Option<Vec<String>>> {
    match meta(content, key) {
        None => Ok(None),
        Some(gguf_file::Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                gguf_file::Value::String(s) => Ok(s.clone()),
                _ => Err(ModelError::BadMetadata(key.to_string())),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(_) => Err(ModelError::BadMetadata(key.to_string())),
    }
}

fn meta_int_array(content: &gguf_file::Content, key: &str) -> Result<Option<Vec<i64>>> {
    match meta(content, key) {
        None => Ok(None),
        Some(gguf_file::Value::Array(items)) => items
            .iter()
            .map(|v| meta_int(v).ok_or_else(|| ModelError::BadMetadata(key.to_string())))
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(_) => Err(ModelError::BadMetadata(key.to_string())),
    }
}

fn meta_f32_array(content: &gguf_file::Content, key: &str) -> Result<Option<Vec<f32>>> {
    match meta(content, key) {
        None => Ok(None),
        Some(gguf_file::Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                gguf_file::Value::F32(f) => Ok(*f),
                gguf_file::Value::F64(f) => Ok(*f as f32),
                _ => Err(ModelError::BadMetadata(key.to_string())),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(_) => Err(ModelError::BadMetadata(key.to_string())),
    }
}

/// An entry of `added_tokens` in tokenizer.json form.
fn added_token_json(id: u32, content: &str, special: bool) -> Json {
    json!({
        "id": id,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": special,
    })
}

/// A `TemplateProcessing` post-processor that puts `bos` in front of every sequence.
fn bos_post_processor(bos_text: &str, bos_id: u32) -> Json {
    json!({
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos_text, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}}
        ],
        "pair": [
            {"SpecialToken": {"id": bos_text, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos_text, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}}
        ],
        "special_tokens": {bos_text: {"id": bos_text, "ids": [bos_id], "tokens": [bos_text]}}
    })
}

fn byte_level_json() -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false})
}

fn bpe_model_json(
    vocab: Map<String, Json>,
    merges: Vec<Json>,
    unk: Option<&str>,
    byte_fallback: bool,
    ignore_merges: bool,
) -> Json {
    json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": unk,
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": byte_fallback,
        "byte_fallback": byte_fallback,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges,
    })
}

/// Vocabulary map, first occurrence wins for duplicated strings.
fn vocab_map(tokens: &[String]) -> Map<String, Json> {
    let mut vocab = Map::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.entry(tok.clone()).or_insert_with(|| Json::from(id));
    }
    vocab
}

/// Merge list for a SentencePiece-BPE vocabulary that ships only scores: every split of a
/// token into two vocabulary pieces is a merge, ranked by the merged token's score (highest
/// first), which is the order llama.cpp's SPM tokenizer merges in.
fn merges_from_scores(tokens: &[String], scores: &[f32], types: &[i64]) -> Vec<Json> {
    let index: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        if types.get(id).copied().unwrap_or(TOKEN_TYPE_NORMAL) != TOKEN_TYPE_NORMAL {
            continue;
        }
        for (split, _) in tok.char_indices().skip(1) {
            let (left, right) = tok.split_at(split);
            if let (Some(&l), Some(_)) = (index.get(left), index.get(right)) {
                merges.push((scores.get(id).copied().unwrap_or(0.0), id, l, left, right));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    merges
        .into_iter()
        .map(|(_, _, _, l, r)| json!([l, r]))
        .collect()
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    ///
    /// Supports `tokenizer.ggml.model = "gpt2"` (byte-level BPE, with the pre-tokenizers of
    /// [`pre_tokenizer_regexes`]) and `"llama"` (SentencePiece BPE with byte fallback; merges
    /// come from `tokenizer.ggml.merges` or are derived from the token scores).
    ///
    /// # Errors
    /// `ModelError::Tokenizer` for an unsupported tokenizer model or pre-tokenizer, and
    /// `ModelError::BadMetadata` when a key is missing or has the wrong type.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Tokenizer> {
        let model = meta_str(content, "tokenizer.ggml.model")?
            .ok_or_else(|| ModelError::BadMetadata("tokenizer.ggml.model".into()))?;
        let tokens = meta_str_array(content, "tokenizer.ggml.tokens")?
            .ok_or_else(|| ModelError::BadMetadata("tokenizer.ggml.tokens".into()))?;
        let types = meta_int_array(content, "tokenizer.ggml.token_type")?
            .unwrap_or_else(|| vec![TOKEN_TYPE_NORMAL; tokens.len()]);
        if types.len() != tokens.len() {
            return Err(ModelError::BadMetadata(format!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let merges = meta_str_array(content, "tokenizer.ggml.merges")?;
        let bos_id = meta_u32(content, "tokenizer.ggml.bos_token_id")?;
        let eos_id = meta_u32(content, "tokenizer.ggml.eos_token_id")?;
        let pad_id = meta_u32(content, "tokenizer.ggml.padding_token_id")?;
        let check_id = |id: Option<u32>, what: &str| -> Result<()> {
            match id {
                Some(i) if i as usize >= tokens.len() => Err(ModelError::BadMetadata(format!(
                    "{what} {i} is outside the vocabulary of {}",
                    tokens.len()
                ))),
                _ => Ok(()),
            }
        };
        check_id(bos_id, "tokenizer.ggml.bos_token_id")?;
        check_id(eos_id, "tokenizer.ggml.eos_token_id")?;
        check_id(pad_id, "tokenizer.ggml.padding_token_id")?;

        let mut added = Vec::new();
        for (id, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
            let special = match *ty {
                TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => true,
                TOKEN_TYPE_USER_DEFINED => false,
                _ => continue,
            };
            if tok.is_empty() {
                continue;
            }
            added.push(added_token_json(id as u32, tok, special));
        }

        let add_bos_default;
        let mut doc = match model {
            "gpt2" => {
                let merges = merges
                    .ok_or_else(|| ModelError::BadMetadata("tokenizer.ggml.merges".into()))?;
                let merges: Vec<Json> = merges
                    .iter()
                    .map(|m| {
                        m.split_once(' ')
                            .map(|(a, b)| json!([a, b]))
                            .ok_or_else(|| tok_err(format!("malformed merge `{m}`")))
                    })
                    .collect::<Result<_>>()?;
                let pre = meta_str(content, "tokenizer.ggml.pre")?.unwrap_or("default");
                let regexes = pre_tokenizer_regexes(pre)?;
                let mut pretok: Vec<Json> = regexes
                    .iter()
                    .map(|r| {
                        json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false})
                    })
                    .collect();
                pretok.push(byte_level_json());
                // llama.cpp takes a whole pre-token that is itself a token without merging
                // for llama3-style vocabularies (`ignore_merges`).
                let ignore_merges = matches!(pre, "llama3" | "llama-bpe" | "llama-v3");
                add_bos_default = false;
                json!({
                    "version": "1.0",
                    "truncation": null,
                    "padding": null,
                    "added_tokens": added,
                    "normalizer": null,
                    "pre_tokenizer": {"type": "Sequence", "pretokenizers": pretok},
                    "post_processor": null,
                    "decoder": byte_level_json(),
                    "model": bpe_model_json(vocab_map(&tokens), merges, None, false, ignore_merges),
                })
            }
            "llama" => {
                let add_space_prefix =
                    meta_bool(content, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                let merges = match merges {
                    Some(m) => m
                        .iter()
                        .map(|m| {
                            m.split_once(' ')
                                .map(|(a, b)| json!([a, b]))
                                .ok_or_else(|| tok_err(format!("malformed merge `{m}`")))
                        })
                        .collect::<Result<Vec<_>>>()?,
                    None => {
                        let scores =
                            meta_f32_array(content, "tokenizer.ggml.scores")?.ok_or_else(|| {
                                ModelError::BadMetadata("tokenizer.ggml.scores".into())
                            })?;
                        merges_from_scores(&tokens, &scores, &types)
                    }
                };
                let unk_id = meta_u32(content, "tokenizer.ggml.unknown_token_id")?.or_else(|| {
                    types
                        .iter()
                        .position(|t| *t == TOKEN_TYPE_UNKNOWN)
                        .map(|p| p as u32)
                });
                let unk = unk_id
                    .and_then(|i| tokens.get(i as usize))
                    .map(String::as_str);
                let mut normalizers = Vec::new();
                if add_space_prefix {
                    normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
                }
                normalizers.push(
                    json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
                );
                let mut decoders = vec![
                    json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                    json!({"type": "ByteFallback"}),
                    json!({"type": "Fuse"}),
                ];
                if add_space_prefix {
                    decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                }
                add_bos_default = true;
                json!({
                    "version": "1.0",
                    "truncation": null,
                    "padding": null,
                    "added_tokens": added,
                    "normalizer": {"type": "Sequence", "normalizers": normalizers},
                    "pre_tokenizer": null,
                    "post_processor": null,
                    "decoder": {"type": "Sequence", "decoders": decoders},
                    "model": bpe_model_json(vocab_map(&tokens), merges, unk, true, false),
                })
            }
            other => {
                return Err(ModelError::Tokenizer(format!(
                    "unsupported GGUF tokenizer model `{other}` (supported: gpt2, llama)"
                )))
            }
        };

        let add_bos =
            meta_bool(content, "tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos_default);
        if add_bos {
            let bos = bos_id.ok_or_else(|| {
                ModelError::BadMetadata(
                    "tokenizer.ggml.add_bos_token is set but tokenizer.ggml.bos_token_id is missing"
                        .into(),
                )
            })?;
            doc["post_processor"] = bos_post_processor(&tokens[bos as usize], bos);
        }
        let inner = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&doc).map_err(tok_err)?)
            .map_err(tok_err)?;

        let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = meta_u32(content, key)? {
                if (id as usize) < tokens.len() {
                    eos_ids.push(id);
                }
            }
        }
        for (id, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
            if *ty == TOKEN_TYPE_CONTROL && EOG_TEXTS.contains(&tok.as_str()) {
                eos_ids.push(id as u32);
            }
        }
        dedup_keep_order(&mut eos_ids);
        let chat_template = meta_str(content, "tokenizer.chat_template")?.map(str::to_string);
        Ok(Tokenizer {
            inner: Arc::new(inner),
            bos_id,
            eos_id,
            eos_ids,
            pad_id,
            add_bos,
            vocab_size: tokens.len(),
            derived: Arc::default(),
            chat_template,
        })
    }

    /// Loads a Hugging Face `tokenizer.json`, plus `tokenizer_config.json` from the same
    /// directory when present (BOS/EOS tokens, `add_bos_token`, `chat_template`) and
    /// `generation_config.json` (extra `eos_token_id`s).
    ///
    /// # Errors
    /// `ModelError::NotFound` when `path` does not exist, `ModelError::Tokenizer` when the
    /// file cannot be parsed, `ModelError::BadMetadata` for a malformed config file.
    pub fn from_hf_file(path: &Path) -> Result<Tokenizer> {
        if !path.exists() {
            return Err(ModelError::NotFound {
                path: path.to_path_buf(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| tok_err(format!("{}: {e}", path.display())))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        // A missing file, or one that is no JSON object, reads as all fields absent.
        fn read_json<T: serde::de::DeserializeOwned + Default>(
            dir: &Path,
            name: &str,
        ) -> Result<T> {
            let p = dir.join(name);
            if !p.exists() {
                return Ok(T::default());
            }
            let text = std::fs::read_to_string(&p)?;
            let bad =
                |e: serde_json::Error| ModelError::BadMetadata(format!("{}: {e}", p.display()));
            // Through a `Value`: a list is no config (serde's structs would take one).
            let v: Json = serde_json::from_str(&text).map_err(bad)?;
            if !v.is_object() {
                return Ok(T::default());
            }
            T::deserialize(&v).map_err(bad)
        }
        let config: TokenizerConfig = read_json(dir, "tokenizer_config.json")?;
        let gen_config: GenerationConfig = read_json(dir, "generation_config.json")?;
        // `bos_token` is either a string or an AddedToken object with a `content` field.
        let token_id = |v: Option<Loose<TokenText>>| {
            match v.and_then(Loose::get)? {
                TokenText::Text(s) => Some(s),
                TokenText::Added(a) => a.content.and_then(Loose::get),
            }
            .and_then(|t| inner.token_to_id(&t))
        };
        let bos_id = token_id(config.bos_token).or_else(|| {
            gen_config
                .bos_token_id
                .and_then(Loose::get)
                .map(|v| v as u32)
        });
        let eos_id = token_id(config.eos_token);
        let pad_id = token_id(config.pad_token);
        let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
        match gen_config.eos_token_id.and_then(Loose::get) {
            Some(EosIds::One(n)) => eos_ids.push(n as u32),
            Some(EosIds::Many(a)) => {
                eos_ids.extend(a.into_iter().filter_map(Loose::get).map(|v| v as u32))
            }
            None => {}
        }
        for (id, tok) in inner.get_added_tokens_decoder() {
            if tok.special && EOG_TEXTS.contains(&tok.content.as_str()) {
                eos_ids.push(id);
            }
        }
        eos_ids.sort_unstable();
        if let Some(e) = eos_id {
            eos_ids.retain(|&x| x != e);
            eos_ids.insert(0, e);
        }
        dedup_keep_order(&mut eos_ids);
        let eos_id = eos_id.or_else(|| eos_ids.first().copied());
        // Whether BOS is added: say what the post-processor does, unless the config says.
        let add_bos = match config.add_bos_token.and_then(Loose::get) {
            Some(b) => b,
            None => {
                let enc = inner.encode("a", true).map_err(tok_err)?;
                bos_id.is_some() && enc.get_ids().first().copied() == bos_id
            }
        };
        let chat_template = match config.chat_template.and_then(Loose::get) {
            Some(ChatTemplates::One(s)) => Some(s),
            Some(ChatTemplates::Named(list)) => {
                let list: Vec<Option<NamedTemplate>> = list.into_iter().map(Loose::get).collect();
                let named = |want: &str| {
                    list.iter().flatten().find_map(|t| {
                        (t.name.as_deref() == Some(want))
                            .then(|| t.template.clone())
                            .flatten()
                    })
                };
                named("default").or_else(|| {
                    list.first()
                        .and_then(Option::as_ref)
                        .and_then(|t| t.template.clone())
                })
            }
            None => None,
        };
        let chat_template = match chat_template {
            Some(t) => Some(t),
            None => {
                let p = dir.join("chat_template.jinja");
                if p.exists() {
                    Some(std::fs::read_to_string(p)?)
                } else {
                    None
                }
            }
        };
        let vocab_size = inner.get_vocab_size(true);
        Ok(Tokenizer {
            inner: Arc::new(inner),
            bos_id,
            eos_id,
            eos_ids,
            pad_id,
            add_bos,
            vocab_size,
            derived: Arc::default(),
            chat_template,
        })
    }

    /// The byte-level tokenizer of seeded synthetic test models: ids 0..256 are the 256 bytes
    /// (no merges, so every byte of the input is one token), then `<|im_start|>` = 256 (BOS),
    /// `<|im_end|>` = 257 (EOS) and `<|endoftext|>` = 258 (also ends generation). No BOS is
    /// added when encoding. Vocabulary size 259.
    pub fn byte_level_synthetic() -> Tokenizer {
        Self::byte_level_synthetic_with(&[])
    }

    /// [`Tokenizer::byte_level_synthetic`] with `extra` added special tokens (id, text), each
    /// matched whole in text; the vocabulary grows to hold the largest id.
    ///
    /// # Panics
    /// An extra id below 259 (the byte-level tokenizer's own).
    pub fn byte_level_synthetic_with(extra: &[(u32, &str)]) -> Tokenizer {
        assert!(
            extra.iter().all(|(id, _)| *id >= 259),
            "extra ids start at 259"
        );
        let table = byte_to_char_table();
        let mut vocab = Map::new();
        for (b, c) in table.iter().enumerate() {
            vocab.insert(c.to_string(), Json::from(b));
        }
        let specials = [
            (256u32, "<|im_start|>"),
            (257, "<|im_end|>"),
            (258, "<|endoftext|>"),
        ];
        let added: Vec<Json> = specials
            .iter()
            .chain(extra)
            .map(|(id, text)| added_token_json(*id, text, true))
            .collect();
        let doc = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": byte_level_json(),
            "post_processor": null,
            "decoder": byte_level_json(),
            "model": bpe_model_json(vocab, Vec::new(), None, false, false),
        });
        let inner = tokenizers::Tokenizer::from_bytes(
            serde_json::to_vec(&doc).expect("static tokenizer document serialises"),
        )
        .expect("the synthetic tokenizer document is valid");
        Tokenizer {
            inner: Arc::new(inner),
            bos_id: Some(256),
            eos_id: Some(257),
            eos_ids: vec![257, 258],
            pad_id: None,
            add_bos: false,
            vocab_size: extra
                .iter()
                .map(|(id, _)| *id as usize + 1)
                .fold(259, usize::max),
            derived: Arc::default(),
            chat_template: None,
        }
    }

    /// Writes this tokenizer as a Hugging Face `tokenizer.json` at `path`. (BOS/EOS facts that
    /// live in `tokenizer_config.json` are not part of it; see
    /// [`Tokenizer::save_with_config`].)
    ///
    /// # Errors
    /// `ModelError::Tokenizer` if serialisation or writing fails.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner.save(path, false).map_err(tok_err)
    }

    /// Writes this tokenizer as a Hugging Face tokenizer directory: `tokenizer.json`,
    /// `tokenizer_config.json` (BOS/EOS/pad tokens, `add_bos_token`, the chat template if
    /// any, `model_max_length` when given) and `generation_config.json` (the EOS ids), so that
    /// [`Tokenizer::from_hf_file`] reads back the same facts and client tools that count tokens
    /// themselves (`AutoTokenizer.from_pretrained`: AIPerf, lm-eval, benchmark clients) get the
    /// model's tokenizer when the model came as a GGUF file (`pdserve model tokenizer`). When
    /// this tokenizer prepends BOS and `tokenizer.json` has no post-processor, one that prepends
    /// it is added, since Hugging Face's fast tokenizers ignore `add_bos_token`.
    ///
    /// # Errors
    /// `ModelError::Tokenizer` or `ModelError::Io` if writing fails.
    pub fn save_with_config(&self, dir: &Path, model_max_length: Option<usize>) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut tokenizer: Json =
            serde_json::from_str(&self.inner.to_string(false).map_err(tok_err)?)
                .map_err(tok_err)?;
        let text = |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i));
        if let (true, Some(bos), Some(bos_id)) = (self.add_bos, text(self.bos_id), self.bos_id) {
            if tokenizer["post_processor"].is_null() {
                let with_bos = |seqs: &[&str]| -> Json {
                    seqs.iter()
                        .flat_map(|seq| {
                            [
                                json!({"SpecialToken": {"id": bos, "type_id": 0}}),
                                json!({"Sequence": {"id": seq, "type_id": 0}}),
                            ]
                        })
                        .collect()
                };
                tokenizer["post_processor"] = json!({
                    "type": "TemplateProcessing",
                    "single": with_bos(&["A"]),
                    "pair": with_bos(&["A", "B"]),
                    "special_tokens": {bos.as_str(): {"id": bos, "ids": [bos_id], "tokens": [bos]}},
                });
            }
        }
        std::fs::write(
            dir.join("tokenizer.json"),
            serde_json::to_vec(&tokenizer).map_err(tok_err)?,
        )?;
        let mut config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(self.bos_id),
            "eos_token": text(self.eos_id),
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": false,
        });
        if let Some(pad) = text(self.pad_id) {
            config["pad_token"] = Json::from(pad);
        }
        if let Some(n) = model_max_length {
            config["model_max_length"] = Json::from(n);
        }
        if let Some(t) = &self.chat_template {
            config["chat_template"] = Json::from(t.clone());
        }
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::to_vec_pretty(&config).map_err(tok_err)?,
        )?;
        let gen = json!({ "eos_token_id": self.eos_ids });
        std::fs::write(
            dir.join("generation_config.json"),
            serde_json::to_vec_pretty(&gen).map_err(tok_err)?,
        )?;
        Ok(())
    }

    /// Token ids of `text`. Special and user-defined tokens written in the text (for example
    /// `<|im_start|>` in a rendered chat template) become their single ids. With
    /// `add_special_tokens`, BOS is prepended if — and only if — the model asks for it.
    ///
    /// # Errors
    /// `ModelError::Tokenizer` if the underlying tokenizer fails.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(tok_err)?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens && self.add_bos {
            if let Some(bos) = self.bos_id {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// Text of `ids`; special (control) tokens are dropped when `skip_special` is set.
    /// Incomplete UTF-8 sequences become U+FFFD.
    ///
    /// # Errors
    /// `ModelError::Tokenizer` if the underlying tokenizer fails.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(tok_err)
    }

    /// A streaming decoder for generated tokens (see [`DecodeStream`]).
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(self.clone(), skip_special)
    }

    /// Id of the beginning-of-sequence token, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Id of the model's main end-of-sequence token.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Every id that ends generation: the EOS token first, then end-of-turn/end-of-text
    /// tokens the model defines (`<|endoftext|>`, `<|eot_id|>` ...).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` ends generation (is one of [`Tokenizer::eos_ids`]).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// Id of the padding token, if the model names one.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// Whether [`Tokenizer::encode`] with `add_special_tokens` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Text of the BOS token, for chat templates.
    pub fn bos_token(&self) -> Option<String> {
        self.bos_id.and_then(|i| self.inner.id_to_token(i))
    }

    /// Text of the EOS token, for chat templates.
    pub fn eos_token(&self) -> Option<String> {
        self.eos_id.and_then(|i| self.inner.id_to_token(i))
    }

    /// The chat template that came with the tokenizer (GGUF `tokenizer.chat_template` or
    /// `tokenizer_config.json`), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Number of token ids the model's vocabulary defines (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of a token given by its vocabulary string (`"<|im_start|>"`, `"Ġthe"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes token `id` stands for, as logprobs report them (`bytes`): a byte-fallback
    /// token (`<0xE2>`) is its byte, a byte-level BPE token (GPT-2's byte-to-character table)
    /// its bytes, so that a character split over several tokens is exact; otherwise the
    /// UTF-8 of its decoded text (special tokens included).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let raw = self.inner.id_to_token(id).unwrap_or_default();
        if let Some(hex) = raw.strip_prefix("<0x").and_then(|r| r.strip_suffix('>')) {
            if let (2, Ok(b)) = (hex.len(), u8::from_str_radix(hex, 16)) {
                return vec![b];
            }
        }
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        if byte_level && !raw.is_empty() {
            let table = byte_to_char_table();
            let bytes: Option<Vec<u8>> = raw
                .chars()
                .map(|c| table.iter().position(|&t| t == c).map(|b| b as u8))
                .collect();
            if let Some(b) = bytes {
                return b;
            }
        }
        self.decode(&[id], false).unwrap_or_default().into_bytes()
    }

    /// Ids of the special tokens (added tokens marked special: `<|im_start|>`, `<|im_end|>`
    /// ...), sorted.
    pub fn special_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The `T` that `build` makes from this vocabulary, built on the first call for that type
    /// and shared by every clone of this tokenizer afterwards: for indexes of the whole
    /// vocabulary that take tens of milliseconds, such as [`crate::grammar`]'s token trie.
    /// Concurrent first calls wait for one build.
    pub(crate) fn derived<T: Any + Send + Sync>(&self, build: impl FnOnce(&Self) -> T) -> Arc<T> {
        // A build that panicked pushed nothing: the list is still whole.
        let mut built = self.derived.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = built
            .iter()
            .find_map(|d| Arc::clone(d).downcast::<T>().ok())
        {
            return t;
        }
        let t = Arc::new(build(self));
        built.push(t.clone());
        t
    }

    /// Whether the `T` of [`Tokenizer::derived`] is built already (never builds it).
    pub(crate) fn has_derived<T: Any + Send + Sync>(&self) -> bool {
        let built = self.derived.lock().unwrap_or_else(PoisonError::into_inner);
        built.iter().any(|d| d.is::<T>())
    }

    /// The wrapped Hugging Face tokenizer, shared.
    pub(crate) fn shared_inner(&self) -> Arc<tokenizers::Tokenizer> {
        Arc::clone(&self.inner)
    }

    /// The wrapped Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

fn dedup_keep_order(ids: &mut Vec<u32>) {
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
}

/// Incremental detokenizer for one generated sequence.
///
/// Feed ids one at a time with [`DecodeStream::step`]; each call returns the text completed
/// by that token, or `None` when the token only added part of a character (byte-level BPE
/// may split a multi-byte UTF-8 character across tokens) or no text at all. The
/// concatenation of everything returned plus [`DecodeStream::flush`] equals the full decode
/// of the ids.
///
/// It decodes only a short window of recent ids (the tokens since the last emitted piece, plus
/// the tokens before it that set the context, since some decoders — SentencePiece's leading
/// space — depend on the previous token), so each step costs O(window), not O(sequence).
#[derive(Debug, Clone)]
pub struct DecodeStream {
    tokenizer: Tokenizer,
    skip_special: bool,
    /// Ids in the current window.
    ids: Vec<u32>,
    /// Decoded text of `ids[..prefix_index]`, already emitted.
    prefix: String,
    prefix_index: usize,
}

impl DecodeStream {
    /// A stream over `tokenizer`; `skip_special` drops control tokens from the text.
    pub fn new(tokenizer: Tokenizer, skip_special: bool) -> Self {
        DecodeStream {
            tokenizer,
            skip_special,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// Adds one token; returns the text that became complete, if any.
    ///
    /// # Errors
    /// `ModelError::Tokenizer` if decoding fails (for example an id outside the vocabulary).
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        if text.len() > self.prefix.len() && !text.ends_with('\u{FFFD}') {
            let new_text = match text.strip_prefix(self.prefix.as_str()) {
                Some(rest) => rest.to_string(),
                None => {
                    return Err(ModelError::Tokenizer(format!(
                        "stream decode of token {id}: text {text:?} does not extend {:?}",
                        self.prefix
                    )))
                }
            };
            // Keep the ids from the previous boundary as context for the next decode.
            let keep_from = self.prefix_index;
            self.ids.drain(..keep_from);
            self.prefix = self.tokenizer.decode(&self.ids, self.skip_special)?;
            self.prefix_index = self.ids.len();
            Ok(Some(new_text))
        } else {
            Ok(None)
        }
    }

    /// Returns whatever text is still held back (an incomplete character decodes as U+FFFD);
    /// call at the end of the sequence.
    ///
    /// # Errors
    /// `ModelError::Tokenizer` if decoding fails.
    pub fn flush(&mut self) -> Result<String> {
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        let rest = text
            .strip_prefix(self.prefix.as_str())
            .map(str::to_string)
            .unwrap_or_default();
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        Ok(rest)
    }
}

/// The fields of a Hugging Face `tokenizer_config.json` pdserve reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenizerConfig {
    bos_token: Option<Loose<TokenText>>,
    eos_token: Option<Loose<TokenText>>,
    pad_token: Option<Loose<TokenText>>,
    add_bos_token: Option<Loose<bool>>,
    chat_template: Option<Loose<ChatTemplates>>,
}

/// A special token: its text, or an AddedToken object with a `content` field.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenText {
    Text(String),
    Added(AddedToken),
}

#[derive(Debug, Deserialize)]
struct AddedToken {
    content: Option<Loose<String>>,
}

/// `chat_template`: one template, or a list of named ones.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ChatTemplates {
    One(String),
    Named(Vec<Loose<NamedTemplate>>),
}

#[derive(Debug, Deserialize)]
struct NamedTemplate {
    #[serde(default, deserialize_with = "loose")]
    name: Option<String>,
    #[serde(default, deserialize_with = "loose")]
    template: Option<String>,
}

/// Reads a field that is absent when it has another type.
fn loose<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> std::result::Result<Option<T>, D::Error> {
    Ok(Option::<Loose<T>>::deserialize(d)?.and_then(Loose::get))
}

/// The fields of a Hugging Face `generation_config.json` pdserve reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct GenerationConfig {
    bos_token_id: Option<Loose<u64>>,
    eos_token_id: Option<Loose<EosIds>>,
}

/// `eos_token_id`: one id or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum EosIds {
    One(u64),
    Many(Vec<Loose<u64>>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_file::Value as V;

    fn content(metadata: Vec<(&str, V)>) -> gguf_file::Content {
        gguf_file::Content {
            magic: gguf_file::VersionedMagic::GgufV3,
            metadata: metadata
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    /// A tiny SentencePiece-BPE vocabulary: specials, 256 byte tokens, then pieces.
    fn spm_content() -> gguf_file::Content {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        let mut types = vec![2i32, 3, 3];
        let mut scores = vec![0f32, 0.0, 0.0];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for (piece, score) in [
            ("\u{2581}", -1.0),
            ("h", -2.0),
            ("e", -3.0),
            ("l", -4.0),
            ("o", -5.0),
            ("\u{2581}h", -6.0),
            ("ll", -7.0),
            ("\u{2581}he", -8.0),
            ("llo", -9.0),
            ("\u{2581}hello", -10.0),
        ] {
            tokens.push(piece.to_string());
            types.push(1);
            scores.push(score);
        }
        content(vec![
            ("tokenizer.ggml.model", V::String("llama".into())),
            (
                "tokenizer.ggml.tokens",
                V::Array(tokens.into_iter().map(V::String).collect()),
            ),
            (
                "tokenizer.ggml.token_type",
                V::Array(types.into_iter().map(V::I32).collect()),
            ),
            (
                "tokenizer.ggml.scores",
                V::Array(scores.into_iter().map(V::F32).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", V::U32(1)),
            ("tokenizer.ggml.eos_token_id", V::U32(2)),
        ])
    }

    #[test]
    fn tokenizer_spm_llama_from_scores() {
        let t = Tokenizer::from_gguf(&spm_content()).unwrap();
        assert!(t.adds_bos(), "llama vocabularies add BOS by default");
        let hello = t.token_to_id("\u{2581}hello").unwrap();
        let h = t.token_to_id("\u{2581}h").unwrap();
        let byte_i = t.token_to_id("<0x69>").unwrap();
        assert_eq!(t.encode("hello", true).unwrap(), vec![1, hello]);
        assert_eq!(t.encode("hello hi", false).unwrap(), vec![hello, h, byte_i]);
        assert_eq!(
            t.decode(&t.encode("hello hi", true).unwrap(), true)
                .unwrap(),
            "hello hi"
        );
        assert_eq!(t.eos_ids(), &[2]);
        assert_eq!(t.encode("<s>hello", false).unwrap(), vec![1, hello]);
    }

    /// A vocabulary that prepends BOS keeps doing so once written as Hugging Face files: the
    /// written `tokenizer.json` alone adds it (a post-processor), and reading the directory
    /// back does not add it twice.
    #[test]
    fn tokenizer_hf_files_keep_bos() {
        let t = Tokenizer::from_gguf(&spm_content()).unwrap();
        let hello = t.token_to_id("\u{2581}hello").unwrap();
        let dir = tempfile::tempdir().unwrap();
        t.save_with_config(dir.path(), None).unwrap();
        let path = dir.path().join("tokenizer.json");
        let raw = tokenizers::Tokenizer::from_file(&path).unwrap();
        assert_eq!(raw.encode("hello", true).unwrap().get_ids(), &[1, hello]);
        assert_eq!(raw.encode("hello", false).unwrap().get_ids(), &[hello]);
        let back = Tokenizer::from_hf_file(&path).unwrap();
        assert!(back.adds_bos());
        assert_eq!(back.encode("hello", true).unwrap(), vec![1, hello]);
    }

    #[test]
    fn tokenizer_gguf_errors_are_clear() {
        let err = Tokenizer::from_gguf(&content(vec![
            ("tokenizer.ggml.model", V::String("bert".into())),
            (
                "tokenizer.ggml.tokens",
                V::Array(vec![V::String("a".into())]),
            ),
        ]))
        .unwrap_err();
        assert!(
            matches!(&err, ModelError::Tokenizer(m) if m.contains("`bert`")),
            "{err}"
        );
        let err = Tokenizer::from_gguf(&content(vec![])).unwrap_err();
        assert_eq!(err.kind(), "bad_metadata");
        let err = pre_tokenizer_regexes("no-such-pre").unwrap_err();
        assert!(err.to_string().contains("no-such-pre"));
    }

    #[test]
    fn tokenizer_pre_tokenizer_regexes_compile() {
        for pre in ["smollm", "gpt2", "llama3", "llama-bpe", "qwen2", "default"] {
            for r in pre_tokenizer_regexes(pre).unwrap() {
                tokenizers::pre_tokenizers::split::Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex(r.to_string()),
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{pre}: {r}: {e}"));
            }
        }
    }

    #[test]
    fn tokenizer_byte_table_is_gpt2() {
        let t = byte_to_char_table();
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(t[b'\n' as usize], '\u{10A}'); // Ċ
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
