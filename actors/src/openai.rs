//! OpenAI-compatible request parsing and response shapes, as pure functions: every field is
//! checked here and a bad one becomes a [`RequestError::BadRequest`] naming it.

use crate::error::RequestError;
use crate::json_field::{present, Lenient, Object};
use crate::tools::{self, Tools};
use pdserve_gpu::chat::ChatMessage;
use pdserve_gpu::grammar::GrammarSpec;
use pdserve_gpu::sampling::{
    LogitBias, SamplingParams, TokenLogprobs, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS,
};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

pub mod response;

/// What an `image_url` part of a chat message becomes in the message's text: the image's
/// place, which the instance turns into the image's placeholder tokens
/// ([`crate::multimodal::splice_prompt`]). Text that contains it is refused with images.
pub const IMAGE_MARKER: &str = "<|pdserve_image|>";

/// Most `image_url` parts one request may hold at all (the instance's own
/// `multimodal.max_images_per_request` is at most this).
pub const MAX_IMAGE_PARTS: usize = 64;

/// Completions default `max_tokens` (as OpenAI's API).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// What the client sent as its prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Text to tokenize.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Chat messages to render with the model's template.
    Chat(Vec<ChatMessage>),
}

impl PromptInput {
    /// The token ids an instance serving this tokenizer and chat template computes for the
    /// prompt (text with special tokens, chat rendered then encoded without them).
    ///
    /// # Errors
    /// The tokenizer's or the template's error.
    pub fn token_ids(
        &self,
        tokenizer: &pdserve_gpu::Tokenizer,
        template: &pdserve_gpu::ChatTemplate,
    ) -> pdserve_gpu::Result<Vec<u32>> {
        match self {
            Self::Text(t) => tokenizer.encode(t, true),
            Self::Tokens(t) => Ok(t.clone()),
            Self::Chat(messages) => template
                .render(messages, true)
                .and_then(|text| tokenizer.encode(&text, false)),
        }
    }
}

/// A validated request.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// Model name asked for (None: the served model).
    pub model: Option<String>,
    /// `n`: how many choices (independent branches from one prompt), 1..=[`MAX_CHOICES`].
    pub n: usize,
    /// The prompt (the first of a list of prompts).
    pub prompt: PromptInput,
    /// Completions' list of prompts: the prompts after the first (choices are prompt-major:
    /// prompt `j`'s choice `i` has index `j * n + i`). Empty for one prompt.
    pub more_prompts: Vec<PromptInput>,
    /// `max_tokens` if given (resolved against the prompt length later).
    pub max_tokens: Option<usize>,
    /// Sampling settings (max_tokens filled in later).
    pub params: SamplingParams,
    /// Stream with SSE.
    pub stream: bool,
    /// Send a final usage chunk when streaming.
    pub include_usage: bool,
    /// vLLM-style `kv_transfer_params`, passed through untouched for the P/D layer.
    pub kv_transfer_params: Option<Value>,
    /// vLLM's `return_token_ids`: add `token_ids` to each choice (and `prompt_token_ids`).
    pub return_token_ids: bool,
    /// pdserve's `resume_tokens`: the tokens an earlier attempt already generated and sent
    /// (request migration, set by the proxy); generation continues after them and their
    /// text is not sent again. Empty for a new request.
    pub resume_tokens: Vec<u32>,
    /// Completions' `echo`: the answer's text (and, with `logprobs`, its logprobs) starts
    /// with the prompt's.
    pub echo: bool,
    /// Chat's `tools` when the model may call them (`tool_choice` not `none`): its answer's
    /// calls are parsed into `tool_calls`.
    pub tools: Option<Tools>,
    /// Chat's `image_url` parts (their `url`), in prompt order; each left an
    /// [`IMAGE_MARKER`] in its message's text. Empty for text.
    pub images: Vec<String>,
    /// pdserve's `ec_transfer_params` (E/P/D): the encode instance holding this request's
    /// images (set by the proxy); the instance takes their embeddings from there.
    pub ec_transfer_params: Option<EcTransferParams>,
}

/// `ec_transfer_params`: where a request's image embeddings are (encoder disaggregation).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EcTransferParams {
    /// The encode instance's URL (`http://host:port` or `https://...`).
    pub encoder_url: String,
}

/// Longest `ec_transfer_params.encoder_url`, in bytes.
pub const MAX_ENCODER_URL_BYTES: usize = 1024;

fn ec_params(v: Option<Value>) -> Result<Option<EcTransferParams>, RequestError> {
    let Some(v) = v else { return Ok(None) };
    let p =
        EcTransferParams::deserialize(&v).map_err(|e| bad(format!("`ec_transfer_params`: {e}")))?;
    let url = &p.encoder_url;
    if url.len() > MAX_ENCODER_URL_BYTES
        || !(url.starts_with("http://") || url.starts_with("https://"))
        || url.contains(char::is_whitespace)
    {
        return Err(bad(format!(
            "`ec_transfer_params.encoder_url` must be an http:// or https:// URL of at most {MAX_ENCODER_URL_BYTES} bytes"
        )));
    }
    Ok(Some(EcTransferParams {
        encoder_url: url.trim_end_matches('/').to_string(),
    }))
}

/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 16;
/// Most prompts in completions' list of prompts.
pub const MAX_PROMPTS: usize = 64;
/// Most choices of one request over all its prompts (`n` times the prompts).
pub const MAX_CHOICES_TOTAL: usize = 64;

fn bad(msg: impl Into<String>) -> RequestError {
    RequestError::BadRequest(msg.into())
}

/// A request body as serde reads it: every field in the shape it should have, or as sent
/// ([`Lenient`]) for [`parse_value`] to refuse by name, in its own order. Unknown fields are
/// ignored, as OpenAI's own clients send some (`user`, `metadata`). Structured output and tools
/// are read by [`GrammarFields`] and [`tools::parse`].
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawRequest {
    model: Option<Lenient<String>>,
    messages: Option<Lenient<Vec<Lenient<Object<RawMessage>>>>>,
    prompt: Option<RawPrompt>,
    max_tokens: Option<Lenient<u64>>,
    /// Sent at all (`null` included): it then replaces `max_tokens` on chat.
    #[serde(deserialize_with = "present")]
    max_completion_tokens: Option<Option<Lenient<u64>>>,
    echo: Option<Lenient<bool>>,
    n: Option<Lenient<u64>>,
    best_of: Option<Lenient<u64>>,
    logprobs: Option<Lenient<LogprobsArg>>,
    top_logprobs: Option<Lenient<u64>>,
    temperature: Option<Lenient<f64>>,
    top_p: Option<Lenient<f64>>,
    min_p: Option<Lenient<f64>>,
    presence_penalty: Option<Lenient<f64>>,
    frequency_penalty: Option<Lenient<f64>>,
    repetition_penalty: Option<Lenient<f64>>,
    top_k: Option<Lenient<i64>>,
    seed: Option<Lenient<u64>>,
    stop: Option<Lenient<Strings>>,
    stop_token_ids: Option<Lenient<Vec<u32>>>,
    ignore_eos: Option<Lenient<bool>>,
    logit_bias: Option<Lenient<BTreeMap<String, Lenient<f64>>>>,
    /// Only whether it was sent (completions refuse it; chat reads it in [`tools::parse`]).
    tools: Option<IgnoredAny>,
    stream: Option<Lenient<bool>>,
    stream_options: Option<Lenient<Object<StreamOptions>>>,
    /// Passed through untouched; read by [`kv_directive`].
    kv_transfer_params: Option<Value>,
    /// Read by [`ec_params`].
    ec_transfer_params: Option<Value>,
    return_token_ids: Option<Lenient<bool>>,
    resume_tokens: Option<Lenient<Vec<u32>>>,
}

/// One chat message.
#[derive(Debug, Deserialize)]
struct RawMessage {
    role: Option<Lenient<String>>,
    content: Option<RawContent>,
    /// An assistant turn's calls, read by [`tools::render_calls`].
    tool_calls: Option<Value>,
    tool_call_id: Option<Lenient<String>>,
}

