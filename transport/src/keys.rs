//! Session keys: the secret two ends of one transfer session share ([`SessionKey`]) and its
//! public name ([`KeyId`]). A leaf: the handshake (`auth.rs`) and the frame protection
//! (`integrity.rs`) both derive from a key, and neither needs the other to hold one.

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::error::{Result, TransportError};

/// Bytes of a [`SessionKey`].
pub const KEY_BYTES: usize = 32;
/// Bytes of a [`KeyId`].
pub const KEY_ID_BYTES: usize = 16;

/// `N` bytes from the system's secure random generator.
///
/// # Errors
/// [`TransportError::Tls`] when the generator fails.
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| TransportError::Tls("the system random generator failed".into()))?;
    Ok(b)
}

/// A secret shared by the two ends of one transfer session (32 random bytes).
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; KEY_BYTES]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionKey(id {})", self.id())
    }
}

impl SessionKey {
    /// A fresh key from the system's secure random generator.
    ///
    /// # Errors
    /// [`TransportError::Tls`] when the generator fails.
    pub fn generate() -> Result<Self> {
        random().map(Self)
    }

    /// A key from bytes received from the peer (over the mutual-TLS control plane).
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> Self {
        Self(bytes)
    }

    /// The key's bytes, to hand to the peer over an authenticated, encrypted channel.
    pub fn as_bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    /// The public name of the key: what a connection names to say which grant it claims.
    pub fn id(&self) -> KeyId {
        let tag = hmac::sign(&self.hmac_key(), b"pdserve-transfer key id");
        let mut id = [0u8; KEY_ID_BYTES];
        id.copy_from_slice(&tag.as_ref()[..KEY_ID_BYTES]);
        KeyId(id)
    }

    pub(crate) fn hmac_key(&self) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, &self.0)
    }
}

/// The public name of a [`SessionKey`] (a truncated HMAC of a constant under the key).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId(pub [u8; KEY_ID_BYTES]);

impl std::fmt::Display for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyId({self})")
    }
}
