//! [`KvMirror`]: how a rank with a device KV cache uses its host mirror, shared by the rank
//! executors that keep one ([`super::executor`], [`super::standin`]).

use pdserve_runtime::Role;

/// How a rank with a device KV cache uses its host mirror (the CUDA executor's
/// `MirrorMode`, available without the `cuda` feature).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvMirror {
    /// No mirror: KV never leaves the device (colocated serving).
    #[default]
    Off,
    /// Blocks a step wrote are copied to the mirror before each layer is reported (prefill:
    /// peers read KV from the mirror).
    WriteThrough,
    /// Transfers land in the mirror; an upload moves them to the device (decode).
    Receive,
}

impl KvMirror {
    /// The mirror a role needs: prefill write-through, decode receive, colocated none.
    pub fn for_role(role: Role) -> Self {
        match role {
            Role::Prefill => Self::WriteThrough,
            Role::Decode => Self::Receive,
            _ => Self::Off,
        }
    }
}
