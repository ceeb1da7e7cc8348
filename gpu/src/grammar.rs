//! Structured output: a request's grammar ([`GrammarSpec`]: a JSON schema, any JSON object, a
//! regular expression, a list of choices or a Lark grammar) compiled by llguidance into a
//! [`Constraint`], the per-sequence matcher that masks the logits before each sampled token and
//! advances over each accepted one.
//!
//! - [`GrammarSpec`] is plain data: it travels in [`SamplingParams`](crate::SamplingParams)
//!   (HTTP, the P/D peer protocol), bounded by [`GrammarSpec::validate`].
//! - [`GrammarCompiler`] holds llguidance's `ParserFactory` over the model's vocabulary (its
//!   token trie, built once per tokenizer from [`Tokenizer::token_bytes`], see
//!   [`GrammarCompiler::for_tokenizer`]), with [`ParserLimits`] that bound what a remote grammar
//!   may cost: lexer construction fuel, per-token fuel and Earley items, lexer states, grammar
//!   size.
//! - [`Constraint`]: [`Constraint::prepare_mask`] computes the mask of the next token (the
//!   scheduler calls it while the forward pass runs), [`Constraint::apply`] sets every token
//!   the grammar forbids to −∞ in a logits row, [`Constraint::advance`] consumes the sampled
//!   token. EOS is allowed only where the grammar accepts; once the grammar admits nothing
//!   more, [`Constraint::is_done`] ends the sequence.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::tokenizer::Tokenizer;
use crate::{ModelError, Result};

/// Largest grammar source one request may carry, in bytes (a JSON schema as JSON text, a
/// regex, a Lark grammar, the choices together).
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;
/// Most alternatives of a [`GrammarSpec::Choice`].
pub const MAX_GRAMMAR_CHOICES: usize = 256;

/// What a request's output must match.
#[derive(
    Clone,
    Debug,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum GrammarSpec {
    /// A JSON value valid against this JSON schema (JSON text).
    JsonSchema(String),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), anchored at both ends.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

fn invalid(msg: impl Into<String>) -> ModelError {
    ModelError::InvalidGrammar(msg.into())
}

