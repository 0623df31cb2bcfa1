//! Logging for stoke's binaries, in one place: `tracing` events to stderr,
//! filtered by `RUST_LOG` (with a default per binary), as human-readable
//! text or as one JSON object per line for log collectors
//! (`--log-format json`).

use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Text, coloured when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, fields, span.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("unknown log format {other:?}; use text or json")),
        }
    }
}

/// Installs the process's subscriber; `default_filter` applies when
/// `RUST_LOG` is unset or invalid.
pub fn init_logging(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => builder.json().with_current_span(true).init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_by_name() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        let err = "xml".parse::<LogFormat>().expect_err("unknown format");
        assert!(err.contains("xml"), "{err}");
    }
}
