//! Kernel launches per phase on a GPU (`troupe train --profile-kernels`): which kernels each
//! phase of an iteration launches, how many, and how long the device ran them.
//!
//! A launch is reported on the thread that issues it, before it reaches the device (by the
//! launch observer on a cubecl device), and held as that thread's pending launches until a
//! phase claims them with [`close`] on the same thread: the points where [`super::since`] adds a phase's seconds (prefill, decode, the
//! update's forward and backward) and the trainer's `credit`, `optimizer` and `eval`. What no
//! phase claims by the end of an iteration ([`close`] with `"other"`) is the iteration's
//! `other`. A launch's device time, where one was asked for, is a measurement read back later
//! ([`resolve`], once per iteration, after the device has finished the iteration's work), so
//! timing does not make the kernels wait for each other.
//!
//! Nothing here is active unless a [`Recording`] is: [`close`] is then one relaxed atomic load.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// One kernel's launches within a phase, and the device time of those that were timed.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct KernelTally {
    /// Launches issued.
    pub launches: u64,
    /// Launches whose device time was read back.
    pub timed: u64,
    /// Their device time, in seconds.
    pub seconds: f64,
}

impl KernelTally {
    fn add(&mut self, other: &KernelTally) {
        self.launches += other.launches;
        self.timed += other.timed;
        self.seconds += other.seconds;
    }
}

/// Per phase (`prefill`, `decode`, ...), per kernel name: the recording's tallies.
pub type PhaseKernels = BTreeMap<String, BTreeMap<String, KernelTally>>;

/// One launch's device time, not read back yet.
pub trait PendingTiming: Send {
    /// Waits for the measurement; `None` when the device took none.
    fn seconds(self: Box<Self>) -> Option<f64>;
}

