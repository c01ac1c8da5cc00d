//! The cubecl launch observer behind [`super::kernels`]: every kernel a cubecl device (CUDA,
//! wgpu) is asked to run is counted on the issuing thread, and with timing, bracketed by device
//! timestamps that are read back at [`super::kernels::resolve`].

use std::sync::Arc;

use burn_cubecl::cubecl::future::block_on;
use burn_cubecl::cubecl::logging::{LaunchObservation, LaunchObserver, ProfileDuration, TimingRequest};

use super::kernels::{self, PendingTiming};

struct Observer {
    timing: bool,
}

impl LaunchObserver for Observer {
    fn launched(&self, kernel: &'static str) {
        kernels::launched(kernel);
    }

    fn timing(&self) -> TimingRequest {
        if self.timing {
            TimingRequest::Deferred
        } else {
            TimingRequest::None
        }
    }

    fn profiled(&self, kernel: &'static str, profile: ProfileDuration) {
        kernels::timed_later(kernel, Box::new(Deferred(profile)));
    }
}

struct Deferred(ProfileDuration);

impl PendingTiming for Deferred {
    fn seconds(self: Box<Self>) -> Option<f64> {
        block_on(self.0.resolve()).map(|ticks| ticks.duration().as_secs_f64())
    }
}

/// Reports every cubecl kernel launch to [`super::kernels`] (with its device time if `timing`)
/// while the returned value lives.
pub fn observe(timing: bool) -> LaunchObservation {
    LaunchObservation::new(Arc::new(Observer { timing }))
}
