//! A seccomp-BPF filter for sandboxed code: no new sockets of any family (so no network and no
//! connecting to a host's unix sockets; `socketpair` stays), no changes to file metadata (mode,
//! owner, timestamps, extended attributes), no signals to processes outside the sandbox's own
//! process group, no new processes (threads are fine) unless allowed, no ptrace or
//! cross-process memory access, no leaving the process group, no namespaces, mounts or
//! io_uring (which would bypass the socket rule).
//!
//! The program is built in the parent; the child patches its own pid into it (no allocation)
//! and installs it right before `exec`. Only x86_64 and aarch64 (little-endian) are supported;
//! elsewhere the sandbox runs without this layer and says so.

/// Whether this build has a seccomp filter for its architecture.
pub const SUPPORTED: bool = cfg!(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")));

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const AUDIT_ARCH: u32 = 0;

/// BPF_LD | BPF_W | BPF_ABS (BPF_LD and BPF_W are both 0).
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JEQ_K: u16 = 0x05 | 0x10;
const BPF_JMP_JGE_K: u16 = 0x05 | 0x30;
const BPF_JMP_JSET_K: u16 = 0x05 | 0x40;
const BPF_RET_K: u16 = 0x06;

const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;

const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;
/// Low 32 bits of the first argument (little-endian): the kernel reads pid_t and int flags
/// arguments as 32-bit values, so the low half is exactly what it acts on.
const OFFSET_ARG0: u32 = 16;

const CLONE_THREAD: u32 = 0x0001_0000;

/// What the filter allows.
#[derive(Clone, Copy, Debug)]
pub struct FilterPolicy {
    /// Deny `socket()` for every family (network sockets, and unix sockets that could connect
    /// to a pathname socket of the host; `socketpair` is unaffected).
    pub deny_network: bool,
    /// Allow `fork`/`clone` of new processes (threads are always allowed).
    pub allow_subprocesses: bool,
}

/// A built filter with the places where the child's own pid goes.
pub struct Filter {
    program: Vec<libc::sock_filter>,
    /// Indices of instructions whose `k` is the child's pid.
    own_pid_slots: Vec<usize>,
    /// Indices of instructions whose `k` is minus the child's pid (its process group).
    own_group_slots: Vec<usize>,
}

fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt: 0, jf: 0, k }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// Syscalls that change a file's mode, owner, timestamps or extended attributes. Landlock does
/// not cover them, and a process that owns a file (root's, where the trainer is root) could
/// otherwise set a setuid bit or make it world-writable.
#[cfg(target_arch = "x86_64")]
const METADATA_SYSCALLS: &[libc::c_long] = &[
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    SYS_FCHMODAT2,
    libc::SYS_chown,
    libc::SYS_fchown,
    libc::SYS_lchown,
    libc::SYS_fchownat,
    libc::SYS_utime,
    libc::SYS_utimes,
    libc::SYS_futimesat,
    libc::SYS_utimensat,
    libc::SYS_setxattr,
    libc::SYS_lsetxattr,
    libc::SYS_fsetxattr,
    libc::SYS_removexattr,
    libc::SYS_lremovexattr,
    libc::SYS_fremovexattr,
    SYS_SETXATTRAT,
    SYS_REMOVEXATTRAT,
];
/// As above, for aarch64's generic syscall table (no legacy chmod/chown/utime entries).
#[cfg(target_arch = "aarch64")]
const METADATA_SYSCALLS: &[libc::c_long] = &[
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    SYS_FCHMODAT2,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_utimensat,
    libc::SYS_setxattr,
    libc::SYS_lsetxattr,
    libc::SYS_fsetxattr,
    libc::SYS_removexattr,
    libc::SYS_lremovexattr,
    libc::SYS_fremovexattr,
    SYS_SETXATTRAT,
    SYS_REMOVEXATTRAT,
];
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const METADATA_SYSCALLS: &[libc::c_long] = &[];

/// Syscalls added after the `libc` crate's tables (same number on every architecture).
const SYS_FCHMODAT2: libc::c_long = 452;
const SYS_SETXATTRAT: libc::c_long = 463;
const SYS_REMOVEXATTRAT: libc::c_long = 466;

/// Syscalls refused outright, with the errno they get.
fn denied_syscalls(policy: FilterPolicy) -> Vec<(libc::c_long, i32)> {
    let mut denied = vec![
        (libc::SYS_ptrace, libc::EPERM),
        (libc::SYS_process_vm_readv, libc::EPERM),
        (libc::SYS_process_vm_writev, libc::EPERM),
        (libc::SYS_pidfd_send_signal, libc::EPERM),
        (libc::SYS_pidfd_getfd, libc::EPERM),
        (libc::SYS_setsid, libc::EPERM),
        (libc::SYS_setpgid, libc::EPERM),
        (libc::SYS_unshare, libc::EPERM),
        (libc::SYS_setns, libc::EPERM),
        (libc::SYS_mount, libc::EPERM),
        (libc::SYS_umount2, libc::EPERM),
        (libc::SYS_bpf, libc::EPERM),
        (libc::SYS_perf_event_open, libc::EPERM),
        (libc::SYS_keyctl, libc::EPERM),
        (libc::SYS_add_key, libc::EPERM),
        (libc::SYS_request_key, libc::EPERM),
        (libc::SYS_userfaultfd, libc::EPERM),
        (libc::SYS_io_uring_setup, libc::EPERM),
    ];
    denied.extend(METADATA_SYSCALLS.iter().map(|&nr| (nr, libc::EPERM)));
    if !policy.allow_subprocesses {
        // glibc falls back from clone3 to clone on ENOSYS, where the flags can be inspected.
        denied.push((libc::SYS_clone3, libc::ENOSYS));
        #[cfg(target_arch = "x86_64")]
        {
            denied.push((libc::SYS_fork, libc::EAGAIN));
            denied.push((libc::SYS_vfork, libc::EAGAIN));
        }
    }
    denied
}

