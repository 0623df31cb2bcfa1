//! A sandbox's folder: roots, logs, specs and outputs of one test.

use std::path::{Path, PathBuf};

/// A temporary folder removed on drop, unless a panic is unwinding (a
/// failing test keeps its logs) or `STOKE_KEEP` (or `STOKE_CHAOS_KEEP`) is
/// set.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    pub fn new(prefix: &str) -> Self {
        let path = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("tempdir")
            .keep();
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let keep = ["STOKE_KEEP", "STOKE_CHAOS_KEEP"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        if std::thread::panicking() || keep {
            eprintln!("kept {} for inspection", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}
