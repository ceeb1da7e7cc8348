//! Lenient reading of the model's JSON files: a leaf that the loader and the tokenizer share
//! (it lived in `loader.rs`, which made the tokenizer import the loader that imports it).

use serde::de::IgnoredAny;
use serde::Deserialize;

/// A field of a model's JSON file (`config.json`, `tokenizer_config.json`) read when it has
/// its type; another type reads as absent (the defaults and errors then apply, as to a
/// missing field).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Loose<T> {
    Is(T),
    Other(IgnoredAny),
}

impl<T> Loose<T> {
    /// The value, if it had its type.
    pub(crate) fn get(self) -> Option<T> {
        match self {
            Self::Is(t) => Some(t),
            Self::Other(_) => None,
        }
    }
}