impl Filter {
    /// Builds the program for `policy`.
    pub fn build(policy: FilterPolicy) -> Self {
        let mut program = vec![
            stmt(BPF_LD_W_ABS, OFFSET_ARCH),
            jump(BPF_JMP_JEQ_K, AUDIT_ARCH, 1, 0),
            stmt(BPF_RET_K, RET_KILL_PROCESS),
        ];
        #[cfg(target_arch = "x86_64")]
        {
            // The x32 ABI would be a second syscall table that the rules below do not cover.
            program.push(stmt(BPF_LD_W_ABS, OFFSET_NR));
            program.push(jump(BPF_JMP_JGE_K, 0x4000_0000, 0, 1));
            program.push(stmt(BPF_RET_K, RET_ERRNO | libc::ENOSYS as u32));
        }
        let mut own_pid_slots = Vec::new();
        let mut own_group_slots = Vec::new();
        // One block per syscall: load the number, skip the block unless it matches.
        let block = |program: &mut Vec<libc::sock_filter>, nr: libc::c_long, body: Vec<libc::sock_filter>| {
            program.push(stmt(BPF_LD_W_ABS, OFFSET_NR));
            let skip = u8::try_from(body.len()).expect("filter blocks are a few instructions long");
            program.push(jump(BPF_JMP_JEQ_K, nr as u32, 0, skip));
            program.extend(body);
        };
        for (nr, errno) in denied_syscalls(policy) {
            block(&mut program, nr, vec![stmt(BPF_RET_K, RET_ERRNO | errno as u32)]);
        }
        if policy.deny_network {
            // Every family: a unix socket could connect to a pathname socket of the host, whose
            // path seccomp cannot see.
            block(&mut program, libc::SYS_socket, vec![stmt(BPF_RET_K, RET_ERRNO | libc::EACCES as u32)]);
        }
        if !policy.allow_subprocesses {
            block(
                &mut program,
                libc::SYS_clone,
                vec![
                    stmt(BPF_LD_W_ABS, OFFSET_ARG0),
                    jump(BPF_JMP_JSET_K, CLONE_THREAD, 0, 1),
                    stmt(BPF_RET_K, RET_ALLOW),
                    stmt(BPF_RET_K, RET_ERRNO | libc::EAGAIN as u32),
                ],
            );
        }
        // kill(pid, sig): only itself (pid), its own group (0 or -pid).
        let start = program.len();
        block(
            &mut program,
            libc::SYS_kill,
            vec![
                stmt(BPF_LD_W_ABS, OFFSET_ARG0),
                jump(BPF_JMP_JEQ_K, 0, 2, 0),
                jump(BPF_JMP_JEQ_K, 0, 1, 0), // own pid, patched
                jump(BPF_JMP_JEQ_K, 0, 0, 1), // minus own pid, patched
                stmt(BPF_RET_K, RET_ALLOW),
                stmt(BPF_RET_K, RET_ERRNO | libc::EPERM as u32),
            ],
        );
        own_pid_slots.push(start + 4);
        own_group_slots.push(start + 5);
        // tkill(tid, sig) and tgkill(tgid, tid, sig): only its own main thread / thread group.
        for nr in [libc::SYS_tkill, libc::SYS_tgkill] {
            let start = program.len();
            block(
                &mut program,
                nr,
                vec![
                    stmt(BPF_LD_W_ABS, OFFSET_ARG0),
                    jump(BPF_JMP_JEQ_K, 0, 0, 1), // own pid, patched
                    stmt(BPF_RET_K, RET_ALLOW),
                    stmt(BPF_RET_K, RET_ERRNO | libc::EPERM as u32),
                ],
            );
            own_pid_slots.push(start + 3);
        }
        program.push(stmt(BPF_RET_K, RET_ALLOW));
        Self { program, own_pid_slots, own_group_slots }
    }

    /// Patches in the calling process's pid and installs the filter. Async-signal-safe (no
    /// allocation): for use between fork and exec, after `PR_SET_NO_NEW_PRIVS`.
    pub fn install_for_self(&mut self) -> std::io::Result<()> {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        for &slot in &self.own_pid_slots {
            self.program[slot].k = pid as u32;
        }
        for &slot in &self.own_group_slots {
            self.program[slot].k = (-pid) as u32;
        }
        let prog = libc::sock_fprog {
            len: u16::try_from(self.program.len()).map_err(|_| std::io::Error::from_raw_os_error(libc::E2BIG))?,
            filter: self.program.as_mut_ptr(),
        };
        // SAFETY: `prog` points at a valid program that outlives the call (the kernel copies it).
        let rc = unsafe {
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER as libc::c_ulong,
                &prog as *const libc::sock_fprog,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}
