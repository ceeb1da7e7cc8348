//! Tool calling on chat completions (`tools`, `tool_choice`), as pure functions: the tools
//! are read and bounded, described to the model in a system prompt, forced through the
//! structured-output engine when the request asks (`required`, a named function), and the
//! model's calls are parsed out of its text into OpenAI's `tool_calls` — as the text is
//! generated ([`CallParser`], in `stream`), so a streamed answer sends each call's arguments
//! piece by piece, and a whole answer is read by the same parser fed at once.
//!
//! The prompt format is the generic Hermes one (Qwen2.5, Hermes-2-Pro and others use it; the
//! default model's ChatML template has no tool support of its own, so pdserve never depends on
//! a template's tool handling): the tools are listed as JSON inside `<tools></tools>` in the
//! system message, a call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//! an assistant message of the history with `tool_calls` is rendered as those blocks, and a
//! `tool` message's content is wrapped in `<tool_response></tool_response>`.

use crate::error::RequestError;
use crate::json_field::{present, Lenient, Object};
use pdserve_gpu::grammar::{GrammarSpec, MAX_GRAMMAR_BYTES};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Map, Value};

mod stream;
pub use stream::{CallEvent, CallParser, MAX_HEADER, MAX_HELD_WHITESPACE};

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 128;
/// Longest function name (OpenAI's bound).
pub const MAX_TOOL_NAME: usize = 64;

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

fn bad(msg: impl Into<String>) -> RequestError {
    RequestError::BadRequest(msg.into())
}

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// Its name (`[A-Za-z0-9_-]`, 1..=64 characters).
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// The JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model answers with text; the tools are not shown to it.
    None,
    /// The model decides; a call it writes is parsed.
    Auto,
    /// The answer is exactly one call of one of the tools (forced by a grammar).
    Required,
    /// The answer is exactly one call of this function (forced by a grammar).
    Named(String),
}

/// The tools of a request and how they may be used.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The declared functions.
    pub tools: Vec<Tool>,
    /// `tool_choice` (default `auto`).
    pub choice: ToolChoice,
}

/// One call the model made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text (OpenAI's `function.arguments`): the object's text as the
    /// model wrote it.
    pub arguments: String,
}

impl ToolCall {
    /// OpenAI's `tool_calls[]` entry of a whole answer.
    pub fn to_openai(&self, id: &str) -> crate::openai::response::ToolCall {
        crate::openai::response::ToolCall {
            id: id.to_string(),
            kind: "function",
            function: crate::openai::response::FunctionCall {
                name: self.name.clone(),
                arguments: self.arguments.clone(),
            },
        }
    }
}

fn valid_name(name: &str) -> bool {
    (1..=MAX_TOOL_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A chat request's `tools` and `tool_choice` as serde reads them, each in its shape or as
/// sent, for [`parse`] to refuse by name.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ToolFields {
    /// The declared tools; each read as [`RawTool`] after the list's size is checked.
    tools: Option<Lenient<Vec<Value>>>,
    tool_choice: Option<RawChoice>,
}

/// One entry of `tools`: `{"type": "function", "function": {...}}`.
#[derive(Debug, Deserialize)]
struct RawTool {
    #[serde(rename = "type")]
    kind: Option<Lenient<String>>,
    #[serde(default, deserialize_with = "present")]
    function: Option<Lenient<Object<RawFunction>>>,
}

/// A declared function.
#[derive(Debug, Deserialize)]
struct RawFunction {
    name: Option<Lenient<String>>,
    description: Option<Lenient<String>>,
    /// Its arguments' JSON schema, passed through untouched.
    parameters: Option<Lenient<Map<String, Value>>>,
}

/// `tool_choice`: `none` / `auto` / `required`, or a named function.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawChoice {
    Mode(String),
    Function(Object<NamedChoice>),
    Other(IgnoredAny),
}

