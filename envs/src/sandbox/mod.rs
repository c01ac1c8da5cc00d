//! The sandbox that runs generated Python code: one `python3` process per evaluation, in its
//! own temporary directory and process group, with a wall-clock timeout that kills the whole
//! group, CPU-time / memory / file-size / disk / process-count / open-file limits, a cleared
//! environment, output captured up to a cap, and, where the system allows it, no network
//! (fresh network namespace, Landlock, seccomp), no file writes outside its directory and no
//! reads outside the Python installation (Landlock), and no signals, ptrace or new processes
//! aimed outside it (seccomp, Landlock scopes).
//!
//! Whatever the code does, [`Sandbox::run`] returns a [`RunOutput`] and the caller keeps
//! running. Which protections the running system grants is found once, when the sandbox is
//! built, and logged (`tracing`, target `troupe_envs::sandbox`); see [`Protections`].
//!
//! Generated code never runs with a privileged identity: where the trainer is root, it runs
//! as `nobody` (uid and gid 65534, no capabilities), with the interpreter made reachable
//! through a private mount namespace when it lives under a root-only directory (see
//! [`expose`]); only an explicit `run_as_root: true` lets root's identity through, where
//! nothing else works. The seccomp layer also refuses every change of file metadata (mode,
//! owner, timestamps, extended attributes) and every new socket (so no connecting to a
//! host's unix sockets).
//!
//! A single run ([`Sandbox::run`]) reports on a private channel, file descriptor 3. A linked
//! run ([`Sandbox::run_linked`]) starts a judge and the parties it talks to, each its own
//! sandboxed process, connected only by pipes, so that untrusted code (a party) cannot reach
//! what the judge reports: the coding task's verdicts are made that way.

mod confine;
mod expose;
mod landlock;
mod seccomp;
mod watch;

use std::ffi::OsString;
use std::fmt;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::SandboxError;
use confine::{Namespaces, Plan, Rlimits};
use expose::Exposure;
use watch::{Member, Watch};

/// Limits and switches of the sandbox. Every field has a default; configs set them under
/// `sandbox:` in the coding environment's parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    /// The Python interpreter: a path or a name looked up on PATH (`python3`). A launcher such
    /// as a pyenv shim is resolved to the real interpreter once, when the sandbox is built.
    pub python: String,
    /// Wall-clock limit per evaluation, in milliseconds; the whole process group is killed.
    pub timeout_ms: u64,
    /// CPU-time limit per process, in seconds (RLIMIT_CPU).
    pub cpu_seconds: u64,
    /// Address-space limit per process, in MiB (RLIMIT_AS).
    pub memory_mb: u64,
    /// Largest file the code may write, in MiB (RLIMIT_FSIZE).
    pub file_size_mb: u64,
    /// Process limit (RLIMIT_NPROC; counted per user, or per user namespace where one is used).
    pub max_processes: u64,
    /// Open-file limit (RLIMIT_NOFILE).
    pub max_open_files: u64,
    /// Let the code start processes (`fork`, `subprocess`). Threads are always allowed.
    pub allow_subprocesses: bool,
    /// Cap on the captured stdout+stderr, in bytes; the rest is read and dropped.
    pub output_limit_bytes: usize,
    /// Disk space the code may fill in its directory, in MiB (checked every 100 ms; RLIMIT_FSIZE
    /// bounds one file, this bounds them all).
    pub disk_mb: u64,
    /// How many evaluations may run at once in this process (0: the number of CPUs).
    pub max_parallel: usize,
    /// Enter a fresh network namespace (no interfaces but a down loopback) where permitted.
    pub network_namespace: bool,
    /// Use Landlock where the kernel has it (file system, TCP and signal confinement).
    pub landlock: bool,
    /// Install the seccomp filter where the architecture is supported.
    pub seccomp: bool,
    /// Where the per-evaluation temporary directories go (default: the system temp dir).
    pub work_dir: Option<PathBuf>,
    /// Where the trainer is root and no unprivileged user can run the interpreter, run the
    /// code as root (in a user namespace where one can be made) instead of refusing to start.
    /// Off by default: root's identity then owns every root-owned file the code can name.
    pub run_as_root: bool,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            python: "python3".to_string(),
            timeout_ms: 10_000,
            cpu_seconds: 10,
            memory_mb: 1024,
            file_size_mb: 16,
            max_processes: 32,
            max_open_files: 64,
            allow_subprocesses: false,
            output_limit_bytes: 64 * 1024,
            disk_mb: 64,
            max_parallel: 0,
            network_namespace: true,
            landlock: true,
            seccomp: true,
            work_dir: None,
            run_as_root: false,
        }
    }
}

