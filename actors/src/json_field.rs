//! Shapes for reading untrusted request JSON with serde's derive while keeping pdserve's 400s,
//! each naming its field: a field is read as the type it should have or kept as sent
//! ([`Lenient`]), so the caller, not serde, words the refusal ("`max_tokens` must be a
//! non-negative integer, got -3" rather than "data did not match any variant").

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// A field read as `T` when it has that shape, else kept as sent for the message that
/// refuses it.
#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub(crate) enum Lenient<T> {
    /// The expected shape.
    Ok(T),
    /// Anything else, as sent.
    Bad(Value),
}

impl<T> Lenient<T> {
    /// The value, or what was sent instead.
    pub(crate) fn into_result(self) -> Result<T, Value> {
        match self {
            Self::Ok(t) => Ok(t),
            Self::Bad(v) => Err(v),
        }
    }

    /// The value if it had the expected shape.
    pub(crate) fn ok(self) -> Option<T> {
        self.into_result().ok()
    }
}

pub(crate) use pdserve_runtime::json::Object;

/// For `#[serde(default, deserialize_with = "present")]`: a field that was sent, `null`
/// included, is `Some` (a plain `Option` reads `null` as absent).
pub(crate) fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Debug, Deserialize)]
    struct Point {
        x: Option<Lenient<u32>>,
    }

    #[test]
    fn shapes_are_read_or_kept_as_sent() {
        let p: Lenient<Object<Point>> = serde_json::from_value(json!({"x": 3})).unwrap();
        assert!(matches!(
            p,
            Lenient::Ok(Object(Point {
                x: Some(Lenient::Ok(3))
            }))
        ));
        let p: Lenient<Object<Point>> = serde_json::from_value(json!({"x": -3})).unwrap();
        assert!(
            matches!(p, Lenient::Ok(Object(Point { x: Some(Lenient::Bad(v)) })) if v == json!(-3))
        );
        // A list of the fields is not the object.
        let p: Lenient<Object<Point>> = serde_json::from_value(json!([3])).unwrap();
        assert!(matches!(p, Lenient::Bad(_)));
    }
}