/// A message's `content`: text or a list of parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawContent {
    Text(String),
    Parts(Vec<Lenient<Object<RawPart>>>),
    Other(IgnoredAny),
}

/// One part of a message's content: `{"type": "text", "text"}` or `{"type": "image_url",
/// "image_url": {"url"} | url}`.
#[derive(Debug, Deserialize)]
struct RawPart {
    #[serde(rename = "type")]
    kind: Option<Lenient<String>>,
    text: Option<Lenient<String>>,
    #[serde(default, deserialize_with = "present")]
    image_url: Option<ImageUrl>,
}

/// An `image_url` part's image: OpenAI's `{"url": ...}`, or the bare string some clients send.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ImageUrl {
    Bare(String),
    Object(Object<UrlObject>),
    Other(IgnoredAny),
}

#[derive(Debug, Deserialize)]
struct UrlObject {
    url: Option<Lenient<String>>,
}

/// Completions' `prompt`: a string, token ids, or a list of those.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawPrompt {
    Text(String),
    List(Vec<PromptItem>),
    Other(IgnoredAny),
}

/// One item of a `prompt` list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptItem {
    Text(String),
    /// A token id.
    Token(u32),
    /// A number that is no token id (its value is not needed, only its shape).
    Number(#[allow(dead_code)] serde_json::Number),
    Tokens(Vec<u32>),
    /// A list that is not all token ids.
    List(#[allow(dead_code)] Vec<IgnoredAny>),
    Other(IgnoredAny),
}

/// `logprobs`: a flag on chat, a count on completions.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum LogprobsArg {
    Flag(bool),
    Count(u64),
}

/// `stop`: one string or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Strings {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    include_usage: Option<Lenient<bool>>,
}

fn opt_f32(
    field: Option<Lenient<f64>>,
    key: &str,
    lo: f32,
    hi: f32,
    lo_open: bool,
) -> Result<Option<f32>, RequestError> {
    let Some(x) = field else { return Ok(None) };
    let f = x
        .ok()
        .ok_or_else(|| bad(format!("`{key}` must be a number")))? as f32;
    let below = if lo_open { f <= lo } else { f < lo };
    if !f.is_finite() || below || f > hi {
        let lb = if lo_open { "(" } else { "[" };
        return Err(bad(format!("`{key}` must be in {lb}{lo}, {hi}], got {f}")));
    }
    Ok(Some(f))
}

fn opt_uint(field: Option<Lenient<u64>>, key: &str) -> Result<Option<u64>, RequestError> {
    match field.map(Lenient::into_result) {
        None => Ok(None),
        Some(Ok(n)) => Ok(Some(n)),
        Some(Err(x)) => Err(not_uint(&x, key)),
    }
}

/// The refusal of `x` where a non-negative integer belongs.
fn not_uint(x: &Value, key: &str) -> RequestError {
    if x.as_i64().is_some() {
        bad(format!("`{key}` must be a non-negative integer, got {x}"))
    } else {
        bad(format!("`{key}` must be an integer, got {x}"))
    }
}

fn opt_bool(field: Option<Lenient<bool>>, key: &str) -> Result<bool, RequestError> {
    match field.map(Lenient::into_result) {
        None => Ok(false),
        Some(Ok(b)) => Ok(b),
        Some(Err(x)) => Err(bad(format!("`{key}` must be a boolean, got {x}"))),
    }
}

fn token_list(field: Option<Lenient<Vec<u32>>>, what: &str) -> Result<Vec<u32>, RequestError> {
    match field {
        None => Ok(Vec::new()),
        Some(x) => x.ok().ok_or_else(|| bad(what)),
    }
}

/// Parses a body for `/v1/completions` (`chat == false`) or `/v1/chat/completions`.
///
/// # Errors
/// [`RequestError::BadRequest`] naming the offending field.
pub fn parse_request(body: &[u8], chat: bool) -> Result<ParsedRequest, RequestError> {
    parse_value(&parse_json(body)?, chat)
}

/// Parses a request body as JSON (once; see [`parse_value`]).
///
/// # Errors
/// [`RequestError::BadRequest`] when it is not JSON.
pub fn parse_json(body: &[u8]) -> Result<Value, RequestError> {
    serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))
}

/// Reads `v` as `T`, whose fields all take any shape: only a body that is no object fails.
fn read<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, RequestError> {
    T::deserialize(v).map_err(|e| bad(format!("the request body: {e}")))
}

/// Chat's `messages`, rendered; each `image_url` part's url is pushed onto `images`.
fn parse_messages(
    messages: Option<Lenient<Vec<Lenient<Object<RawMessage>>>>>,
    images: &mut Vec<String>,
) -> Result<Vec<ChatMessage>, RequestError> {
    let msgs = messages
        .and_then(Lenient::ok)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("`messages` must be a non-empty list"))?;
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.into_iter().enumerate() {
        let images_before = images.len();
        let role_error = || bad(format!("`messages[{i}].role` must be a string"));
        let Some(Object(m)) = m.ok() else {
            return Err(role_error());
        };
        let Some(Lenient::Ok(role)) = m.role else {
            return Err(role_error());
        };
        let role = role.as_str();
        if !matches!(role, "system" | "user" | "assistant" | "tool" | "developer") {
            return Err(bad(format!("`messages[{i}].role` `{role}` is not one of system, user, assistant, tool, developer")));
        }
        let content = match m.content {
            Some(RawContent::Text(s)) => s,
            Some(RawContent::Parts(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.into_iter().enumerate() {
                    let at = format!("`messages[{i}].content[{j}]");
                    let Some(Object(p)) = p.ok() else {
                        return Err(bad(format!(
                            "{at}.type` must be a string (text, image_url)"
                        )));
                    };
                    match p.kind.and_then(Lenient::ok).as_deref() {
                        Some("text") => match p.text.and_then(Lenient::ok) {
                            Some(t) => text.push_str(&t),
                            None => return Err(bad(format!("{at}.text` must be a string"))),
                        },
                        Some("image_url") => {
                            if role != "user" {
                                return Err(bad(format!(
                                    "{at}`: image parts belong to user messages, not {role}"
                                )));
                            }
                            let url = match p.image_url {
                                Some(ImageUrl::Bare(u)) => u,
                                Some(ImageUrl::Object(Object(UrlObject {
                                    url: Some(Lenient::Ok(u)),
                                }))) => u,
                                Some(_) => {
                                    return Err(bad(format!(
                                        "{at}.image_url.url` must be a string"
                                    )))
                                }
                                None => {
                                    return Err(bad(format!(
                                        "{at}.image_url` is required for an image_url part"
                                    )))
                                }
                            };
                            if images.len() == MAX_IMAGE_PARTS {
                                return Err(bad(format!(
                                    "a request holds at most {MAX_IMAGE_PARTS} image_url parts"
                                )));
                            }
                            images.push(url);
                            text.push_str(IMAGE_MARKER);
                        }
                        Some(other) => {
                            return Err(bad(format!(
                                "{at}.type` `{}` is not supported (text, image_url)",
                                other.chars().take(64).collect::<String>()
                            )))
                        }
                        None => {
                            return Err(bad(format!(
                                "{at}.type` must be a string (text, image_url)"
                            )))
                        }
                    }
                }
                text
            }
            None if role == "assistant" || role == "tool" => String::new(),
            _ => {
                return Err(bad(format!(
                    "`messages[{i}].content` must be a string or a list of text parts"
                )))
            }
        };
        let content = match (role, m.tool_calls) {
            // The calls an assistant turn made, as the model writes them.
            ("assistant", Some(calls)) => {
                let calls = tools::render_calls(&calls, i)?;
                if content.is_empty() {
                    calls
                } else {
                    format!("{content}\n{calls}")
                }
            }
            (_, Some(_)) => {
                return Err(bad(format!(
                    "`messages[{i}].tool_calls` belongs to assistant messages"
                )))
            }
            _ if images.len() > images_before
                && content.matches(IMAGE_MARKER).count() != images.len() - images_before =>
            {
                return Err(bad(format!(
                    "`messages[{i}].content` text may not contain `{IMAGE_MARKER}` beside images"
                )));
            }
            ("tool", None) => {
                if let Some(Lenient::Bad(_)) = m.tool_call_id {
                    return Err(bad(format!(
                        "`messages[{i}].tool_call_id` must be a string"
                    )));
                }
                tools::render_response(&content)
            }
            _ => content,
        };
        out.push(ChatMessage::new(role, content));
    }
    Ok(out)
}

