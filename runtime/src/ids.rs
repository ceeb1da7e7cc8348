//! Identifiers shared by every actor: [`RequestId`] (one client request inside an instance)
//! and [`TransferId`] (one KV hand-off, shared by the prefill and decode side of a request).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One request inside an instance; displayed as `req-<n>`, serialized as the bare number.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(transparent)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

impl FromStr for RequestId {
    type Err = IdParseError;

    /// Parses `req-<n>` (the [`Display`](fmt::Display) form).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.strip_prefix("req-")
            .and_then(|n| n.parse().ok())
            .map(RequestId)
            .ok_or_else(|| IdParseError(format!("expected `req-<n>`, got {s:?}")))
    }
}

/// A string that is not a valid id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid id: {0}")]
pub struct IdParseError(String);

/// One KV-cache hand-off between a prefill and a decode instance, chosen by the proxy and
/// carried by both sides (`kv_transfer_params.transfer_id`).
///
/// 128 random bits; displayed and serialized as 32 lowercase hex digits, so JSON clients
/// without 128-bit integers keep it exact.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct TransferId(pub u128);

impl TransferId {
    /// A fresh id from 128 bits of the OS-seeded thread RNG; collisions are negligible.
    pub fn new_random() -> Self {
        TransferId(rand::random())
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for TransferId {
    type Err = IdParseError;

    /// Parses 1 to 32 hex digits (the [`Display`](fmt::Display) form has exactly 32).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || s.len() > 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(IdParseError(format!(
                "expected up to 32 hex digits, got {s:?}"
            )));
        }
        u128::from_str_radix(s, 16)
            .map(TransferId)
            .map_err(|e| IdParseError(e.to_string()))
    }
}

impl Serialize for TransferId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TransferId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn request_id_displays_and_parses() {
        let id = RequestId(42);
        assert_eq!(id.to_string(), "req-42");
        assert_eq!("req-42".parse::<RequestId>().unwrap(), id);
        assert!("42".parse::<RequestId>().is_err());
        assert!("req-x".parse::<RequestId>().is_err());
        assert_eq!(serde_json::to_string(&id).unwrap(), "42");
        assert_eq!(serde_json::from_str::<RequestId>("42").unwrap(), id);
    }

    #[test]
    fn transfer_id_is_32_hex_digits_and_round_trips() {
        let id = TransferId(0xab);
        assert_eq!(id.to_string(), "000000000000000000000000000000ab");
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"000000000000000000000000000000ab\"");
        assert_eq!(serde_json::from_str::<TransferId>(&json).unwrap(), id);
        let max = TransferId(u128::MAX);
        assert_eq!(max.to_string().parse::<TransferId>().unwrap(), max);
        assert!("".parse::<TransferId>().is_err());
        assert!("+1".parse::<TransferId>().is_err());
        assert!("g".parse::<TransferId>().is_err());
        assert!("0".repeat(33).parse::<TransferId>().is_err());
        assert!(serde_json::from_str::<TransferId>("12").is_err());
    }

    #[test]
    fn random_transfer_ids_differ_and_use_high_bits() {
        let ids: HashSet<TransferId> = (0..1000).map(|_| TransferId::new_random()).collect();
        assert_eq!(ids.len(), 1000);
        // With 1000 uniform draws, some id has a nonzero top 64 bits unless the generator
        // only fills 64 bits.
        assert!(ids.iter().any(|id| id.0 >> 64 != 0));
        assert!(ids.iter().all(|id| id.to_string().len() == 32));
    }
}
