//! A GPU's memory per phase: at every phase boundary ([`super::since`] and the trainer's own
//! marks) the device's memory is read from its allocator (cubecl's memory report: the bytes
//! live tensors hold, and the bytes its pools have taken from the driver), and each phase keeps
//! the most it saw. The trainer [`take`]s them once an iteration (`memory_mib_<phase>` and
//! `memory_reserved_mib` in `metrics.jsonl`, the `--profile` table's memory lines).
//!
//! A boundary is where the code already waits for the device (a decoding step reads its
//! tokens back, a micro-batch its loss), so what is in use there is what the phase keeps
//! between its kernels: the update's forward ends with every activation its backward needs
//! alive, a decoding step with the KV cache. A kernel's transient scratch inside a phase is
//! not seen in use, but the pools' reservation grows to hold it, and reservations are what a
//! GPU's own tools (`nvidia-smi`) report. Only cubecl devices have an allocator to read: on the
//! CPU nothing is recorded.

use std::cell::RefCell;
use std::collections::BTreeMap;

use burn::tensor::Device;

/// A device's memory at one moment, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// What live tensors hold.
    pub in_use: u64,
    /// What the allocator's pools hold from the driver (at least `in_use`).
    pub reserved: u64,
}

impl DeviceMemory {
    /// The larger of each figure.
    fn max(self, other: Self) -> Self {
        Self { in_use: self.in_use.max(other.in_use), reserved: self.reserved.max(other.reserved) }
    }
}

/// The most each phase saw since the last [`take`], by phase name.
pub type PhaseMemory = BTreeMap<&'static str, DeviceMemory>;

#[derive(Default)]
struct Watch {
    /// The device read at each mark, while one is watched.
    device: Option<Device>,
    phases: PhaseMemory,
}

thread_local! {
    static WATCH: RefCell<Watch> = RefCell::new(Watch::default());
}

/// Reads `device`'s memory at every later [`mark`] on this thread, when it has an allocator to
/// read (a CUDA or wgpu device); on the CPU, stops watching.
pub fn watch(device: &Device) {
    let device = read(device).map(|_| device.clone());
    WATCH.with(|w| w.borrow_mut().device = device);
}

/// Records the watched device's memory for `phase` (a no-op when none is watched).
pub fn mark(phase: &'static str) {
    WATCH.with(|w| {
        let mut w = w.borrow_mut();
        if let Some(now) = w.device.as_ref().and_then(read) {
            record(&mut w.phases, phase, now);
        }
    });
}

/// This thread's maxima per phase since the last `take`, which resets them.
pub fn take() -> PhaseMemory {
    WATCH.with(|w| std::mem::take(&mut w.borrow_mut().phases))
}

fn record(phases: &mut PhaseMemory, phase: &'static str, now: DeviceMemory) {
    let seen = phases.entry(phase).or_default();
    *seen = seen.max(now);
}

/// `device`'s memory now, or `None` where there is no cubecl allocator (the CPU).
pub fn read(device: &Device) -> Option<DeviceMemory> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        use burn_cubecl::cubecl::MemoryScope;
        match device.clone().without_autodiff().as_dispatch() {
            burn::backend::DispatchDevice::Cube(cube) => {
                let usage = cube.client().memory_report(MemoryScope::Device).usage();
                Some(DeviceMemory { in_use: usage.bytes_in_use, reserved: usage.bytes_reserved })
            }
            _ => None,
        }
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    {
        let _ = device;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_phase_keeps_the_most_it_saw_of_each_figure() {
        let mut phases = PhaseMemory::new();
        record(&mut phases, "decode", DeviceMemory { in_use: 5, reserved: 8 });
        record(&mut phases, "decode", DeviceMemory { in_use: 7, reserved: 7 });
        record(&mut phases, "backward", DeviceMemory { in_use: 2, reserved: 9 });
        assert_eq!(phases["decode"], DeviceMemory { in_use: 7, reserved: 8 });
        assert_eq!(phases["backward"], DeviceMemory { in_use: 2, reserved: 9 });
    }

    #[test]
    fn the_cpu_has_no_allocator_to_read_and_marks_record_nothing() {
        let device = crate::device::parse_device("cpu").unwrap();
        assert_eq!(read(&device), None);
        take();
        watch(&device);
        mark("decode");
        assert!(take().is_empty());
    }
}
