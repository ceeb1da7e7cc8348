//! Loading in layers: built-in defaults < TOML file < `PDSERVE_<SECTION>__<KEY>`
//! environment < flags, each a named figment provider so an error can say which layer set a
//! bad key ([`ConfigLayer`]).

use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde::Serialize;

use crate::error::{ConfigError, ConfigLayer};

/// Prefix of every environment variable that maps into the config.
pub const ENV_PREFIX: &str = "PDSERVE_";

/// Separator between nesting levels in a config environment variable's name:
/// `PDSERVE_<SECTION>__<KEY>`. Variables without it are not config (e.g. `PDSERVE_HOME`).
pub const ENV_SEPARATOR: &str = "__";

/// The name of the environment variable that sets a dotted config key.
///
/// `env_var_name("server.port") == "PDSERVE_SERVER__PORT"`.
pub fn env_var_name(key: &str) -> String {
    let upper: Vec<String> = key.split('.').map(str::to_ascii_uppercase).collect();
    format!("{ENV_PREFIX}{}", upper.join(ENV_SEPARATOR))
}

const LAYER_DEFAULTS: &str = "built-in defaults";
const LAYER_ENV: &str = "environment";
const LAYER_FLAGS: &str = "command-line flags";

/// A provider under a name of ours, so errors can say which layer a key came from.
struct NamedLayer<P> {
    name: &'static str,
    inner: P,
}

impl<P: Provider> Provider for NamedLayer<P> {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name)
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        self.inner.data()
    }
}

/// The layered figment of a config whose built-in values are `defaults`: defaults < TOML
/// `file` < `PDSERVE_<SECTION>__<KEY>` environment < `flags`.
pub(super) fn layered(
    defaults: impl Serialize,
    file: Option<&Path>,
    flags: impl Serialize,
    env_sections: impl Fn(&str) -> bool + Clone + Send + Sync + 'static,
) -> Result<Figment, ConfigError> {
    let mut figment = Figment::from(NamedLayer {
        name: LAYER_DEFAULTS,
        inner: Serialized::defaults(defaults),
    });
    if let Some(path) = file {
        // `Toml::file` silently treats a missing file as empty; an explicit `--config`
        // that does not exist is a mistake the user must hear about.
        if let Err(err) = std::fs::metadata(path).and_then(|m| {
            if m.is_file() {
                Ok(())
            } else {
                Err(std::io::Error::other("not a regular file"))
            }
        }) {
            return Err(ConfigError::File {
                path: path.to_path_buf(),
                message: err.to_string(),
            });
        }
        figment = figment.merge(Toml::file_exact(path));
    }
    let env = Env::prefixed(ENV_PREFIX)
        .filter(move |key| {
            key.as_str()
                .split_once(ENV_SEPARATOR)
                .is_some_and(|(section, _)| env_sections(&section.to_ascii_lowercase()))
        })
        .split(ENV_SEPARATOR);
    figment = figment
        .merge(NamedLayer {
            name: LAYER_ENV,
            inner: env,
        })
        .merge(NamedLayer {
            name: LAYER_FLAGS,
            inner: Serialized::defaults(flags),
        });
    Ok(figment)
}

/// Extracts a config from `figment` and checks it with `validate`, naming the layer of the
/// offending key.
pub(super) fn extract_validated<T: serde::de::DeserializeOwned>(
    figment: &Figment,
    validate: impl FnOnce(&T) -> Result<(), ConfigError>,
) -> Result<T, ConfigError> {
    let config: T = figment
        .extract()
        .map_err(|err| convert_error(figment, err))?;
    validate(&config).map_err(|err| match err {
        ConfigError::Invalid {
            key,
            message,
            layer: None,
        } => {
            let layer = layer_of(figment, &key);
            ConfigError::Invalid {
                key,
                message,
                layer,
            }
        }
        other => other,
    })?;
    Ok(config)
}

/// Which layer set `key` (dotted), as figment recorded it.
fn layer_of(figment: &Figment, key: &str) -> Option<ConfigLayer> {
    let metadata = figment.find_metadata(key)?;
    Some(layer_from_metadata(metadata, key))
}

fn layer_from_metadata(metadata: &Metadata, key: &str) -> ConfigLayer {
    if let Some(figment::Source::File(path)) = &metadata.source {
        return ConfigLayer::File(path.clone());
    }
    match metadata.name.as_ref() {
        LAYER_ENV => ConfigLayer::Env(env_var_name(key)),
        LAYER_FLAGS => ConfigLayer::Flags,
        _ => ConfigLayer::Defaults,
    }
}

/// Turns figment's error (first of its chain) into a [`ConfigError`] naming the key and layer.
fn convert_error(figment: &Figment, err: figment::Error) -> ConfigError {
    use figment::error::Kind;
    let more = err.count().saturating_sub(1);
    // For an unknown field, figment's path already ends with the field's name.
    let key = err.path.join(".");
    // Prefer the provider that actually holds `key`; the error's own tag can point at the
    // enclosing table, which the defaults created.
    let layer = if key.is_empty() {
        None
    } else {
        layer_of(figment, &key)
            .or_else(|| err.metadata.as_ref().map(|m| layer_from_metadata(m, &key)))
    };
    if let Kind::UnknownField(_, expected) = &err.kind {
        let expected = expected.iter().map(|s| (*s).to_owned()).collect();
        return ConfigError::UnknownKey {
            key,
            expected,
            layer,
        };
    }
    let mut message = err.kind.to_string();
    if more > 0 {
        message.push_str(&format!(" (and {more} more error(s))"));
    }
    if key.is_empty() {
        // Syntax errors in a file and the like carry no key path.
        let origin = err
            .metadata
            .as_ref()
            .map(|m| layer_from_metadata(m, "").to_string());
        return ConfigError::Parse {
            message: err.to_string(),
            origin,
        };
    }
    ConfigError::InvalidValue {
        key,
        message,
        layer,
    }
}
