//! The model's tool calls read out of its text as it is generated: [`CallParser`] is fed the
//! text increments of one answer and emits [`CallEvent`]s — content, a call's start (index and
//! name), pieces of its `arguments` JSON text, its end — so a streamed answer sends each call's
//! arguments as they arrive. The non-streamed answer is this parser fed the whole text at once
//! ([`super::parse_calls`]), so both read an answer the same way whatever its split points.
//!
//! What it reads, in the Hermes format of [`super`]:
//! - **Content**: the text before the first `<tool_call>`, passed on as it comes. A possible
//!   start of the marker (`<tool_`) and the whitespace before it (at most
//!   [`MAX_HELD_WHITESPACE`] bytes) are held until decided: the whitespace between the content
//!   and a call is dropped, the marker never reaches the content.
//! - **A call**: `<tool_call>`, then the header `{"name": <string>, "arguments": ` (whitespace
//!   anywhere JSON allows it, at most [`MAX_HEADER`] bytes), which starts the call, then the
//!   `arguments` object's text exactly as generated, from its `{` to the matching `}` (a scanner
//!   tracks strings, escapes and nesting depth), sent piece by piece. Whatever follows the
//!   arguments up to the next `<tool_call>` (the closing `}`, `</tool_call>`, text between or
//!   after calls) is dropped. The arguments are not checked beyond their nesting: like OpenAI's,
//!   `function.arguments` is the text the model wrote, which a client validates.
//! - **A block that is not a call** (its header is not of that shape, or is longer than
//!   [`MAX_HEADER`], or the answer ends inside it): when no call has started, the whole answer
//!   is plain content, the block included (what the non-streamed path has always answered for
//!   an answer without a well-formed call); after a call, the block is dropped (the calls sent
//!   stand).
//! - **An unfinished call** (the answer ends inside its arguments, or `</tool_call>` comes
//!   outside a string before they close): the call ends there with the arguments written so far.
//! - **Names** are not checked against the request's tools (as the non-streamed path never
//!   did): a call of an undeclared function is reported as written; forced calls (`required`,
//!   a named function) can only name declared ones.
//!
//! Held text is bounded: at most [`MAX_HEADER`] bytes of a header, [`MAX_HELD_WHITESPACE`]
//! bytes of whitespace and a marker's length otherwise.

use super::{CALL_CLOSE, CALL_OPEN};

/// Longest call header held before it is decided (`{"name": ..., "arguments": `): names are at
/// most 64 characters, so anything longer is not a call.
pub const MAX_HEADER: usize = 256;
/// Most whitespace held at the end of the content (dropped when a call follows).
pub const MAX_HELD_WHITESPACE: usize = 256;

/// What the answer's text holds, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallEvent {
    /// Text of the answer's content.
    Content(String),
    /// Call `index` (0, 1, ... in the answer) of function `name` starts.
    CallStart {
        /// The call's position among the answer's calls.
        index: usize,
        /// The function's name, as written.
        name: String,
    },
    /// The next piece of call `index`'s arguments JSON text.
    ArgsDelta {
        /// The call's position among the answer's calls.
        index: usize,
        /// The piece, as generated.
        text: String,
    },
    /// Call `index` is complete (its arguments closed, or the answer ended inside them).
    CallEnd {
        /// The call's position among the answer's calls.
        index: usize,
    },
}

/// Where the parser is in the answer.
#[derive(Clone, Debug)]
enum Mode {
    /// Before the first call.
    Content,
    /// Inside `<tool_call>`, before the arguments; `dropped` is the text that becomes content
    /// if this block turns out not to be a call (the whitespace dropped before the marker, and
    /// the marker).
    Header { dropped: String },
    /// Inside a call's arguments.
    Args(Scanner),
    /// After a call, or a block that was not one after a call: text is dropped up to the next
    /// `<tool_call>`.
    Between,
    /// The answer is plain content (a block that was not a call came before any call).
    Plain,
}