impl GrammarSpec {
    /// The name of its kind, as errors and logs say it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json_schema",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Choice(_) => "choice",
            Self::Lark(_) => "grammar",
        }
    }

    /// Bytes of its source.
    pub fn source_bytes(&self) -> usize {
        match self {
            Self::JsonSchema(s) | Self::Regex(s) | Self::Lark(s) => s.len(),
            Self::JsonObject => 0,
            Self::Choice(c) => c.iter().map(String::len).sum(),
        }
    }

    /// Checks the bounds a grammar from a client or a peer must keep (it is compiled only
    /// after this): at most [`MAX_GRAMMAR_BYTES`] of source, 1..=[`MAX_GRAMMAR_CHOICES`]
    /// non-empty choices, a non-empty regex or grammar.
    ///
    /// # Errors
    /// [`ModelError::InvalidGrammar`] naming the bound.
    pub fn validate(&self) -> Result<()> {
        let bytes = self.source_bytes();
        if bytes > MAX_GRAMMAR_BYTES {
            return Err(invalid(format!(
                "the {} is {bytes} bytes, more than the {MAX_GRAMMAR_BYTES} allowed",
                self.kind()
            )));
        }
        match self {
            Self::Choice(c) if c.is_empty() || c.len() > MAX_GRAMMAR_CHOICES => {
                Err(invalid(format!(
                    "choice needs 1 to {MAX_GRAMMAR_CHOICES} strings, got {}",
                    c.len()
                )))
            }
            Self::Choice(c) if c.iter().any(String::is_empty) => {
                Err(invalid("choice strings must not be empty"))
            }
            Self::JsonSchema(s) | Self::Regex(s) | Self::Lark(s) if s.trim().is_empty() => {
                Err(invalid(format!("the {} is empty", self.kind())))
            }
            _ => Ok(()),
        }
    }

    /// llguidance's form of the grammar. JSON is written compactly (`", "` and `": "`
    /// separators, no free whitespace: a small model cannot then spend its tokens on blank
    /// space).
    fn to_llguidance(&self) -> Result<TopLevelGrammar> {
        let json = |mut schema: Value| {
            if let Value::Object(map) = &mut schema {
                map.insert(
                    "x-guidance".into(),
                    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
                );
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        Ok(match self {
            Self::JsonSchema(text) => {
                let schema: Value = serde_json::from_str(text)
                    .map_err(|e| invalid(format!("the JSON schema is not valid JSON: {e}")))?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(invalid("the JSON schema must be an object"));
                }
                json(schema)
            }
            Self::JsonObject => json(json!({"type": "object"})),
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Self::Choice(choices) => {
                // Lark string literals take JSON's escapes.
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::to_string(c).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Self::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        })
    }
}

/// The vocabulary as llguidance sees it: each token's bytes (special tokens behind
/// [`TokTrie::SPECIAL_TOKEN_MARKER`], so no grammar text can produce them), and the Hugging
/// Face tokenizer for the few strings llguidance tokenizes itself. (It holds the inner
/// tokenizer, not our [`Tokenizer`], whose compiler cache would then hold itself.)
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Arc<tokenizers::Tokenizer>,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// Compiles [`GrammarSpec`]s for one model's vocabulary. Built once per tokenizer
/// ([`GrammarCompiler::for_tokenizer`]); cheap to share.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

/// What compiling or running one grammar may cost (llguidance's defaults, spelled out because
/// every grammar comes from the network): ≈20 ms of lexer construction, ≈15 ms per token mask,
/// ≈0.5 GB of lexer states at most, and a grammar of at most 100 000 symbols (a 64 KiB source
/// stays far below).
fn limits() -> ParserLimits {
    ParserLimits {
        max_items_in_row: 2000,
        initial_lexer_fuel: 1_000_000,
        step_lexer_fuel: 200_000,
        step_max_items: 50_000,
        max_lexer_states: 250_000,
        max_grammar_size: 100_000,
        precompute_large_lexemes: true,
        verbose_errors: false,
    }
}

impl GrammarCompiler {
    /// The compiler over `tokenizer`'s vocabulary, built on first use (a trie of the whole
    /// vocabulary: tens of milliseconds) and shared by every clone of that tokenizer.
    ///
    /// # Errors
    /// [`ModelError::InvalidGrammar`] when the vocabulary cannot serve grammars (no EOS).
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Arc<Self>> {
        match &*tokenizer.derived(|t| Self::new(t).map(Arc::new)) {
            Ok(compiler) => Ok(Arc::clone(compiler)),
            Err(ModelError::InvalidGrammar(why)) => Err(ModelError::InvalidGrammar(why.clone())),
            Err(other) => Err(ModelError::InvalidGrammar(other.to_string())),
        }
    }

    /// Whether the compiler of `tokenizer` (and of its clones) is built: an instance builds it
    /// in the background at start ([`GrammarCompiler::warm`]).
    pub fn is_built(tokenizer: &Tokenizer) -> bool {
        tokenizer.has_derived::<Result<Arc<Self>>>()
    }

    /// Builds the compiler of `tokenizer` now, so that the first constrained request does not
    /// (the token trie over the whole vocabulary: 0.33 s for the default model, docs/api.md). Blocking;
    /// logs whether structured output is available.
    pub fn warm(tokenizer: &Tokenizer) {
        let started = std::time::Instant::now();
        match Self::for_tokenizer(tokenizer) {
            Ok(_) => tracing::debug!(
                ms = started.elapsed().as_millis() as u64,
                "structured-output grammar compiler ready"
            ),
            Err(e) => {
                tracing::info!(error = %e, "structured output is unavailable for this vocabulary")
            }
        }
    }

    /// A compiler over `tokenizer`'s vocabulary.
    ///
    /// # Errors
    /// [`ModelError::InvalidGrammar`] when the vocabulary has no EOS token or llguidance
    /// refuses it.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let eos = tokenizer.eos_ids().to_vec();
        let Some(&first_eos) = eos.first() else {
            return Err(invalid("the model has no end-of-sequence token"));
        };
        let vocab = tokenizer.vocab_size();
        let specials = tokenizer.special_token_ids();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                if specials.contains(&id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(tokenizer.id_to_token(id).unwrap_or_default().into_bytes());
                    w
                } else {
                    tokenizer.token_bytes(id)
                }
            })
            .collect();
        let info = TokRxInfo {
            tok_bos: tokenizer.bos_id(),
            tok_pad: tokenizer.pad_id(),
            ..TokRxInfo::new(vocab as u32, first_eos)
        };
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(&eos);
        }
        let env: TokEnv = Arc::new(VocabEnv {
            trie,
            tokenizer: tokenizer.shared_inner(),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| invalid(format!("cannot prepare the vocabulary: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Self { factory })
    }

    /// Compiles `spec` into a fresh [`Constraint`] (checked with [`GrammarSpec::validate`]
    /// first). A JSON schema is compiled to a grammar here and its lexer is built lazily, in
    /// the first [`Constraint::prepare_mask`].
    ///
    /// # Errors
    /// [`ModelError::InvalidGrammar`] with llguidance's message (an unsupported JSON-schema
    /// keyword, a regex or Lark syntax error, a grammar past the limits).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint> {
        spec.validate()?;
        let grammar = spec.to_llguidance()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| invalid(format!("the {} cannot be compiled: {e}", spec.kind())))?;
        Ok(Constraint {
            matcher: Matcher::new(Ok(parser)),
            mask: None,
        })
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The mask of the next token, when already computed.
    mask: Option<SimpleVob>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("mask_ready", &self.mask.is_some())
            .field("done", &self.is_done())
            .finish_non_exhaustive()
    }
}

