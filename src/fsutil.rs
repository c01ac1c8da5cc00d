//! Atomic file writes: a temp file in the same directory, fsync, then rename, so a reader (or a
//! resumed run) never sees a half-written file.

use std::io::Write;
use std::path::Path;

use crate::error::{Result, TroupeError};

/// Writes `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| {
        let mut file = std::fs::File::create(tmp).map_err(|e| TroupeError::io(path, e))?;
        file.write_all(bytes).map_err(|e| TroupeError::io(path, e))
    })
}

/// Writes `path` atomically through `fill`, which creates and writes the temporary file it is
/// given (beside `path`; its errors should name `path`). The file is then synced and renamed
/// over `path`; on any error it is removed and `path` is left as it was.
pub fn write_atomic_with(path: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
    let result = fill(&tmp).and_then(|()| {
        (|| {
            std::fs::OpenOptions::new().write(true).open(&tmp)?.sync_all()?;
            std::fs::rename(&tmp, path)
        })()
        .map_err(|e| TroupeError::io(path, e))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Builds a directory atomically: `fill` writes into a fresh staging directory beside `dir`,
/// which then replaces `dir` (an existing `dir` is moved aside first and deleted after). On
/// error, the staging directory is removed and `dir` is left as it was.
pub fn write_dir_atomic(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| TroupeError::io(parent, e))?;
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("dir");
    let staging = parent.join(format!(".{name}.staging-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    let result = std::fs::create_dir_all(&staging)
        .map_err(|e| TroupeError::io(&staging, e))
        .and_then(|()| fill(&staging))
        .and_then(|()| replace_dir(&staging, dir));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

/// Moves `staging` to `dir`, moving an existing `dir` aside first and deleting it after.
fn replace_dir(staging: &Path, dir: &Path) -> Result<()> {
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("dir");
    let aside = dir.with_file_name(format!(".{name}.old-{}", std::process::id()));
    let moved_aside = if dir.exists() {
        let _ = std::fs::remove_dir_all(&aside);
        std::fs::rename(dir, &aside).map_err(|e| TroupeError::io(dir, e))?;
        true
    } else {
        false
    };
    if let Err(e) = std::fs::rename(staging, dir) {
        if moved_aside {
            let _ = std::fs::rename(&aside, dir);
        }
        return Err(TroupeError::io(dir, e));
    }
    if moved_aside {
        let _ = std::fs::remove_dir_all(&aside);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temp file left behind");
    }
}
