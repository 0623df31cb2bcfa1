//! Where the binaries are, and running short commands (the `stoke` CLI)
//! to completion within a deadline.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::wait::DEADLINE;

/// The workspace root.
pub fn repo_root() -> PathBuf {
    // At run time first: `cargo test` and `cargo run` set it to the
    // package's folder. The compiled-in path can name another clone of
    // the repository that shared the target folder and built this crate
    // first. The root is the nearest folder above with the workspace's
    // Cargo.toml.
    let workspace = |package: &Path| {
        package
            .ancestors()
            .find(|dir| {
                std::fs::read_to_string(dir.join("Cargo.toml"))
                    .is_ok_and(|toml| toml.contains("[workspace]"))
            })
            .map(Path::to_path_buf)
    };
    std::env::var_os("CARGO_MANIFEST_DIR")
        .and_then(|dir| workspace(Path::new(&dir)))
        .or_else(|| workspace(Path::new(env!("CARGO_MANIFEST_DIR"))))
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .expect("sandbox/ has a parent")
                .to_path_buf()
        })
}

/// The folder of the workspace's binaries this process was built with:
/// `target/<profile>` for a test (`target/<profile>/deps/<test>`) or for a
/// binary of the workspace (the scale bench).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("the executable's folder");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("target dir").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// A binary of the workspace, from the target folder this process runs
/// from; panics if it is missing or older than a source it is built from.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins, as scripts/test.sh does)",
        path.display()
    );
    static CURRENT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut current = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
    if !current.iter().any(|n| n == name) {
        if let Err(why) = check_current(&path) {
            panic!(
                "{why}: build the binaries again (cargo build --workspace --bins, as scripts/test.sh does)"
            );
        }
        current.push(name.to_string());
    }
    path
}

/// Whether `bin` is newer than every file its cargo dep-info (`<bin>.d`
/// beside it) names: a test must never run a binary built from older
/// sources than its own.
fn check_current(bin: &Path) -> Result<(), String> {
    let built = std::fs::metadata(bin)
        .and_then(|m| m.modified())
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    let dep_info = bin.with_extension("d");
    let text = std::fs::read_to_string(&dep_info).map_err(|e| {
        format!(
            "cannot tell whether {} is current: {}: {e}",
            bin.display(),
            dep_info.display()
        )
    })?;
    let (_, deps) = text
        .lines()
        .next()
        .and_then(|l| l.split_once(": "))
        .ok_or_else(|| format!("{}: not cargo dep-info", dep_info.display()))?;
    for source in dep_paths(deps) {
        let changed = std::fs::metadata(&source).and_then(|m| m.modified());
        if changed.is_ok_and(|t| t > built) {
            return Err(format!(
                "{} is older than {}, which it is built from",
                bin.display(),
                source.display()
            ));
        }
    }
    Ok(())
}

/// The paths of a dep-info rule's prerequisites (spaces in a path escaped
/// as `\ `).
fn dep_paths(deps: &str) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    let mut current = String::new();
    let mut chars = deps.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => {
                current.push(' ');
                chars.next();
            }
            ' ' => {
                if !current.is_empty() {
                    paths.push(PathBuf::from(std::mem::take(&mut current)));
                }
            }
            c => current.push(c),
        }
    }
    if !current.is_empty() {
        paths.push(PathBuf::from(current));
    }
    paths
}

/// The project's Python (the venv with torch that scripts/env.sh sets up).
pub fn python() -> PathBuf {
    let venv = std::env::var_os("STOKE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("venv"));
    let py = venv.join("bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/test.sh (it sets up the venv)",
        py.display()
    );
    py
}

/// stoke's cache folder (`$STOKE_CACHE`, else `~/.cache/stoke`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("STOKE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/stoke")))
        .unwrap_or_else(std::env::temp_dir)
}

/// Runs the `stoke` CLI and returns its output; fails the test if it runs
/// past the deadline.
pub fn stoke_cli(args: &[&str]) -> Output {
    stoke_cli_env(args, &[])
}

/// Runs the `stoke` CLI with extra environment (store settings).
pub fn stoke_cli_env(args: &[&str], env: &[(String, String)]) -> Output {
    let mut cmd = Command::new(bin("stoke"));
    cmd.args(args).envs(env.iter().map(|(k, v)| (k, v)));
    output_within(cmd, DEADLINE)
}

/// Runs a command to completion within `deadline` (killing it otherwise).
pub fn output_within(mut cmd: Command, deadline: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut buf);
        buf
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut buf);
        buf
    });
    let end = Instant::now() + deadline;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} ran past {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    }
}

/// Bytes as text (lossy).
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).to_string()
}

/// A `file://` URI for a local path.
pub fn file_uri(path: &Path) -> String {
    stoke_store::StoreUri::from_local_path(path)
        .expect("uri")
        .to_string()
}

/// A local path from a `file://` URI.
pub fn uri_path(uri: &str) -> PathBuf {
    url::Url::parse(uri)
        .ok()
        .and_then(|u| u.to_file_path().ok())
        .unwrap_or_else(|| panic!("not a file URI: {uri}"))
}