type Pending = (&'static str, Box<dyn PendingTiming>);

/// The launches a thread issued that no phase has claimed yet.
#[derive(Default)]
struct ThreadPending {
    /// The recording they belong to ([`EPOCH`]): a thread's leftovers from an earlier one are
    /// dropped.
    epoch: u64,
    launches: BTreeMap<&'static str, u64>,
    timings: Vec<Pending>,
}

impl ThreadPending {
    fn current(&mut self) -> &mut Self {
        let epoch = EPOCH.load(Ordering::Relaxed);
        if self.epoch != epoch {
            *self = Self { epoch, ..Self::default() };
        }
        self
    }
}

#[derive(Default)]
struct Tallies {
    /// Claimed launches.
    phases: BTreeMap<&'static str, BTreeMap<&'static str, KernelTally>>,
    /// Claimed measurements, by phase, to read back at [`resolve`].
    unresolved: Vec<(&'static str, Pending)>,
}

static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Which recording is running: each [`Recording::start`] takes the next.
static EPOCH: AtomicU64 = AtomicU64::new(0);
static TALLIES: Mutex<Option<Tallies>> = Mutex::new(None);

thread_local! {
    static PENDING: RefCell<ThreadPending> = RefCell::new(ThreadPending::default());
    /// The phase every `close` on this thread claims for while [`scoped`] runs.
    static SCOPE: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Runs `f` with every launch it makes claimed by `phase`, whichever phases close inside it
/// (the held-out evaluation's generation is `eval`'s, not `prefill`'s and `decode`'s).
pub fn scoped<T>(phase: &'static str, f: impl FnOnce() -> T) -> T {
    if !ACTIVE.load(Ordering::Relaxed) {
        return f();
    }
    close("other");
    let outer = SCOPE.with(|s| s.replace(Some(phase)));
    let out = f();
    close(phase);
    SCOPE.with(|s| s.set(outer));
    out
}

fn with_tallies<T>(f: impl FnOnce(&mut Tallies) -> T) -> Option<T> {
    let mut guard = TALLIES.lock().unwrap_or_else(|e| e.into_inner());
    guard.as_mut().map(f)
}

/// Counts a launch of `kernel` (by the observer, on the issuing thread).
pub fn launched(kernel: &'static str) {
    if ACTIVE.load(Ordering::Relaxed) {
        PENDING.with(|p| *p.borrow_mut().current().launches.entry(kernel).or_default() += 1);
    }
}

/// Holds the measurement of a launch of `kernel` until [`resolve`] (on the issuing thread).
pub fn timed_later(kernel: &'static str, timing: Box<dyn PendingTiming>) {
    if ACTIVE.load(Ordering::Relaxed) {
        PENDING.with(|p| p.borrow_mut().current().timings.push((kernel, timing)));
    }
}

/// Gives the launches this thread issued since its last `close` to `phase`.
pub fn close(phase: &'static str) {
    if !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    let (launches, timings) = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        let p = p.current();
        (std::mem::take(&mut p.launches), std::mem::take(&mut p.timings))
    });
    if launches.is_empty() && timings.is_empty() {
        return;
    }
    let phase = SCOPE.with(|s| s.get()).unwrap_or(phase);
    with_tallies(|t| {
        let tallies = t.phases.entry(phase).or_default();
        for (kernel, launches) in launches {
            tallies.entry(kernel).or_default().launches += launches;
        }
        t.unresolved.extend(timings.into_iter().map(|p| (phase, p)));
    });
}

/// Reads back the device times of the claimed launches (waiting for the device to reach them).
pub fn resolve() {
    if !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    // Taken out first: reading a measurement may wait on the device, which must not hold the
    // lock a launch on another thread needs.
    let unresolved = with_tallies(|t| std::mem::take(&mut t.unresolved)).unwrap_or_default();
    let read: Vec<(&'static str, &'static str, Option<f64>)> =
        unresolved.into_iter().map(|(phase, (kernel, timing))| (phase, kernel, timing.seconds())).collect();
    with_tallies(|t| {
        for (phase, kernel, seconds) in read {
            if let Some(seconds) = seconds {
                let tally = t.phases.entry(phase).or_default().entry(kernel).or_default();
                tally.timed += 1;
                tally.seconds += seconds;
            }
        }
    });
}

/// Records launches from [`Recording::start`] to [`Recording::finish`] (one at a time per
/// process: starting a second ends the first's counting). Launches a thread issued that no
/// phase claimed are `other`'s if it is the finishing thread, else dropped.
#[derive(Debug)]
pub struct Recording {
    _private: (),
}

impl Recording {
    /// Starts counting.
    pub fn start() -> Self {
        *TALLIES.lock().unwrap_or_else(|e| e.into_inner()) = Some(Tallies::default());
        EPOCH.fetch_add(1, Ordering::Relaxed);
        ACTIVE.store(true, Ordering::Relaxed);
        Self { _private: () }
    }

    /// Stops counting and returns the tallies, kernel names shortened ([`short_kernel_name`]);
    /// launches no phase claimed are `other`'s.
    pub fn finish(self) -> PhaseKernels {
        close("other");
        resolve();
        let tallies = self.stop().unwrap_or_default();
        let mut out = PhaseKernels::new();
        for (phase, kernels) in tallies.phases {
            let phase_out = out.entry(phase.to_string()).or_default();
            for (kernel, tally) in kernels {
                phase_out.entry(short_kernel_name(kernel)).or_default().add(&tally);
            }
        }
        out
    }

    fn stop(&self) -> Option<Tallies> {
        ACTIVE.store(false, Ordering::Relaxed);
        TALLIES.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A kernel's type name without its module paths:
/// `burn_cubecl::kernel::binary::kernel_scalar_binop<f32, burn_cubecl::ops::AddOp>` ->
/// `kernel_scalar_binop<f32, AddOp>`.
pub fn short_kernel_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut start = 0;
    for (i, ch) in name.char_indices() {
        if !(ch.is_alphanumeric() || ch == '_' || ch == ':') {
            out.push_str(last_segment(&name[start..i]));
            out.push(ch);
            start = i + ch.len_utf8();
        }
    }
    out.push_str(last_segment(&name[start..]));
    out
}

fn last_segment(path: &str) -> &str {
    path.rsplit("::").next().unwrap_or(path)
}

/// The `--profile-kernels` table: per phase, launches and device milliseconds per iteration;
/// then the `top` kernels by device time (by launches where none was timed), with their phase.
pub fn kernel_table(phases: &PhaseKernels, iterations: u64, top: usize) -> String {
    let per = iterations.max(1) as f64;
    let mut out =
        format!("kernels per phase, per iteration (mean over {iterations}; troupe train --profile-kernels)\n");
    out += &format!("{:>15} {:>12} {:>12} {:>10}\n", "phase", "launches", "device ms", "kernels");
    let (mut all_launches, mut all_seconds) = (0, 0.0);
    for (phase, kernels) in phases {
        let launches: u64 = kernels.values().map(|t| t.launches).sum();
        let seconds: f64 = kernels.values().map(|t| t.seconds).sum();
        all_launches += launches;
        all_seconds += seconds;
        out += &format!(
            "{phase:>15} {:>12.1} {:>12.3} {:>10}\n",
            launches as f64 / per,
            1e3 * seconds / per,
            kernels.len()
        );
    }
    out += &format!("{:>15} {:>12.1} {:>12.3}\n", "total", all_launches as f64 / per, 1e3 * all_seconds / per);
    let mut rows: Vec<(&str, &str, &KernelTally)> = phases
        .iter()
        .flat_map(|(phase, kernels)| kernels.iter().map(move |(k, t)| (phase.as_str(), k.as_str(), t)))
        .collect();
    let timed = rows.iter().any(|(_, _, t)| t.timed > 0);
    rows.sort_by(|a, b| {
        let key = |t: &KernelTally| if timed { t.seconds } else { t.launches as f64 };
        key(b.2).total_cmp(&key(a.2)).then(a.0.cmp(b.0)).then(a.1.cmp(b.1))
    });
    out += &format!(
        "top {} kernels by {} (per iteration):\n",
        top.min(rows.len()),
        if timed { "device time" } else { "launches" }
    );
    out += &format!("{:>15} {:>10} {:>10} {:>9}  kernel\n", "phase", "launches", "device ms", "us each");
    for (phase, kernel, t) in rows.into_iter().take(top) {
        let each = if t.timed > 0 { format!("{:.1}", 1e6 * t.seconds / t.timed as f64) } else { "-".to_string() };
        out += &format!(
            "{phase:>15} {:>10.1} {:>10.3} {each:>9}  {kernel}\n",
            t.launches as f64 / per,
            1e3 * t.seconds / per
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recordings of these tests share the process's one.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    struct Fixed(Option<f64>);

    impl PendingTiming for Fixed {
        fn seconds(self: Box<Self>) -> Option<f64> {
            self.0
        }
    }

    #[test]
    fn launches_go_to_the_phase_that_closes_after_them_and_times_are_read_at_resolve() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let recording = Recording::start();
        launched("a::k1<f32, b::Add>");
        timed_later("a::k1<f32, b::Add>", Box::new(Fixed(Some(2e-3))));
        launched("a::k2");
        close("prefill");
        launched("a::k1<f32, b::Add>");
        launched("a::k1<f32, b::Add>");
        timed_later("a::k1<f32, b::Add>", Box::new(Fixed(None)));
        close("decode");
        resolve();
        launched("c::k3");
        let phases = recording.finish();
        let tally = |phase: &str, kernel: &str| phases[phase][kernel];
        assert_eq!(tally("prefill", "k1<f32, Add>"), KernelTally { launches: 1, timed: 1, seconds: 2e-3 });
        assert_eq!(tally("prefill", "k2"), KernelTally { launches: 1, timed: 0, seconds: 0.0 });
        // A launch the device did not time is counted, not timed.
        assert_eq!(tally("decode", "k1<f32, Add>"), KernelTally { launches: 2, timed: 0, seconds: 0.0 });
        assert_eq!(tally("other", "k3").launches, 1);
        assert_eq!(phases.len(), 3);
        // Once finished, nothing is counted.
        launched("a::k2");
        close("prefill");
        assert!(TALLIES.lock().unwrap().is_none());
    }

    #[test]
    fn a_scope_claims_every_phase_closed_inside_it() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let recording = Recording::start();
        launched("k");
        scoped("eval", || {
            launched("k");
            close("prefill");
            launched("k");
            launched("k");
            close("decode");
        });
        launched("k");
        close("decode");
        let phases = recording.finish();
        assert_eq!(phases["other"]["k"].launches, 1);
        assert_eq!(phases["eval"]["k"].launches, 3);
        assert_eq!(phases["decode"]["k"].launches, 1);
        assert_eq!(phases.len(), 3);
    }

    #[test]
    fn names_lose_their_module_paths_and_the_table_ranks_by_device_time() {
        assert_eq!(
            short_kernel_name("burn_cubecl::kernel::binary::kernel_scalar_binop<f32, burn_cubecl::ops::AddOp>"),
            "kernel_scalar_binop<f32, AddOp>"
        );
        assert_eq!(short_kernel_name("matmul"), "matmul");
        let mut phases = PhaseKernels::new();
        let t = |launches, seconds| KernelTally { launches, timed: launches, seconds };
        phases.entry("decode".into()).or_default().insert("add".into(), t(40, 0.004));
        phases.entry("decode".into()).or_default().insert("matmul".into(), t(20, 0.010));
        phases.entry("backward".into()).or_default().insert("matmul".into(), t(10, 0.006));
        let table = kernel_table(&phases, 2, 2);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[2].contains("backward") && lines[2].contains("5.0") && lines[2].contains("3.000"), "{table}");
        assert!(lines[3].contains("decode") && lines[3].contains("30.0") && lines[3].contains("7.000"), "{table}");
        assert!(lines[4].contains("total") && lines[4].contains("35.0") && lines[4].contains("10.000"), "{table}");
        assert!(lines[5].starts_with("top 2 kernels by device time"), "{table}");
        assert!(lines[7].contains("decode") && lines[7].ends_with("matmul") && lines[7].contains("500.0"), "{table}");
        assert!(lines[8].contains("backward") && lines[8].ends_with("matmul"), "{table}");
        assert_eq!(lines.len(), 9, "{table}");
    }
}