/// The protections active on this system, found when the sandbox is built.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Protections {
    /// The interpreter actually run.
    pub python: PathBuf,
    /// Its version line.
    pub python_version: String,
    /// Which namespaces each evaluation enters.
    pub namespaces: String,
    /// The Landlock ABI in use (None: not used).
    pub landlock_abi: Option<u32>,
    /// Landlock denies TCP bind/connect.
    pub landlock_network: bool,
    /// Landlock scopes signals and abstract unix sockets to the sandbox.
    pub landlock_scoped: bool,
    /// The seccomp filter is installed.
    pub seccomp: bool,
    /// The unprivileged user id the code is switched to (None: it keeps the trainer's).
    pub uid: Option<u32>,
    /// Exactly which identity the code runs as, in words (`uid 65534 gid 65534 (nobody), no
    /// capabilities`, ...).
    pub identity: String,
    /// Directories made visible to that user through a private mount namespace (the
    /// interpreter's, under a directory it could not enter otherwise).
    pub exposed: Vec<PathBuf>,
}

impl Protections {
    /// Whether network access is cut by at least one layer.
    pub fn network_blocked(&self) -> bool {
        self.namespaces != "none" || self.landlock_network || self.seccomp
    }
}

impl fmt::Display for Protections {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "process group + wall-clock kill, rlimits (cpu, address space, file size, processes, open files, no core), \
             disk allowance, output cap, cleared environment, own temp dir; namespaces: {}; landlock: {}; seccomp: {}",
            self.namespaces,
            match self.landlock_abi {
                Some(abi) => format!(
                    "ABI {abi} (files{}{})",
                    if self.landlock_network { ", tcp" } else { "" },
                    if self.landlock_scoped { ", signals" } else { "" }
                ),
                None => "off".to_string(),
            },
            if self.seccomp { "on (sockets, file metadata, signals, processes, ptrace)" } else { "off" },
        )?;
        write!(f, "; runs as {}", self.identity)?;
        if !self.exposed.is_empty() {
            let shown: Vec<String> = self.exposed.iter().map(|p| p.display().to_string()).collect();
            write!(f, "; interpreter shown read-only in a private mount namespace: {}", shown.join(", "))?;
        }
        Ok(())
    }
}

/// One evaluation: a Python script run with `-c`, and files put in its directory first.
#[derive(Clone, Debug, Default)]
pub struct Job {
    /// The Python source run as the main program.
    pub script: String,
    /// Files written into the evaluation's directory before it starts (name, content).
    pub files: Vec<(String, Vec<u8>)>,
    /// What the process reads on its standard input (empty: nothing, end of file at once).
    /// Unlike files and the script, invisible to other processes of the same user.
    pub stdin: Vec<u8>,
}

impl Job {
    /// A job that runs `script` and nothing else.
    pub fn script(script: impl Into<String>) -> Self {
        Self { script: script.into(), ..Self::default() }
    }
}

/// A judge and the parties it talks to, each run as its own sandboxed process (own
/// directory, process group, Landlock domain and seccomp filter), started together.
///
/// The judge's file descriptor 3 is its results channel (read by the sandbox); for party `i`
/// it writes requests on descriptor `4 + 2i` and reads replies on `5 + 2i`. Each party reads
/// requests on its descriptor 3 and writes replies on 4. Nothing else connects them. When
/// the judge exits, the parties are killed.
#[derive(Clone, Debug, Default)]
pub struct LinkedJob {
    /// The process whose channel is the result.
    pub judge: Job,
    /// The processes that answer the judge's requests.
    pub parties: Vec<Job>,
}

/// What a linked run produced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkedOutput {
    /// The judge's run: its end, its own output, and its results channel.
    pub judge: RunOutput,
    /// Each party's run (its channel is always empty).
    pub parties: Vec<RunOutput>,
}

