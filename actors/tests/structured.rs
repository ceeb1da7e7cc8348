//! Structured output and tools on one colocated instance over HTTP: `response_format`
//! (`json_object`, `json_schema`), vLLM's `guided_*` and `structured_outputs`, the 400s of bad
//! or oversized grammars (nothing stays queued), a grammar continued over `resume_tokens`
//! (request migration), and tool calls (forced, parsed, streamed with their arguments piece by
//! piece — `n` > 1 and a stream migrated mid-call included — and the follow-up turn with the
//! tool's result). The disaggregated case is in pd.rs.

mod common;
use common::{assert_pool_full, post, post_to, stream_chunks};

use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";

async fn start(name: &str) -> Instance {
    // A context of 4096: the tools' system prompt alone is ~900 byte-level tokens.
    let model = load_model(&ModelSource::Synthetic("small,context=4096".into())).unwrap();
    Instance::start(InstanceOptions::local(name, model))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_builds_the_grammar_compiler_at_start() {
    use pdserve_gpu::grammar::GrammarCompiler;
    let model = load_model(&ModelSource::Synthetic("small,context=4096".into())).unwrap();
    // A clone shares what is built from the vocabulary.
    let tokenizer = model.tokenizer.clone();
    assert!(!GrammarCompiler::is_built(&tokenizer));
    let inst = Instance::start(InstanceOptions::local("warm", model))
        .await
        .unwrap();
    // Built in the background, before any constrained request (bounded wait, no timing
    // asserted).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !GrammarCompiler::is_built(&tokenizer) {
        assert!(
            std::time::Instant::now() < deadline,
            "the compiler was not built after start"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    inst.stop().await;
}

fn chat(extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 300,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// Checks `v` against the subset of JSON Schema the tests use: `type`, `properties`,
/// `required`, `additionalProperties: false`, `enum`, `minimum`/`maximum`, `maxLength`,
/// `items`, `minItems`/`maxItems`.
#[track_caller]
fn check_schema(v: &Value, schema: &Value) {
    macro_rules! fail {
        () => {
            panic!("{v} does not match {schema}")
        };
    }
    if let Some(options) = schema["enum"].as_array() {
        if !options.contains(v) {
            fail!();
        }
    }
    match schema["type"].as_str() {
        Some("object") => {
            let o = v.as_object().unwrap_or_else(|| fail!());
            let props = schema["properties"].as_object().unwrap();
            for r in schema["required"].as_array().into_iter().flatten() {
                if !o.contains_key(r.as_str().unwrap()) {
                    fail!();
                }
            }
            for (k, x) in o {
                match props.get(k) {
                    Some(s) => check_schema(x, s),
                    None if schema["additionalProperties"] == json!(false) => fail!(),
                    None => {}
                }
            }
        }
        Some("array") => {
            let a = v.as_array().unwrap_or_else(|| fail!());
            let (lo, hi) = (schema["minItems"].as_u64(), schema["maxItems"].as_u64());
            if lo.is_some_and(|m| (a.len() as u64) < m) || hi.is_some_and(|m| a.len() as u64 > m) {
                fail!();
            }
            for x in a {
                check_schema(x, &schema["items"]);
            }
        }
        Some("integer") => {
            let n = v
                .as_f64()
                .filter(|n| n.fract() == 0.0)
                .unwrap_or_else(|| fail!());
            if schema["minimum"].as_f64().is_some_and(|m| n < m)
                || schema["maximum"].as_f64().is_some_and(|m| n > m)
            {
                fail!();
            }
        }
        Some("string") => {
            let s = v.as_str().unwrap_or_else(|| fail!());
            if schema["maxLength"]
                .as_u64()
                .is_some_and(|m| s.chars().count() as u64 > m)
            {
                fail!();
            }
        }
        Some("boolean") if !v.is_boolean() => fail!(),
        _ => {}
    }
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3}},
               "required": ["ok", "tags"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "n": {"type": "integer", "minimum": -5, "maximum": 5},
                "inner": {"type": "object", "properties": {"x": {"type": "boolean"}},
                          "required": ["x"], "additionalProperties": false}},
               "required": ["color", "n", "inner"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "minItems": 1, "maxItems": 4}),
    ]
}

fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schemas_regexes_and_choices_are_followed() {
    let inst = start("structured").await;
    let url = inst.url();
    for (i, schema) in schemas().into_iter().enumerate() {
        // OpenAI's response_format on chat, streamed and not (the same greedy answer).
        let body = chat(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": format!("s{i}"), "schema": schema, "strict": true}}}));
        let (status, v) = post_to(&url, CHAT, &body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let text = content(&v);
        let parsed: Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("schema {i}: {e}: {text}"));
        check_schema(&parsed, &schema);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let chunks = stream_chunks(&url, CHAT, &streamed).await;
        let joined: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(joined, text, "schema {i} streamed");
        // vLLM's guided_json and structured_outputs on completions: the same grammar.
        for field in [
            json!({"guided_json": schema}),
            json!({"structured_outputs": {"json": schema.to_string()}}),
        ] {
            let mut b = json!({"prompt": "A JSON value:", "max_tokens": 300});
            b.as_object_mut()
                .unwrap()
                .extend(field.as_object().unwrap().clone());
            let (status, v) = post(&url, &b).await;
            assert_eq!(status, 200, "{v}");
            let text = v["choices"][0]["text"].as_str().unwrap();
            let parsed: Value = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("schema {i} on completions: {e}: {text}"));
            check_schema(&parsed, &schema);
        }
    }
    // Any JSON object.
    let (status, v) = post_to(
        &url,
        CHAT,
        &chat(json!({"response_format": {"type": "json_object"}})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let parsed: Value = serde_json::from_str(content(&v)).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert!(parsed.is_object(), "{v}");
    // A regex, and a choice (greedy picks one of them, whole).
    let (status, v) = post(
        &url,
        &json!({"prompt": "Code:", "guided_regex": "[A-Z]{2}-[0-9]{3}", "max_tokens": 50}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let code = v["choices"][0]["text"].as_str().unwrap();
    assert!(
        code.len() == 6
            && code[..2].bytes().all(|b| b.is_ascii_uppercase())
            && &code[2..3] == "-"
            && code[3..].bytes().all(|b| b.is_ascii_digit()),
        "{code}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let choices = ["positive", "negative", "neutral \"quoted\""];
    for body in [
        json!({"prompt": "Sentiment:", "guided_choice": choices, "max_tokens": 50}),
        json!({"prompt": "Sentiment:", "structured_outputs": {"choice": choices}, "max_tokens": 50}),
    ] {
        let (status, v) = post(&url, &body).await;
        assert_eq!(status, 200, "{v}");
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert!(choices.contains(&text), "{text}");
    }
    // A Lark grammar.
    let (status, v) = post(
        &url,
        &json!({"prompt": "Say:", "max_tokens": 50,
        "guided_grammar": "start: (\"ab\" | \"cd\") \"!\"\n"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(text == "ab!" || text == "cd!", "{text}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_and_oversized_grammars_are_400s_naming_the_problem() {
    let inst = start("structured-bad").await;
    let url = inst.url();
    let huge = json!({"type": "object", "description": "x".repeat(70 * 1024)});
    for (extra, needle) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
            "json_schema cannot be compiled",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": huge}}}),
            "more than the 65536 allowed",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "`response_format.type` `xml`",
        ),
        (json!({"guided_json": "{not json"}), "not valid JSON"),
        (
            json!({"guided_regex": "(unclosed"}),
            "regex cannot be compiled",
        ),
        (
            json!({"guided_grammar": "start: missing_rule"}),
            "grammar cannot be compiled",
        ),
        (json!({"guided_choice": []}), "choice needs"),
        (
            json!({"guided_choice": "yes"}),
            "`guided_choice` must be a list",
        ),
        (
            json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
            "both constrain the output",
        ),
        (
            json!({"structured_outputs": {"xml": "<a/>"}}),
            "`structured_outputs.xml`",
        ),
    ] {
        let (status, v) = post_to(&url, CHAT, &chat(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{extra}: {msg}");
    }
    // The instance serves on, nothing queued or allocated.
    let (status, v) = post_to(&url, CHAT, &chat(json!({"max_tokens": 4}))).await;
    assert_eq!(status, 200, "{v}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_request_continues_its_grammar_after_the_resumed_tokens() {
    let inst = start("structured-resume").await;
    let url = inst.url();
    let schema = &schemas()[2];
    let body = json!({"prompt": "JSON:", "max_tokens": 300, "guided_json": schema, "return_token_ids": true});
    let (status, whole) = post(&url, &body).await;
    assert_eq!(status, 200, "{whole}");
    let ids = common::choice_token_ids(&whole).remove(0);
    assert!(ids.len() > 6, "{whole}");
    for cut in [1, ids.len() / 2, ids.len() - 1] {
        let mut b = body.clone();
        b["resume_tokens"] = json!(ids[..cut]);
        let (status, v) = post(&url, &b).await;
        assert_eq!(status, 200, "cut {cut}: {v}");
        let rest = common::choice_token_ids(&v).remove(0);
        assert_eq!(rest, ids[cut..], "cut {cut}");
    }
    // Resumed tokens the grammar does not allow are refused.
    let mut b = body.clone();
    b["resume_tokens"] = json!([b'x']);
    let (status, v) = post(&url, &b).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("grammar"),
        "{v}"
    );
    assert_pool_full(&inst).await;
    inst.stop().await;
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
         "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "description": "Current time",
         "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
          "required": ["zone"], "additionalProperties": false}}},
    ])
}

#[track_caller]
fn check_call(call: &Value, tools: &Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")),
        "{call}"
    );
    let name = call["function"]["name"].as_str().unwrap();
    let tool = tools
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == name)
        .unwrap_or_else(|| panic!("unknown tool {name}"));
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{e}: {call}"));
    check_schema(&args, &tool["function"]["parameters"]);
}

/// One choice's streamed chunks carry `call` (the non-streamed answer's): a first delta with
/// `index`, `id`, `type`, `function.name` and empty arguments, then deltas of `index` and
/// `function.arguments` only — more than one — whose pieces join into the call's arguments;
/// no content, and `finish_reason: tool_calls` once.
#[track_caller]
fn check_streamed_call(chunks: &[&Value], call: &Value) {
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert!(deltas.len() > 2, "{chunks:?}");
    let start = deltas[0];
    assert_eq!(start["index"], 0, "{start}");
    assert!(
        start["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")),
        "{start}"
    );
    assert_eq!(start["type"], "function", "{start}");
    assert_eq!(
        start["function"]["name"], call["function"]["name"],
        "{start}"
    );
    assert_eq!(start["function"]["arguments"], "", "{start}");
    let mut arguments = String::new();
    for d in &deltas[1..] {
        let mut keys: Vec<&String> = d.as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(keys, ["function", "index"], "{d}");
        assert_eq!(d["index"], 0, "{d}");
        assert_eq!(d["function"].as_object().unwrap().len(), 1, "{d}");
        arguments.push_str(d["function"]["arguments"].as_str().unwrap());
    }
    assert_eq!(arguments, call["function"]["arguments"].as_str().unwrap());
    for c in chunks {
        let content = &c["choices"][0]["delta"]["content"];
        assert!(
            content.is_null() || content == "",
            "content in a forced call: {c}"
        );
    }
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("tool_calls")], "{chunks:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_round_trip_streamed_and_not() {
    let inst = start("tools").await;
    let url = inst.url();
    let tools = weather_tools();
    let ask = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_time"}}),
    ] {
        let body = chat(json!({"messages": ask, "tools": tools, "tool_choice": choice}));
        let (status, v) = post_to(&url, CHAT, &body).await;
        assert_eq!(status, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        check_call(&calls[0], &tools);
        if choice.is_object() {
            assert_eq!(calls[0]["function"]["name"], "get_time", "{v}");
        }

        // Streamed: the same call as `delta.tool_calls`, its arguments piece by piece, then
        // `finish_reason: tool_calls`; with `n` = 2, each choice's the same (greedy).
        for n in [1, 2] {
            let mut streamed = body.clone();
            streamed["stream"] = json!(true);
            streamed["n"] = json!(n);
            let chunks = stream_chunks(&url, CHAT, &streamed).await;
            for choice in 0..n {
                let of_choice: Vec<&Value> = chunks
                    .iter()
                    .filter(|c| c["choices"][0]["index"] == choice)
                    .collect();
                check_streamed_call(&of_choice, &calls[0]);
                assert_eq!(of_choice[0]["choices"][0]["delta"]["role"], "assistant");
            }
        }

        // A migrated stream (`resume_tokens`: the tokens of the chunks the client has, cut in
        // the middle of the arguments) goes on with the call: no second start, the rest of
        // its arguments.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["return_token_ids"] = json!(true);
        let chunks = stream_chunks(&url, CHAT, &streamed).await;
        let deltas = |chunks: &[Value]| -> Vec<Value> {
            chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
                .flatten()
                .cloned()
                .collect()
        };
        let arguments = |chunks: &[Value]| -> String {
            deltas(chunks)
                .iter()
                .filter_map(|d| d["function"]["arguments"].as_str().map(String::from))
                .collect()
        };
        let with_args: Vec<usize> = (0..chunks.len())
            .filter(|&i| !arguments(&chunks[i..=i]).is_empty())
            .collect();
        let have = with_args[with_args.len() / 2] + 1;
        let tokens: Vec<u64> = chunks[..have]
            .iter()
            .filter_map(|c| c["choices"][0]["token_ids"].as_array())
            .flatten()
            .map(|t| t.as_u64().unwrap())
            .collect();
        let mut resumed = streamed.clone();
        resumed["resume_tokens"] = json!(tokens);
        let rest = stream_chunks(&url, CHAT, &resumed).await;
        assert!(
            deltas(&rest).iter().all(|d| d.get("id").is_none()),
            "{rest:?}"
        );
        assert!(!arguments(&rest).is_empty(), "{rest:?}");
        assert_eq!(
            arguments(&chunks[..have]) + &arguments(&rest),
            calls[0]["function"]["arguments"].as_str().unwrap(),
            "{chunks:?} {rest:?}"
        );
        assert_eq!(
            rest.last().unwrap()["choices"][0]["finish_reason"],
            "tool_calls"
        );

        // The follow-up turn: the call and its result in the history.
        let mut messages = ask.as_array().unwrap().clone();
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
        messages.push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "{\"temperature\": 21}"}));
        let follow = chat(
            json!({"messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 8}),
        );
        let (status, v) = post_to(&url, CHAT, &follow).await;
        assert_eq!(status, 200, "{v}");
        assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
        assert!(
            v["choices"][0]["message"].get("tool_calls").is_none(),
            "{v}"
        );
    }
    // With `auto`, an answer without a call is plain content, streamed as it comes.
    let body = chat(json!({"messages": ask, "tools": tools, "max_tokens": 8}));
    let (status, v) = post_to(&url, CHAT, &body).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream_chunks(&url, CHAT, &streamed).await;
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, content, "{chunks:?}");
    // Bad tools are 400s naming the field.
    for (extra, needle) in [
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            "`tools[0].function.name`",
        ),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "does not declare",
        ),
        (json!({"tool_choice": "required"}), "needs `tools`"),
        (
            json!({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "cannot be combined",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}),
            "`messages[0].tool_calls`",
        ),
    ] {
        let (status, v) = post_to(&url, CHAT, &chat(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{extra}: {msg}");
    }
    let (status, v) = post(&url, &json!({"prompt": "x", "tools": tools})).await;
    assert_eq!(status, 400, "{v}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

/// The default model (SmolLM2-135M-Instruct) under real prompts: chat answers valid against
/// their schemas, streamed and not, and a forced tool call, as `client.chat.completions.parse`
/// and a tool-using client would ask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_model_answers_follow_schemas_and_call_tools() {
    let model = load_model(&ModelSource::Default).unwrap();
    let mut o = InstanceOptions::local("structured-default", model);
    o.num_blocks = Some(256);
    let inst = Instance::start(o).await.unwrap();
    let url = inst.url();
    let asks = [
        "Give me a fictional person with a name and an age.",
        "Describe the weather today: is it sunny, and what is the temperature?",
        "Name three colors you like.",
    ];
    for (ask, schema) in asks.iter().zip(schemas()) {
        let body = chat(json!({
            "messages": [{"role": "user", "content": ask}],
            "max_tokens": 200,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}},
        }));
        for stream in [false, true] {
            let text = if stream {
                let mut b = body.clone();
                b["stream"] = json!(true);
                stream_chunks(&url, CHAT, &b)
                    .await
                    .iter()
                    .filter_map(|c| {
                        c["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(String::from)
                    })
                    .collect::<String>()
            } else {
                let (status, v) = post_to(&url, CHAT, &body).await;
                assert_eq!(status, 200, "{v}");
                assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
                content(&v).to_string()
            };
            let parsed: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{ask}: {e}: {text}"));
            check_schema(&parsed, &schema);
        }
    }
    let tools = weather_tools();
    let body = chat(json!({
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools, "tool_choice": "required", "max_tokens": 100,
    }));
    let (status, v) = post_to(&url, CHAT, &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    check_call(&v["choices"][0]["message"]["tool_calls"][0], &tools);
    // Streamed, with the model's own tokenizer: the same call, its arguments piece by piece.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream_chunks(&url, CHAT, &streamed).await;
    check_streamed_call(
        &chunks.iter().collect::<Vec<_>>(),
        &v["choices"][0]["message"]["tool_calls"][0],
    );
    assert_pool_full(&inst).await;
    inst.stop().await;
}