/// `{"type": "function", "function": {"name": ...}}`.
#[derive(Debug, Deserialize)]
struct NamedChoice {
    #[serde(rename = "type")]
    kind: Option<Lenient<String>>,
    function: Option<Lenient<Object<NamedFunction>>>,
}

#[derive(Debug, Deserialize)]
struct NamedFunction {
    name: Option<Lenient<String>>,
}

/// Reads `tools` and `tool_choice` of a chat request: `None` without tools (a `tool_choice`
/// other than `none` then is a 400).
///
/// # Errors
/// [`RequestError::BadRequest`] naming the field: a tool that is not `{"type": "function",
/// "function": {"name", "description"?, "parameters"?}}`, a bad or repeated name, more than
/// [`MAX_TOOLS`] tools or more than [`MAX_GRAMMAR_BYTES`] of them, a `tool_choice` that is
/// not `none`/`auto`/`required`/a declared function.
pub fn parse(v: &Value) -> Result<Option<Tools>, RequestError> {
    let fields = ToolFields::deserialize(v).map_err(|e| bad(format!("the request body: {e}")))?;
    let list = match fields.tools.map(Lenient::into_result) {
        None => None,
        Some(Ok(list)) => Some(list),
        Some(Err(_)) => return Err(bad("`tools` must be a list")),
    };
    let choice = match fields.tool_choice {
        None => None,
        Some(RawChoice::Mode(s)) => Some(match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "`tool_choice` `{other}` is not one of none, auto, required"
                )))
            }
        }),
        Some(RawChoice::Function(Object(c))) => match (c.kind, c.function) {
            (
                Some(Lenient::Ok(kind)),
                Some(Lenient::Ok(Object(NamedFunction {
                    name: Some(Lenient::Ok(name)),
                }))),
            ) if kind == "function" => Some(ToolChoice::Named(name)),
            _ => return Err(bad("`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")),
        },
        Some(RawChoice::Other(_)) => return Err(bad("`tool_choice` must be a string or an object")),
    };
    let Some(list) = list.filter(|l| !l.is_empty()) else {
        return match choice {
            None | Some(ToolChoice::None) => Ok(None),
            Some(_) => Err(bad("`tool_choice` needs `tools`")),
        };
    };
    if list.len() > MAX_TOOLS {
        return Err(bad(format!(
            "`tools` holds at most {MAX_TOOLS} functions, got {}",
            list.len()
        )));
    }
    let size = serde_json::to_string(&list).map_or(usize::MAX, |s| s.len());
    if size > MAX_GRAMMAR_BYTES {
        return Err(bad(format!(
            "`tools` is {size} bytes, more than the {MAX_GRAMMAR_BYTES} allowed"
        )));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let f = match Lenient::<Object<RawTool>>::deserialize(t).ok() {
            Some(Lenient::Ok(Object(RawTool {
                kind: Some(Lenient::Ok(kind)),
                function: Some(f),
            }))) if kind == "function" => f.ok(),
            _ => {
                return Err(bad(format!(
                    "`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{...}}}}"
                )))
            }
        };
        let name_error = || {
            bad(format!("`tools[{i}].function.name` must be 1 to {MAX_TOOL_NAME} characters of a-z, A-Z, 0-9, _ and -"))
        };
        let Some(Object(f)) = f else {
            return Err(name_error());
        };
        let name = f
            .name
            .and_then(Lenient::ok)
            .filter(|n| valid_name(n))
            .ok_or_else(name_error)?;
        if tools.iter().any(|t| t.name == name) {
            return Err(bad(format!("`tools` declares `{name}` twice")));
        }
        let description = match f.description.map(Lenient::into_result) {
            None => None,
            Some(Ok(d)) => Some(d),
            Some(Err(_)) => {
                return Err(bad(format!(
                    "`tools[{i}].function.description` must be a string"
                )))
            }
        };
        let parameters = match f.parameters.map(Lenient::into_result) {
            None => json!({"type": "object", "properties": {}}),
            Some(Ok(p)) => Value::Object(p),
            Some(Err(_)) => {
                return Err(bad(format!(
                    "`tools[{i}].function.parameters` must be a JSON schema object"
                )))
            }
        };
        tools.push(Tool {
            name,
            description,
            parameters,
        });
    }
    let choice = choice.unwrap_or(ToolChoice::Auto);
    if let ToolChoice::Named(name) = &choice {
        if !tools.iter().any(|t| &t.name == name) {
            return Err(bad(format!(
                "`tool_choice` names `{name}`, which `tools` does not declare"
            )));
        }
    }
    Ok(Some(Tools { tools, choice }))
}