/// How the process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Termination {
    /// It exited with this code.
    Exited(i32),
    /// A signal ended it (not the sandbox's timeout kill); e.g. SIGXCPU for the CPU limit.
    Signaled(i32),
    /// The wall-clock limit ran out and the sandbox killed its process group.
    TimedOut,
    /// It filled more than its disk allowance (or made too many files) and the sandbox killed
    /// its process group.
    DiskLimit,
}

/// What an evaluation produced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunOutput {
    /// How it ended.
    pub termination: Termination,
    /// stdout and stderr interleaved, cut at the configured cap (lossy UTF-8).
    pub output: String,
    /// Total bytes it wrote to stdout/stderr, kept or not.
    pub output_bytes: u64,
    /// Whether `output` was cut.
    pub output_truncated: bool,
    /// What it wrote on the results channel (fd 3), cut at 1 MiB.
    pub channel: String,
    /// Wall-clock time from spawn to the end of the process.
    pub wall_time: Duration,
}

/// A counting semaphore bounding concurrent evaluations.
#[derive(Debug)]
struct Slots {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    fn acquire(&self) -> SlotGuard<'_> {
        let mut free = self.free.lock().unwrap_or_else(|poison| poison.into_inner());
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|poison| poison.into_inner());
        }
        *free -= 1;
        SlotGuard { slots: self }
    }
}

struct SlotGuard<'a> {
    slots: &'a Slots,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let mut free = self.slots.free.lock().unwrap_or_else(|poison| poison.into_inner());
        *free += 1;
        self.slots.freed.notify_one();
    }
}

/// The sandbox: cheap to clone (shared state behind an `Arc`), safe to use from many threads.
#[derive(Clone, Debug)]
pub struct Sandbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: SandboxConfig,
    protections: Protections,
    namespaces: Namespaces,
    drop_to: Option<u32>,
    exposures: Vec<Exposure>,
    read_paths: Vec<PathBuf>,
    slots: Slots,
    parallel: usize,
}

/// Wall-clock limit of the runs that find which protections work.
const PROBE_TIMEOUT_MS: u64 = 30_000;

/// The user and group id of `nobody`, which code runs as when the trainer is root.
const NOBODY: u32 = 65534;

/// Read-only paths besides the interpreter's own prefixes: the shared libraries and the files
/// the dynamic loader and the C library read.
const SYSTEM_READ_PATHS: &[&str] = &[
    "/usr",
    "/lib",
    "/lib64",
    "/lib32",
    "/bin",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/dev/urandom",
    "/dev/random",
    "/dev/zero",
];
const SYSTEM_READ_WRITE_FILES: &[&str] = &["/dev/null"];

/// The probe run unsandboxed to find the real interpreter behind a name or launcher.
const PROBE: &str = "import sys\nprint(sys.executable)\nprint(sys.version.split()[0])\n\
for p in sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}): print(p)\n";

fn io_err(action: &str) -> impl FnOnce(std::io::Error) -> SandboxError + '_ {
    move |error| SandboxError::Io { action: action.to_string(), error }
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file())
}

fn process_list() -> &'static Mutex<Vec<(SandboxConfig, Sandbox)>> {
    static SHARED: OnceLock<Mutex<Vec<(SandboxConfig, Sandbox)>>> = OnceLock::new();
    SHARED.get_or_init(|| Mutex::new(Vec::new()))
}

