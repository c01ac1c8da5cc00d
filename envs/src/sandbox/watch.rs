//! Watching running sandboxed processes: drains their pipes, notices their exits, enforces the
//! deadline and the disk allowance, and kills whole process groups.
//!
//! One watch covers a group of processes that belong together (a single evaluation, or a judge
//! and its parties, see [`super::Sandbox::run_linked`]): the first of them is the leader, and
//! when it exits the others are killed.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const DISK_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// More entries than this in an evaluation's directory count as over the allowance.
const MAX_DIR_ENTRIES: usize = 10_000;
/// How long the pipes may still drain after the processes are gone.
const DRAIN_GRACE: Duration = Duration::from_millis(500);
/// The results channel is cut at this size.
pub const CHANNEL_LIMIT: usize = 1 << 20;

/// One watched process.
pub struct Member {
    /// Its pid, also its process group id (it leads its own group).
    pub pid: libc::pid_t,
    pidfd: Option<OwnedFd>,
    output_fd: Option<OwnedFd>,
    channel_fd: Option<OwnedFd>,
    dir: PathBuf,
    exited: bool,
}

impl Member {
    /// Watches the child `pid` with its output pipe, optional results channel and directory.
    pub fn new(pid: libc::pid_t, output: OwnedFd, channel: Option<OwnedFd>, dir: PathBuf) -> Self {
        // SAFETY: pidfd_open on our own child's pid (not yet reaped, so it cannot be reused).
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
        // SAFETY: a non-negative result is a fresh descriptor.
        let pidfd = (raw >= 0).then(|| unsafe { OwnedFd::from_raw_fd(raw as i32) });
        Self { pid, pidfd, output_fd: Some(output), channel_fd: channel, dir, exited: false }
    }

    /// Whether the child has exited, without reaping it (so its pid, which is also its
    /// process group id, stays reserved while we kill the group).
    fn has_exited(&self) -> bool {
        // SAFETY: a zeroed siginfo is a valid out-parameter.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with WNOWAIT leaves it waitable.
        let rc = unsafe {
            libc::waitid(libc::P_PID, self.pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT)
        };
        // SAFETY: si_pid is set by waitid when a child was found.
        rc == 0 && unsafe { info.si_pid() } != 0
    }

    fn kill_group(&self) {
        // SAFETY: the group id is our unreaped child's pid; SIGKILL to the whole group.
        unsafe { libc::kill(-self.pid, libc::SIGKILL) };
    }
}

/// What one member produced.
#[derive(Default)]
pub struct Captured {
    /// Its stdout and stderr, up to the limit.
    pub output: Vec<u8>,
    /// Bytes it wrote there in all.
    pub output_bytes: u64,
    /// What it wrote on its results channel, up to [`CHANNEL_LIMIT`].
    pub channel: Vec<u8>,
}

/// What the watch saw.
pub struct WatchOutcome {
    /// Per member, in order.
    pub captured: Vec<Captured>,
    /// The deadline passed and everything was killed.
    pub timed_out: bool,
    /// A directory went over the disk allowance and everything was killed.
    pub disk_limit: bool,
}

/// The watch over a leader (index 0) and the processes that serve it.
pub struct Watch {
    members: Vec<Member>,
    output_limit: usize,
    disk_limit: u64,
}

impl Watch {
    /// A watch over `members`; the first is the leader.
    pub fn new(members: Vec<Member>, output_limit: usize, disk_limit: u64) -> Self {
        Self { members, output_limit, disk_limit }
    }

    fn kill_all(&self) {
        for member in &self.members {
            member.kill_group();
        }
    }