impl Tools {
    /// Whether the model sees the tools and its calls are parsed (`tool_choice` not `none`).
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The system prompt block that describes the tools to the model (Hermes format).
    pub fn system_prompt(&self) -> String {
        let mut out = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        // Fields in the order the model has always seen them (sorted, as `json!` wrote).
        #[derive(serde::Serialize)]
        struct Function<'a> {
            #[serde(skip_serializing_if = "Option::is_none")]
            description: Option<&'a str>,
            name: &'a str,
            parameters: &'a Value,
        }
        #[derive(serde::Serialize)]
        struct Declared<'a> {
            function: Function<'a>,
            #[serde(rename = "type")]
            kind: &'static str,
        }
        for t in &self.tools {
            let declared = Declared {
                function: Function {
                    description: t.description.as_deref(),
                    name: &t.name,
                    parameters: &t.parameters,
                },
                kind: "function",
            };
            out.push('\n');
            out.push_str(&serde_json::to_string(&declared).unwrap_or_default());
        }
        out.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        out
    }

    /// The grammar that forces one call (`required`: of any tool; named: of that one), as
    /// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` with the arguments valid
    /// against the tool's parameters; `None` for `auto` and `none`.
    pub fn grammar(&self) -> Option<GrammarSpec> {
        let call = |t: &Tool| {
            json!({"type": "object",
                   "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                   "required": ["name", "arguments"], "additionalProperties": false})
        };
        let schema = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => {
                json!({"anyOf": self.tools.iter().map(call).collect::<Vec<_>>()})
            }
            ToolChoice::Named(name) => call(self.tools.iter().find(|t| &t.name == name)?),
        };
        let mut schema = schema;
        schema["x-guidance"] =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        Some(GrammarSpec::Lark(format!(
            "start: \"{}\\n\" call \"\\n{}\"\ncall: %json {}\n",
            CALL_OPEN, CALL_CLOSE, schema
        )))
    }
}

/// An assistant message's `tool_calls` of the request's history, as the text the model would
/// have written (Hermes `<tool_call>` blocks).
///
/// # Errors
/// [`RequestError::BadRequest`] naming `messages[i].tool_calls` when a call is not
/// `{"type": "function", "function": {"name", "arguments"}}` (arguments a JSON string).
pub fn render_calls(calls: &Value, i: usize) -> Result<String, RequestError> {
    let what = || {
        bad(format!("`messages[{i}].tool_calls` must be a list of {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"))
    };
    let list = Vec::<Lenient<Object<HistoryCall>>>::deserialize(calls).map_err(|_| what())?;
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        let Some(Object(HistoryCall {
            function: Some(Lenient::Ok(Object(f))),
        })) = c.ok()
        else {
            return Err(what());
        };
        let name = f.name.and_then(Lenient::ok).ok_or_else(what)?;
        let arguments = match f.arguments {
            Some(Arguments::Text(s)) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
            Some(Arguments::Object(m)) => Value::Object(m),
            _ => return Err(what()),
        };
        out.push(format!(
            "{CALL_OPEN}\n{}\n{CALL_CLOSE}",
            json!({"name": name, "arguments": arguments})
        ));
    }
    Ok(out.join("\n"))
}

