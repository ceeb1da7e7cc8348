//! The serving configuration: one [`ServeConfig`] tree loaded in layers by figment.
//!
//! Layers, lowest precedence first (a later layer overrides an earlier one key by key):
//!
//! 1. built-in defaults ([`ServeConfig::default`]);
//! 2. a TOML file (`--config FILE`), whose tables are the sections below;
//! 3. the environment: `PDSERVE_<SECTION>__<KEY>` (see [`ENV_PREFIX`], [`ENV_SEPARATOR`]),
//!    e.g. `PDSERVE_SERVER__PORT=9000` or `PDSERVE_SCHEDULER__MAX_NUM_SEQS=8`;
//! 4. command-line flags ([`ServeFlags`], or any partial structure of the same shape).
//!
//! Every struct denies unknown fields, so a misspelt key in any layer is an error that names
//! the key and the layer it came from ([`ConfigError::UnknownKey`]). Only environment variables
//! whose name (after the prefix) contains [`ENV_SEPARATOR`] take part: other `PDSERVE_*`
//! variables used elsewhere (`PDSERVE_HOME`, `PDSERVE_LOG`, `PDSERVE_PYTHON`, ...) are ignored.
//!
//! ```toml
//! [model]
//! source = "synthetic:tiny"
//! tp = 2
//!
//! [server]
//! port = 9000
//!
//! [instance]
//! role = "prefill"
//! ```
//!
//! | file | what it holds |
//! |---|---|
//! | `config/serve.rs` | [`ServeConfig`] and its sections, with their defaults |
//! | `config/values.rs` | the closed sets of names some keys take ([`UnknownValue`]) |
//! | `config/flags.rs` | [`ServeFlags`], the command-line layer |
//! | `config/layers.rs` | the layers ([`ServeConfig::load`] here), the environment names |
//! | `config/validate.rs` | [`ServeConfig::validate`] |
//! | `config/proxy.rs` | [`ProxyConfig`], the proxy's `[proxy]` section |
//! | `config/discovery.rs` | [`DiscoveryConfig`]: static registration or etcd membership |
//! | `config/lenient.rs` | deserializers that take environment numbers as text |

mod discovery;
mod flags;
mod layers;
mod lenient;
mod proxy;
mod serve;
mod validate;
mod values;

pub use crate::error::ConfigLayer;
pub use crate::role::Role;
pub use discovery::*;
pub use flags::*;
pub use layers::{env_var_name, ENV_PREFIX, ENV_SEPARATOR};
pub use proxy::*;
pub use serve::*;
pub use values::*;

use std::path::Path;

use figment::Figment;
use serde::Serialize;

use crate::error::ConfigError;
use layers::{extract_validated, layered};

impl ServeConfig {
    /// Builds the layered figment (defaults < `file` < environment < `flags`) without
    /// extracting it; use [`ServeConfig::from_figment`] to extract, or merge more providers
    /// first.
    ///
    /// `flags` is any serializable partial structure of the config's shape (usually
    /// [`ServeFlags`]); `None` fields must be skipped, not serialized as null.
    ///
    /// # Errors
    ///
    /// [`ConfigError::File`] when `file` is given but is not a readable file.
    pub fn figment(file: Option<&Path>, flags: impl Serialize) -> Result<Figment, ConfigError> {
        // Every section but the proxy's: a misspelt section is an error that names it.
        layered(ServeConfig::default(), file, flags, |section| {
            section != PROXY_SECTION
        })
    }

    /// Extracts and validates a config from `figment` (usually from [`ServeConfig::figment`]).
    ///
    /// # Errors
    ///
    /// [`ConfigError::UnknownKey`] or [`ConfigError::InvalidValue`] when a layer holds a key
    /// the config does not have or a value of the wrong type (the error names the key and the
    /// layer); [`ConfigError::Invalid`] when [`ServeConfig::validate`] rejects the result.
    pub fn from_figment(figment: &Figment) -> Result<ServeConfig, ConfigError> {
        extract_validated(figment, ServeConfig::validate)
    }

    /// Loads the config: built-in defaults < TOML `file` < `PDSERVE_<SECTION>__<KEY>`
    /// environment variables < `flags`, then validates it.
    ///
    /// # Errors
    ///
    /// [`ConfigError::File`] when `file` cannot be read; [`ConfigError::UnknownKey`],
    /// [`ConfigError::InvalidValue`] or [`ConfigError::Parse`] when a layer is wrong;
    /// [`ConfigError::Invalid`] when the merged config fails [`ServeConfig::validate`].
    pub fn load(file: Option<&Path>, flags: impl Serialize) -> Result<ServeConfig, ConfigError> {
        Self::from_figment(&Self::figment(file, flags)?)
    }
}

#[cfg(test)]
// `Jail::expect_with` closures must return `figment::Error`, which is large; not our API.
#[allow(clippy::result_large_err)]
mod tests;
