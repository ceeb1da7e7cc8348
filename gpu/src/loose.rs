//! Reading the model's JSON files into typed structs: a leaf that the loaders and the tokenizer
//! share (it lived in `loader.rs`, which made the tokenizer import the loader that imports it).
//!
//! serde's derived structs ignore unknown keys (HF files carry many that pdserve does not read)
//! but refuse a wrong type with an error that does not name the key, so a field is read as one
//! of:
//!
//! - [`Loose`]: a value of another type reads as absent (its default, or the caller's "missing"
//!   error, then applies);
//! - [`Strict`]: a value of another type is kept, as [`JsonText`], for the caller's error that
//!   refuses it by name; `null` is such a value, not an absent key.
//!
//! [`Object`] takes only a JSON object (a derived struct alone also takes an array, its items
//! as the fields in order), and [`parse_object`] reads a whole file as one.

use serde::de::{DeserializeOwned, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use std::fmt;

/// A field of a model's JSON file (`config.json`, `tokenizer_config.json`) read when it has
/// its type; another type reads as absent (the defaults and errors then apply, as to a
/// missing field).
#[derive(Clone, Debug, Deserialize)]
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

    /// The value, if it had its type, borrowed.
    pub(crate) fn get_ref(&self) -> Option<&T> {
        match self {
            Self::Is(t) => Some(t),
            Self::Other(_) => None,
        }
    }
}

/// A field of a model's JSON file read strictly: absent, its value, or the JSON it held
/// instead, which the caller refuses naming the key. Its default is [`Strict::Absent`], which
/// a struct's `#[serde(default)]` gives a missing key.
#[derive(Debug, Default, Deserialize)]
#[serde(untagged)]
pub(crate) enum Strict<T> {
    /// The key is not in the file.
    #[default]
    #[serde(skip)]
    Absent,
    /// The value, of its type.
    Is(T),
    /// A value of another type (`null` included).
    Not(JsonText),
}

/// A JSON value as compact text, kept for the error message that refuses it.
#[derive(Debug, PartialEq)]
pub(crate) struct JsonText(String);

impl fmt::Display for JsonText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for JsonText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonTextVisitor)
    }
}

struct JsonTextVisitor;

impl<'de> Visitor<'de> for JsonTextVisitor {
    type Value = JsonText;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<JsonText, E> {
        Ok(JsonText(v.to_string()))
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<JsonText, E> {
        Ok(JsonText(v.to_string()))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<JsonText, E> {
        Ok(JsonText(v.to_string()))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<JsonText, E> {
        Ok(JsonText(v.to_string()))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<JsonText, E> {
        Ok(JsonText(format!("{v:?}")))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<JsonText, E> {
        Ok(JsonText("null".into()))
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<JsonText, E> {
        self.visit_unit()
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<JsonText, D::Error> {
        JsonText::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<JsonText, A::Error> {
        let mut items = Vec::new();
        while let Some(JsonText(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(JsonText(format!("[{}]", items.join(","))))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonText, A::Error> {
        let mut items = Vec::new();
        while let Some((key, JsonText(value))) = map.next_entry::<String, JsonText>()? {
            items.push(format!("{key:?}:{value}"));
        }
        Ok(JsonText(format!("{{{}}}", items.join(","))))
    }
}

pub(crate) use pdserve_runtime::json::Object;

/// The text of a model's JSON file, which must be an object, read as a `T`.
///
/// # Errors
/// Malformed JSON, anything but an object, or a field `T` refuses.
pub(crate) fn parse_object<T: DeserializeOwned>(text: &str) -> serde_json::Result<T> {
    serde_json::from_str::<Object<T>>(text).map(|Object(t)| t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    struct Probe {
        count: Strict<f64>,
        name: Option<Loose<String>>,
        inner: Strict<Object<Inner>>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    struct Inner {
        edge: Strict<u64>,
    }

    fn shown<T>(s: &Strict<T>) -> Option<&str> {
        match s {
            Strict::Not(JsonText(t)) => Some(t),
            _ => None,
        }
    }

    #[test]
    fn strict_fields_tell_absent_from_null_and_keep_what_a_wrong_type_held() {
        let p: Probe = parse_object(r#"{"count": 2, "unknown": [1, {"x": null}]}"#).unwrap();
        assert!(
            matches!(p.count, Strict::Is(c) if c == 2.0),
            "an int reads as a float"
        );
        assert!(matches!(p.inner, Strict::Absent));
        let p: Probe = parse_object(r#"{"count": 2.5, "inner": {"edge": 7}}"#).unwrap();
        assert!(matches!(p.count, Strict::Is(c) if c == 2.5));
        assert!(matches!(
            p.inner,
            Strict::Is(Object(Inner {
                edge: Strict::Is(7)
            }))
        ));
        for (json, count) in [
            (r#"{"count": null}"#, "null"),
            (r#"{"count": "12"}"#, r#""12""#),
            (r#"{"count": true}"#, "true"),
            (r#"{"count": [1, "a", [null]]}"#, r#"[1,"a",[null]]"#),
            (r#"{"count": {"k": {"j": -3}}}"#, r#"{"k":{"j":-3}}"#),
        ] {
            let p: Probe = parse_object(json).unwrap();
            assert_eq!(shown(&p.count), Some(count), "{json}");
        }
        // A nested object's wrong type, and an array where an object belongs.
        let p: Probe = parse_object(r#"{"inner": {"edge": 1.5}}"#).unwrap();
        let Strict::Is(Object(inner)) = p.inner else {
            panic!("inner is an object")
        };
        assert_eq!(shown(&inner.edge), Some("1.5"));
        let p: Probe = parse_object(r#"{"inner": [3]}"#).unwrap();
        assert_eq!(shown(&p.inner), Some("[3]"));
    }

    #[test]
    fn loose_fields_read_a_wrong_type_as_absent() {
        let p: Probe = parse_object(r#"{"name": "x"}"#).unwrap();
        assert_eq!(p.name.and_then(Loose::get).as_deref(), Some("x"));
        let p: Probe = parse_object(r#"{"name": 3}"#).unwrap();
        assert!(matches!(p.name, Some(Loose::Other(_))));
        assert_eq!(p.name.as_ref().and_then(Loose::get_ref), None);
    }

    #[test]
    fn only_an_object_is_a_file() {
        for text in ["[2, 3]", "3", "null", r#""{}""#] {
            let e = parse_object::<Probe>(text).unwrap_err();
            assert!(
                e.to_string().contains("expected a JSON object"),
                "{text}: {e}"
            );
        }
        assert!(parse_object::<Probe>("{} x").is_err(), "trailing text");
    }
}
