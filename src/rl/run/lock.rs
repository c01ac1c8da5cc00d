//! One trainer per run directory: an exclusive `flock` on the run directory itself, held for
//! the run's life (deleting or replacing a file inside cannot undo it). The kernel releases it
//! whenever the process ends, however it ends (exit, panic, SIGKILL), so a lock left by a dead
//! process is never in the way. `RUN_DIR/.lock` records the holder's pid, so that a second
//! trainer, or a `--resume` of a run still training, is refused naming it. Nothing in a run
//! directory is written through a symbolic link: one planted where troupe writes is refused.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Result, RunError, TroupeError};

/// The lock file inside a run directory.
pub const LOCK_FILE: &str = ".lock";

/// What troupe writes directly inside a run directory (besides `.lock`), checked for links.
const WRITTEN: &[&str] = &["checkpoints", "plots", "metrics.jsonl", "config.yaml"];

/// A held lock on a run directory; released when dropped (or when the process dies).
#[derive(Debug)]
pub struct RunLock {
    _dir: File,
    _file: File,
    path: PathBuf,
}

/// Refuses a symbolic link at `path` (an absent path is fine).
fn refuse_link(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if metadata.file_type().is_symlink() => Err(TroupeError::io(
            path,
            std::io::Error::other(
                "is a symbolic link; troupe writes nothing through links in a run directory (replace it with a real \
                 file or directory)",
            ),
        )),
        _ => Ok(()),
    }
}

/// Refuses symbolic links where troupe writes in `run_dir`: `.lock`, `checkpoints/` and what
/// it holds, `plots/`, `metrics.jsonl`, `config.yaml`.
pub fn refuse_links(run_dir: &Path) -> Result<()> {
    refuse_link(&run_dir.join(LOCK_FILE))?;
    for name in WRITTEN {
        refuse_link(&run_dir.join(name))?;
    }
    for sub in ["checkpoints", "plots"] {
        if let Ok(entries) = std::fs::read_dir(run_dir.join(sub)) {
            for entry in entries.flatten() {
                refuse_link(&entry.path())?;
            }
        }
    }
    Ok(())
}

impl RunLock {
    /// Locks `run_dir` (creating it), or refuses with [`RunError::RunInUse`](crate::error::RunError::RunInUse) naming the
    /// holder's pid. Never blocks.
    pub fn acquire(run_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(run_dir).map_err(|e| TroupeError::io(run_dir, e))?;
        let dir = File::open(run_dir).map_err(|e| TroupeError::io(run_dir, e))?;
        let path = run_dir.join(LOCK_FILE);
        // SAFETY: flock on a descriptor this process owns.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut text = String::new();
                if let Ok(mut file) = open_no_follow(&path, false) {
                    let _ = (&mut file).take(64).read_to_string(&mut text);
                }
                let holder = text.split_whitespace().next().and_then(|pid| pid.parse().ok());
                return Err(TroupeError::Run(RunError::RunInUse { path: run_dir.to_path_buf(), holder }));
            }
            return Err(TroupeError::io(run_dir, err));
        }
        refuse_links(run_dir)?;
        let mut file = open_no_follow(&path, true).map_err(|e| TroupeError::io(&path, e))?;
        // Ours now: whatever pid a dead holder left is replaced by ours.
        let record = format!("{}\n", std::process::id());
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(record.as_bytes()))
            .and_then(|()| file.flush())
            .map_err(|e| TroupeError::io(&path, e))?;
        Ok(Self { _dir: dir, _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Opens `path` for reading (and writing, creating it, when `write`) without following a
/// symbolic link at `path`.
fn open_no_follow(path: &Path, write: bool) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .create(write)
        .truncate(false)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_with_the_holders_pid_and_a_released_one_is_free() {
        let dir = tempfile::tempdir().expect("temp dir");
        let run = dir.path().join("run");
        let first = RunLock::acquire(&run).expect("free");
        // flock locks belong to the open file: a second open in this process conflicts too.
        match RunLock::acquire(&run) {
            Err(TroupeError::Run(RunError::RunInUse { holder, .. })) => assert_eq!(holder, Some(std::process::id())),
            other => panic!("expected RunInUse, got {other:?}"),
        }
        drop(first);
        let again = RunLock::acquire(&run).expect("released on drop");
        assert!(again.path().ends_with(LOCK_FILE));
    }

    #[test]
    fn a_lock_file_left_by_a_dead_process_is_not_in_the_way() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join(LOCK_FILE), "999999999\n").expect("stale file");
        let lock = RunLock::acquire(dir.path()).expect("nobody holds it");
        let text = std::fs::read_to_string(lock.path()).expect("read");
        assert_eq!(text.trim(), std::process::id().to_string());
    }

    #[test]
    fn deleting_the_lock_file_does_not_free_the_run() {
        let dir = tempfile::tempdir().expect("temp dir");
        let _held = RunLock::acquire(dir.path()).expect("free");
        std::fs::remove_file(dir.path().join(LOCK_FILE)).expect("delete .lock");
        assert!(matches!(RunLock::acquire(dir.path()), Err(TroupeError::Run(crate::error::RunError::RunInUse { .. }))));
    }

    #[test]
    fn links_in_a_run_directory_are_refused_and_their_targets_untouched() {
        let dir = tempfile::tempdir().expect("temp dir");
        let outside = dir.path().join("outside.txt");
        std::fs::write(&outside, "keep").expect("write");
        let run = dir.path().join("run");
        std::fs::create_dir(&run).expect("run dir");
        std::os::unix::fs::symlink(&outside, run.join(LOCK_FILE)).expect("link");
        let err = RunLock::acquire(&run).expect_err("a .lock link").to_string();
        assert!(err.contains(".lock") && err.contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read_to_string(&outside).expect("read"), "keep");
        std::fs::remove_file(run.join(LOCK_FILE)).expect("unlink");
        std::os::unix::fs::symlink(dir.path(), run.join("checkpoints")).expect("link");
        let err = RunLock::acquire(&run).expect_err("a checkpoints link").to_string();
        assert!(err.contains("checkpoints") && err.contains("symbolic link"), "{err}");
    }
}
