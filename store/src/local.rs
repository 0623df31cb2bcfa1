//! The local file system's fast paths for [`super::Stores::copy_all`] and
//! [`super::Stores::put_all`]: plain system calls on one blocking thread,
//! with the same results as `object_store`'s local store.

use std::path::Path as FsPath;

/// What one local copy came to.
pub(super) enum LocalCopy {
    Done,
    /// The source does not exist.
    Missing,
    /// Left to the general path.
    Fallback,
}

/// Puts `to` in place as a hard link to `from`, creating its folders if
/// needed; an object already at `to` is left if it is `from` itself (a
/// retried copy) and otherwise replaced atomically (a link under a
/// temporary name, then a rename), as `object_store`'s local copy does.
pub(super) fn link_local(from: &FsPath, to: &FsPath) -> LocalCopy {
    use std::io::ErrorKind;
    let mut made_folders = false;
    loop {
        match std::fs::hard_link(from, to) {
            Ok(()) => return LocalCopy::Done,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if !from.exists() {
                    return LocalCopy::Missing;
                }
                let Some(parent) = to.parent() else {
                    return LocalCopy::Fallback;
                };
                if made_folders || std::fs::create_dir_all(parent).is_err() {
                    return LocalCopy::Fallback;
                }
                made_folders = true;
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                return replace_local(from, to);
            }
            Err(_) => return LocalCopy::Fallback,
        }
    }
}

/// A temporary name beside `path` that no other writer uses and that
/// listings skip (`object_store` hides `<name>#<digits>`).
fn temp_beside(path: &FsPath) -> Option<std::path::PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut name = path.file_name()?.to_os_string();
    name.push(format!("#9{}{n:06}", std::process::id()));
    Some(path.with_file_name(name))
}

/// Writes `bytes` to `path` through a temporary file renamed into place,
/// creating its folders if needed; `false` if anything failed (the caller
/// then writes it the general way).
pub(super) fn write_local(path: &FsPath, bytes: &[u8]) -> bool {
    use std::io::Write;
    let Some(temp) = temp_beside(path) else {
        return false;
    };
    let open = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
    };
    let file = match open() {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let made = path
                .parent()
                .is_some_and(|p| std::fs::create_dir_all(p).is_ok());
            match made.then(open) {
                Some(Ok(file)) => file,
                _ => return false,
            }
        }
        Err(_) => return false,
    };
    let mut file = file;
    if file.write_all(bytes).is_err() || std::fs::rename(&temp, path).is_err() {
        let _ = std::fs::remove_file(&temp);
        return false;
    }
    true
}

fn replace_local(from: &FsPath, to: &FsPath) -> LocalCopy {
    use std::os::unix::fs::MetadataExt;
    let same = match (std::fs::metadata(from), std::fs::metadata(to)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    };
    if same {
        return LocalCopy::Done;
    }
    let Some(temp) = temp_beside(to) else {
        return LocalCopy::Fallback;
    };
    if std::fs::hard_link(from, &temp).is_err() {
        return LocalCopy::Fallback;
    }
    if std::fs::rename(&temp, to).is_err() {
        let _ = std::fs::remove_file(&temp);
        return LocalCopy::Fallback;
    }
    LocalCopy::Done
}
