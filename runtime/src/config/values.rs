//! The closed sets of names some config keys take ([`TransferBackend`] and the other
//! `config_enum!` enums, refused with [`UnknownValue`]), and the accepted devices and model
//! sources.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::lenient;

/// A config value that names none of its key's accepted values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key} must be one of {}, got `{value}`", .expected.join(", "))]
pub struct UnknownValue {
    /// The dotted key (`transfer.backend`).
    pub key: &'static str,
    /// The value given.
    pub value: String,
    /// The accepted values.
    pub expected: &'static [&'static str],
}

/// A closed set of lowercase names for one config key: the enum, its `as_str`/`ALL`/`NAMES`,
/// `Display`, `FromStr` (the accepted names, plus any listed alias) and serde (the same
/// names; a bad one is refused when the config is parsed, with [`UnknownValue`]'s message).
macro_rules! config_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident for $key:literal {
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $text:literal $(| $alias:literal)*,
            )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        $vis enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in a stable order.
            pub const ALL: [$name; <[&str]>::len(&[$($text),+])] = [$(Self::$variant),+];
            /// The accepted names, in the order of [`Self::ALL`].
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The name used in config, flags, logs and metrics.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownValue;

            fn from_str(s: &str) -> Result<Self, UnknownValue> {
                match s {
                    $($text $(| $alias)* => Ok(Self::$variant),)+
                    other => Err(UnknownValue {
                        key: $key,
                        value: other.to_string(),
                        expected: Self::NAMES,
                    }),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                lenient::string(d)?.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

config_enum! {
    /// `transfer.backend`: which medium moves KV bytes between instances.
    pub enum TransferBackend for "transfer.backend" {
        /// Both ends in one process; a transfer is a memcpy.
        Local = "local",
        /// Two processes on one host; regions are memfds the peer maps; a transfer is a memcpy.
        #[default]
        Shm = "shm",
        /// Tokio TCP sockets, several parallel connections per peer.
        Tcp = "tcp",
        /// QUIC (quinn) streams, mutual TLS from the cluster CA.
        Quic = "quic",
        /// One-sided RDMA READ/WRITE (ibverbs, cargo feature `rdma`).
        Rdma = "rdma",
    }
}

config_enum! {
    /// `kv_tiers.write_policy`: which blocks the pool's evictions offer to the KV cache tiers.
    pub enum TierWritePolicy for "kv_tiers.write_policy" {
        /// Every evicted block (host first; what the host region evicts moves on to disk).
        #[default]
        WriteBack = "write_back",
        /// Only evicted blocks reused at least `kv_tiers.selective_min_hits` times (Dynamo
        /// KVBM's frequency filter).
        Selective = "selective",
    }
}

config_enum! {
    /// How members of a cluster find each other.
    pub enum DiscoveryKind for "discovery.kind" {
        /// The built-in registration: an instance registers with the one proxy its config
        /// names (`control.proxy`); the proxy keeps membership in memory.
        #[default]
        Static = "static",
        /// Membership in etcd: every member keeps its record under a lease, proxies watch the
        /// instances and instances watch the proxies (several proxies side by side).
        Etcd = "etcd",
    }
}

config_enum! {
    /// `transfer.mode`: how KV moves from prefill to decode when the decode instance drives
    /// the hand-off.
    pub enum TransferMode for "transfer.mode" {
        /// vLLM NIXL style: prefill finishes and holds the blocks under a lease; decode reads
        /// them and releases the lease.
        #[default]
        Pull = "pull",
        /// Mooncake/SGLang style: decode sends its destination blocks with the prompt; prefill
        /// writes each layer's blocks as soon as that layer is computed.
        Push = "push",
    }
}

config_enum! {
    /// `model.weights`: the in-memory weight format of the CPU backend.
    pub enum WeightFormat for "model.weights" {
        /// A model whose matmul weights are all Q4_0, Q4_1 or Q8_0 runs as `native` (on every
        /// CPU: llama.cpp's numerics, tp- and batch-invariant); any other runs as `packed`.
        #[default]
        Auto = "auto",
        /// Exactly as stored in the file. Q4_0, Q4_1, Q8_0, Q4_K and Q6_K run on pdserve's own
        /// llama.cpp-exact kernels (llama.cpp's numerics and greedy tokens; tensor-parallel
        /// runs give tp=1's logits bit for bit). Other formats run on candle's.
        Native = "native",
        /// On AVX-512 VNNI CPUs Q8_0, Q4_0 and Q4_1 weights keep their exact values, one byte
        /// per weight, on pdserve's 16-row packed kernel (one integer sum per block and row:
        /// not llama.cpp's float order), the other sub-8-bit formats (Q5_*, k-quants)
        /// requantized to Q8_0 for it: ~1.3× `native`'s prefill there, slower batch-1
        /// decode. Elsewhere sub-8-bit weights are requantized to Q8_0. Floats stay as stored.
        Packed = "packed",
        /// Q8_0 wherever the row length allows it (`q8` is accepted as an alias).
        Q8_0 = "q8_0" | "q8",
        /// Dequantized to f32.
        F32 = "f32",
    }
}

config_enum! {
    /// `scheduler.kv_cache_dtype`: the element type of the KV cache (part of the layout both
    /// sides of a hand-off must share).
    pub enum KvCacheDtype for "scheduler.kv_cache_dtype" {
        /// 32-bit floats: what attention computes with.
        #[default]
        F32 = "f32",
        /// IEEE half precision: half the memory and half the hand-off bytes.
        F16 = "f16",
        /// bfloat16: as f16, with f32's range and 8 mantissa bits.
        Bf16 = "bf16",
    }
}

/// Devices accepted by `model.device` (besides `cuda:N`, a GPU by ordinal).
pub const DEVICES: &[&str] = &["cpu", "cuda"];

/// CUDA matmul weight types accepted by `model.dtype`.
pub const CUDA_DTYPES: &[&str] = &["auto", "f16", "bf16", "f32"];

/// Whether `s` names a device `model.device` accepts: `cpu`, `cuda` or `cuda:N`.
pub fn is_device(s: &str) -> bool {
    DEVICES.contains(&s)
        || s.strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The default model source: the built-in default model (SmolLM2-135M-Instruct).
pub const DEFAULT_MODEL_SOURCE: &str = "default";

/// Prefix of a synthetic model source: `synthetic:NAME`.
pub const SYNTHETIC_MODEL_PREFIX: &str = "synthetic:";
