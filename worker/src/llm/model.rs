//! The engine's model folder on local disk: a local path is used as it
//! is; a folder in a store is fetched once into
//! `~/.cache/stoke/models/<content hash>/` (the hash of its files' names
//! and contents), found again by its listing (names, sizes, entity tags)
//! without downloading it, and shared by every job that names it.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use stoke_store::{StoreUri, Stores};
use tracing::info;

use super::{LlmError, cache_root};

/// The local folder of `model` (a path or a store URI), fetched if needed.
pub(super) fn local_model(
    model: &str,
    stores: &Stores,
    runtime: &tokio::runtime::Handle,
) -> Result<PathBuf, LlmError> {
    if !model.contains("://") {
        return Ok(PathBuf::from(model));
    }
    let uri = StoreUri::parse(model).map_err(|e| LlmError::Model {
        model: model.to_string(),
        message: e.to_string(),
    })?;
    if let Some(path) = uri.local_path() {
        return Ok(path);
    }
    fetch(&uri, stores, runtime)
}

fn fetch(
    uri: &StoreUri,
    stores: &Stores,
    runtime: &tokio::runtime::Handle,
) -> Result<PathBuf, LlmError> {
    let fail = |message: String| LlmError::Model {
        model: uri.to_string(),
        message,
    };
    let prefix = if uri.as_str().ends_with('/') {
        uri.clone()
    } else {
        StoreUri::parse(&format!("{uri}/")).map_err(|e| fail(e.to_string()))?
    };
    let listed = runtime
        .block_on(stores.list(&prefix))
        .map_err(|e| fail(format!("listing: {e}")))?;
    let base = prefix.as_str();
    let mut files: Vec<(String, stoke_store::Listed)> = listed
        .into_iter()
        .filter_map(|l| {
            let rel = l.uri.as_str().strip_prefix(base)?.to_string();
            (!rel.is_empty() && !rel.ends_with('/')).then_some((rel, l))
        })
        .collect();
    files.sort_by(|a, b| a.0.cmp(&b.0));
    if files.is_empty() {
        return Err(fail("no objects under it".into()));
    }
    let models = cache_root().join("models");
    let mut by_listing = Sha256::new();
    by_listing.update(base.as_bytes());
    for (rel, l) in &files {
        by_listing.update(format!("{rel}\0{}\0{:?}\n", l.size, l.e_tag).as_bytes());
    }
    let pointer = models
        .join("by-listing")
        .join(hex::encode(by_listing.finalize()));
    if let Ok(hash) = std::fs::read_to_string(&pointer) {
        let dir = models.join(hash.trim());
        if dir.is_dir() {
            return Ok(dir);
        }
    }
    let io = |what: &str, p: &Path, e: std::io::Error| fail(format!("{what} {}: {e}", p.display()));
    std::fs::create_dir_all(&models).map_err(|e| io("creating", &models, e))?;
    let tmp = tempfile::tempdir_in(&models).map_err(|e| io("creating a folder in", &models, e))?;
    let mut content = Sha256::new();
    for (rel, l) in &files {
        if rel.split('/').any(|s| s == ".." || s.is_empty()) {
            return Err(fail(format!("object name {rel:?} cannot be a file name")));
        }
        let bytes = runtime
            .block_on(stores.get(&l.uri))
            .map_err(|e| fail(format!("reading {}: {e}", l.uri)))?;
        content.update(rel.as_bytes());
        content.update([0]);
        content.update(Sha256::digest(&bytes));
        let path = tmp.path().join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io("creating", parent, e))?;
        }
        std::fs::write(&path, &bytes).map_err(|e| io("writing", &path, e))?;
    }
    let hash = hex::encode(content.finalize());
    let dir = models.join(&hash);
    if !dir.is_dir() {
        let kept = tmp.keep();
        if let Err(e) = std::fs::rename(&kept, &dir) {
            // Another worker on this machine fetched it first.
            let _ = std::fs::remove_dir_all(&kept);
            if !dir.is_dir() {
                return Err(io("moving the model to", &dir, e));
            }
        }
    }
    if let Some(parent) = pointer.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io("creating", parent, e))?;
    }
    std::fs::write(&pointer, &hash).map_err(|e| io("writing", &pointer, e))?;
    info!(model = %uri, dir = %dir.display(), files = files.len(), "model fetched");
    Ok(dir)
}