/// Completions' `prompt`: the first prompt and the ones after it.
fn parse_prompt(
    prompt: Option<RawPrompt>,
) -> Result<(PromptInput, Vec<PromptInput>), RequestError> {
    let bad_ids = || bad("`prompt` token ids must be non-negative integers");
    let is_number = |p: &PromptItem| matches!(p, PromptItem::Token(_) | PromptItem::Number(_));
    let items = match prompt {
        Some(RawPrompt::Text(s)) => return Ok((PromptInput::Text(s), Vec::new())),
        Some(RawPrompt::List(items)) => items,
        None => return Err(bad("`prompt` is required")),
        Some(RawPrompt::Other(_)) => Vec::new(),
    };
    let one = match items.as_slice() {
        [PromptItem::Text(s)] => Some(PromptInput::Text(s.clone())),
        [PromptItem::Tokens(t)] => Some(PromptInput::Tokens(t.clone())),
        [PromptItem::List(_)] => return Err(bad_ids()),
        _ => None,
    };
    if let Some(p) = one {
        return Ok((p, Vec::new()));
    }
    if !items.is_empty() && items.iter().all(is_number) {
        let tokens = items
            .into_iter()
            .map(|p| match p {
                PromptItem::Token(t) => Some(t),
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(bad_ids)?;
        return Ok((PromptInput::Tokens(tokens), Vec::new()));
    }
    if items.len() <= 1 {
        return Err(bad(
            "`prompt` must be a string, a list of token ids, or a list with one of those",
        ));
    }
    if items.len() > MAX_PROMPTS {
        return Err(bad(format!(
            "`prompt` lists at most {MAX_PROMPTS} prompts, got {}",
            items.len()
        )));
    }
    let mut prompts = items.into_iter().map(|p| match p {
        PromptItem::Text(s) => Ok(PromptInput::Text(s)),
        PromptItem::Tokens(t) => Ok(PromptInput::Tokens(t)),
        PromptItem::List(_) => Err(bad_ids()),
        _ => Err(bad("a list of prompts holds strings or lists of token ids")),
    });
    let first = prompts.next().expect("more than one")?;
    Ok((first, prompts.collect::<Result<_, _>>()?))
}

/// Validates an already parsed request body (the proxy parses a body once, validates it, and
/// forwards the same value).
///
/// # Errors
/// [`RequestError::BadRequest`] naming the first bad field.
pub fn parse_value(v: &Value, chat: bool) -> Result<ParsedRequest, RequestError> {
    if !v.is_object() {
        return Err(bad("the request body must be a JSON object"));
    }
    let raw: RawRequest = read(v)?;
    let model = match raw.model.map(Lenient::into_result) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(_)) => return Err(bad("`model` must be a string")),
    };
    let mut images = Vec::new();
    let (prompt, more_prompts) = if chat {
        (
            PromptInput::Chat(parse_messages(raw.messages, &mut images)?),
            Vec::new(),
        )
    } else {
        parse_prompt(raw.prompt)?
    };
    let (key_max, max_tokens) = match raw.max_completion_tokens {
        Some(n) if chat => ("max_completion_tokens", n),
        _ => ("max_tokens", raw.max_tokens),
    };
    let max_tokens = opt_uint(max_tokens, key_max)?.map(|n| n as usize);
    let echo = opt_bool(raw.echo, "echo")?;
    if echo && chat {
        return Err(bad("`echo` is not supported on chat completions"));
    }
    // `echo` with `max_tokens` 0 scores the prompt without generating (lm-eval's
    // log-likelihood requests).
    if max_tokens == Some(0) && !echo {
        return Err(bad(format!(
            "`{key_max}` must be at least 1 (0 only with `echo`)"
        )));
    }
    let n = match opt_uint(raw.n, "n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => n as usize,
        Some(n) => return Err(bad(format!("`n` must be in [1, {MAX_CHOICES}], got {n}"))),
    };
    match opt_uint(raw.best_of, "best_of") {
        Ok(None | Some(1)) => {}
        _ => {
            return Err(bad(
                "`best_of` is not supported: ask `n` choices and rank them with `logprobs`",
            ))
        }
    }
    let logprobs = parse_logprobs(raw.logprobs, raw.top_logprobs, chat)?;
    let mut params = SamplingParams {
        logprobs,
        // With `echo`, the prompt's tokens get as many alternatives as the generated ones.
        prompt_logprobs: logprobs.filter(|_| echo),
        ..SamplingParams::default()
    };
    if let Some(t) = opt_f32(raw.temperature, "temperature", 0.0, 2.0, false)? {
        params.temperature = t;
    }
    if let Some(p) = opt_f32(raw.top_p, "top_p", 0.0, 1.0, true)? {
        params.top_p = p;
    }
    if let Some(p) = opt_f32(raw.min_p, "min_p", 0.0, 1.0, false)? {
        params.min_p = p;
    }
    if let Some(p) = opt_f32(raw.presence_penalty, "presence_penalty", -2.0, 2.0, false)? {
        params.presence_penalty = p;
    }
    if let Some(p) = opt_f32(raw.frequency_penalty, "frequency_penalty", -2.0, 2.0, false)? {
        params.frequency_penalty = p;
    }
    if let Some(p) = opt_f32(
        raw.repetition_penalty,
        "repetition_penalty",
        0.0,
        10.0,
        true,
    )? {
        params.repetition_penalty = p;
    }
    match raw.top_k.map(Lenient::into_result) {
        None => {}
        Some(Ok(-1 | 0)) => params.top_k = None,
        // Clamped, never truncated: 2^32 + 1 is not 1 (greedy). Sampling clamps to the
        // vocabulary anyway.
        Some(Ok(k)) if k > 0 => params.top_k = Some(u32::try_from(k).unwrap_or(u32::MAX)),
        Some(Ok(k)) => {
            return Err(bad(format!(
                "`top_k` must be -1, 0 or a positive integer, got {k}"
            )))
        }
        Some(Err(x)) => {
            return Err(bad(format!(
                "`top_k` must be -1, 0 or a positive integer, got {x}"
            )))
        }
    }
    params.seed = opt_uint(raw.seed, "seed")?;
    params.stop = match raw.stop.map(Lenient::into_result) {
        None => Vec::new(),
        Some(Ok(Strings::One(s))) => vec![s],
        Some(Ok(Strings::Many(s))) => s,
        Some(Err(_)) => return Err(bad("`stop` must be a string or a list of strings")),
    };
    if params.stop.len() > 16 {
        return Err(bad("`stop` takes at most 16 strings"));
    }
    params.stop_token_ids = token_list(
        raw.stop_token_ids,
        "`stop_token_ids` must be a list of token ids",
    )?;
    params.ignore_eos = opt_bool(raw.ignore_eos, "ignore_eos")?;
    params.logit_bias = parse_logit_bias(raw.logit_bias)?;
    params.grammar = parse_grammar(read(v)?)?;
    let tools = if chat {
        tools::parse(v)?.filter(Tools::active)
    } else if raw.tools.is_some() {
        return Err(bad("`tools` is supported on chat completions only"));
    } else {
        None
    };
    let mut prompt = prompt;
    if let (Some(t), PromptInput::Chat(messages)) = (&tools, &mut prompt) {
        // The tools are described in the system message (the first one, or a new one).
        let block = t.system_prompt();
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{block}", first.content);
            }
            _ => messages.insert(0, ChatMessage::new("system", block)),
        }
        if let Some(grammar) = t.grammar() {
            if params.grammar.is_some() {
                return Err(bad("`tool_choice` `required` or a named function cannot be combined with `response_format` or another output constraint"));
            }
            params.grammar = Some(grammar);
        }
    }
    let stream = opt_bool(raw.stream, "stream")?;
    let include_usage = match raw.stream_options.map(Lenient::into_result) {
        None => false,
        Some(Ok(Object(o))) => opt_bool(o.include_usage, "include_usage")?,
        Some(Err(_)) => return Err(bad("`stream_options` must be an object")),
    };
    let kv_transfer_params = raw.kv_transfer_params;
    let ec_transfer_params = ec_params(raw.ec_transfer_params)?;
    if ec_transfer_params.is_some() && images.is_empty() {
        return Err(bad(
            "`ec_transfer_params` names an encoder for a request without images",
        ));
    }
    let return_token_ids = opt_bool(raw.return_token_ids, "return_token_ids")?;
    let resume_tokens = token_list(
        raw.resume_tokens,
        "`resume_tokens` must be a list of token ids",
    )?;
    if !resume_tokens.is_empty() && kv_transfer_params.is_some() {
        return Err(bad(
            "`resume_tokens` cannot be combined with `kv_transfer_params`: a resumed request is prefilled where it continues",
        ));
    }
    if n * (1 + more_prompts.len()) > MAX_CHOICES_TOTAL {
        return Err(bad(format!(
            "`n` times the number of prompts must be at most {MAX_CHOICES_TOTAL}, got {} x {}",
            n,
            1 + more_prompts.len()
        )));
    }
    if !more_prompts.is_empty() && !resume_tokens.is_empty() {
        return Err(bad(
            "`resume_tokens` (request migration) cannot be combined with a list of prompts",
        ));
    }
    if n > 1 && !resume_tokens.is_empty() {
        return Err(bad(
            "`resume_tokens` (request migration) cannot be combined with `n` > 1",
        ));
    }
    Ok(ParsedRequest {
        model,
        n,
        prompt,
        more_prompts,
        max_tokens,
        params,
        stream,
        include_usage,
        kv_transfer_params,
        return_token_ids,
        resume_tokens,
        echo,
        tools,
        images,
        ec_transfer_params,
    })
}