impl Sandbox {
    /// Builds a sandbox: finds the interpreter, finds which protections this system grants
    /// (trying each with a real sandboxed run), and logs them.
    pub fn new(config: SandboxConfig) -> Result<Self, SandboxError> {
        if !cfg!(target_os = "linux") {
            return Err(SandboxError::Unsupported);
        }
        for (field, value) in [
            ("timeout_ms", config.timeout_ms),
            ("cpu_seconds", config.cpu_seconds),
            ("memory_mb", config.memory_mb),
            ("file_size_mb", config.file_size_mb),
            ("max_processes", config.max_processes),
            ("max_open_files", config.max_open_files),
            ("disk_mb", config.disk_mb),
        ] {
            if value == 0 {
                return Err(SandboxError::BadConfig {
                    field: field.to_string(),
                    message: "must be at least 1".to_string(),
                });
            }
        }
        let (python, version, prefixes) = resolve_python(&config.python)?;
        let mut read_paths: Vec<PathBuf> = prefixes;
        if let Some(dir) = python.parent() {
            read_paths.push(dir.to_path_buf());
        }
        read_paths.extend(SYSTEM_READ_PATHS.iter().map(PathBuf::from));
        let parallel = if config.max_parallel == 0 {
            std::thread::available_parallelism().map(usize::from).unwrap_or(1)
        } else {
            config.max_parallel
        };
        let landlock_abi = if config.landlock { landlock::abi_version() } else { 0 };
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let root = euid == 0;
        let work_root = config.work_dir.clone().unwrap_or_else(std::env::temp_dir);
        let exposures = if root { expose::plan(&read_paths, NOBODY, NOBODY, &work_root) } else { Vec::new() };
        let namespace_options: &[Namespaces] = if config.network_namespace {
            &[Namespaces::UserAndNetwork, Namespaces::Network, Namespaces::None]
        } else {
            &[Namespaces::None]
        };
        let seccomp_options: &[bool] = if config.seccomp && seccomp::SUPPORTED { &[true, false] } else { &[false] };
        let landlock_options: Vec<u32> = if landlock_abi > 0 { vec![landlock_abi, 0] } else { vec![0] };
        // (namespaces, switch to nobody, landlock ABI, seccomp). Root runs the code as `nobody`
        // (a network namespace needs no user namespace then); the trainer's own identity is
        // tried only for a normal user, or for root when explicitly allowed.
        let mut candidates: Vec<(Namespaces, Option<u32>, u32, bool)> = Vec::new();
        for &abi in &landlock_options {
            for &use_seccomp in seccomp_options {
                if root {
                    // Without a network namespace too (a container may refuse new namespaces;
                    // Landlock and seccomp still cut the network).
                    if config.network_namespace {
                        candidates.push((Namespaces::Network, Some(NOBODY), abi, use_seccomp));
                    }
                    candidates.push((Namespaces::None, Some(NOBODY), abi, use_seccomp));
                }
                if !root || config.run_as_root {
                    for &namespaces in namespace_options {
                        candidates.push((namespaces, None, abi, use_seccomp));
                    }
                }
            }
        }
        let mut last_error = String::new();
        let mut unprivileged_error = String::new();
        for (namespaces, drop_to, abi, use_seccomp) in candidates {
            let coverage = landlock::LandlockCoverage::for_abi(abi);
            let identity = match (drop_to, root) {
                (Some(id), _) => format!("uid {id} gid {id} (nobody), no supplementary groups, no capabilities"),
                (None, false) => format!(
                    "uid {euid} gid {} (the trainer's own unprivileged user){}",
                    // SAFETY: getegid has no preconditions.
                    unsafe { libc::getegid() },
                    if namespaces == Namespaces::UserAndNetwork { ", in a user namespace" } else { "" }
                ),
                (None, true) => format!(
                    "ROOT (uid 0{}), allowed by sandbox.run_as_root",
                    if namespaces == Namespaces::UserAndNetwork { ", in an unmapped user namespace" } else { "" }
                ),
            };
            let used_exposures = if drop_to.is_some() { exposures.clone() } else { Vec::new() };
            let protections = Protections {
                python: python.clone(),
                python_version: version.clone(),
                namespaces: match namespaces {
                    Namespaces::UserAndNetwork => "user+network",
                    Namespaces::Network => "network",
                    Namespaces::None => "none",
                }
                .to_string(),
                landlock_abi: (abi > 0).then_some(abi),
                landlock_network: abi > 0 && coverage.network,
                landlock_scoped: abi > 0 && coverage.scoped,
                seccomp: use_seccomp,
                uid: drop_to,
                identity,
                exposed: used_exposures.iter().flat_map(|e| e.shown.iter().cloned()).collect(),
            };
            let sandbox = Self {
                inner: Arc::new(Inner {
                    config: config.clone(),
                    protections,
                    namespaces,
                    drop_to,
                    exposures: used_exposures,
                    read_paths: read_paths.clone(),
                    slots: Slots { free: Mutex::new(parallel), freed: Condvar::new() },
                    parallel,
                }),
            };
            let probe = Job::script("print('ok')");
            // A generous limit: a loaded machine must not be mistaken for a refused protection.
            match sandbox.run_within(&probe, config.timeout_ms.max(PROBE_TIMEOUT_MS)) {
                Ok(output) if output.termination == Termination::Exited(0) && output.output.trim() == "ok" => {
                    if root && drop_to.is_none() && config.allow_subprocesses {
                        return Err(SandboxError::BadConfig {
                            field: "allow_subprocesses".to_string(),
                            message: format!(
                                "the trainer runs as root and {} is not usable by an unprivileged user, so no process \
                                 limit would bind; run as a normal user, use an interpreter outside /root, or leave it off",
                                python.display()
                            ),
                        });
                    }
                    if root && drop_to.is_none() {
                        tracing::warn!(
                            target: "troupe_envs::sandbox",
                            "generated code runs as ROOT (sandbox.run_as_root): nobody could run {} ({unprivileged_error})",
                            python.display()
                        );
                    }
                    tracing::info!(
                        target: "troupe_envs::sandbox",
                        "sandbox ready ({} parallel, python {} at {}): {}",
                        parallel,
                        version,
                        python.display(),
                        sandbox.inner.protections
                    );
                    let protections = &sandbox.inner.protections;
                    if namespaces == Namespaces::None && config.network_namespace {
                        tracing::warn!(target: "troupe_envs::sandbox", "no network namespace on this system: network is cut by landlock/seccomp only");
                    }
                    if !protections.network_blocked() {
                        tracing::warn!(target: "troupe_envs::sandbox", "no network protection is active: sandboxed code can open connections");
                    }
                    if config.landlock && protections.landlock_abi.is_none() {
                        tracing::warn!(target: "troupe_envs::sandbox", "no Landlock: sandboxed code can read and write wherever the trainer's user can");
                    }
                    if config.seccomp
                        && !protections.seccomp
                        && protections.uid.is_none()
                        && !protections.landlock_scoped
                    {
                        tracing::warn!(target: "troupe_envs::sandbox", "neither seccomp nor Landlock scopes: sandboxed code can signal the trainer's processes");
                    }
                    return Ok(sandbox);
                }
                Ok(output) => last_error = format!("{:?}: {}", output.termination, output.output.trim()),
                Err(err) => last_error = err.to_string(),
            }
            if drop_to.is_some() {
                unprivileged_error = last_error.clone();
            }
            tracing::debug!(
                target: "troupe_envs::sandbox",
                "protection set {namespaces:?}/uid {drop_to:?}/landlock {abi}/seccomp {use_seccomp} refused: {last_error}"
            );
        }
        if root && !config.run_as_root {
            return Err(SandboxError::BadConfig {
                field: "run_as_root".to_string(),
                message: format!(
                    "the trainer runs as root and the unprivileged user nobody (uid {NOBODY}) cannot run {} ({}); \
                     generated code is never given root's identity unless you set sandbox.run_as_root: true. Use an \
                     interpreter that others may read (e.g. python: /usr/bin/python3) or run as a normal user",
                    python.display(),
                    unprivileged_error.lines().last().unwrap_or("").trim()
                ),
            });
        }
        Err(SandboxError::Interpreter {
            python: python.display().to_string(),
            message: format!("cannot run even without protections: {last_error}"),
        })
    }