/// One call of an assistant message in the history.
#[derive(Debug, Deserialize)]
struct HistoryCall {
    function: Option<Lenient<Object<HistoryFunction>>>,
}

#[derive(Debug, Deserialize)]
struct HistoryFunction {
    name: Option<Lenient<String>>,
    arguments: Option<Arguments>,
}

/// A call's `arguments`: OpenAI's JSON text, or the object some clients send.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Arguments {
    Text(String),
    Object(Map<String, Value>),
    Other(IgnoredAny),
}

/// A `tool` message's content as the model sees it.
pub fn render_response(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// The calls in a model's answer, read as a streamed answer reads them ([`CallParser`] fed the
/// whole text): the content before the first call (`None` when empty) and each call, its
/// `arguments` the object's text as the model wrote it. `None` when no call starts (the answer
/// is then plain content). See [`CallParser`] for blocks that are not calls and unfinished calls.
pub fn parse_calls(text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    let (events, calls) = stream::parse_all(text);
    if calls == 0 {
        return None;
    }
    let mut content = String::new();
    let mut out: Vec<ToolCall> = Vec::with_capacity(calls);
    for e in events {
        match e {
            CallEvent::Content(t) => content.push_str(&t),
            CallEvent::CallStart { name, .. } => out.push(ToolCall {
                name,
                arguments: String::new(),
            }),
            CallEvent::ArgsDelta { index, text } => {
                if let Some(c) = out.get_mut(index) {
                    c.arguments.push_str(&text);
                }
            }
            CallEvent::CallEnd { .. } => {}
        }
    }
    Some(((!content.is_empty()).then_some(content), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Result<Option<Tools>, RequestError> {
        parse(&json!({
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
            "tool_choice": choice,
        }))
    }

    #[test]
    fn tools_and_choices_are_read_and_bounded() {
        let t = tools(json!("auto")).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.grammar().is_none());
        assert!(t.system_prompt().contains("\"get_weather\""));
        let t = tools(json!({"type": "function", "function": {"name": "get_weather"}}))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        assert!(t.grammar().is_some());
        for (choice, needle) in [
            (json!("sometimes"), "`tool_choice` `sometimes`"),
            (
                json!({"type": "function", "function": {"name": "nope"}}),
                "does not declare",
            ),
            (json!(3), "`tool_choice` must be"),
        ] {
            let e = tools(choice).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        for (body, needle) in [
            (json!({"tool_choice": "required"}), "needs `tools`"),
            (json!({"tools": {}}), "`tools` must be a list"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "`tools[0].function.name`",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]}),
                "twice",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"description": "x".repeat(MAX_GRAMMAR_BYTES)}}}]}),
                "more than the",
            ),
        ] {
            let e = parse(&body).unwrap_err().to_string();
            assert!(e.contains(needle), "{body}: {e}");
        }
        assert_eq!(parse(&json!({"tool_choice": "none"})).unwrap(), None);
    }

    #[test]
    fn calls_are_parsed_out_of_the_answer() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}";
        let (content, calls) = parse_calls(text).unwrap();
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\": \"Paris\"}".into()
                },
                ToolCall {
                    name: "t".into(),
                    arguments: "{}".into()
                }
            ]
        );
        assert_eq!(parse_calls("no calls here"), None);
        assert_eq!(parse_calls("<tool_call>\nnot json\n</tool_call>"), None);
        // Whitespace before the call is dropped; content that is only whitespace is none.
        assert_eq!(
            parse_calls(" \n<tool_call>{\"name\": \"t\", \"arguments\": {}}")
                .unwrap()
                .0,
            None
        );
        let rendered = render_calls(
            &json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]),
            1,
        )
        .unwrap();
        assert_eq!(
            parse_calls(&rendered).unwrap().1,
            vec![ToolCall {
                name: "f".into(),
                arguments: "{\"x\":1}".into()
            }]
        );
    }
}
