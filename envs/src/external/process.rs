//! One external process (an environment, or a reward function) and the request/response exchange with it: JSON lines on
//! its stdin and stdout, a time limit on every answer, its stderr kept for error messages, and
//! the process killed when troupe is done with it (or dies).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
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

/// A running environment process. Once an exchange fails (the process exited, hung, or broke
/// the protocol) the process is killed and every later call fails with the same message: a run
/// stops with that error rather than going on with a half-working environment.
pub struct Process {
    child: Child,
    requests: Option<Sender<String>>,
    answers: Receiver<Option<String>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    next_id: u64,
    timeout: Duration,
    broken: Option<String>,
}

impl Process {
    /// Starts `command` (argv) with piped stdin, stdout and stderr. On Linux the process is
    /// killed if the thread that started it exits (`PR_SET_PDEATHSIG`), so it never outlives a
    /// troupe that was killed.
    pub fn start(command: &[String], timeout: Duration) -> Result<Self, String> {
        let (program, args) = command.split_first().ok_or_else(|| "`command` is empty".to_string())?;
        let mut builder = Command::new(program);
        builder.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl with integer arguments is async-signal-safe.
            unsafe {
                builder.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
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
        let (answer_tx, answer_rx) = mpsc::channel::<Option<String>>();
        thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            loop {
                let mut line = String::new();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => {
                        let _ = answer_tx.send(None);
                        break;
                    }
                    Ok(_) => {
                        if answer_tx.send(Some(line)).is_err() {
                            break;
                        }
                    }
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
            Ok(Some(answer)) => answer,
            Ok(None) | Err(RecvTimeoutError::Disconnected) => {
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
        let _ = self.child.kill();
        let _ = self.child.wait();
        let tail = self.stderr_tail();
        let message = if tail.is_empty() { message } else { format!("{message}; its stderr ended with:\n{tail}") };
        self.broken = Some(message.clone());
        CallError::Broken(message)
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
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
