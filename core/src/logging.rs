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

/// Set (to anything but `0` or empty) to see an error that ends a process
/// in full: its debug form, with a backtrace when `RUST_BACKTRACE` asks for
/// one. Without it, a user sees the message and its causes only.
pub const DEBUG_VAR: &str = "STOKE_DEBUG";

/// True when [`DEBUG_VAR`] is set.
pub fn debug_enabled() -> bool {
    std::env::var_os(DEBUG_VAR).is_some_and(|v| !v.is_empty() && v != "0")
}

/// How an error that ends a process reads: `program: message: cause: ...`
/// on one line (a cause whose text the message already holds is not
/// repeated). Only with `STOKE_DEBUG` the debug form `debug` (with a
/// backtrace, when `RUST_BACKTRACE` captured one): `RUST_BACKTRACE=1` alone,
/// common among Rust users, must not turn a typo in a spec into 30 frames.
/// Panics (real bugs) keep Rust's own report, backtrace included.
pub fn fatal_message(
    program: &str,
    error: &(dyn std::error::Error + 'static),
    debug: &dyn std::fmt::Debug,
) -> String {
    if debug_enabled() {
        return format!("{program}: {debug:?}");
    }
    let mut message = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        cause = c.source();
    }
    format!("{program}: {message}")
}

/// The exit status of a process whose reader went away: that of a process
/// killed by SIGPIPE (128 + 13), as Unix tools end.
pub const EXIT_BROKEN_PIPE: i32 = 141;

/// Makes printing to a closed stdout or stderr (`stoke report J | head -1`)
/// end the process quietly with [`EXIT_BROKEN_PIPE`], as Unix tools do.
/// Rust ignores SIGPIPE, so such a print fails with EPIPE and `println!`
/// panics ("failed printing to stdout: Broken pipe"); this hook turns that
/// one panic into the quiet exit and leaves every other panic as it was.
/// Call it first in `main`.
pub fn exit_quietly_on_broken_pipe() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if is_broken_pipe_panic(message) {
            std::process::exit(EXIT_BROKEN_PIPE);
        }
        previous(info);
    }));
}

/// The message of `print!`'s panic on a closed pipe.
fn is_broken_pipe_panic(message: &str) -> bool {
    message.starts_with("failed printing to std") && message.contains("Broken pipe")
}

/// Prints [`fatal_message`] to stderr.
pub fn print_fatal(
    program: &str,
    error: &(dyn std::error::Error + 'static),
    debug: &dyn std::fmt::Debug,
) {
    eprintln!("{}", fatal_message(program, error, debug));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_prints_to_a_closed_pipe_exit_quietly() {
        assert!(is_broken_pipe_panic(
            "failed printing to stdout: Broken pipe (os error 32)"
        ));
        assert!(is_broken_pipe_panic(
            "failed printing to stderr: Broken pipe (os error 32)"
        ));
        assert!(!is_broken_pipe_panic("index out of bounds"));
        assert!(!is_broken_pipe_panic(
            "failed printing to stdout: No space left on device"
        ));
    }

    #[test]
    fn formats_parse_by_name() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        let err = "xml".parse::<LogFormat>().expect_err("unknown format");
        assert!(err.contains("xml"), "{err}");
    }

    #[derive(Debug)]
    struct Outer(std::io::Error);
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "reading job spec job.toml: {}", self.0)
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[derive(Debug)]
    struct Context(Outer);
    impl std::fmt::Display for Context {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("submitting")
        }
    }
    impl std::error::Error for Context {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_fatal_error_is_its_message_and_causes_once() {
        // Whatever RUST_BACKTRACE says; STOKE_DEBUG is unset in tests.
        if debug_enabled() {
            return;
        }
        let e = Context(Outer(std::io::Error::from(std::io::ErrorKind::NotFound)));
        let text = fatal_message("stoke", &e, &e);
        assert_eq!(
            text,
            "stoke: submitting: reading job spec job.toml: entity not found"
        );
        assert!(!text.contains("Context"), "{text}");
    }
}