/// Nesting of a JSON value's text: strings, escapes, depth of `{}` and `[]`.
#[derive(Clone, Debug, Default)]
struct Scanner {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

/// What [`Scanner::scan`] found in a piece of text.
enum Scanned {
    /// The value closed after this many bytes.
    Closed(usize),
    /// `</tool_call>` (or what may start it, at the piece's end) outside a string at this
    /// offset: the value's text stops there.
    Close(usize),
    /// All of the piece is part of the value.
    Open,
}

impl Scanner {
    fn scan(&mut self, text: &str) -> Scanned {
        for (i, b) in text.bytes().enumerate() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return Scanned::Closed(i + 1);
                    }
                }
                b'<' if CALL_CLOSE.starts_with(&text[i..]) || text[i..].starts_with(CALL_CLOSE) => {
                    return Scanned::Close(i);
                }
                _ => {}
            }
        }
        Scanned::Open
    }
}

/// What [`header`] read of a call's header.
#[derive(Debug, PartialEq, Eq)]
enum Header {
    /// Complete: the function's name, and the offset of the arguments' `{`.
    Call(String, usize),
    /// A prefix of a header so far.
    NeedMore,
    /// Not a call.
    Bad,
}

/// Reads `{"name": <string>, "arguments": ` up to the arguments' `{` in `text`.
fn header(text: &str) -> Header {
    struct Cursor<'a> {
        bytes: &'a [u8],
        at: usize,
    }
    impl Cursor<'_> {
        fn ws(&mut self) {
            while self.at < self.bytes.len() && self.bytes[self.at].is_ascii_whitespace() {
                self.at += 1;
            }
        }
        /// `lit` next: `Some(true)` read, `Some(false)` the text ends inside it, `None` not it.
        fn lit(&mut self, lit: &str) -> Option<bool> {
            let rest = &self.bytes[self.at..];
            let n = rest.len().min(lit.len());
            if rest[..n] != lit.as_bytes()[..n] {
                return None;
            }
            self.at += n;
            Some(n == lit.len())
        }
        /// A JSON string's end (after its closing quote), from its opening quote.
        fn string(&mut self) -> Option<bool> {
            if self.lit("\"")? {
                let mut escaped = false;
                while self.at < self.bytes.len() {
                    let b = self.bytes[self.at];
                    self.at += 1;
                    match b {
                        _ if escaped => escaped = false,
                        b'\\' => escaped = true,
                        b'"' => return Some(true),
                        _ => {}
                    }
                }
            }
            Some(false)
        }
    }
    let mut c = Cursor {
        bytes: text.as_bytes(),
        at: 0,
    };
    let mut name = None;
    // Each step: whitespace, then a literal or the name string.
    for step in ["{", "\"name\"", ":", "", ",", "\"arguments\"", ":", "{"] {
        c.ws();
        let start = c.at;
        let read = if step.is_empty() {
            c.string()
        } else {
            c.lit(step)
        };
        match read {
            None => return Header::Bad,
            Some(false) => return Header::NeedMore,
            Some(true) if step.is_empty() => {
                match serde_json::from_str::<String>(&text[start..c.at]) {
                    Ok(n) => name = Some(n),
                    Err(_) => return Header::Bad,
                }
            }
            Some(true) => {}
        }
    }
    match name {
        Some(n) => Header::Call(n, c.at - 1),
        None => Header::Bad,
    }
}

/// The length of the longest end of `text` that begins `marker` (a marker split across
/// increments), at a character boundary.
fn partial_marker(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Reads the calls out of one answer's text as it is generated (see the module's doc).
#[derive(Clone, Debug)]
pub struct CallParser {
    mode: Mode,
    /// Text received and not yet decided.
    held: String,
    /// Calls started so far.
    calls: usize,
}

impl Default for CallParser {
    fn default() -> Self {
        Self::new()
    }
}

impl CallParser {
    /// A parser at the start of an answer.
    pub fn new() -> Self {
        Self {
            mode: Mode::Content,
            held: String::new(),
            calls: 0,
        }
    }

