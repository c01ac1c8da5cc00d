//! What the child does between `fork` and `exec`: everything here must be async-signal-safe
//! (no allocation, no locks), so all data is prepared by the parent.

use std::ffi::CString;

use super::landlock;
use super::seccomp::Filter;

/// Which namespaces the child enters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Namespaces {
    /// A fresh user namespace and, inside it, a fresh network namespace (unprivileged).
    UserAndNetwork,
    /// A fresh network namespace only (needs CAP_SYS_ADMIN, i.e. root).
    Network,
    /// None: the system refuses both.
    None,
}

/// Resource limits (`setrlimit`), already converted to bytes and seconds.
#[derive(Clone, Copy, Debug)]
pub struct Rlimits {
    /// RLIMIT_CPU soft limit in seconds (hard = soft + 1, then SIGKILL).
    pub cpu_seconds: u64,
    /// RLIMIT_AS in bytes.
    pub address_space: u64,
    /// RLIMIT_FSIZE in bytes.
    pub file_size: u64,
    /// RLIMIT_NPROC.
    pub processes: u64,
    /// RLIMIT_NOFILE.
    pub open_files: u64,
}

/// One step of the private mount namespace that makes the interpreter reachable by the
/// unprivileged user (see `expose.rs`). Paths are prepared by the parent.
#[derive(Debug)]
pub enum MountOp {
    /// `mount --bind SOURCE TARGET` (recursive).
    Bind(CString, CString),
    /// A small empty tmpfs (mode 0755) on TARGET, hiding what was there.
    Tmpfs(CString),
    /// `mkdir TARGET` (mode 0755); an existing directory is fine.
    Mkdir(CString),
    /// `mount --move SOURCE TARGET`.
    Move(CString, CString),
    /// Remount TARGET read-only, nosuid, nodev (a bind mount when the flag is set). Best
    /// effort: the unprivileged user could not write there anyway.
    ReadOnly(CString, bool),
    /// `rmdir TARGET` (the emptied staging point).
    Rmdir(CString),
}

/// The whole plan for one child.
pub struct Plan {
    /// Descriptors to place at fixed numbers (source in this process, target number in the
    /// child), e.g. the results channel at 3. Targets are 3 and up; everything else the parent
    /// left open closes on exec.
    pub fd_map: Vec<(i32, i32)>,
    /// Namespaces to enter.
    pub namespaces: Namespaces,
    /// Steps of a private mount namespace, entered first when not empty.
    pub mounts: Vec<MountOp>,
    /// Limits to set.
    pub rlimits: Rlimits,
    /// A Landlock ruleset to apply.
    pub landlock_fd: Option<i32>,
    /// Switch to this unprivileged user and group id (when the trainer runs as root: root is
    /// exempt from RLIMIT_NPROC, may signal or read any process, and owns root's files).
    pub drop_to: Option<u32>,
    /// A seccomp filter to install (last).
    pub seccomp: Option<Filter>,
}

fn check(rc: libc::c_int) -> std::io::Result<()> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn set_limit(resource: libc::__rlimit_resource_t, soft: u64, hard: u64) -> std::io::Result<()> {
    let limit = libc::rlimit { rlim_cur: soft as libc::rlim_t, rlim_max: hard as libc::rlim_t };
    // SAFETY: `limit` is a valid struct.
    check(unsafe { libc::setrlimit(resource, &limit) })
}

/// Descriptors are first moved at or above this number, out of the way of every target.
const HIGH_FD: i32 = 100;

fn apply_mount(op: &MountOp) -> std::io::Result<()> {
    let null = std::ptr::null::<libc::c_char>();
    // SAFETY: every pointer is a NUL-terminated string prepared by the parent, or null where
    // mount(2) accepts null.
    unsafe {
        match op {
            MountOp::Bind(source, target) => check(libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                null,
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            )),
            MountOp::Tmpfs(target) => check(libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                c"mode=0755,size=64k,nr_inodes=256".as_ptr().cast(),
            )),
            MountOp::Mkdir(target) => {
                if libc::mkdir(target.as_ptr(), 0o755) < 0 {
                    let err = std::io::Error::last_os_error();
                    if err.raw_os_error() != Some(libc::EEXIST) {
                        return Err(err);
                    }
                }
                Ok(())
            }
            MountOp::Move(source, target) => {
                check(libc::mount(source.as_ptr(), target.as_ptr(), null, libc::MS_MOVE, std::ptr::null()))
            }
            MountOp::ReadOnly(target, bind) => {
                let mut flags = libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
                if *bind {
                    flags |= libc::MS_BIND;
                }
                libc::mount(null, target.as_ptr(), null, flags, std::ptr::null());
                Ok(())
            }
            MountOp::Rmdir(target) => check(libc::rmdir(target.as_ptr())),
        }
    }
}