/// The fields that ask for structured output; a request may use one of them. Read in this
/// order; the first two found are named in the refusal.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct GrammarFields {
    response_format: Option<Lenient<Object<ResponseFormat>>>,
    guided_json: Option<GrammarArg>,
    guided_regex: Option<GrammarArg>,
    guided_choice: Option<GrammarArg>,
    guided_grammar: Option<GrammarArg>,
    structured_outputs: Option<Lenient<BTreeMap<String, Option<GrammarArg>>>>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Deserialize)]
struct ResponseFormat {
    #[serde(rename = "type")]
    kind: Option<Lenient<String>>,
    json_schema: Option<Lenient<Object<JsonSchemaFormat>>>,
}

/// `response_format.json_schema`.
#[derive(Debug, Deserialize)]
struct JsonSchemaFormat {
    strict: Option<Lenient<bool>>,
    schema: Option<GrammarArg>,
}

/// What a structured-output field holds; which shapes it may take depends on the field.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum GrammarArg {
    Flag(bool),
    Text(String),
    Strings(Vec<String>),
    /// A JSON schema, handed to the grammar compiler untouched.
    Schema(serde_json::Map<String, Value>),
    Other(IgnoredAny),
}

/// Structured output: OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's
/// `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (Lark) and its newer
/// `structured_outputs: {json | regex | choice | grammar | json_object}`. At most one of them
/// may constrain a request. Bounds (size, choices) and compilation are checked later
/// ([`SamplingParams::validate`], the grammar compiler), each a 400 naming the problem.
fn parse_grammar(fields: GrammarFields) -> Result<Option<GrammarSpec>, RequestError> {
    let GrammarFields {
        response_format: format,
        guided_json,
        guided_regex,
        guided_choice,
        guided_grammar,
        structured_outputs: outputs,
    } = fields;
    let specs = [
        ("response_format", format.map(response_format)),
        (
            "guided_json",
            guided_json.map(|x| json_schema(x, "guided_json").map(Some)),
        ),
        (
            "guided_regex",
            guided_regex
                .map(|x| string_field(x, "guided_regex").map(|r| Some(GrammarSpec::Regex(r)))),
        ),
        (
            "guided_choice",
            guided_choice.map(|x| choice(x, "guided_choice").map(Some)),
        ),
        (
            "guided_grammar",
            guided_grammar
                .map(|x| string_field(x, "guided_grammar").map(|g| Some(GrammarSpec::Lark(g)))),
        ),
        ("structured_outputs", outputs.map(structured_outputs)),
    ];
    let mut found: Option<(&str, GrammarSpec)> = None;
    for (field, spec) in specs {
        let Some(spec) = spec.transpose()?.flatten() else {
            continue;
        };
        if let Some((first, _)) = &found {
            return Err(bad(format!(
                "`{first}` and `{field}` both constrain the output: send one of them"
            )));
        }
        found = Some((field, spec));
    }
    Ok(found.map(|(_, spec)| spec))
}

fn string_field(x: GrammarArg, name: &str) -> Result<String, RequestError> {
    match x {
        GrammarArg::Text(s) => Ok(s),
        _ => Err(bad(format!("`{name}` must be a string"))),
    }
}

/// A JSON schema given as an object (or a boolean), or as its JSON text (vLLM accepts both).
fn json_schema(x: GrammarArg, name: &str) -> Result<GrammarSpec, RequestError> {
    match x {
        GrammarArg::Schema(schema) => {
            Ok(GrammarSpec::JsonSchema(Value::Object(schema).to_string()))
        }
        GrammarArg::Flag(b) => Ok(GrammarSpec::JsonSchema(b.to_string())),
        GrammarArg::Text(text) => Ok(GrammarSpec::JsonSchema(text)),
        _ => Err(bad(format!("`{name}` must be a JSON schema (an object)"))),
    }
}

fn choice(x: GrammarArg, name: &str) -> Result<GrammarSpec, RequestError> {
    match x {
        GrammarArg::Strings(items) => Ok(GrammarSpec::Choice(items)),
        _ => Err(bad(format!("`{name}` must be a list of strings"))),
    }
}

fn response_format(
    x: Lenient<Object<ResponseFormat>>,
) -> Result<Option<GrammarSpec>, RequestError> {
    let (kind, json_schema_format) = match x {
        Lenient::Ok(Object(ResponseFormat {
            kind: Some(Lenient::Ok(kind)),
            json_schema,
        })) => (kind, json_schema),
        _ => return Err(bad("`response_format.type` must be a string")),
    };
    match kind.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonObject)),
        "json_schema" => {
            let Some(Lenient::Ok(Object(js))) = json_schema_format else {
                return Err(bad(
                    "`response_format.json_schema` must be an object with `name` and `schema`",
                ));
            };
            if let Some(Lenient::Bad(_)) = js.strict {
                return Err(bad(
                    "`response_format.json_schema.strict` must be a boolean",
                ));
            }
            // OpenAI's schema is optional; without one any JSON value is allowed.
            match js.schema {
                Some(schema) => json_schema(schema, "response_format.json_schema.schema").map(Some),
                None => Ok(Some(GrammarSpec::JsonSchema("{}".into()))),
            }
        }
        other => Err(bad(format!(
            "`response_format.type` `{other}` is not one of text, json_object, json_schema"
        ))),
    }
}

fn structured_outputs(
    x: Lenient<BTreeMap<String, Option<GrammarArg>>>,
) -> Result<Option<GrammarSpec>, RequestError> {
    let map = x
        .ok()
        .ok_or_else(|| bad("`structured_outputs` must be an object"))?;
    let mut found = None;
    for (key, val) in map {
        let Some(val) = val.filter(|v| !matches!(v, GrammarArg::Flag(false))) else {
            continue;
        };
        let name = format!("structured_outputs.{key}");
        let spec = match (key.as_str(), val) {
            ("json", val) => json_schema(val, &name)?,
            ("regex", val) => GrammarSpec::Regex(string_field(val, &name)?),
            ("choice", val) => choice(val, &name)?,
            ("grammar", val) => GrammarSpec::Lark(string_field(val, &name)?),
            ("json_object", GrammarArg::Flag(true)) => GrammarSpec::JsonObject,
            _ => {
                return Err(bad(format!(
                    "`{name}` is not supported (json, regex, choice, grammar, json_object are)"
                )))
            }
        };
        if found.replace(spec).is_some() {
            return Err(bad(
                "`structured_outputs` takes one of json, regex, choice, grammar, json_object",
            ));
        }
    }
    Ok(found)
}