    /// Runs until the leader has exited (or the deadline, or the disk allowance) and the pipes
    /// are drained; every process group is killed by then.
    pub fn run(mut self, deadline: Instant) -> WatchOutcome {
        let mut outcome = WatchOutcome {
            captured: self.members.iter().map(|_| Captured::default()).collect(),
            timed_out: false,
            disk_limit: false,
        };
        let mut ended_at: Option<Instant> = None;
        let mut next_disk_check = Instant::now() + DISK_CHECK_INTERVAL;
        loop {
            let now = Instant::now();
            if ended_at.is_none() && now >= next_disk_check {
                next_disk_check = now + DISK_CHECK_INTERVAL;
                if self.members.iter().any(|member| !within_disk_allowance(&member.dir, self.disk_limit)) {
                    outcome.disk_limit = true;
                    self.kill_all();
                    ended_at = Some(now);
                    continue;
                }
            }
            if ended_at.is_none() {
                for member in self.members.iter_mut().filter(|member| !member.exited) {
                    if member.has_exited() {
                        // Stragglers (children it forked) die with the leader of their group.
                        member.exited = true;
                        member.kill_group();
                    }
                }
                if self.members[0].exited {
                    self.kill_all();
                    ended_at = Some(now);
                }
            }
            let pipes_open =
                self.members.iter().any(|member| member.output_fd.is_some() || member.channel_fd.is_some());
            if let Some(at) = ended_at {
                if !pipes_open || now >= at + DRAIN_GRACE {
                    break;
                }
            } else if now >= deadline {
                outcome.timed_out = true;
                self.kill_all();
                ended_at = Some(now);
                continue;
            }
            // (member index, which pipe: 0 output, 1 channel, 2 pidfd)
            let mut polls: Vec<libc::pollfd> = Vec::new();
            let mut owners: Vec<(usize, u8)> = Vec::new();
            for (index, member) in self.members.iter().enumerate() {
                for (kind, fd) in [(0u8, &member.output_fd), (1u8, &member.channel_fd)] {
                    if let Some(fd) = fd {
                        polls.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                        owners.push((index, kind));
                    }
                }
                if ended_at.is_none() && !member.exited {
                    if let Some(pidfd) = &member.pidfd {
                        polls.push(libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                        owners.push((index, 2));
                    }
                }
            }
            let limit = match ended_at {
                Some(at) => (at + DRAIN_GRACE).saturating_duration_since(now),
                None => deadline.saturating_duration_since(now),
            };
            // Wake up regularly for the disk check, and without a pidfd to check for the exit.
            let tick = if self.members.iter().any(|member| member.pidfd.is_none()) {
                Duration::from_millis(10)
            } else {
                DISK_CHECK_INTERVAL
            };
            let wait_ms = limit.min(tick).as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: `polls` is a valid array of pollfd.
            let ready = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, wait_ms) };
            if ready <= 0 {
                continue;
            }
            for (poll, &(index, kind)) in polls.iter().zip(&owners) {
                if poll.revents == 0 || kind == 2 {
                    continue;
                }
                let member = &mut self.members[index];
                let captured = &mut outcome.captured[index];
                if kind == 0 {
                    if !drain(
                        &mut member.output_fd,
                        &mut captured.output,
                        self.output_limit,
                        &mut captured.output_bytes,
                    ) {
                        member.output_fd = None;
                    }
                } else {
                    let mut channel_bytes = 0;
                    if !drain(&mut member.channel_fd, &mut captured.channel, CHANNEL_LIMIT, &mut channel_bytes) {
                        member.channel_fd = None;
                    }
                }
            }
        }
        outcome
    }
}

/// Whether the disk blocks under `dir` stay within `limit` bytes (symlinks not followed).
fn within_disk_allowance(dir: &std::path::Path, limit: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    let mut used = 0u64;
    let mut entries = 0usize;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        let Ok(listing) = std::fs::read_dir(&current) else { continue };
        for entry in listing.flatten() {
            entries += 1;
            if entries > MAX_DIR_ENTRIES {
                return false;
            }
            let Ok(meta) = entry.path().symlink_metadata() else { continue };
            used = used.saturating_add(meta.blocks().saturating_mul(512));
            if used > limit {
                return false;
            }
            if meta.is_dir() {
                pending.push(entry.path());
            }
        }
    }
    true
}

/// Reads what is available from `fd` into `buffer` up to `limit` bytes (dropping the rest).
/// Returns false at end of file.
fn drain(fd: &mut Option<OwnedFd>, buffer: &mut Vec<u8>, limit: usize, total: &mut u64) -> bool {
    let Some(owned) = fd.as_ref() else { return false };
    let mut chunk = [0u8; 64 * 1024];
    // SAFETY: `chunk` is a valid writable buffer of the given length.
    let n = unsafe { libc::read(owned.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
    if n < 0 {
        let err = std::io::Error::last_os_error();
        return err.kind() == std::io::ErrorKind::Interrupted || err.kind() == std::io::ErrorKind::WouldBlock;
    }
    if n == 0 {
        return false;
    }
    let n = n as usize;
    *total += n as u64;
    let room = limit.saturating_sub(buffer.len());
    buffer.extend_from_slice(&chunk[..n.min(room)]);
    true
}