impl Clone for Constraint {
    /// An independent copy in the same state (another choice of the same request).
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
        }
    }
}

impl Constraint {
    /// Computes the next token's mask now, unless it is ready: the scheduler calls this while
    /// the forward pass computes the logits it will mask.
    ///
    /// # Errors
    /// [`ModelError::InvalidGrammar`] when the matcher failed (a limit was hit).
    pub fn prepare_mask(&mut self) -> Result<()> {
        if self.mask.is_none() {
            let mask = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| invalid(format!("the grammar failed: {e}")))?;
            self.mask = Some(mask);
        }
        Ok(())
    }

    /// Sets every token of `logits` that the grammar forbids to −∞ (tokens past the
    /// vocabulary included).
    ///
    /// # Errors
    /// As [`Constraint::prepare_mask`]; also when the grammar allows no token at all.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        self.prepare_mask()?;
        let mask = self.mask.as_ref().expect("prepared");
        let mut allowed = 0usize;
        for (id, logit) in logits.iter_mut().enumerate() {
            if id < mask.len() && mask.is_allowed(id as TokenId) {
                allowed += 1;
            } else {
                *logit = f32::NEG_INFINITY;
            }
        }
        if allowed == 0 {
            return Err(invalid("the grammar allows no token here"));
        }
        Ok(())
    }

    /// Consumes `token`, the one sampled (or, on a P/D decode instance and after a
    /// migration, the one another instance sampled).
    ///
    /// # Errors
    /// [`ModelError::InvalidGrammar`] when the grammar does not allow `token` here.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| invalid(format!("token {token} does not match the grammar: {e}")))
    }

    /// Whether the grammar is complete and admits nothing more (the sequence stops).
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compiler() -> (Tokenizer, GrammarCompiler) {
        let tok = Tokenizer::byte_level_synthetic();
        let c = GrammarCompiler::new(&tok).unwrap();
        (tok, c)
    }

    #[test]
    fn grammar_compiler_is_built_once_per_vocabulary() {
        let tok = Tokenizer::byte_level_synthetic();
        let first = GrammarCompiler::for_tokenizer(&tok).unwrap();
        let again = GrammarCompiler::for_tokenizer(&tok.clone()).unwrap();
        assert!(Arc::ptr_eq(&first, &again), "a clone shares the compiler");
        let other = GrammarCompiler::for_tokenizer(&Tokenizer::byte_level_synthetic()).unwrap();
        assert!(
            !Arc::ptr_eq(&first, &other),
            "another tokenizer builds its own"
        );
    }

    /// Greedy over uniform logits with a preference for low ids: whatever the grammar allows.
    fn generate(tok: &Tokenizer, mut c: Constraint, max: usize) -> (String, bool) {
        let mut out = Vec::new();
        for _ in 0..max {
            if c.is_done() {
                break;
            }
            let mut logits: Vec<f32> = (0..tok.vocab_size()).map(|i| -(i as f32)).collect();
            c.apply(&mut logits).unwrap();
            let (t, _) = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap();
            let t = t as u32;
            if tok.is_eos(t) {
                return (tok.decode(&out, true).unwrap(), true);
            }
            c.advance(t).unwrap();
            out.push(t);
        }
        (tok.decode(&out, true).unwrap(), c.is_done())
    }

    #[test]
    fn choices_and_regexes_are_followed_to_their_end() {
        let (tok, comp) = compiler();
        let c = comp
            .compile(&GrammarSpec::Choice(vec![
                "yes".into(),
                "no \"way\"".into(),
            ]))
            .unwrap();
        let (text, done) = generate(&tok, c, 20);
        assert!(done);
        assert!(text == "yes" || text == "no \"way\"", "{text}");
        let c = comp
            .compile(&GrammarSpec::Regex("[0-9]{3}-x".into()))
            .unwrap();
        let (text, done) = generate(&tok, c, 20);
        assert!(done);
        assert_eq!(text.len(), 5, "{text}");
        assert!(text.ends_with("-x"), "{text}");
    }

    #[test]
    fn json_schemas_give_valid_json() {
        let (tok, comp) = compiler();
        let schema = r#"{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string","maxLength":3}},"required":["a","b"],"additionalProperties":false}"#;
        let c = comp
            .compile(&GrammarSpec::JsonSchema(schema.into()))
            .unwrap();
        let (text, _) = generate(&tok, c, 200);
        let v: Value = serde_json::from_str(&text).unwrap();
        // `-0` is a JSON integer too (serde_json reads it as a float).
        assert!(v["a"].as_f64().is_some_and(|a| a.fract() == 0.0), "{text}");
        assert!(v["b"].as_str().unwrap().len() <= 3, "{text}");
    }

    #[test]
    fn bad_or_oversized_grammars_are_refused_with_a_message() {
        let (_, comp) = compiler();
        for (spec, needle) in [
            (GrammarSpec::JsonSchema("{".into()), "not valid JSON"),
            (
                GrammarSpec::JsonSchema(r#"{"type":"nonsense"}"#.into()),
                "cannot be compiled",
            ),
            (GrammarSpec::Regex("(".into()), "cannot be compiled"),
            (GrammarSpec::Lark("start: foo".into()), "cannot be compiled"),
            (GrammarSpec::Choice(vec![]), "choice needs"),
            (
                GrammarSpec::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1)),
                "more than the",
            ),
        ] {
            let e = comp.compile(&spec).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec:?}: {e}");
        }
    }

    /// What grammars cost on the default model's 49 152-token vocabulary: building the
    /// compiler, compiling a schema, and each token's mask along a greedy walk. Prints the
    /// figures (docs/api.md quotes them); run with `--ignored --nocapture`.
    #[test]
    #[ignore = "needs the default model; prints timings"]
    fn mask_costs_on_the_default_model() {
        use std::time::Instant;
        let model = crate::loader::load_model(&crate::loader::ModelSource::Default).unwrap();
        let tok = model.tokenizer;
        let t = Instant::now();
        let comp = GrammarCompiler::new(&tok).unwrap();
        println!(
            "compiler (token trie) for {} tokens: {:?}",
            tok.vocab_size(),
            t.elapsed()
        );
        let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":20},"age":{"type":"integer","minimum":0,"maximum":150},"email":{"type":"string","format":"email"},"tags":{"type":"array","items":{"enum":["a","b","c"]},"maxItems":4}},"required":["name","age","email","tags"],"additionalProperties":false}"#;
        for spec in [
            GrammarSpec::JsonSchema(schema.into()),
            GrammarSpec::JsonObject,
            GrammarSpec::Regex("[A-Z][a-z]{2,10}( [A-Z][a-z]{2,10})?".into()),
        ] {
            let t = Instant::now();
            let mut c = comp.compile(&spec).unwrap();
            let compiled = t.elapsed();
            let (mut masks, mut n, mut worst) =
                (std::time::Duration::ZERO, 0, std::time::Duration::ZERO);
            for _ in 0..60 {
                if c.is_done() {
                    break;
                }
                let t = Instant::now();
                c.prepare_mask().unwrap();
                let d = t.elapsed();
                masks += d;
                worst = worst.max(d);
                n += 1;
                let mut logits: Vec<f32> = (0..tok.vocab_size())
                    .map(|i| ((i * 7919) % 1000) as f32)
                    .collect();
                c.apply(&mut logits).unwrap();
                let (id, _) = logits
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .unwrap();
                if tok.is_eos(id as u32) {
                    break;
                }
                c.advance(id as u32).unwrap();
            }
            println!(
                "{}: compile {compiled:?}, {n} masks, mean {:?}, worst {worst:?}",
                spec.kind(),
                masks / n.max(1) as u32
            );
        }
    }

    #[test]
    fn a_copy_continues_independently_and_forced_tokens_are_checked() {
        let (tok, comp) = compiler();
        let mut c = comp.compile(&GrammarSpec::Regex("ab+".into())).unwrap();
        let a = tok.encode("a", false).unwrap();
        c.advance(a[0]).unwrap();
        let copy = c.clone();
        let x = tok.encode("x", false).unwrap();
        assert!(c.advance(x[0]).is_err());
        let (text, _) = generate(&tok, copy, 3);
        assert!(text.starts_with('b'), "{text}");
    }
}