    /// The process-wide sandbox for `config`, built on first use: environments built from the
    /// same settings share one, and with it one bound on parallel evaluations.
    pub fn shared(config: &SandboxConfig) -> Result<Self, SandboxError> {
        let mut list = process_list().lock().unwrap_or_else(|poison| poison.into_inner());
        if let Some((_, sandbox)) = list.iter().find(|(known, _)| known == config) {
            return Ok(sandbox.clone());
        }
        let sandbox = Self::new(config.clone())?;
        list.push((config.clone(), sandbox.clone()));
        Ok(sandbox)
    }

    /// The settings.
    pub fn config(&self) -> &SandboxConfig {
        &self.inner.config
    }

    /// The protections active on this system.
    pub fn protections(&self) -> &Protections {
        &self.inner.protections
    }

    /// How many evaluations run at once.
    pub fn parallelism(&self) -> usize {
        self.inner.parallel
    }

    /// Runs many jobs, up to [`Sandbox::parallelism`] at a time; results in input order.
    pub fn run_many(&self, jobs: &[Job]) -> Vec<Result<RunOutput, SandboxError>> {
        let next = AtomicUsize::new(0);
        let results: Vec<Mutex<Option<Result<RunOutput, SandboxError>>>> =
            jobs.iter().map(|_| Mutex::new(None)).collect();
        std::thread::scope(|scope| {
            for _ in 0..self.inner.parallel.min(jobs.len()) {
                scope.spawn(|| loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(index) else { break };
                    let result = self.run(job);
                    *results[index].lock().unwrap_or_else(|poison| poison.into_inner()) = Some(result);
                });
            }
        });
        results
            .into_iter()
            .map(|slot| {
                slot.into_inner()
                    .unwrap_or_else(|poison| poison.into_inner())
                    .expect("every job index below jobs.len() is taken by exactly one worker")
            })
            .collect()
    }

    /// Runs one job, waiting for a free slot first. Errors only when the sandbox itself cannot
    /// start the process; anything the code does is in the [`RunOutput`].
    pub fn run(&self, job: &Job) -> Result<RunOutput, SandboxError> {
        self.run_within(job, self.inner.config.timeout_ms)
    }

    fn run_within(&self, job: &Job, timeout_ms: u64) -> Result<RunOutput, SandboxError> {
        let _slot = self.inner.slots.acquire();
        let (channel_read, channel_write) = pipe().map_err(io_err("create the results pipe"))?;
        let started = Instant::now();
        let process = self.spawn(job, vec![(channel_write, 3)])?;
        let member =
            Member::new(process.pid(), process.output_read, Some(channel_read), process.dir.path().to_path_buf());
        let config = &self.inner.config;
        let watch = Watch::new(vec![member], config.output_limit_bytes, config.disk_mb.saturating_mul(MIB));
        let outcome = watch.run(started + Duration::from_millis(timeout_ms));
        let children = vec![(process.child, process.dir, process.feeder)];
        let mut outputs = finish(children, outcome, started)?;
        Ok(outputs.remove(0))
    }

    /// Runs a judge and its parties together (see [`LinkedJob`]), as one evaluation: one slot,
    /// one wall-clock limit for all, every process killed when the judge ends. Errors only when
    /// the sandbox itself cannot start a process.
    pub fn run_linked(&self, job: &LinkedJob) -> Result<LinkedOutput, SandboxError> {
        let _slot = self.inner.slots.acquire();
        let config = &self.inner.config;
        let (channel_read, channel_write) = pipe().map_err(io_err("create the results pipe"))?;
        let mut judge_fds = vec![(channel_write, 3)];
        let mut party_fds = Vec::new();
        for (index, _) in job.parties.iter().enumerate() {
            let (request_read, request_write) = pipe().map_err(io_err("create a request pipe"))?;
            let (reply_read, reply_write) = pipe().map_err(io_err("create a reply pipe"))?;
            let base = 4 + 2 * index as i32;
            judge_fds.push((request_write, base));
            judge_fds.push((reply_read, base + 1));
            party_fds.push(vec![(request_read, 3), (reply_write, 4)]);
        }
        let started = Instant::now();
        let mut processes = Vec::with_capacity(1 + job.parties.len());
        // Parties first: the judge's requests then always find a reader.
        for (party, fds) in job.parties.iter().zip(party_fds) {
            processes.push(self.spawn(party, fds)?);
        }
        processes.insert(0, self.spawn(&job.judge, judge_fds)?);
        let mut channel = Some(channel_read);
        let mut members = Vec::new();
        let mut children = Vec::new();
        for process in processes {
            members.push(Member::new(
                process.pid(),
                process.output_read,
                channel.take(),
                process.dir.path().to_path_buf(),
            ));
            children.push((process.child, process.dir, process.feeder));
        }
        let watch = Watch::new(members, config.output_limit_bytes, config.disk_mb.saturating_mul(MIB));
        let outcome = watch.run(started + Duration::from_millis(config.timeout_ms));
        let mut outputs = finish(children, outcome, started)?;
        let judge = outputs.remove(0);
        Ok(LinkedOutput { judge, parties: outputs })
    }

    /// Starts one sandboxed process for `job`, with `fds` placed at the given descriptor numbers
    /// (the parent's copies are closed once it has started).
    fn spawn(&self, job: &Job, fds: Vec<(OwnedFd, i32)>) -> Result<Spawned, SandboxError> {
        let config = &self.inner.config;
        let mut builder = tempfile::Builder::new();
        builder.prefix("troupe-sandbox-");
        let dir = match &config.work_dir {
            Some(root) => builder.tempdir_in(root),
            None => builder.tempdir(),
        }
        .map_err(io_err("create a temporary directory"))?;
        for (name, content) in &job.files {
            let path = dir.path().join(name);
            if path.parent() != Some(dir.path()) {
                return Err(SandboxError::BadConfig {
                    field: "job.files".to_string(),
                    message: format!("{name:?} is not a plain file name"),
                });
            }
            std::fs::write(&path, content).map_err(io_err("write a job file"))?;
            if let Some(id) = self.inner.drop_to {
                std::os::unix::fs::chown(&path, Some(id), Some(id))
                    .map_err(io_err("hand a job file to the sandbox user"))?;
            }
        }
        let mounts = expose::mount_ops(&self.inner.exposures, dir.path())
            .map_err(io_err("prepare the interpreter's mount namespace"))?;
        if let Some(id) = self.inner.drop_to {
            std::os::unix::fs::chown(dir.path(), Some(id), Some(id))
                .map_err(io_err("hand the directory to the sandbox user"))?;
        }
        let ruleset = match self.inner.protections.landlock_abi {
            Some(abi) => Some(
                landlock::Ruleset::build(
                    landlock::LandlockCoverage::for_abi(abi),
                    &self.inner.read_paths,
                    &SYSTEM_READ_WRITE_FILES.iter().map(PathBuf::from).collect::<Vec<_>>(),
                    dir.path(),
                )
                .map_err(io_err("build the landlock ruleset"))?,
            ),
            None => None,
        };
        let (output_read, output_write) = pipe().map_err(io_err("create the output pipe"))?;
        let (stdin_read, stdin_write) = pipe().map_err(io_err("create the input pipe"))?;
        let mut plan = Plan {
            fd_map: fds.iter().map(|(fd, target)| (fd.as_raw_fd(), *target)).collect(),
            namespaces: self.inner.namespaces,
            mounts,
            rlimits: Rlimits {
                cpu_seconds: config.cpu_seconds,
                address_space: config.memory_mb.saturating_mul(MIB),
                file_size: config.file_size_mb.saturating_mul(MIB),
                processes: config.max_processes,
                open_files: config.max_open_files,
            },
            drop_to: self.inner.drop_to,
            landlock_fd: ruleset.as_ref().map(landlock::Ruleset::raw_fd),
            seccomp: self.inner.protections.seccomp.then(|| {
                seccomp::Filter::build(seccomp::FilterPolicy {
                    deny_network: true,
                    allow_subprocesses: config.allow_subprocesses,
                })
            }),
        };
        let mut command = Command::new(&self.inner.protections.python);
        command
            .args(["-I", "-S", "-B", "-c", &job.script])
            .current_dir(dir.path())
            .env_clear()
            .envs(sandbox_env(dir.path()))
            .stdin(Stdio::from(stdin_read))
            .stdout(Stdio::from(output_write.try_clone().map_err(io_err("duplicate the output pipe"))?))
            .stderr(Stdio::from(output_write))
            .process_group(0);
        // SAFETY: `Plan::apply` only makes async-signal-safe calls on data prepared here.
        unsafe {
            command.pre_exec(move || plan.apply());
        }
        let child = command.spawn().map_err(io_err("start the interpreter"))?;
        // The parent must not hold the child's ends, or nobody would ever see end-of-file.
        drop(command);
        drop(fds);
        drop(ruleset);
        let input = job.stdin.clone();
        let feeder = std::thread::spawn(move || {
            // A process that exits without reading its input ends this with EPIPE.
            let _ = std::fs::File::from(stdin_write).write_all(&input);
        });
        Ok(Spawned { child, dir, output_read, feeder })
    }
}

