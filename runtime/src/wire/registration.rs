//! An instance's registration with a proxy ([`ControlMessage::Register`]) and the proxy's
//! typed refusal ([`ControlMessage::RegistrationRefused`]).
//!
//! [`ControlMessage::Register`]: super::ControlMessage::Register
//! [`ControlMessage::RegistrationRefused`]: super::ControlMessage::RegistrationRefused

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::role::Role;

/// What an instance tells the proxy when it registers.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct Registration {
    /// Node name; must equal the name the connection's greeting announced.
    pub node: String,
    /// `prefill`, `decode` or `colocated`.
    pub role: Role,
    /// The instance's OpenAI-compatible HTTP API (`http://host:port`).
    pub url: String,
    /// Its control-plane address (`IP:port`).
    pub control_addr: String,
    /// Milliseconds between its heartbeats.
    pub heartbeat_ms: u64,
    /// Tokens per KV block, when its prefix cache is on and it sends KV events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// The salt its block hashes start from (model and KV layout), with `block_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<u64>,
}

/// The registration field a refusal is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum RegistrationField {
    /// The registration as a whole (it could not be sent or read).
    Registration,
    /// [`Registration::node`].
    Node,
    /// [`Registration::role`].
    Role,
    /// [`Registration::url`].
    Url,
    /// [`Registration::control_addr`].
    ControlAddr,
    /// [`Registration::heartbeat_ms`].
    HeartbeatMs,
    /// [`Registration::block_size`] (with [`Registration::cache_salt`]).
    BlockSize,
}

impl RegistrationField {
    /// The field's name as it is spelled in the registration.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Registration => "registration",
            Self::Node => "node",
            Self::Role => "role",
            Self::Url => "url",
            Self::ControlAddr => "control_addr",
            Self::HeartbeatMs => "heartbeat_ms",
            Self::BlockSize => "block_size",
        }
    }
}

impl std::fmt::Display for RegistrationField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A registration the proxy refuses: the field at fault and what is wrong with it. It is also
/// the refusal on the wire ([`super::ControlMessage::RegistrationRefused`]).
#[derive(
    Debug, Clone, PartialEq, Eq, thiserror::Error, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
#[error("{message}")]
pub struct RegistrationError {
    /// The field at fault.
    pub field: RegistrationField,
    /// What is wrong with it.
    pub message: String,
}

impl RegistrationError {
    /// A refusal of `field`.
    pub fn new(field: RegistrationField, message: impl Into<String>) -> Self {
        Self {
            field,
            message: message.into(),
        }
    }
}

impl Registration {
    /// Checks a registration received from the peer `peer_node` (peer-supplied metadata is
    /// validated before it is used).
    ///
    /// # Errors
    /// [`RegistrationError`] naming the first bad field.
    pub fn validate(&self, peer_node: &str) -> Result<(), RegistrationError> {
        use RegistrationField as F;
        let bad = RegistrationError::new;
        if !self.role.is_instance() {
            return Err(bad(F::Role, format!("role `{}` cannot serve", self.role)));
        }
        if self.node.is_empty()
            || self
                .node
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(bad(F::Node, format!("invalid node name {:?}", self.node)));
        }
        if self.node != peer_node {
            return Err(bad(
                F::Node,
                format!(
                    "registration for node `{}` on the control connection of `{peer_node}`",
                    self.node
                ),
            ));
        }
        let url = url::Url::parse(&self.url)
            .map_err(|e| bad(F::Url, format!("url {:?} does not parse: {e}", self.url)))?;
        if !matches!(url.scheme(), "http" | "https")
            || url.host().is_none()
            || url.port_or_known_default().is_none()
        {
            return Err(bad(
                F::Url,
                format!("url {:?} must be http(s)://host:port", self.url),
            ));
        }
        self.control_addr.parse::<SocketAddr>().map_err(|e| {
            bad(
                F::ControlAddr,
                format!("control_addr {:?}: {e}", self.control_addr),
            )
        })?;
        let range = crate::config::HEARTBEAT_MS_RANGE;
        if !range.contains(&self.heartbeat_ms) {
            return Err(bad(
                F::HeartbeatMs,
                format!(
                    "heartbeat_ms {} is outside {}..={}",
                    self.heartbeat_ms,
                    range.start(),
                    range.end()
                ),
            ));
        }
        match (self.block_size, self.cache_salt) {
            (None, None) => {}
            (Some(bs), Some(_)) if (1..=4096).contains(&bs) => {}
            (Some(bs), Some(_)) => {
                return Err(bad(
                    F::BlockSize,
                    format!("block_size {bs} is outside 1..=4096"),
                ))
            }
            _ => {
                return Err(bad(
                    F::BlockSize,
                    "block_size and cache_salt come together".into(),
                ))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A valid registration of `decode-0`, for the wire's tests too.
    pub(in crate::wire) fn registration() -> Registration {
        Registration {
            node: "decode-0".into(),
            role: Role::Decode,
            url: "http://127.0.0.1:8200".into(),
            control_addr: "127.0.0.1:7200".into(),
            heartbeat_ms: 500,
            block_size: Some(16),
            cache_salt: Some(u64::MAX),
        }
    }

    #[test]
    fn registration_json_uses_lowercase_roles_and_round_trips() {
        let json = serde_json::to_string(&registration()).unwrap();
        assert!(json.contains("\"role\":\"decode\""), "{json}");
        let back: Registration = serde_json::from_str(&json).unwrap();
        assert_eq!(back, registration());
    }

    #[test]
    fn registration_validation_refuses_bad_fields() {
        registration().validate("decode-0").unwrap();
        type Mutation = fn(&mut Registration);
        let cases: Vec<(&str, RegistrationField, Mutation)> = vec![
            ("on the control connection", RegistrationField::Node, |r| {
                r.node = "decode-1".into()
            }),
            ("invalid node name", RegistrationField::Node, |r| {
                r.node = "".into()
            }),
            ("cannot serve", RegistrationField::Role, |r| {
                r.role = Role::Proxy
            }),
            ("does not parse", RegistrationField::Url, |r| {
                r.url = "not a url".into()
            }),
            ("http(s)://host:port", RegistrationField::Url, |r| {
                r.url = "ftp://127.0.0.1:1".into()
            }),
            ("control_addr", RegistrationField::ControlAddr, |r| {
                r.control_addr = "nowhere".into()
            }),
            ("heartbeat_ms", RegistrationField::HeartbeatMs, |r| {
                r.heartbeat_ms = 0
            }),
            ("outside 1..=4096", RegistrationField::BlockSize, |r| {
                r.block_size = Some(0)
            }),
            ("come together", RegistrationField::BlockSize, |r| {
                r.cache_salt = None
            }),
        ];
        for (needle, field, mutate) in cases {
            let mut r = registration();
            mutate(&mut r);
            let peer = if needle == "invalid node name" {
                ""
            } else {
                "decode-0"
            };
            let e = r.validate(peer).expect_err(needle);
            assert_eq!(e.field, field, "{needle}");
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
    }
}
