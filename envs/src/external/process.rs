//! One external process (an environment, or a reward function) and the request/response exchange with it: JSON lines on
//! its stdin and stdout, a time limit on every answer, its stderr kept for error messages, and
//! the process killed when troupe is done with it (or dies).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::{Map, Value};

/// How many of the process's last stderr lines an error message shows.
const STDERR_TAIL_LINES: usize = 20;
/// The longest answer line shown in an error message, in characters.
const SHOWN_CHARS: usize = 300;
/// The longest answer line read by default, in bytes (`max_line_bytes`): a line is held whole
/// in memory, and parsing it takes several times its size.
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 << 20;

/// What the reader of the process's stdout hands on.
enum Answer {
    /// One line, newline included.
    Line(String),
    /// Stdout closed (or could not be read).
    Closed,
    /// A line that cannot be an answer (too long, not UTF-8): the process is broken.
    Bad(String),
}

/// The number of the next process started, for its descendants' mark ([`Process::start`]).
static NEXT_PROCESS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A running environment process. Once an exchange fails (the process exited, hung, or broke
/// the protocol) the process is killed and every later call fails with the same message: a run
/// stops with that error rather than going on with a half-working environment.
pub struct Process {
    child: Child,
    requests: Option<Sender<String>>,
    answers: Receiver<Answer>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    next_id: u64,
    timeout: Duration,
    broken: Option<String>,
    /// The environment variable (`TROUPE_DESCENDANT_<troupe pid>_<n>=1`) the process, and
    /// everything it starts that keeps its environment, inherits: how its descendants are found
    /// when they leave its process group.
    mark: String,
}

impl Process {
    /// Starts `command` (argv) with piped stdin, stdout and stderr, in a process group of its
    /// own which troupe ends whole (see [`Process::kill_group`]). On Linux the process is
    /// killed if the thread that started it exits (`PR_SET_PDEATHSIG`), and a watchdog in its
    /// group kills the group once the process is gone, so neither the process nor anything
    /// it started in its group outlives a troupe that was killed. Its environment holds one
    /// more variable, `TROUPE_DESCENDANT_<troupe pid>_<n>=1`, which its descendants inherit: on
    /// Linux, ending the process also ends every process that carries it, so a descendant
    /// that left the group (`setsid`, a double fork) goes too.
    pub fn start(command: &[String], timeout: Duration) -> Result<Self, String> {
        Self::start_with_line_limit(command, timeout, DEFAULT_MAX_LINE_BYTES)
    }

    /// [`Process::start`] reading answer lines of at most `max_line_bytes` bytes: a longer one
    /// breaks the process with an error naming the limit, before more of it is read.
    pub fn start_with_line_limit(command: &[String], timeout: Duration, max_line_bytes: usize) -> Result<Self, String> {
        let (program, args) = command.split_first().ok_or_else(|| "`command` is empty".to_string())?;
        let mark = format!(
            "TROUPE_DESCENDANT_{}_{}",
            std::process::id(),
            NEXT_PROCESS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut builder = Command::new(program);
        builder.args(args).env(&mark, "1").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: between fork and exec only async-signal-safe calls are made (getppid,
            // setpgid, prctl, fork; the watchdog uses close, nanosleep, kill and _exit).
            unsafe {
                builder.pre_exec(|| {
                    let parent = libc::getppid();
                    if libc::setpgid(0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    #[cfg(target_os = "linux")]
                    {
                        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        if libc::getppid() != parent {
                            // troupe died before the death signal was armed.
                            libc::_exit(1);
                        }
                    }
                    let leader = libc::getpid();
                    match libc::fork() {
                        -1 => Err(std::io::Error::last_os_error()),
                        0 => watch_group(leader),
                        _ => Ok(()),
                    }
                });
            }
        }
        let mut child = builder.spawn().map_err(|err| format!("cannot start {program:?}: {err}"))?;
        let (Some(mut stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            return Err("the process's pipes could not be opened".to_string());
        };
        // Writes happen on their own thread so a process that stops reading cannot block troupe:
        // the answer's time limit still runs out, and killing the process ends the write.
        let (request_tx, request_rx) = mpsc::channel::<String>();
        thread::spawn(move || {
            for line in request_rx {
                if stdin.write_all(line.as_bytes()).and_then(|()| stdin.flush()).is_err() {
                    break;
                }
            }
        });
        let (answer_tx, answer_rx) = mpsc::channel::<Answer>();
        thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let limit = max_line_bytes as u64;
            loop {
                let mut bytes = Vec::new();
                let answer = match (&mut reader).take(limit.saturating_add(1)).read_until(b'\n', &mut bytes) {
                    Ok(0) | Err(_) => Answer::Closed,
                    Ok(read) if read as u64 > limit && bytes.last() != Some(&b'\n') => Answer::Bad(format!(
                        "printed a line longer than {max_line_bytes} bytes (`max_line_bytes`); \
                         raise max_line_bytes if such answers are intended"
                    )),
                    Ok(_) => match String::from_utf8(bytes) {
                        Ok(line) => Answer::Line(line),
                        Err(err) => Answer::Bad(format!(
                            "printed a line that is not UTF-8 text (invalid byte at offset {}): {}",
                            err.utf8_error().valid_up_to(),
                            shorten(&String::from_utf8_lossy(err.as_bytes()))
                        )),
                    },
                };
                let last = !matches!(answer, Answer::Line(_));
                if answer_tx.send(answer).is_err() || last {
                    break;
                }
            }
        });
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let tail = Arc::clone(&stderr_tail);
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                if tail.len() == STDERR_TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
        Ok(Self {
            child,
            requests: Some(request_tx),
            answers: answer_rx,
            stderr_tail,
            next_id: 0,
            timeout,
            broken: None,
            mark,
        })
    }

    /// Sends `{"id", "method", ...fields}` and returns the answer's `result`. An `error` answer
    /// comes back as [`CallError::Refused`]; anything else that goes wrong (no answer within the
    /// time limit, an exit, a line that is not a JSON object, a wrong id) breaks the process.
    pub fn call(&mut self, method: &str, fields: Map<String, Value>) -> Result<Value, CallError> {
        if let Some(message) = &self.broken {
            return Err(CallError::Broken(message.clone()));
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut line = request_line(id, method, fields);
        line.push('\n');
        let sent = self.requests.as_ref().is_some_and(|tx| tx.send(line).is_ok());
        if !sent {
            return Err(self.break_with(format!("could not send `{method}`: the process's stdin is closed")));
        }
        let answer = match self.answers.recv_timeout(self.timeout) {
            Ok(Answer::Line(answer)) => answer,
            Ok(Answer::Bad(message)) => {
                return Err(self.break_with(format!("{message} (answering `{method}`)")));
            }
            Ok(Answer::Closed) | Err(RecvTimeoutError::Disconnected) => {
                let status = self.exit_status_after_eof();
                return Err(self.break_with(format!("the process exited ({status}) before answering `{method}`")));
            }
            Err(RecvTimeoutError::Timeout) => {
                return Err(self.break_with(format!(
                    "no answer to `{method}` within {:.1} s (`timeout_s`)",
                    self.timeout.as_secs_f64()
                )));
            }
        };
        read_answer(method, id, &answer).map_err(|err| match err {
            CallError::Broken(message) => self.break_with(message),
            refused => refused,
        })
    }

    /// Whether an exchange already failed (the process is killed and every call fails).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// Marks the process broken (killing it) and returns the error for `message`, with the end
    /// of its stderr.
    pub fn break_with(&mut self, message: String) -> CallError {
        self.kill_group();
        let _ = self.child.wait();
        let tail = self.stderr_tail();
        let message = if tail.is_empty() { message } else { format!("{message}; its stderr ended with:\n{tail}") };
        self.broken = Some(message.clone());
        CallError::Broken(message)
    }

    /// Kills the process, everything in its process group, and (on Linux) every other
    /// descendant that still carries its mark in its environment (one that moved to a session
    /// or group of its own).
    pub fn kill_group(&mut self) {
        #[cfg(unix)]
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: a signal to the group this process leads (it is not yet reaped, so its
            // pid, and with it the group id, cannot have been reused).
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
        let _ = self.child.kill();
        #[cfg(target_os = "linux")]
        kill_marked(&self.mark);
    }

    /// The process's exit status once its stdout closed (waiting briefly for it to exit).
    fn exit_status_after_eof(&mut self) -> String {
        for _ in 0..50 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.to_string();
            }
            thread::sleep(Duration::from_millis(10));
        }
        "its stdout closed".to_string()
    }

    /// The last lines the process wrote to stderr (after giving the reader a moment to catch up).
    fn stderr_tail(&self) -> String {
        thread::sleep(Duration::from_millis(20));
        let tail = self.stderr_tail.lock().unwrap_or_else(|e| e.into_inner());
        tail.iter().cloned().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // Closing stdin asks a well-behaved process to exit; the kill makes sure of it.
        self.requests.take();
        self.kill_group();
        let _ = self.child.wait();
    }
}

/// Kills every process whose initial environment holds `mark=1`: the descendants of one
/// external process, wherever they moved (a new session, a new group, a new parent). Each is
/// found through `/proc/<pid>/environ` and signalled through a pidfd opened before the read, so
/// a pid reused meanwhile is never signalled. Repeated until a pass finds none, so what a
/// descendant forks while it is being killed goes too. Processes of other users, and a
/// descendant that replaced its whole environment, are not found.
#[cfg(target_os = "linux")]
fn kill_marked(mark: &str) {
    let entry = format!("{mark}=1");
    let own = std::process::id();
    for _pass in 0..20 {
        let Ok(entries) = std::fs::read_dir("/proc") else { return };
        let mut found = 0;
        for dir in entries.flatten() {
            let Some(pid) = dir.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
            let Ok(raw) = libc::pid_t::try_from(pid) else { continue };
            if pid == own {
                continue;
            }
            // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
            let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
            let marked = std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|environ| environ.split(|&b| b == 0).any(|e| e == entry.as_bytes()));
            if marked {
                found += 1;
                // SAFETY: a signal through a descriptor this function owns, or (where pidfds are
                // missing) to a pid just read as carrying the mark.
                unsafe {
                    if pidfd >= 0 {
                        libc::syscall(
                            libc::SYS_pidfd_send_signal,
                            pidfd as libc::c_int,
                            libc::SIGKILL,
                            std::ptr::null::<libc::siginfo_t>(),
                            0u32,
                        );
                    } else {
                        libc::kill(raw, libc::SIGKILL);
                    }
                }
            }
            if pidfd >= 0 {
                // SAFETY: the descriptor pidfd_open returned above, closed once.
                unsafe {
                    libc::close(pidfd as libc::c_int);
                }
            }
        }
        if found == 0 {
            return;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// The watchdog of the process group `leader` leads, forked before the leader runs its
/// command: it holds none of troupe's files (the leader's pipes must close when the leader
/// exits, and the run directory's lock must go with troupe), waits until the leader is gone
/// (its parent changes: the leader exited or was killed, on its own, by troupe, or by the
/// death signal when troupe died), then kills the group and exits. Async-signal-safe calls
/// only: it runs in a fork of a multithreaded process.
#[cfg(unix)]
unsafe fn watch_group(leader: libc::pid_t) -> ! {
    #[cfg(target_os = "linux")]
    let closed = libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) == 0;
    #[cfg(not(target_os = "linux"))]
    let closed = false;
    if !closed {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        let max = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur.min(1 << 16) as libc::c_int
        } else {
            1024
        };
        for fd in 0..max {
            libc::close(fd);
        }
    }
    let pause = libc::timespec { tv_sec: 0, tv_nsec: 100_000_000 };
    while libc::getppid() == leader {
        libc::nanosleep(&pause, std::ptr::null_mut());
    }
    libc::kill(-leader, libc::SIGKILL);
    libc::_exit(0)
}

/// The `result` of the answer line `answer` to request `id` (`method`): a `Refused` error when
/// it carries an `error`, a `Broken` one (with the reason) when it is not a well-formed answer to
/// that request.
pub(crate) fn read_answer(method: &str, id: u64, answer: &str) -> Result<Value, CallError> {
    let answer = answer.trim_end();
    let parsed: Value = match serde_json::from_str(answer) {
        Ok(Value::Object(map)) => Value::Object(map),
        _ => {
            return Err(CallError::Broken(format!(
                "answered `{method}` with a line that is not a JSON object: {}",
                shorten(answer)
            )))
        }
    };
    let answered_id = parsed.get("id").and_then(Value::as_u64);
    if answered_id != Some(id) {
        return Err(CallError::Broken(format!(
            "answered request {id} (`{method}`) with id {}: {}",
            parsed.get("id").map_or("(none)".to_string(), Value::to_string),
            shorten(answer)
        )));
    }
    if let Some(error) = parsed.get("error") {
        let message = error.as_str().map_or_else(|| error.to_string(), str::to_string);
        return Err(CallError::Refused(message));
    }
    match parsed.get("result") {
        Some(result) => Ok(result.clone()),
        None => Err(CallError::Broken(format!(
            "answered `{method}` with neither `result` nor `error`: {}",
            shorten(answer)
        ))),
    }
}

/// The request line of call `id`: `{"id": id, "method": method, ...fields}`.
pub(crate) fn request_line(id: u64, method: &str, fields: Map<String, Value>) -> String {
    let mut request = Map::new();
    request.insert("id".to_string(), Value::from(id));
    request.insert("method".to_string(), Value::from(method));
    request.extend(fields);
    Value::Object(request).to_string()
}

/// Why a call failed.
#[derive(Debug)]
pub enum CallError {
    /// The process answered with an `error` (it refused this request and can go on).
    Refused(String),
    /// The process cannot be used any more (the message says why).
    Broken(String),
}

/// `text` cut to [`SHOWN_CHARS`] characters for an error message.
fn shorten(text: &str) -> String {
    if text.chars().count() <= SHOWN_CHARS {
        text.to_string()
    } else {
        format!("{}...", text.chars().take(SHOWN_CHARS).collect::<String>())
    }
}
