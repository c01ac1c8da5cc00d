//! One trainer per run directory: an exclusive `flock` on `RUN_DIR/.lock`, held for the run's
//! life. The kernel releases it whenever the process ends, however it ends (exit, panic,
//! SIGKILL), so a lock left by a dead process is never in the way: a stale lock file is just a
//! file whose lock nobody holds. A second trainer, or a `--resume` of a run still training,
//! is refused with the holder's pid.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Result, RunError, TroupeError};

/// The lock file inside a run directory.
pub const LOCK_FILE: &str = ".lock";

/// A held lock on a run directory; released when dropped (or when the process dies).
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Locks `run_dir` (creating it), or refuses with [`RunError::RunInUse`](crate::error::RunError::RunInUse) naming the
    /// holder's pid. Never blocks.
    pub fn acquire(run_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(run_dir).map_err(|e| TroupeError::io(run_dir, e))?;
        let path = run_dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| TroupeError::io(&path, e))?;
        // SAFETY: flock on a descriptor this process owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let holder = text.split_whitespace().next().and_then(|pid| pid.parse().ok());
                return Err(TroupeError::Run(RunError::RunInUse { path: run_dir.to_path_buf(), holder }));
            }
            return Err(TroupeError::io(&path, err));
        }
        // Ours now: whatever pid a dead holder left is replaced by ours.
        let record = format!("{}\n", std::process::id());
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(record.as_bytes()))
            .and_then(|()| file.flush())
            .map_err(|e| TroupeError::io(&path, e))?;
        Ok(Self { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
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
}
