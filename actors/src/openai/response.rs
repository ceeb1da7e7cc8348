//! The OpenAI shapes pdserve answers with, typed and written by serde: a whole answer or a
//! stream chunk of `/v1/completions` and `/v1/chat/completions`, the `usage` object, chat's
//! messages and deltas (tool calls included). Built by the HTTP layer
//! (`http/openai_api.rs`), never patched as JSON.

use super::{KvTransferParams, Usage};
use serde::Serialize;
use serde_json::Value;

/// `object` of a completions answer or chunk.
pub const TEXT_COMPLETION: &str = "text_completion";
/// `object` of a whole chat answer.
pub const CHAT_COMPLETION: &str = "chat.completion";
/// `object` of a chat stream chunk.
pub const CHAT_CHUNK: &str = "chat.completion.chunk";

/// One answer, or one stream chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Answer {
    /// `cmpl-…` / `chatcmpl-…`, the same in every chunk of a stream.
    pub id: String,
    /// [`TEXT_COMPLETION`], [`CHAT_COMPLETION`] or [`CHAT_CHUNK`].
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model's served name.
    pub model: String,
    /// The choices (none in a stream's usage chunk).
    pub choices: Vec<Choice>,
    /// Token counts: whole answers and a stream's usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
    /// A prefill instance's hand-off of the prompt's KV (vLLM's two-hop flow).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// One choice of an answer or chunk: `text` (completions), `message` (a whole chat answer)
/// or `delta` (a chat chunk).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Choice {
    /// Its index (prompt-major, `n` per prompt).
    pub index: usize,
    /// Completions' text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// A whole chat answer's message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
    /// A chat chunk's delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
    /// The logprobs object (chat's or completions'), `null` when not asked for.
    pub logprobs: Option<Value>,
    /// Why the choice ended; `null` until its last chunk.
    pub finish_reason: Option<&'static str>,
    /// The generated token ids (`return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// The prompt's token ids (`return_token_ids`, whole answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

impl Choice {
    fn new(index: usize) -> Self {
        Self {
            index,
            text: None,
            message: None,
            delta: None,
            logprobs: None,
            finish_reason: None,
            token_ids: None,
            prompt_token_ids: None,
        }
    }

    /// A completions choice of `text`.
    pub fn text(index: usize, text: impl Into<String>) -> Self {
        Self {
            text: Some(text.into()),
            ..Self::new(index)
        }
    }

    /// A whole chat answer's choice.
    pub fn message(index: usize, message: Message) -> Self {
        Self {
            message: Some(message),
            ..Self::new(index)
        }
    }

    /// A chat chunk's choice.
    pub fn delta(index: usize, delta: Delta) -> Self {
        Self {
            delta: Some(delta),
            ..Self::new(index)
        }
    }
}

/// A whole chat answer's message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    /// Always `assistant`.
    pub role: &'static str,
    /// The text; `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// The calls the model made (requests with tools).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

impl Message {
    /// The assistant's message of `content`, with `tool_calls` when it made any.
    pub fn assistant(content: Option<String>, tool_calls: Option<Vec<ToolCall>>) -> Self {
        Self {
            role: "assistant",
            content,
            tool_calls,
        }
    }
}

/// A chat chunk's delta: what the choice adds. Each field is absent when it adds nothing;
/// `content` is `null` in a first delta that opens the choice with a tool call.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Delta {
    /// `assistant` in the choice's first delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// Text (`Some(None)`: written as `null`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<Option<String>>,
    /// A call's start or a run of its arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

impl Delta {
    /// A delta of text.
    pub fn content(text: impl Into<String>) -> Self {
        Self {
            content: Some(Some(text.into())),
            ..Self::default()
        }
    }

    /// This delta as the choice's first: the role, and `content: null` when it has none.
    pub fn opening(mut self) -> Self {
        self.role = Some("assistant");
        self.content.get_or_insert(None);
        self
    }
}

/// One call of a whole chat answer (OpenAI's `tool_calls[]`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    /// The call's id.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments (a JSON text).
    pub function: FunctionCall,
}

/// A called function.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments, a JSON text.
    pub arguments: String,
}

/// A streamed piece of a call: its start (`id`, `type`, the function's name, empty
/// arguments) or a run of its arguments (`index` and `function.arguments` only).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// Which call of the choice.
    pub index: usize,
    /// The call's id (its start).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function` (its start).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The function's name (its start) and arguments text.
    pub function: FunctionDelta,
}

/// A streamed piece of a called function.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionDelta {
    /// Its name (the call's start).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Arguments text added.
    pub arguments: String,
}

/// OpenAI's `usage` object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UsageBody {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// What of the prompt came from the prefix cache.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens taken from the prefix cache.
    pub cached_tokens: usize,
}

impl From<Usage> for UsageBody {
    fn from(u: Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

impl From<UsageBody> for Usage {
    fn from(u: UsageBody) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.prompt_tokens_details.cached_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn answers_and_chunks_write_openais_shapes() {
        let usage = Usage {
            prompt_tokens: 5,
            completion_tokens: 3,
            cached_tokens: 2,
        };
        let mut choice = Choice::text(0, "hi");
        choice.finish_reason = Some("stop");
        let answer = Answer {
            id: "cmpl-1".into(),
            object: TEXT_COMPLETION,
            created: 7,
            model: "m".into(),
            choices: vec![choice],
            usage: Some(usage.into()),
            kv_transfer_params: None,
        };
        assert_eq!(
            serde_json::to_value(&answer).unwrap(),
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "text": "hi", "logprobs": null, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 2}}})
        );
        // A chat chunk opening with a call: role, null content, the call's start.
        let start = ToolCallDelta {
            index: 0,
            id: Some("call_1".into()),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some("f".into()),
                arguments: String::new(),
            },
        };
        let delta = Delta {
            tool_calls: Some(vec![start]),
            ..Delta::default()
        }
        .opening();
        assert_eq!(
            serde_json::to_value(Choice::delta(1, delta)).unwrap(),
            json!({"index": 1, "delta": {"role": "assistant", "content": null, "tool_calls": [
                       {"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": ""}}]},
                   "logprobs": null, "finish_reason": null})
        );
        // A finishing delta adds nothing; text opening keeps its text.
        assert_eq!(serde_json::to_value(Delta::default()).unwrap(), json!({}));
        assert_eq!(
            serde_json::to_value(Delta::content("x").opening()).unwrap(),
            json!({"role": "assistant", "content": "x"})
        );
        // A message of calls only has a null content.
        let call = ToolCall {
            id: "call_2".into(),
            kind: "function",
            function: FunctionCall {
                name: "g".into(),
                arguments: "{}".into(),
            },
        };
        assert_eq!(
            serde_json::to_value(Message::assistant(None, Some(vec![call]))).unwrap(),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]})
        );
        assert_eq!(Usage::from(UsageBody::from(usage)), usage);
    }
}