const MIB: u64 = 1024 * 1024;

/// A started process, before it is watched.
struct Spawned {
    child: std::process::Child,
    dir: tempfile::TempDir,
    output_read: OwnedFd,
    feeder: std::thread::JoinHandle<()>,
}

impl Spawned {
    fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }
}

/// Reaps the watched processes (every group was killed by the watch) and turns what the watch
/// saw into one [`RunOutput`] per process.
fn finish(
    children: Vec<(std::process::Child, tempfile::TempDir, std::thread::JoinHandle<()>)>,
    outcome: watch::WatchOutcome,
    started: Instant,
) -> Result<Vec<RunOutput>, SandboxError> {
    let mut outputs = Vec::with_capacity(children.len());
    let mut statuses = Vec::with_capacity(children.len());
    for (mut child, dir, feeder) in children {
        // SAFETY: the group id is our unreaped child's pid; a member still alive (a party whose
        // leader ended the run) dies now.
        unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
        statuses.push(child.wait().map_err(io_err("wait for the interpreter"))?);
        // Its input pipe is closed now, so the feeder has finished or fails with EPIPE.
        let _ = feeder.join();
        drop(dir);
    }
    let wall_time = started.elapsed();
    for (status, captured) in statuses.into_iter().zip(outcome.captured) {
        let termination = if outcome.timed_out {
            Termination::TimedOut
        } else if outcome.disk_limit {
            Termination::DiskLimit
        } else if let Some(code) = status.code() {
            Termination::Exited(code)
        } else {
            Termination::Signaled(status.signal().unwrap_or(0))
        };
        outputs.push(RunOutput {
            termination,
            output: String::from_utf8_lossy(&captured.output).into_owned(),
            output_bytes: captured.output_bytes,
            output_truncated: captured.output_bytes > captured.output.len() as u64,
            channel: String::from_utf8_lossy(&captured.channel).into_owned(),
            wall_time,
        });
    }
    Ok(outputs)
}

