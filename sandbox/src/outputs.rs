//! What a job stored under a `file://` root: its manifest, progress
//! records and files. (Reading the rows of its outputs needs Arrow; the
//! tests crate does that.)

use std::path::{Path, PathBuf};

use stoke_core::records::{Manifest, ProgressRecord};

/// The manifest of a job under a `file://` root.
pub fn manifest(root: &Path, job_id: &str) -> Manifest {
    let path = root.join("jobs").join(job_id).join("manifest.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("decoding {}: {e}", path.display()))
}

/// A job's committed progress record for one shard, if written yet.
pub fn progress(root: &Path, job_id: &str, shard_id: &str) -> Option<ProgressRecord> {
    let root = stoke_store::StoreUri::parse(&format!("file://{}", root.display())).ok()?;
    let layout = stoke_core::layout::RootLayout::new(root).job(job_id);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    let mut stored = runtime
        .block_on(stoke_core::progress::load(
            &stoke_store::Stores::new(),
            &layout,
        ))
        .ok()?;
    stored.records.remove(shard_id)
}

/// Every file under a folder, recursively (none when it does not exist).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}