/// OpenAI's `logit_bias`: an object from token ids (as decimal strings) to biases in
/// [-100, 100], at most 300 entries; sorted by token id. Ids are checked against the
/// vocabulary by [`SamplingParams::validate`].
fn parse_logit_bias(
    field: Option<Lenient<BTreeMap<String, Lenient<f64>>>>,
) -> Result<Vec<LogitBias>, RequestError> {
    let map = match field.map(Lenient::into_result) {
        None => return Ok(Vec::new()),
        Some(Ok(m)) => m,
        Some(Err(x)) => {
            return Err(bad(format!(
                "`logit_bias` must be an object from token ids to biases, got {x}"
            )))
        }
    };
    if map.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(bad(format!(
            "`logit_bias` takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {}",
            map.len()
        )));
    }
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let token: u32 = key
            .parse()
            .map_err(|_| bad(format!("`logit_bias` key {key:?} is not a token id")))?;
        let bias = match value {
            Lenient::Ok(b) if (-(MAX_LOGIT_BIAS as f64)..=MAX_LOGIT_BIAS as f64).contains(&b) => b,
            value => {
                let value = match value {
                    Lenient::Ok(b) => Value::from(b),
                    Lenient::Bad(x) => x,
                };
                return Err(bad(format!(
                    "`logit_bias` values must be numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {value} for token {key}"
                )));
            }
        };
        out.push(LogitBias {
            token,
            bias: bias as f32,
        });
    }
    out.sort_unstable_by_key(|b| b.token);
    if let Some(w) = out.windows(2).find(|w| w[0].token == w[1].token) {
        return Err(bad(format!(
            "`logit_bias` names token {} twice",
            w[0].token
        )));
    }
    Ok(out)
}

/// A count of logprobs in `0..=MAX_LOGPROBS` under `key`.
fn logprob_count(n: Option<Result<u64, Value>>, key: &str) -> Result<Option<u32>, RequestError> {
    match n.transpose().map_err(|x| not_uint(&x, key))? {
        Some(n) if n > u64::from(MAX_LOGPROBS) => Err(bad(format!(
            "`{key}` must be in [0, {MAX_LOGPROBS}], got {n}"
        ))),
        n => Ok(n.map(|n| n as u32)),
    }
}

/// How many alternatives per generated token the request asks for, `None` for no logprobs.
/// Chat: `logprobs: true` and `top_logprobs` (0..=20, which needs `logprobs: true`), as
/// OpenAI. Completions: `logprobs: N`, 0..=20 (vLLM's bound; OpenAI's is 5).
fn parse_logprobs(
    logprobs: Option<Lenient<LogprobsArg>>,
    top_logprobs: Option<Lenient<u64>>,
    chat: bool,
) -> Result<Option<u32>, RequestError> {
    let logprobs = logprobs.map(Lenient::into_result);
    if !chat {
        let count = match logprobs {
            Some(Ok(LogprobsArg::Flag(_))) => return Err(bad(
                "`logprobs` must be an integer on completions (how many alternatives per token)",
            )),
            Some(Ok(LogprobsArg::Count(n))) => Some(Ok(n)),
            Some(Err(x)) => Some(Err(x)),
            None => None,
        };
        return logprob_count(count, "logprobs");
    }
    let wants = match logprobs {
        None => false,
        Some(Ok(LogprobsArg::Flag(b))) => b,
        Some(Ok(LogprobsArg::Count(n))) => {
            return Err(bad(format!(
                "`logprobs` must be a boolean on chat completions, got {n}"
            )))
        }
        Some(Err(x)) => {
            return Err(bad(format!(
                "`logprobs` must be a boolean on chat completions, got {x}"
            )))
        }
    };
    let top = logprob_count(top_logprobs.map(Lenient::into_result), "top_logprobs")?;
    match (wants, top) {
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, Some(n)) if n > 0 => Err(bad("`top_logprobs` needs `logprobs: true`")),
        (false, _) => Ok(None),
    }
}

impl ParsedRequest {
    /// The `max_tokens` to run: as asked, except that `echo` with `max_tokens` 0 runs one
    /// token that the answer leaves out (the prompt's last logits come with its prefill
    /// anyway; vLLM does the same).
    pub fn max_tokens_to_run(&self) -> Option<usize> {
        match self.max_tokens {
            Some(0) if self.echo => Some(1),
            n => n,
        }
    }

    /// `echo` with `max_tokens` 0: score the prompt, report no generated token.
    pub fn scores_only(&self) -> bool {
        self.echo && self.max_tokens == Some(0)
    }
}

/// Resolves `max_tokens` against the prompt: the default for a missing one (16 for
/// completions, the rest of the context for chat), and refusals for absurd values.
///
/// # Errors
/// [`RequestError::ContextOverflow`] when the prompt alone, or the prompt plus `max_tokens`,
/// exceed `max_model_len`.
pub fn resolve_max_tokens(
    requested: Option<usize>,
    chat: bool,
    prompt_len: usize,
    max_model_len: usize,
) -> Result<usize, RequestError> {
    let overflow = |completion: usize| RequestError::ContextOverflow {
        max: max_model_len,
        requested: prompt_len.saturating_add(completion),
        prompt: prompt_len,
        completion,
    };
    if prompt_len >= max_model_len {
        return Err(overflow(requested.unwrap_or(1)));
    }
    let n = match requested {
        Some(n) => n,
        None if chat => max_model_len - prompt_len,
        None => DEFAULT_COMPLETION_MAX_TOKENS.min(max_model_len - prompt_len),
    };
    // `prompt_len < max_model_len` here, so the subtraction cannot wrap (the sum could).
    if n > max_model_len - prompt_len {
        return Err(overflow(n));
    }
    Ok(n)
}

/// The OpenAI error body.
pub fn error_body(e: &RequestError) -> Value {
    error_json(&e.to_string(), e.kind(), e.status())
}

/// OpenAI's error object.
pub fn error_json(message: &str, kind: &str, code: u16) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// A request's token counts, as OpenAI's `usage` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Of the prompt tokens, those this instance took from its prefix cache (not computed).
    pub cached_tokens: usize,
}

/// A token as logprobs report it: its text alone (special tokens kept; a token holding part
/// of a UTF-8 character shows U+FFFD, as vLLM's) and the exact bytes it stands for
/// ([`pdserve_gpu::Tokenizer::token_bytes`]: the bytes of consecutive tokens join into the
/// answer's UTF-8).
pub fn token_text(tokenizer: &pdserve_gpu::Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id);
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t.to_string(),
        Err(_) => tokenizer.decode(&[id], false).unwrap_or_default(),
    };
    (text, bytes)
}

/// One entry of chat's `logprobs.content`, or of its `top_logprobs` (without theirs).
#[derive(serde::Serialize)]
struct ChatLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs: Option<Vec<ChatLogprob>>,
}

/// Chat's `logprobs` object of `tokens`: `{"content": [{token, logprob, bytes,
/// top_logprobs: [{token, logprob, bytes}]}]}`.
pub fn chat_logprobs(tokenizer: &pdserve_gpu::Tokenizer, tokens: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_text(tokenizer, id);
        ChatLogprob {
            token,
            logprob,
            bytes,
            top_logprobs: None,
        }
    };
    let content: Vec<ChatLogprob> = tokens
        .iter()
        .map(|t| ChatLogprob {
            top_logprobs: Some(t.top.iter().map(|a| entry(a.token, a.logprob)).collect()),
            ..entry(t.token, t.logprob)
        })
        .collect();
    json!({ "content": content })
}

