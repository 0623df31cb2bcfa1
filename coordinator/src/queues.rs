//! Queues and their caps, from the command line (`--queue NAME=MAX_LEASES`,
//! repeatable) or a small TOML file (`--queues-file`):
//!
//! ```toml
//! borrow = true          # as --queue-borrow
//! [queues]
//! team-a = 8             # at most 8 leases at once
//! team-b = 4
//! [prices]               # as --price: a worker-hour per pool
//! gpu = 2.50
//! cpu = 0.20
//! ```
//!
//! A flag names a queue (or prices a pool) the file also names: the flag
//! wins.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum QueueConfigError {
    #[error("--queue {arg:?}: expected NAME=MAX_LEASES, such as team-a=8")]
    Form { arg: String },
    #[error("--queue {arg:?}: MAX_LEASES must be a whole number of at least 1")]
    Cap { arg: String },
    #[error("--queue {arg:?}: {message}")]
    Name { arg: String, message: String },
    #[error("reading queues file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("queues file {path}: {message}")]
    File { path: String, message: String },
}

/// Queues with their caps, and whether a queue at its cap may borrow.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueConfig {
    #[serde(default)]
    pub borrow: bool,
    #[serde(default)]
    pub queues: BTreeMap<String, u64>,
    /// What a worker-hour costs in each pool.
    #[serde(default)]
    pub prices: BTreeMap<String, f64>,
}

impl QueueConfig {
    /// Reads a queues file (TOML, see the module docs).
    pub fn from_file(path: &Path) -> Result<Self, QueueConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| QueueConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        let config: QueueConfig = toml::from_str(&text).map_err(|e| QueueConfigError::File {
            path: shown.clone(),
            message: e.message().to_string(),
        })?;
        for (name, cap) in &config.queues {
            stoke_core::schedule::validate_queue(name).map_err(|e| QueueConfigError::File {
                path: shown.clone(),
                message: e.to_string(),
            })?;
            if *cap == 0 {
                return Err(QueueConfigError::File {
                    path: shown,
                    message: format!("queues.{name}: the cap must be at least 1, got 0"),
                });
            }
        }
        for (pool, price) in &config.prices {
            stoke_core::schedule::validate_pool(pool).map_err(|e| QueueConfigError::File {
                path: shown.clone(),
                message: format!("prices.{pool}: {e}"),
            })?;
            if !(price.is_finite() && *price >= 0.0) {
                return Err(QueueConfigError::File {
                    path: shown,
                    message: format!(
                        "prices.{pool}: the price must be a number of at least 0, got {price}"
                    ),
                });
            }
        }
        Ok(config)
    }

    /// Adds `--queue NAME=MAX_LEASES` flags (they win over the file).
    pub fn with_flags(mut self, flags: &[String]) -> Result<Self, QueueConfigError> {
        for arg in flags {
            let (name, cap) = parse_queue_flag(arg)?;
            self.queues.insert(name, cap);
        }
        Ok(self)
    }
}

/// One `--queue NAME=MAX_LEASES`.
pub fn parse_queue_flag(arg: &str) -> Result<(String, u64), QueueConfigError> {
    let Some((name, cap)) = arg.split_once('=') else {
        return Err(QueueConfigError::Form {
            arg: arg.to_string(),
        });
    };
    stoke_core::schedule::validate_queue(name).map_err(|e| QueueConfigError::Name {
        arg: arg.to_string(),
        message: e.to_string(),
    })?;
    match cap.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok((name.to_string(), n)),
        _ => Err(QueueConfigError::Cap {
            arg: arg.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_and_name_what_is_wrong() {
        assert_eq!(
            parse_queue_flag("team-a=8").expect("valid"),
            ("team-a".to_string(), 8)
        );
        for (arg, says) in [
            ("team-a", "NAME=MAX_LEASES"),
            ("team-a=0", "at least 1"),
            ("team-a=lots", "at least 1"),
            ("bad name=3", "queue"),
        ] {
            let e = parse_queue_flag(arg).expect_err(arg).to_string();
            assert!(e.contains(says) && e.contains(arg), "{arg}: {e}");
        }
    }

    #[test]
    fn a_file_and_flags_combine() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("queues.toml");
        std::fs::write(&path, "borrow = true\n[queues]\nteam-a = 8\nteam-b = 4\n").expect("write");
        let config = QueueConfig::from_file(&path)
            .expect("valid")
            .with_flags(&["team-b=2".to_string()])
            .expect("valid");
        assert!(config.borrow);
        assert_eq!(config.queues.get("team-a"), Some(&8));
        assert_eq!(config.queues.get("team-b"), Some(&2));
        std::fs::write(&path, "[queues]\nteam-a = 0\n").expect("write");
        let e = QueueConfig::from_file(&path).expect_err("zero").to_string();
        assert!(e.contains("queues.team-a"), "{e}");
        std::fs::write(&path, "borow = true\n").expect("write");
        let e = QueueConfig::from_file(&path).expect_err("typo").to_string();
        assert!(e.contains("borow"), "{e}");
    }

    #[test]
    fn a_file_prices_pools_and_names_a_bad_price() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("coordinator.toml");
        std::fs::write(&path, "[prices]\ngpu = 2.5\ncpu = 0.2\n").expect("write");
        let config = QueueConfig::from_file(&path).expect("valid");
        assert_eq!(config.prices.get("gpu"), Some(&2.5));
        assert_eq!(config.prices.get("cpu"), Some(&0.2));
        std::fs::write(&path, "[prices]\ngpu = -1.0\n").expect("write");
        let e = QueueConfig::from_file(&path)
            .expect_err("negative")
            .to_string();
        assert!(
            e.contains("prices.gpu: the price must be a number of at least 0, got -1"),
            "{e}"
        );
    }
}
