//! [`Role`]: the part a cluster member plays. One enum for the config (`instance.role`,
//! `[[node]] role`), the control plane's greeting, registrations with the proxy, routing and
//! `pdserve inspect`; serialized in lowercase (serde) and archived with rkyv.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What a cluster member runs.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill and decode in one instance.
    #[default]
    Colocated,
    /// Runs prompts and hands their KV cache to a decode instance.
    Prefill,
    /// Generates tokens from KV cache transferred from a prefill instance.
    Decode,
    /// The HTTP front door of a P/D cluster.
    Proxy,
    /// Tools, tests and benchmarks (`pdserve inspect`); never serves.
    Other,
    /// Runs a vision-language model's image encoder and hands the embeddings to the
    /// instances that compute prompts (E/P/D). Last, so earlier variants keep their archived
    /// tags.
    Encode,
}

impl Role {
    /// The roles a serving instance can take.
    pub const INSTANCE: [Role; 4] = [Role::Colocated, Role::Prefill, Role::Decode, Role::Encode];

    /// The lowercase name used in config, logs and `inspect`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Colocated => "colocated",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Proxy => "proxy",
            Self::Other => "other",
            Self::Encode => "encode",
        }
    }

    /// Whether a serving instance can take this role (`colocated`, `prefill`, `decode`,
    /// `encode`).
    pub fn is_instance(self) -> bool {
        Self::INSTANCE.contains(&self)
    }

    /// Whether an instance of this role moves KV cache to or from peers (and so needs a
    /// transfer engine).
    pub fn disaggregated(self) -> bool {
        matches!(self, Self::Prefill | Self::Decode)
    }

    /// Whether an instance of this role needs a transfer engine: the P/D roles, and
    /// `encode` (its image embeddings move over it).
    pub fn transfers(self) -> bool {
        self.disaggregated() || self == Self::Encode
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no role.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role `{0}` (expected colocated, prefill, decode, encode or proxy)")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "colocated" => Ok(Self::Colocated),
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            "proxy" => Ok(Self::Proxy),
            "other" => Ok(Self::Other),
            "encode" => Ok(Self::Encode),
            other => Err(UnknownRole(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_text_serde_and_rkyv() {
        for r in [
            Role::Colocated,
            Role::Prefill,
            Role::Decode,
            Role::Proxy,
            Role::Other,
            Role::Encode,
        ] {
            assert_eq!(r.as_str().parse::<Role>().unwrap(), r);
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, format!("\"{}\"", r.as_str()));
            let bytes = crate::wire::to_archive(&r).unwrap();
            assert_eq!(crate::wire::from_archive::<Role>(&bytes).unwrap(), r);
        }
        assert!(Role::Prefill.is_instance() && !Role::Proxy.is_instance());
        assert!(Role::Decode.disaggregated() && !Role::Colocated.disaggregated());
        assert!("router".parse::<Role>().is_err());
    }
}
