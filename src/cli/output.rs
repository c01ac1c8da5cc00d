//! Writing the commands' results to stdout, and ending quietly when whoever reads stdout has
//! gone (`troupe train ... | head -1`): no panic, no error line, and the exit status a shell
//! reports for any program that writes into a closed pipe (killed by SIGPIPE: 141).

use std::fmt::Display;
use std::io::Write;

/// The reader of stdout has closed its end: the command ends quietly.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed by its reader")]
pub struct StdoutClosed;

/// Prints `text` and a newline to stdout and flushes it; a closed stdout is [`StdoutClosed`].
pub fn emit(text: impl Display) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}").and_then(|()| out.flush()).map_err(|err| {
        if err.kind() == std::io::ErrorKind::BrokenPipe {
            anyhow::Error::new(StdoutClosed)
        } else {
            anyhow::Error::new(err).context("writing to stdout")
        }
    })
}

/// Whether `err` comes from a closed stdout: a [`StdoutClosed`], or any error while stdout's
/// reader is gone (a command that streams to stdout through a writer of its own).
pub fn is_stdout_closed(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| cause.is::<StdoutClosed>()) || stdout_reader_gone()
}

/// Whether stdout is a pipe or socket whose reading end has been closed.
fn stdout_reader_gone() -> bool {
    let mut poll = libc::pollfd { fd: libc::STDOUT_FILENO, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    ready == 1 && poll.revents & libc::POLLERR != 0
}

/// Ends the process as a program that wrote into a closed pipe ends: by SIGPIPE (the Rust
/// runtime ignores SIGPIPE, so restore its default action first). Returns 141 if the signal
/// did not end it.
pub fn exit_for_closed_stdout() -> std::process::ExitCode {
    // SAFETY: resetting a signal's disposition and raising it have no memory-safety effects.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::ExitCode::from(141)
}
