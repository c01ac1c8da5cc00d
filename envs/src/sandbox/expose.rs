//! Making the interpreter reachable by the unprivileged user that generated code runs as,
//! when the trainer is root and the interpreter lives under a directory only root may enter
//! (`/root/.pyenv/...`, a common install).
//!
//! Inside the child's private mount namespace, each such directory is covered with an empty
//! read-only tmpfs into which only the interpreter's own directories are bind-mounted back
//! (read-only, at the same paths). Nothing else of the hidden directory is visible, and the
//! trainer's mount namespace is untouched.

use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::confine::MountOp;

/// A directory the unprivileged user may not enter, and the directories beneath it that the
/// interpreter needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exposure {
    /// The directory to cover (`/root`).
    pub hidden: PathBuf,
    /// What to show inside it, at the same paths.
    pub shown: Vec<PathBuf>,
}

/// Whether `uid`/`gid` may search (enter) the directory `path`.
fn searchable(path: &Path, uid: u32, gid: u32) -> bool {
    let Ok(meta) = std::fs::metadata(path) else { return false };
    let mode = meta.mode();
    if meta.uid() == uid {
        mode & 0o100 != 0
    } else if meta.gid() == gid {
        mode & 0o010 != 0
    } else {
        mode & 0o001 != 0
    }
}

/// The exposures that make every directory of `needed` reachable by `uid`/`gid`: for each,
/// the topmost ancestor that user cannot enter. Directories already reachable need nothing; a
/// directory the user cannot enter itself cannot be helped (and is left out). `keep_visible`
/// (the evaluation directories' parent) must never be covered.
pub fn plan(needed: &[PathBuf], uid: u32, gid: u32, keep_visible: &Path) -> Vec<Exposure> {
    let mut exposures: Vec<Exposure> = Vec::new();
    let mut dirs: Vec<PathBuf> =
        needed.iter().filter_map(|path| std::fs::canonicalize(path).ok()).filter(|path| path.is_dir()).collect();
    dirs.sort();
    dirs.dedup();
    // Only the outermost of nested directories.
    let outermost: Vec<PathBuf> =
        dirs.iter().filter(|dir| !dirs.iter().any(|other| other != *dir && dir.starts_with(other))).cloned().collect();
    let keep_visible = std::fs::canonicalize(keep_visible).unwrap_or_else(|_| keep_visible.to_path_buf());
    for dir in outermost {
        let blocked =
            dir.ancestors().collect::<Vec<_>>().into_iter().rev().find(|ancestor| !searchable(ancestor, uid, gid));
        let Some(hidden) = blocked.map(Path::to_path_buf) else { continue };
        if hidden == dir || hidden == Path::new("/") || keep_visible.starts_with(&hidden) {
            continue;
        }
        match exposures.iter_mut().find(|exposure| exposure.hidden == hidden) {
            Some(exposure) => exposure.shown.push(dir),
            None => exposures.push(Exposure { hidden, shown: vec![dir] }),
        }
    }
    exposures
}

fn c_path(path: &Path) -> Option<CString> {
    CString::new(path.as_os_str().as_encoded_bytes()).ok()
}

/// The mount steps for `exposures`, staging bind mounts in `staging_dir` (created here, each
/// staging point removed again by the child). None when a path cannot be passed to the kernel.
pub fn mount_ops(exposures: &[Exposure], staging_dir: &Path) -> std::io::Result<Vec<MountOp>> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "a path holds a NUL byte");
    let mut ops = Vec::new();
    let mut staged = 0usize;
    for exposure in exposures {
        let mut moves = Vec::new();
        for shown in &exposure.shown {
            let staging = staging_dir.join(format!(".troupe-mount-{staged}"));
            staged += 1;
            std::fs::create_dir(&staging)?;
            let (source, point) = (c_path(shown).ok_or_else(bad)?, c_path(&staging).ok_or_else(bad)?);
            ops.push(MountOp::Bind(source, point.clone()));
            moves.push((point, shown));
        }
        let hidden = c_path(&exposure.hidden).ok_or_else(bad)?;
        ops.push(MountOp::Tmpfs(hidden.clone()));
        for (point, shown) in moves {
            let inside = shown.strip_prefix(&exposure.hidden).map_err(|_| bad())?;
            let mut path = exposure.hidden.clone();
            for component in inside.components() {
                path.push(component);
                ops.push(MountOp::Mkdir(c_path(&path).ok_or_else(bad)?));
            }
            let target = c_path(shown).ok_or_else(bad)?;
            ops.push(MountOp::Move(point.clone(), target.clone()));
            ops.push(MountOp::ReadOnly(target, true));
            ops.push(MountOp::Rmdir(point));
        }
        ops.push(MountOp::ReadOnly(hidden, false));
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_topmost_closed_ancestor_is_covered_and_nested_paths_merge() {
        let root = tempfile::tempdir().expect("temp dir");
        let closed = root.path().join("closed");
        let prefix = closed.join("a/b/prefix");
        std::fs::create_dir_all(prefix.join("bin")).expect("dirs");
        std::fs::create_dir_all(root.path().join("open")).expect("dirs");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let needed = vec![prefix.clone(), prefix.join("bin"), root.path().join("open")];
        // A user that owns nothing here.
        let exposures = plan(&needed, 54321, 54321, Path::new("/nonexistent-eval-dir"));
        let canonical = |p: &Path| std::fs::canonicalize(p).expect("exists");
        if searchable(&canonical(root.path()), 54321, 54321) {
            assert_eq!(exposures, vec![Exposure { hidden: canonical(&closed), shown: vec![canonical(&prefix)] }]);
        }
        // Covering the directory that holds the evaluation directories is refused.
        assert!(plan(&needed, 54321, 54321, &closed.join("work")).is_empty());
    }
}