/// Completions' `logprobs` object, `{tokens, token_logprobs, top_logprobs, text_offset}`, of
/// `tokens` (`(id, None)`: the prompt's first token, whose logprob is null). Each
/// `top_logprobs` entry maps the alternatives' texts (and the token's own, as vLLM) to their
/// logprobs. Text offsets count characters from `offset`, which moves past these tokens (a
/// stream passes the same counter to each chunk).
pub fn completion_logprobs(
    tokenizer: &pdserve_gpu::Tokenizer,
    tokens: &[(u32, Option<&TokenLogprobs>)],
    offset: &mut usize,
) -> Value {
    let mut texts = Vec::with_capacity(tokens.len());
    let mut token_logprobs = Vec::with_capacity(tokens.len());
    let mut tops = Vec::with_capacity(tokens.len());
    let mut offsets = Vec::with_capacity(tokens.len());
    for &(id, lp) in tokens {
        let text = token_text(tokenizer, id).0;
        offsets.push(*offset);
        *offset += text.chars().count();
        match lp {
            None => {
                token_logprobs.push(Value::Null);
                tops.push(Value::Null);
            }
            Some(lp) => {
                token_logprobs.push(json!(lp.logprob));
                let mut top = serde_json::Map::new();
                for a in &lp.top {
                    top.entry(token_text(tokenizer, a.token).0)
                        .or_insert(json!(a.logprob));
                }
                top.entry(text.clone()).or_insert(json!(lp.logprob));
                tops.push(Value::Object(top));
            }
        }
        texts.push(text);
    }
    json!({"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": tops,
           "text_offset": offsets})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str, chat: bool) -> String {
        parse_request(body.as_bytes(), chat)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn parses_prompts_and_sampling() {
        let r = parse_request(br#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0.5,"top_k":-1,"stop":"x","stream":true,"stream_options":{"include_usage":true}}"#, false).unwrap();
        assert_eq!(r.prompt, PromptInput::Text("hi".into()));
        assert_eq!(
            (
                r.max_tokens,
                r.params.temperature,
                r.params.top_k,
                r.stream,
                r.include_usage
            ),
            (Some(5), 0.5, None, true, true)
        );
        assert_eq!(r.params.stop, vec!["x".to_string()]);
        let r = parse_request(br#"{"prompt":[1,2,3]}"#, false).unwrap();
        assert_eq!(r.prompt, PromptInput::Tokens(vec![1, 2, 3]));
        let r = parse_request(br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#, true).unwrap();
        assert_eq!(
            r.prompt,
            PromptInput::Chat(vec![ChatMessage::new("user", "ab")])
        );
        let r = parse_request(br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"data:x"}},{"type":"image_url","image_url":"data:y"}]}]}"#, true).unwrap();
        assert_eq!(r.images, vec!["data:x".to_string(), "data:y".to_string()]);
        assert_eq!(
            r.prompt,
            PromptInput::Chat(vec![ChatMessage::new(
                "user",
                format!("a{IMAGE_MARKER}{IMAGE_MARKER}")
            )])
        );
    }

    #[test]
    fn bad_fields_are_named() {
        assert!(err("{not json", false).contains("invalid JSON"));
        assert!(err(r#"{"prompt":"x","max_tokens":-3}"#, false).contains("non-negative"));
        assert!(err(r#"{"prompt":"x","max_tokens":2.5}"#, false)
            .contains("`max_tokens` must be an integer"));
        assert!(err(r#"{"prompt":"x","temperature":7}"#, false).contains("temperature"));
        assert!(err(r#"{"prompt":"x","top_p":0}"#, false).contains("top_p"));
        assert!(err(r#"{"prompt":"x","n":17}"#, false).contains("`n` must be in [1, 16]"));
        assert!(err(r#"{"prompt":"x","n":0}"#, false).contains("`n`"));
        assert!(err(r#"{"prompt":"x","n":2,"best_of":3}"#, false).contains("`best_of`"));
        assert!(err(r#"{"prompt":"x","best_of":-1}"#, false).contains("`best_of`"));
        assert_eq!(
            parse_request(br#"{"prompt":"x","n":16}"#, false).unwrap().n,
            16
        );
        assert_eq!(
            parse_request(br#"{"prompt":"x","best_of":1}"#, false)
                .unwrap()
                .n,
            1
        );
        let r = parse_request(br#"{"prompt":["a","b","c"],"n":2}"#, false).unwrap();
        assert_eq!(r.prompt, PromptInput::Text("a".into()));
        assert_eq!(
            r.more_prompts,
            [PromptInput::Text("b".into()), PromptInput::Text("c".into())]
        );
        let r = parse_request(br#"{"prompt":[[1,2],[3]]}"#, false).unwrap();
        assert_eq!(r.more_prompts, [PromptInput::Tokens(vec![3])]);
        let r = parse_request(br#"{"prompt":["a",[1]]}"#, false).unwrap();
        assert_eq!(r.more_prompts, [PromptInput::Tokens(vec![1])]);
        assert!(err(r#"{"prompt":["a",3]}"#, false).contains("a list of prompts"));
        assert!(err(r#"{"prompt":["a","b","c","d","e"],"n":16}"#, false).contains("at most 64"));
        let many = format!(r#"{{"prompt":[{}"x"]}}"#, r#""x","#.repeat(64));
        assert!(err(&many, false).contains("at most 64 prompts"));
        assert!(err(r#"{"messages":[]}"#, true).contains("messages"));
        assert!(err(r#"{"messages":[{"role":"wizard","content":"x"}]}"#, true).contains("role"));
        assert!(err(r#"{"messages":[{"role":"user"}]}"#, true).contains("content"));
        assert!(err(r#"{"max_tokens":3}"#, false).contains("`prompt` is required"));
    }

    #[test]
    fn logit_bias_is_read_sorted_and_bounded() {
        let r =
            parse_request(br#"{"prompt":"a","logit_bias":{"17":100,"3":-2.5}}"#, false).unwrap();
        assert_eq!(
            r.params.logit_bias,
            [
                LogitBias {
                    token: 3,
                    bias: -2.5
                },
                LogitBias {
                    token: 17,
                    bias: 100.0
                }
            ]
        );
        let many: serde_json::Map<String, Value> =
            (0..301).map(|i| (i.to_string(), json!(1))).collect();
        let many = json!({"prompt": "a", "logit_bias": many}).to_string();
        for (body, needle) in [
            (r#"{"prompt":"a","logit_bias":[1]}"#, "must be an object"),
            (r#"{"prompt":"a","logit_bias":{"x":1}}"#, "not a token id"),
            (r#"{"prompt":"a","logit_bias":{"-1":1}}"#, "not a token id"),
            (r#"{"prompt":"a","logit_bias":{"1":101}}"#, "[-100, 100]"),
            (r#"{"prompt":"a","logit_bias":{"1":"5"}}"#, "[-100, 100]"),
            (r#"{"prompt":"a","logit_bias":{"1":1,"01":2}}"#, "twice"),
            (many.as_str(), "at most 300"),
        ] {
            let e = err(body, false);
            assert!(
                e.contains("`logit_bias`") && e.contains(needle),
                "{body}: {e}"
            );
        }
    }

    #[test]
    fn logprobs_fields_are_read_and_bounded() {
        let chat = |b: &str| parse_request(b.as_bytes(), true);
        let msgs = r#""messages":[{"role":"user","content":"x"}]"#;
        let r = chat(&format!(r#"{{{msgs},"logprobs":true,"top_logprobs":5}}"#)).unwrap();
        assert_eq!(
            (r.params.logprobs, r.params.prompt_logprobs),
            (Some(5), None)
        );
        let r = chat(&format!(r#"{{{msgs},"logprobs":true}}"#)).unwrap();
        assert_eq!(r.params.logprobs, Some(0));
        let r = chat(&format!(r#"{{{msgs},"logprobs":false,"top_logprobs":0}}"#)).unwrap();
        assert_eq!(r.params.logprobs, None);
        for (body, needle) in [
            (
                r#""logprobs":true,"top_logprobs":21"#,
                "`top_logprobs` must be in [0, 20]",
            ),
            (
                r#""logprobs":true,"top_logprobs":-1"#,
                "`top_logprobs` must be a non-negative",
            ),
            (
                r#""top_logprobs":3"#,
                "`top_logprobs` needs `logprobs: true`",
            ),
            (r#""logprobs":3"#, "`logprobs` must be a boolean"),
            (r#""echo":true"#, "`echo` is not supported on chat"),
            (r#""max_tokens":0"#, "`max_tokens` must be at least 1"),
        ] {
            let e = chat(&format!("{{{msgs},{body}}}")).unwrap_err().to_string();
            assert!(e.contains(needle), "{body}: {e}");
        }
        let r = parse_request(
            br#"{"prompt":"a b","echo":true,"max_tokens":0,"logprobs":1}"#,
            false,
        )
        .unwrap();
        assert!(r.echo && r.scores_only());
        assert_eq!(
            (r.params.logprobs, r.params.prompt_logprobs),
            (Some(1), Some(1))
        );
        assert_eq!(r.max_tokens_to_run(), Some(1));
        let r = parse_request(br#"{"prompt":"a","logprobs":20}"#, false).unwrap();
        assert_eq!(
            (r.params.logprobs, r.params.prompt_logprobs),
            (Some(20), None)
        );
        for (body, needle) in [
            (
                r#"{"prompt":"a","logprobs":21}"#,
                "`logprobs` must be in [0, 20]",
            ),
            (
                r#"{"prompt":"a","logprobs":-2}"#,
                "`logprobs` must be a non-negative",
            ),
            (
                r#"{"prompt":"a","logprobs":true}"#,
                "`logprobs` must be an integer",
            ),
            (r#"{"prompt":"a","max_tokens":0}"#, "0 only with `echo`"),
        ] {
            assert!(
                err(body, false).contains(needle),
                "{body}: {}",
                err(body, false)
            );
        }
    }

    #[test]
    fn max_tokens_defaults_and_limits() {
        assert_eq!(resolve_max_tokens(None, false, 10, 100).unwrap(), 16);
        assert_eq!(resolve_max_tokens(None, true, 10, 100).unwrap(), 90);
        assert!(matches!(
            resolve_max_tokens(Some(91), false, 10, 100),
            Err(RequestError::ContextOverflow { requested: 101, .. })
        ));
        assert!(matches!(
            resolve_max_tokens(Some(1), false, 100, 100),
            Err(RequestError::ContextOverflow { .. })
        ));
        assert!(matches!(
            resolve_max_tokens(Some(usize::MAX / 2), false, 1, 100),
            Err(RequestError::ContextOverflow { .. })
        ));
        // Values whose sum with the prompt wraps (u64::MAX and u64::MAX - 3 from a client).
        for n in [usize::MAX, usize::MAX - 3] {
            match resolve_max_tokens(Some(n), false, 5, 8192) {
                Err(RequestError::ContextOverflow {
                    requested,
                    completion,
                    ..
                }) => {
                    assert_eq!(completion, n);
                    assert_eq!(requested, usize::MAX, "the message saturates, never wraps");
                }
                other => panic!("max_tokens {n} was not refused: {other:?}"),
            }
        }
    }
}

/// Where a peer instance is, as `kv_transfer_params` name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRef {
    /// Its HTTP API, `http://remote_host:remote_port`.
    pub url: String,
    /// Its control-plane address (`remote_control_addr`, pdserve's extension), when given.
    pub control: Option<std::net::SocketAddr>,
    /// Its engine id (`remote_engine_id`), when given: the node name it must prove on the
    /// control plane.
    pub engine_id: Option<String>,
}

/// What a request's `kv_transfer_params` ask for (vLLM's field names).
#[derive(Debug, Clone, PartialEq)]
pub enum KvDirective {
    /// A plain request.
    None,
    /// `do_remote_decode`: prefill here, keep the prompt's KV for a decode instance.
    HoldForDecode(pdserve_runtime::ids::TransferId),
    /// `do_remote_prefill` with `remote_block_ids`: the prompt's KV is held by a prefill
    /// instance (vLLM's two-hop flow); read it, then decode.
    FromPrefill {
        /// The prefill instance.
        peer: PeerRef,
        /// The hand-off.
        transfer: pdserve_runtime::ids::TransferId,
        /// Its blocks holding the prompt (`remote_block_ids`).
        block_ids: Vec<u32>,
        /// The first token it sampled (`first_token_id`).
        first_token: u32,
        /// Its logprobs (`first_token_logprobs`), when it computed them: at most
        /// [`MAX_LOGPROBS`] alternatives, finite values ≤ 0, for `first_token` (the ids are
        /// checked against the vocabulary where it is known).
        first_logprobs: Option<TokenLogprobs>,
        /// How long it holds the blocks unless renewed (`kv_lease_ms`), when it said.
        lease: Option<std::time::Duration>,
        /// Leading prompt tokens it took from its prefix cache (`cached_tokens`, pdserve's
        /// extension; 0 when absent); checked below the prompt's length where that is known.
        cached_tokens: u32,
    },
    /// `do_remote_prefill` without `remote_block_ids`: ask the prefill instance to run the
    /// prompt and hand its KV over (pdserve's one-hop flow; push or pull by the decode
    /// instance's `transfer.mode`).
    DriveRemote {
        /// The prefill instance.
        peer: PeerRef,
        /// The hand-off.
        transfer: pdserve_runtime::ids::TransferId,
    },
}

/// A DNS name, an IPv4 address or a bracketed IPv6 address — nothing that could change the
/// meaning of the URL it is put into (`/`, `?`, `#`, `@`, `:` outside brackets).
fn is_host(host: &str) -> bool {
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().is_ok();
    }
    !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
}

/// `kv_transfer_params` as serde reads them, each field in its shape or as sent (see
/// [`kv_directive`] for what they mean).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawKvParams {
    transfer_id: Option<Lenient<String>>,
    do_remote_decode: Option<Lenient<bool>>,
    do_remote_prefill: Option<Lenient<bool>>,
    remote_host: Option<Lenient<String>>,
    remote_port: Option<Lenient<u64>>,
    remote_control_addr: Option<Lenient<String>>,
    remote_engine_id: Option<Lenient<String>>,
    remote_block_ids: Option<Lenient<Vec<u32>>>,
    first_token_id: Option<Lenient<u32>>,
    /// Read as [`TokenLogprobs`], whose serde message the refusal quotes.
    first_token_logprobs: Option<Value>,
    kv_lease_ms: Option<Lenient<u64>>,
    cached_tokens: Option<Lenient<u32>>,
}

/// Reads `kv_transfer_params` (vLLM's field names plus pdserve's `transfer_id`,
/// `first_token_id`, `kv_lease_ms` and `remote_control_addr`). The prefill peer is reached at
/// `scheme://remote_host:remote_port` (`scheme`: this instance's own, `http` or `https`).
///
/// # Errors
/// [`RequestError::BadRequest`] naming the first malformed field.
pub fn kv_directive(params: Option<&Value>, scheme: &str) -> Result<KvDirective, RequestError> {
    use pdserve_runtime::ids::TransferId;
    let Some(p) = params else {
        return Ok(KvDirective::None);
    };
    if !p.is_object() {
        return Err(bad("`kv_transfer_params` must be an object"));
    }
    let p = RawKvParams::deserialize(p).map_err(|e| bad(format!("`kv_transfer_params`: {e}")))?;
    let transfer_id = match p.transfer_id.map(Lenient::into_result) {
        None => None,
        Some(Ok(s)) => Some(
            s.parse::<TransferId>()
                .map_err(|e| bad(format!("`kv_transfer_params.transfer_id`: {e}")))?,
        ),
        Some(Err(_)) => return Err(bad("`kv_transfer_params.transfer_id` must be a string")),
    };
    if opt_bool(p.do_remote_decode, "do_remote_decode")? {
        return Ok(KvDirective::HoldForDecode(
            transfer_id.unwrap_or_else(TransferId::new_random),
        ));
    }
    if !opt_bool(p.do_remote_prefill, "do_remote_prefill")? {
        return Ok(KvDirective::None);
    }
    let field = |k: &str| format!("`kv_transfer_params.{k}`");
    let host = p
        .remote_host
        .and_then(Lenient::ok)
        .ok_or_else(|| bad(format!("{} must be a string", field("remote_host"))))?;
    let port = p
        .remote_port
        .and_then(Lenient::ok)
        .filter(|&n| n > 0 && n <= 65535)
        .ok_or_else(|| bad(format!("{} must be a port number", field("remote_port"))))?;
    let host = match host.parse::<std::net::Ipv6Addr>() {
        Ok(v6) => format!("[{v6}]"),
        Err(_) if is_host(&host) => host,
        Err(_) => {
            return Err(bad(format!(
                "{} is not a host name or an IP address",
                field("remote_host")
            )))
        }
    };
    let control = match p.remote_control_addr {
        None => None,
        Some(v) => Some(
            v.ok()
                .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
                .ok_or_else(|| bad(format!("{} must be IP:port", field("remote_control_addr"))))?,
        ),
    };
    let engine_id = match p.remote_engine_id {
        None => None,
        Some(Lenient::Ok(s)) if !s.is_empty() => Some(s),
        Some(_) => {
            return Err(bad(format!(
                "{} must be a non-empty string",
                field("remote_engine_id")
            )))
        }
    };
    let peer = PeerRef {
        url: format!("{scheme}://{host}:{port}"),
        control,
        engine_id,
    };
    let Some(block_ids) = p.remote_block_ids else {
        return Ok(KvDirective::DriveRemote {
            peer,
            transfer: transfer_id.unwrap_or_else(TransferId::new_random),
        });
    };
    let block_ids = block_ids.ok().ok_or_else(|| {
        bad(format!(
            "{} must be a list of block ids",
            field("remote_block_ids")
        ))
    })?;
    let first_token = p
        .first_token_id
        .and_then(Lenient::ok)
        .ok_or_else(|| bad(format!("{} must be a token id", field("first_token_id"))))?;
    let transfer = transfer_id.ok_or_else(|| {
        bad(format!(
            "{} is required with do_remote_prefill",
            field("transfer_id")
        ))
    })?;
    let first_logprobs = match p.first_token_logprobs {
        None => None,
        Some(v) => {
            let what = field("first_token_logprobs");
            let lp: TokenLogprobs = serde_json::from_value(v).map_err(|e| {
                bad(format!(
                    "{what} must be {{\"token\", \"logprob\", \"top\": [{{\"token\", \"logprob\"}}]}}: {e}"
                ))
            })?;
            lp.validate(usize::MAX, MAX_LOGPROBS as usize)
                .map_err(|e| bad(format!("{what}: {e}")))?;
            if lp.token != first_token {
                return Err(bad(format!(
                    "{what} are for token {}, not first_token_id {first_token}",
                    lp.token
                )));
            }
            Some(lp)
        }
    };
    let lease = match p.kv_lease_ms {
        None => None,
        Some(v) => Some(std::time::Duration::from_millis(v.ok().ok_or_else(
            || {
                bad(format!(
                    "{} must be a number of milliseconds",
                    field("kv_lease_ms")
                ))
            },
        )?)),
    };
    let cached_tokens = match p.cached_tokens {
        None => 0,
        Some(v) => v.ok().ok_or_else(|| {
            bad(format!(
                "{} must be a count of tokens",
                field("cached_tokens")
            ))
        })?,
    };
    Ok(KvDirective::FromPrefill {
        peer,
        transfer,
        block_ids,
        first_token,
        first_logprobs,
        lease,
        cached_tokens,
    })
}

#[cfg(test)]
mod kv_params_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn vllm_fields_and_our_extensions_are_read() {
        let params = json!({
            "do_remote_prefill": true, "remote_host": "10.0.0.1", "remote_port": 8100,
            "remote_engine_id": "prefill-0", "remote_control_addr": "10.0.0.1:7100",
            "transfer_id": "000000000000000000000000000000ab"
        });
        let d = kv_directive(Some(&params), "http").unwrap();
        let KvDirective::DriveRemote { peer, transfer } = d else {
            panic!("{d:?}")
        };
        assert_eq!(peer.url, "http://10.0.0.1:8100");
        // An instance serving HTTPS reaches its peers over HTTPS.
        let KvDirective::DriveRemote { peer: tls_peer, .. } =
            kv_directive(Some(&params), "https").unwrap()
        else {
            panic!("not a remote prefill")
        };
        assert_eq!(tls_peer.url, "https://10.0.0.1:8100");
        // An IPv6 address, bare (as a prefill instance's two-hop answer writes it) or in
        // brackets, is put into the URL in brackets.
        for v6 in ["::1", "[::1]"] {
            let mut p = params.clone();
            p["remote_host"] = json!(v6);
            let KvDirective::DriveRemote { peer, .. } = kv_directive(Some(&p), "http").unwrap()
            else {
                panic!("not a remote prefill")
            };
            assert_eq!(peer.url, "http://[::1]:8100");
        }
        assert_eq!(peer.control, Some("10.0.0.1:7100".parse().unwrap()));
        assert_eq!(peer.engine_id.as_deref(), Some("prefill-0"));
        assert_eq!(transfer.0, 0xab);
        for (params, needle) in [
            (
                json!({"do_remote_prefill": true, "remote_port": 1}),
                "remote_host",
            ),
            (
                json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 70000}),
                "remote_port",
            ),
            // Nothing that changes the URL the host is put into.
            (
                json!({"do_remote_prefill": true, "remote_host": "evil@h", "remote_port": 1}),
                "remote_host",
            ),
            (
                json!({"do_remote_prefill": true, "remote_host": "h/x?", "remote_port": 1}),
                "remote_host",
            ),
            (
                json!({"do_remote_prefill": true, "remote_host": "h:99#", "remote_port": 1}),
                "remote_host",
            ),
            (
                json!({"do_remote_prefill": true, "remote_host": "[h]", "remote_port": 1}),
                "remote_host",
            ),
            (
                json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_control_addr": "x"}),
                "remote_control_addr",
            ),
            (
                json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_block_ids": [1]}),
                "first_token_id",
            ),
            (
                json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_block_ids": [1],
                       "first_token_id": 1, "transfer_id": "1", "cached_tokens": -1}),
                "cached_tokens",
            ),
            (
                json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_block_ids": [1],
                       "first_token_id": 1, "transfer_id": "1", "cached_tokens": 1u64 << 40}),
                "cached_tokens",
            ),
        ] {
            let e = kv_directive(Some(&params), "http").unwrap_err();
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
    }
}

/// The `kv_transfer_params` pdserve writes: the proxy's one-hop request to a decode instance
/// (no block ids: the decode instance drives the hand-off), and a prefill instance's answer in
/// vLLM's two-hop flow (held block ids, T0, lease). vLLM's field names plus pdserve's
/// `transfer_id`, `first_token_id`, `kv_lease_ms`, `remote_control_addr` and `cached_tokens`;
/// [`kv_directive`] reads them back.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KvTransferParams {
    /// Decode asks no remote decode.
    pub do_remote_decode: bool,
    /// The prompt's KV comes from a prefill instance.
    pub do_remote_prefill: bool,
    /// The prefill instance's host.
    pub remote_host: Option<String>,
    /// Its HTTP port.
    pub remote_port: Option<u16>,
    /// Its engine id (node name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// Its control-plane address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_control_addr: Option<String>,
    /// The blocks it holds (two-hop flow).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<Vec<u32>>,
    /// The hand-off id.
    pub transfer_id: String,
    /// T0 (two-hop flow).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_token_id: Option<u32>,
    /// T0's logprobs, when the request asked for them (two-hop flow).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_token_logprobs: Option<TokenLogprobs>,
    /// How long the blocks are held unless renewed (two-hop flow).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_lease_ms: Option<u64>,
    /// Leading prompt tokens the prefill instance took from its prefix cache (two-hop flow;
    /// pdserve's extension): the decode instance reports the larger of this and its own reuse
    /// as `usage.prompt_tokens_details.cached_tokens`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
}
