//! Cheap wall-clock accounting of the phases inside generation and the update that the
//! trainer's own phase timers cannot see: prefill (a generation's first forward over the
//! prompts, and `choice` scoring), decode (every later step), the update's forward passes and
//! its backward passes. Each is an [`Instant`] read where the code already waits for the
//! device (a generation step reads its logits back to sample; the update reads each
//! micro-batch's loss before its backward), so timing adds no host round trip.
//!
//! The sums are per thread (what a trainer's iteration on that thread spent): the trainer
//! [`take`]s them at the start and the end of an iteration. They feed
//! [`crate::rl::trainer::IterationStats::phase_seconds`] (`seconds_prefill`, ... in
//! `metrics.jsonl`) and the `troupe train --profile` table.

use std::cell::Cell;
use std::time::Instant;

pub mod kernels;
pub mod memory;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod observer;

/// A phase timed inside generation or the update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A generation's first step (the prompts' forward and the first token), and `choice` scoring.
    Prefill,
    /// Every later generation step (one token per live row).
    Decode,
    /// The update's forward passes, up to each micro-batch's loss.
    UpdateForward,
    /// The update's backward passes, gradients summed per adapter.
    Backward,
}

impl Phase {
    /// Every phase, in [`PhaseSeconds`] order.
    pub const ALL: [Phase; 4] = [Phase::Prefill, Phase::Decode, Phase::UpdateForward, Phase::Backward];

    /// The phase's key (`seconds_<name>` in `metrics.jsonl`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::UpdateForward => "update_forward",
            Phase::Backward => "backward",
        }
    }
}

/// Seconds per phase, indexed as [`Phase::ALL`].
pub type PhaseSeconds = [f64; 4];

thread_local! {
    static SECONDS: Cell<PhaseSeconds> = const { Cell::new([0.0; 4]) };
}

/// Closes `phase` on this thread: gives it the kernels launched since the last phase closed,
/// when they are being counted ([`kernels`]), and the device's memory now, when it is watched
/// ([`memory`]).
pub fn close(phase: &'static str) {
    kernels::close(phase);
    memory::mark(phase);
}

/// Adds the time since `started` to `phase`, and [`close`]s it.
pub fn since(phase: Phase, started: Instant) {
    close(phase.name());
    let seconds = started.elapsed().as_secs_f64();
    SECONDS.with(|s| {
        let mut v = s.get();
        v[phase as usize] += seconds;
        s.set(v);
    });
}

/// This thread's sums since the last `take`, which resets them.
pub fn take() -> PhaseSeconds {
    SECONDS.with(|s| s.replace([0.0; 4]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_accumulate_per_phase_and_take_resets_them() {
        take();
        let earlier = Instant::now() - std::time::Duration::from_millis(5);
        since(Phase::Decode, earlier);
        since(Phase::Decode, earlier);
        let sums = take();
        assert!(sums[Phase::Decode as usize] >= 0.01);
        assert_eq!((sums[0], sums[2], sums[3]), (0.0, 0.0, 0.0));
        assert_eq!(take(), [0.0; 4]);
    }
}