impl Plan {
    /// Applies the plan to the calling (child) process. Runs after std has set up stdio, the
    /// working directory and the process group.
    pub fn apply(&mut self) -> std::io::Result<()> {
        // SAFETY: plain syscalls on integers and descriptors this process owns.
        unsafe {
            // Every descriptor to keep goes high first (close-on-exec), so that placing one at
            // its target never overwrites another still to be placed.
            if let Some(fd) = self.landlock_fd {
                let moved = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, HIGH_FD);
                check(moved)?;
                self.landlock_fd = Some(moved);
            }
            for entry in self.fd_map.iter_mut() {
                let moved = libc::fcntl(entry.0, libc::F_DUPFD_CLOEXEC, HIGH_FD);
                check(moved)?;
                entry.0 = moved;
            }
            // dup2 leaves the target without close-on-exec: these are inherited.
            for &(source, target) in self.fd_map.iter() {
                check(libc::dup2(source, target))?;
            }
            // Anything else the trainer left open (a library's non-CLOEXEC descriptor) closes
            // on exec. Best effort: kernels before 5.11 lack close_range.
            let first_free = self.fd_map.iter().map(|&(_, target)| target + 1).max().unwrap_or(3).max(3);
            libc::syscall(libc::SYS_close_range, first_free as u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
        }
        let mut flags = match self.namespaces {
            Namespaces::UserAndNetwork => libc::CLONE_NEWUSER | libc::CLONE_NEWNET,
            Namespaces::Network => libc::CLONE_NEWNET,
            Namespaces::None => 0,
        };
        if !self.mounts.is_empty() {
            flags |= libc::CLONE_NEWNS;
        }
        if flags != 0 {
            // SAFETY: unshare on the single-threaded child.
            check(unsafe { libc::unshare(flags) })?;
        }
        if !self.mounts.is_empty() {
            // Nothing done below may reach the trainer's mount namespace.
            // SAFETY: mount with static strings and null data.
            check(unsafe {
                libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                )
            })?;
            for op in &self.mounts {
                apply_mount(op)?;
            }
        }
        if let Some(id) = self.drop_to {
            // SAFETY: plain credential syscalls; the order (groups, gid, uid) keeps the
            // privileges needed for each step until the last.
            unsafe {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setresgid(id, id, id))?;
                check(libc::setresuid(id, id, id))?;
                // Really dropped: root cannot be regained.
                if libc::setuid(0) == 0 || libc::geteuid() != id || libc::getegid() != id {
                    return Err(std::io::Error::from_raw_os_error(libc::EPERM));
                }
            }
        }
        // SAFETY: prctl with integer arguments; set after the credential change, which clears it.
        check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) })?;
        let limits = self.rlimits;
        set_limit(libc::RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 1)?;
        set_limit(libc::RLIMIT_AS, limits.address_space, limits.address_space)?;
        set_limit(libc::RLIMIT_FSIZE, limits.file_size, limits.file_size)?;
        set_limit(libc::RLIMIT_NPROC, limits.processes, limits.processes)?;
        set_limit(libc::RLIMIT_NOFILE, limits.open_files, limits.open_files)?;
        set_limit(libc::RLIMIT_CORE, 0, 0)?;
        // SAFETY: prctl with integer arguments.
        check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) })?;
        if let Some(fd) = self.landlock_fd {
            landlock::restrict_self(fd)?;
            // SAFETY: the ruleset descriptor is no longer needed in the child.
            unsafe { libc::close(fd) };
        }
        if let Some(filter) = self.seccomp.as_mut() {
            filter.install_for_self()?;
        }
        Ok(())
    }
}