/// The environment the code sees: nothing inherited, only what Python needs.
fn sandbox_env(dir: &Path) -> Vec<(OsString, OsString)> {
    vec![
        ("PATH".into(), "/usr/bin:/bin".into()),
        ("HOME".into(), dir.as_os_str().to_owned()),
        ("TMPDIR".into(), dir.as_os_str().to_owned()),
        ("LANG".into(), "C.UTF-8".into()),
        ("PYTHONIOENCODING".into(), "utf-8".into()),
    ]
}

fn resolve_python(name: &str) -> Result<(PathBuf, String, Vec<PathBuf>), SandboxError> {
    let bad = |message: String| SandboxError::Interpreter { python: name.to_string(), message };
    let launcher = find_on_path(name).ok_or_else(|| bad("not found on PATH".to_string()))?;
    let mut child = Command::new(&launcher)
        .args(["-I", "-S", "-c", PROBE])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|err| bad(format!("cannot start {}: {err}", launcher.display())))?;
    // The probe is trusted, but bound it anyway: a broken launcher must not hang the trainer.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(bad("did not answer within 30 s".to_string()));
            }
            Err(err) => return Err(bad(err.to_string())),
        }
    };
    let mut stdout = String::new();
    if let Some(mut pipe) = child.stdout.take() {
        let _ = pipe.read_to_string(&mut stdout);
    }
    if !status.success() {
        let mut stderr = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            let _ = pipe.read_to_string(&mut stderr);
        }
        return Err(bad(format!("probe failed ({status}): {}", stderr.trim())));
    }
    let mut lines = stdout.lines();
    let executable =
        lines.next().filter(|line| !line.is_empty()).ok_or_else(|| bad("reported no sys.executable".to_string()))?;
    let version = lines.next().unwrap_or("?").to_string();
    let major_ok = version.starts_with("3.");
    if !major_ok {
        return Err(bad(format!("Python 3 is needed, found {version}")));
    }
    let prefixes = lines.filter(|line| !line.is_empty()).map(PathBuf::from).collect();
    Ok((PathBuf::from(executable), version, prefixes))
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 just returned these descriptors, owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