    /// How many calls have started.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads the next piece of the answer's text, appending what it decides to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<CallEvent>) {
        self.held.push_str(text);
        self.advance(out, false);
    }

    /// The answer ended: decides what is held (see the module's doc).
    pub fn finish(&mut self, out: &mut Vec<CallEvent>) {
        self.advance(out, true);
    }

    fn advance(&mut self, out: &mut Vec<CallEvent>, end: bool) {
        loop {
            let held = std::mem::take(&mut self.held);
            let mode = std::mem::replace(&mut self.mode, Mode::Plain);
            let (mode, rest, more) = self.step(mode, held, out, end);
            self.mode = mode;
            self.held = rest;
            if !more {
                return;
            }
        }
    }

    /// One step of `mode` over `held`: the next mode, what stays held, whether to go on.
    fn step(
        &mut self,
        mode: Mode,
        held: String,
        out: &mut Vec<CallEvent>,
        end: bool,
    ) -> (Mode, String, bool) {
        let content = |out: &mut Vec<CallEvent>, text: &str| {
            if !text.is_empty() {
                out.push(CallEvent::Content(text.to_string()));
            }
        };
        match mode {
            Mode::Plain => {
                content(out, &held);
                (Mode::Plain, String::new(), false)
            }
            Mode::Content => {
                if let Some(at) = held.find(CALL_OPEN) {
                    let before = &held[..at];
                    let keep = before
                        .trim_end_matches(|c: char| c.is_ascii_whitespace())
                        .len();
                    let keep = keep.max(before.len().saturating_sub(MAX_HELD_WHITESPACE));
                    let keep = (keep..=before.len())
                        .find(|&k| before.is_char_boundary(k))
                        .unwrap_or(before.len());
                    content(out, &before[..keep]);
                    let dropped = held[keep..at + CALL_OPEN.len()].to_string();
                    let rest = held[at + CALL_OPEN.len()..].to_string();
                    return (Mode::Header { dropped }, rest, true);
                }
                if end {
                    content(out, &held);
                    return (Mode::Content, String::new(), false);
                }
                let marker_at = held.len() - partial_marker(&held, CALL_OPEN);
                let before = &held[..marker_at];
                let ws = before
                    .trim_end_matches(|c: char| c.is_ascii_whitespace())
                    .len();
                let mut cut = ws.max(before.len().saturating_sub(MAX_HELD_WHITESPACE));
                while !held.is_char_boundary(cut) {
                    cut += 1;
                }
                content(out, &held[..cut]);
                (Mode::Content, held[cut..].to_string(), false)
            }
            Mode::Header { dropped } => {
                let verdict = match header(&held) {
                    Header::NeedMore if end || held.len() > MAX_HEADER => Header::Bad,
                    Header::Call(_, at) if at > MAX_HEADER => Header::Bad,
                    v => v,
                };
                match verdict {
                    Header::NeedMore => (Mode::Header { dropped }, held, false),
                    Header::Call(name, at) => {
                        let index = self.calls;
                        self.calls += 1;
                        out.push(CallEvent::CallStart { index, name });
                        (Mode::Args(Scanner::default()), held[at..].to_string(), true)
                    }
                    Header::Bad if self.calls == 0 => {
                        content(out, &dropped);
                        (Mode::Plain, held, true)
                    }
                    Header::Bad => (Mode::Between, held, true),
                }
            }
            Mode::Args(mut scanner) => {
                let index = self.calls - 1;
                let args = |out: &mut Vec<CallEvent>, text: &str| {
                    if !text.is_empty() {
                        out.push(CallEvent::ArgsDelta {
                            index,
                            text: text.to_string(),
                        });
                    }
                };
                match scanner.scan(&held) {
                    Scanned::Closed(n) => {
                        args(out, &held[..n]);
                        out.push(CallEvent::CallEnd { index });
                        (Mode::Between, held[n..].to_string(), true)
                    }
                    Scanned::Close(at) if held[at..].starts_with(CALL_CLOSE) || end => {
                        // `</tool_call>` before the arguments closed (the call ends with what
                        // it has), or the answer ended with what may start it (part of the
                        // arguments as generated).
                        let n = if held[at..].starts_with(CALL_CLOSE) {
                            at
                        } else {
                            held.len()
                        };
                        args(out, &held[..n]);
                        out.push(CallEvent::CallEnd { index });
                        (Mode::Between, held[n..].to_string(), true)
                    }
                    Scanned::Close(at) => {
                        args(out, &held[..at]);
                        (Mode::Args(scanner), held[at..].to_string(), false)
                    }
                    Scanned::Open => {
                        args(out, &held);
                        if end {
                            out.push(CallEvent::CallEnd { index });
                            return (Mode::Between, String::new(), false);
                        }
                        (Mode::Args(scanner), String::new(), false)
                    }
                }
            }
            Mode::Between => {
                if let Some(at) = held.find(CALL_OPEN) {
                    let rest = held[at + CALL_OPEN.len()..].to_string();
                    return (
                        Mode::Header {
                            dropped: String::new(),
                        },
                        rest,
                        true,
                    );
                }
                let keep = if end {
                    0
                } else {
                    partial_marker(&held, CALL_OPEN)
                };
                (Mode::Between, held[held.len() - keep..].to_string(), false)
            }
        }
    }
}

