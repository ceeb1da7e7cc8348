//! Chat templates: a model's Jinja template turned into the prompt text for a list of messages.
//!
//! Templates are rendered with minijinja (real Jinja, never string pasting), configured the way
//! Hugging Face's `apply_chat_template` configures jinja2: `trim_blocks` and `lstrip_blocks` on,
//! Python string methods (`.strip()`, `.startswith()`, ...) through minijinja-contrib's pycompat,
//! `raise_exception(msg)` and `tojson`. The context holds `messages`, `add_generation_prompt`,
//! `bos_token` and `eos_token`.

use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::{ModelError, Result};

/// Name under which the template is stored in its environment.
const TEMPLATE_NAME: &str = "chat";

/// The ChatML template (`<|im_start|>role\ncontent<|im_end|>\n`), used when a model ships none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// One message of a chat conversation (OpenAI `messages[]` entry).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or any role the template knows).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template (cheap to clone: the compiled environment is shared).
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: Option<String>,
    eos: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

fn template_err(e: &minijinja::Error) -> ModelError {
    // `{:#}` includes the template line the error points at.
    if e.kind() == ErrorKind::InvalidOperation {
        if let Some(detail) = e.detail() {
            return ModelError::ChatTemplate(detail.to_string());
        }
    }
    ModelError::ChatTemplate(format!("{e:#}"))
}

/// `raise_exception(msg)`: what HF templates call to reject a conversation.
fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles `source`; `bos` / `eos` become the template's `bos_token` / `eos_token`.
    ///
    /// # Errors
    /// `ModelError::ChatTemplate` when the template does not parse.
    pub fn new(source: &str, bos: Option<String>, eos: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| template_err(&e))?;
        Ok(ChatTemplate { env, bos, eos })
    }

    /// The ChatML template, for models that ship no template.
    pub fn chatml_default() -> Self {
        Self::new(CHATML_TEMPLATE, None, None).expect("the built-in ChatML template compiles")
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with the opening of an
    /// assistant turn.
    ///
    /// # Errors
    /// `ModelError::ChatTemplate` when rendering fails, including a template that calls
    /// `raise_exception` (its message is the error's text).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_err(&e))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos.clone().unwrap_or_default(),
                eos_token => self.eos.clone().unwrap_or_default(),
            })
            .map_err(|e| template_err(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_chatml_default_renders() {
        let t = ChatTemplate::chatml_default();
        let out = t.render(&[ChatMessage::new("user", "hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t.render(&[ChatMessage::new("user", "hi")], false).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n");
    }

    #[test]
    fn chat_raise_exception_is_an_error() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let err = t
            .render(&[ChatMessage::new("assistant", "x")], false)
            .unwrap_err();
        assert!(
            matches!(&err, ModelError::ChatTemplate(m) if m.contains("first must be user")),
            "{err}"
        );
        assert_eq!(
            t.render(&[ChatMessage::new("user", "x")], false).unwrap(),
            "ok"
        );
    }

    #[test]
    fn chat_malformed_template_is_an_error() {
        for src in ["{% for m in messages %}", "{{ messages[0] ", "{% endif %}"] {
            let err = ChatTemplate::new(src, None, None).unwrap_err();
            assert_eq!(err.kind(), "chat_template", "{src}: {err}");
        }
        // Fails only at render time: calling an undefined function.
        let t = ChatTemplate::new("{{ no_such_function() }}", None, None).unwrap();
        assert!(matches!(
            t.render(&[], false),
            Err(ModelError::ChatTemplate(_))
        ));
    }

    #[test]
    fn chat_pycompat_tojson_and_tokens() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}|\
                   {{ m.role.startswith('us') }}|{{ m | tojson }}{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "  hi  ")], false)
            .unwrap();
        assert_eq!(out, r#"<s>HI|True|{"role":"user","content":"  hi  "}</s>"#);
    }

    #[test]
    fn chat_trim_and_lstrip_blocks_like_hf() {
        let src = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let out = t
            .render(
                &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
                false,
            )
            .unwrap();
        assert_eq!(out, "    a\n    b\n");
    }
}
