//! The runtime crate's errors: [`ConfigError`] for loading and validating config (with the
//! [`ConfigLayer`] a bad value came from), and [`RuntimeError`], the crate-wide enum the
//! actor runtime reports with.
//!
//! Each has a stable [`kind`](RuntimeError::kind) string for logs and metrics labels; the
//! strings never change once released.

use std::path::PathBuf;
use std::time::Duration;

use crate::wire::WireError;

/// Where a config value came from: the layer of the figment stack that set it (named in
/// [`ConfigError`]s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigLayer {
    /// [`ServeConfig::default`](crate::config::ServeConfig::default).
    Defaults,
    /// A TOML file.
    File(PathBuf),
    /// A `PDSERVE_<SECTION>__<KEY>` environment variable (its full name).
    Env(String),
    /// Command-line flags.
    Flags,
}

impl std::fmt::Display for ConfigLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Defaults => f.write_str("built-in defaults"),
            Self::File(path) => write!(f, "config file `{}`", path.display()),
            Self::Env(name) => write!(f, "environment variable `{name}`"),
            Self::Flags => f.write_str("command-line flags"),
        }
    }
}

/// Why a configuration could not be loaded. Every variant that concerns a key names it in
/// dotted form (`scheduler.block_size`) and, where known, the layer that set it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The config file given explicitly could not be read.
    #[error("cannot read config file `{}`: {message}", path.display())]
    File {
        /// The path given.
        path: PathBuf,
        /// The I/O error.
        message: String,
    },
    /// A layer holds a key the config does not have.
    #[error("unknown config key `{key}`{}; expected one of: {}", layer_suffix(.layer), .expected.join(", "))]
    UnknownKey {
        /// The dotted key (`server.prott`).
        key: String,
        /// The keys allowed at that level.
        expected: Vec<String>,
        /// The layer that set the key, when known.
        layer: Option<ConfigLayer>,
    },
    /// A layer holds a value of the wrong type or shape for its key.
    #[error("invalid value for `{key}`{}: {message}", layer_suffix(.layer))]
    InvalidValue {
        /// The dotted key.
        key: String,
        /// What was wrong.
        message: String,
        /// The layer that set the value, when known.
        layer: Option<ConfigLayer>,
    },
    /// A layer could not be parsed at all (a TOML syntax error); no key is known.
    #[error("cannot parse config{}: {message}", .origin.as_ref().map(|s| format!(" ({s})")).unwrap_or_default())]
    Parse {
        /// The parser's message.
        message: String,
        /// The layer, described, when known.
        origin: Option<String>,
    },
    /// The merged config failed [`ServeConfig::validate`](crate::config::ServeConfig::validate).
    #[error("{message}{}", layer_suffix(.layer))]
    Invalid {
        /// The dotted key that is out of range.
        key: String,
        /// The full message, naming the key.
        message: String,
        /// The layer that set the value, when known (filled in by `load`).
        layer: Option<ConfigLayer>,
    },
}

fn layer_suffix(layer: &Option<ConfigLayer>) -> String {
    layer
        .as_ref()
        .map(|l| format!(" (set by {l})"))
        .unwrap_or_default()
}

impl ConfigError {
    /// A stable name of the error kind, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::File { .. } => "config_file",
            Self::UnknownKey { .. } => "config_unknown_key",
            Self::InvalidValue { .. } => "config_invalid_value",
            Self::Parse { .. } => "config_parse",
            Self::Invalid { .. } => "config_invalid",
        }
    }

    /// The dotted config key the error concerns, when there is one.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::UnknownKey { key, .. }
            | Self::InvalidValue { key, .. }
            | Self::Invalid { key, .. } => Some(key),
            Self::File { .. } | Self::Parse { .. } => None,
        }
    }
}

/// The runtime crate's error: what the actor runtime's shared plumbing reports.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RuntimeError {
    /// Loading or validating the configuration failed.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A control-plane frame could not be encoded or decoded.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// An actor failed (panicked or returned an error) and was not restarted.
    #[error("actor `{actor}` failed: {message}")]
    ActorFailed {
        /// The actor's registered name.
        actor: String,
        /// Its error or panic message.
        message: String,
    },
    /// An actor kept failing: its restart budget is spent and its supervisor escalates.
    #[error("actor `{actor}` failed {restarts} times within {within:?}; escalating")]
    RestartBudgetExhausted {
        /// The actor's registered name.
        actor: String,
        /// Failures counted within the window.
        restarts: u32,
        /// The policy's window.
        within: Duration,
    },
    /// A call to an actor got no answer in time.
    #[error("`{what}` timed out after {after:?}")]
    Timeout {
        /// What was waited for (`scheduler.stats`, ...).
        what: String,
        /// How long it waited.
        after: Duration,
    },
    /// The actor addressed has stopped (its mailbox is closed).
    #[error("actor `{actor}` is stopped")]
    ActorStopped {
        /// The actor's registered name.
        actor: String,
    },
    /// A report carried an epoch older than the actor's current one and was dropped.
    #[error("stale report from `{actor}`: epoch {got} < current {current}")]
    StaleEpoch {
        /// The actor's registered name.
        actor: String,
        /// The epoch the report carried.
        got: u64,
        /// The actor's current epoch.
        current: u64,
    },
}

impl RuntimeError {
    /// A stable name of the error kind, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Config(e) => e.kind(),
            Self::Wire(e) => e.kind(),
            Self::ActorFailed { .. } => "actor_failed",
            Self::RestartBudgetExhausted { .. } => "restart_budget_exhausted",
            Self::Timeout { .. } => "timeout",
            Self::ActorStopped { .. } => "actor_stopped",
            Self::StaleEpoch { .. } => "stale_epoch",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_stable_and_distinct() {
        let errors = [
            RuntimeError::Config(ConfigError::File {
                path: "x".into(),
                message: "m".into(),
            }),
            RuntimeError::Wire(WireError::Malformed("m".into())),
            RuntimeError::ActorFailed {
                actor: "a".into(),
                message: "m".into(),
            },
            RuntimeError::RestartBudgetExhausted {
                actor: "a".into(),
                restarts: 3,
                within: Duration::from_secs(60),
            },
            RuntimeError::Timeout {
                what: "w".into(),
                after: Duration::from_secs(1),
            },
            RuntimeError::ActorStopped { actor: "a".into() },
            RuntimeError::StaleEpoch {
                actor: "a".into(),
                got: 1,
                current: 2,
            },
        ];
        let kinds: Vec<_> = errors.iter().map(RuntimeError::kind).collect();
        assert_eq!(
            kinds,
            [
                "config_file",
                "malformed_frame",
                "actor_failed",
                "restart_budget_exhausted",
                "timeout",
                "actor_stopped",
                "stale_epoch"
            ]
        );
    }

    #[test]
    fn messages_name_key_and_layer() {
        let e = ConfigError::InvalidValue {
            key: "server.port".into(),
            message: "invalid type".into(),
            layer: Some(ConfigLayer::Env("PDSERVE_SERVER__PORT".into())),
        };
        assert_eq!(
            e.to_string(),
            "invalid value for `server.port` (set by environment variable `PDSERVE_SERVER__PORT`): invalid type"
        );
        assert_eq!(e.key(), Some("server.port"));
    }
}