/// The events of a whole answer, as [`CallParser`] reads it fed at once.
pub fn parse_all(text: &str) -> (Vec<CallEvent>, usize) {
    let mut parser = CallParser::new();
    let mut out = Vec::new();
    parser.push(text, &mut out);
    parser.finish(&mut out);
    (out, parser.calls())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The content, and each call's name and arguments, of a list of events.
    fn fold(events: &[CallEvent]) -> (String, Vec<(String, String)>) {
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for e in events {
            match e {
                CallEvent::Content(t) => content.push_str(t),
                CallEvent::CallStart { index, name } => {
                    assert_eq!(*index, calls.len());
                    calls.push((name.clone(), String::new()));
                }
                CallEvent::ArgsDelta { index, text } => {
                    assert_eq!(*index + 1, calls.len());
                    calls[*index].1.push_str(text);
                }
                CallEvent::CallEnd { index } => assert_eq!(*index + 1, calls.len()),
            }
        }
        (content, calls)
    }

    /// The answer fed in pieces cut at `cuts`.
    fn feed(text: &str, cuts: &[usize]) -> Vec<CallEvent> {
        let mut parser = CallParser::new();
        let mut out = Vec::new();
        let mut from = 0;
        for &c in cuts {
            if c > from && text.is_char_boundary(c) {
                parser.push(&text[from..c], &mut out);
                from = c;
            }
        }
        parser.push(&text[from..], &mut out);
        parser.finish(&mut out);
        out
    }

    const TWO_CALLS: &str = "Let me check é.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}r\\\"is\", \"tags\": [{\"a\": 1}, \"<\"]}}\n</tool_call>\n<tool_call>\n{\"name\":\"t\",\"arguments\":{}}\n</tool_call>";

    #[test]
    fn two_calls_read_the_same_at_every_split() {
        let (whole, calls) = parse_all(TWO_CALLS);
        assert_eq!(calls, 2);
        let expected = (
            "Let me check é.".to_string(),
            vec![
                (
                    "get_weather".to_string(),
                    "{\"city\": \"Pa}r\\\"is\", \"tags\": [{\"a\": 1}, \"<\"]}".to_string(),
                ),
                ("t".to_string(), "{}".to_string()),
            ],
        );
        assert_eq!(fold(&whole), expected);
        for i in 0..=TWO_CALLS.len() {
            assert_eq!(fold(&feed(TWO_CALLS, &[i])), expected, "split at {i}");
            for j in i..=TWO_CALLS.len() {
                assert_eq!(
                    fold(&feed(TWO_CALLS, &[i, j])),
                    expected,
                    "split at {i}, {j}"
                );
            }
        }
        // Byte by byte: the arguments come in many pieces, the markup never as content.
        let cuts: Vec<usize> = (0..TWO_CALLS.len()).collect();
        let events = feed(TWO_CALLS, &cuts);
        assert_eq!(fold(&events), expected);
        let pieces = events
            .iter()
            .filter(|e| matches!(e, CallEvent::ArgsDelta { index: 0, .. }))
            .count();
        assert!(pieces > 10, "{events:?}");
        for e in &events {
            if let CallEvent::Content(t) = e {
                assert!(!t.contains('<') && !t.contains('\n'), "{events:?}");
            }
        }
    }

    #[test]
    fn an_answer_without_a_well_formed_call_is_content() {
        for text in [
            "no calls here  \n",
            "<tool_call>\nnot json\n</tool_call> and more",
            "text <tool_call>{\"arguments\": {}, \"name\": \"f\"}</tool_call>",
            "text <tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>",
            "a <tool_ call> b < tool_call>",
            "unfinished <tool_call>\n{\"name\": \"get_",
        ] {
            let (events, calls) = parse_all(text);
            assert_eq!(calls, 0, "{text}");
            for i in 0..=text.len() {
                let (content, calls) = fold(&feed(text, &[i]));
                assert_eq!(content, text, "split at {i}");
                assert!(calls.is_empty());
            }
            assert_eq!(fold(&events).0, text);
        }
        // A header longer than any call's is not held further.
        let long = format!("<tool_call>{{\"name\": \"{}", "x".repeat(MAX_HEADER));
        let mut parser = CallParser::new();
        let mut out = Vec::new();
        parser.push(&long, &mut out);
        assert_eq!(fold(&out).0, long);
    }

    #[test]
    fn malformed_and_unfinished_calls() {
        // A bad block after a call is dropped; the call stands.
        let (events, calls) = parse_all(
            "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 1}}</tool_call><tool_call>oops</tool_call>",
        );
        assert_eq!(calls, 1);
        assert_eq!(
            fold(&events),
            (String::new(), vec![("a".into(), "{\"x\": 1}".into())])
        );
        // An undeclared name is a call as written (not checked here).
        // The answer ends inside the arguments (max_tokens): the call ends there.
        let text = "<tool_call>\n{\"name\": \"nope\", \"arguments\": {\"x\": [1, 2";
        for i in 0..=text.len() {
            assert_eq!(
                fold(&feed(text, &[i])),
                (String::new(), vec![("nope".into(), "{\"x\": [1, 2".into())]),
                "split at {i}"
            );
        }
        // `</tool_call>` before the arguments close ends the call.
        let text = "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 1</tool_call>\nafter";
        for i in 0..=text.len() {
            let events = feed(text, &[i]);
            assert_eq!(
                fold(&events),
                (String::new(), vec![("a".into(), "{\"x\": 1".into())]),
                "split at {i}"
            );
            assert!(events.contains(&CallEvent::CallEnd { index: 0 }));
        }
    }

    #[test]
    fn held_text_is_bounded() {
        let mut parser = CallParser::new();
        let mut out = Vec::new();
        let spaces = " ".repeat(3 * MAX_HELD_WHITESPACE);
        parser.push("a", &mut out);
        parser.push(&spaces, &mut out);
        parser.push("<tool_", &mut out);
        assert!(parser.held.len() <= MAX_HELD_WHITESPACE + CALL_OPEN.len());
        parser.push("call>{\"name\": \"f\", \"arguments\": {}}", &mut out);
        let (content, calls) = fold(&out);
        assert_eq!(content, format!("a{}", " ".repeat(2 * MAX_HELD_WHITESPACE)));
        assert_eq!(calls, vec![("f".into(), "{}".into())]);
        // All at once: the same.
        let (events, _) = parse_all(&format!(
            "a{spaces}<tool_call>{{\"name\": \"f\", \"arguments\": {{}}}}"
        ));
        assert_eq!(fold(&events), (content, calls));
    }
}
