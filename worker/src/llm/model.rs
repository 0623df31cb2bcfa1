//! The engine's model folder on local disk: a local path is used as it
//! is; a folder in a store is fetched once into
//! `~/.cache/stoke/models/<content hash>/` (the hash of its files' names
//! and contents), found again by its listing (names, sizes, entity tags)
//! without downloading it, and shared by every job that names it.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use stoke_store::{StoreUri, Stores};
use tracing::info;

use super::LlmError;

/// The local folder of `model` (a path or a store URI), fetched if needed
/// into `cache` (`~/.cache/stoke`).
pub(super) fn local_model(
    model: &str,
    stores: &Stores,
    runtime: &tokio::runtime::Handle,
    cache: &Path,
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
    fetch(&uri, stores, runtime, cache)
}

fn fetch(
    uri: &StoreUri,
    stores: &Stores,
    runtime: &tokio::runtime::Handle,
    cache: &Path,
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
    let models = cache.join("models");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn put(stores: &Stores, rt: &tokio::runtime::Runtime, uri: &str, bytes: &str) {
        let uri = StoreUri::parse(uri).expect("uri");
        rt.block_on(stores.put(&uri, bytes::Bytes::from(bytes.to_string())))
            .expect("put");
    }

    #[test]
    fn a_model_in_a_store_is_fetched_once_by_its_content() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let stores = Stores::new();
        let cache = tempfile::tempdir().expect("tempdir");
        put(&stores, &rt, "memory:///models/tiny/config.json", "{}");
        put(
            &stores,
            &rt,
            "memory:///models/tiny/sub/tokenizer.json",
            "tok",
        );
        let model = "memory:///models/tiny/";
        let dir = local_model(model, &stores, rt.handle(), cache.path()).expect("fetched");
        assert!(dir.starts_with(cache.path().join("models")));
        assert_eq!(
            std::fs::read_to_string(dir.join("config.json"))
                .ok()
                .as_deref(),
            Some("{}")
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("sub/tokenizer.json"))
                .ok()
                .as_deref(),
            Some("tok")
        );
        // Found again by its listing, without fetching: a file changed in
        // the cache stays changed.
        std::fs::write(dir.join("config.json"), "{\"kept\": 1}").expect("write");
        let again = local_model(model, &stores, rt.handle(), cache.path()).expect("again");
        assert_eq!(again, dir);
        assert!(
            std::fs::read_to_string(again.join("config.json")).is_ok_and(|s| s.contains("kept"))
        );
        // Another content is another folder.
        put(
            &stores,
            &rt,
            "memory:///models/tiny/config.json",
            "{\"v\": 2}",
        );
        let changed = local_model(model, &stores, rt.handle(), cache.path()).expect("changed");
        assert_ne!(changed, dir);
        // A local path is used as it is.
        let local =
            local_model("/opt/models/m", &stores, rt.handle(), cache.path()).expect("local");
        assert_eq!(local, PathBuf::from("/opt/models/m"));
        let missing = local_model("memory:///models/none/", &stores, rt.handle(), cache.path());
        assert!(matches!(missing, Err(LlmError::Model { .. })));
    }
}
