//! Reading tensors back to the host where a device's failure must become an error, not a
//! panic. A GPU computes asynchronously: a kernel that could not get its memory (a model, a
//! batch or a cache too big for the card) fails silently, and the failure surfaces at the next
//! read of anything that depended on it. The reads on a training run's and a generation's path
//! go through here, so running out of device memory ends the command with one line naming
//! what was being computed and what to change, with nothing lost (checkpoints are only written
//! after a step completes).

use std::fmt::Display;

use burn::tensor::Tensor;

use crate::error::{Result, TroupeError};

/// What the device was computing when a read found its failure, and what to change when the
/// failure is a want of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// A rollout's or `troupe generate`'s prefill and decoding steps.
    Decoding,
    /// Scoring fixed texts without gradients (`choice` decisions, reference log-probs,
    /// `troupe logprobs`).
    Scoring,
    /// The update's forward and backward passes.
    Update,
    /// The optimizer's step (gradient norms, AdamW).
    Optimizer,
    /// Reading adapters and optimizer state back to write them (checkpoints, `troupe adapters`).
    Saving,
    /// An adapter's products read back to fold into its base (`troupe adapters merge`).
    Merging,
}

impl Stage {
    /// The phrase after "while".
    fn during(self) -> &'static str {
        match self {
            Stage::Decoding => "decoding",
            Stage::Scoring => "scoring",
            Stage::Update => "computing the update",
            Stage::Optimizer => "stepping the optimizer",
            Stage::Saving => "saving the adapters",
            Stage::Merging => "merging the adapter into its base",
        }
    }

    /// What lowers this stage's memory.
    fn remedy(self) -> &'static str {
        match self {
            Stage::Decoding => {
                "fewer rows in flight (training.groups_per_iteration x training.group_size, \
                 runtime.eval_batch_episodes), a shorter action.max_new_tokens, or a smaller model \
                 (model.dtype: bf16 halves an f32 base)"
            }
            Stage::Scoring => {
                "fewer rows at a time (runtime.micro_batch_rows), or a smaller model (model.dtype: bf16 \
                 halves an f32 base)"
            }
            // A save reads what the update and the optimizer computed: their failure shows here.
            Stage::Update | Stage::Optimizer | Stage::Saving => {
                "smaller micro-batches (runtime.micro_batch_rows or runtime.micro_batch_tokens), \
                 runtime.gradient_checkpointing: true, or a smaller model"
            }
            // One projection's `B A` at a time: the host has room where the device has none.
            Stage::Merging => "--device cpu, which merges on the host",
        }
    }
}

/// Bytes in a message of the form "... can't allocate buffer of size: N ...", the way cubecl's
/// allocators report a want of memory.
fn failed_allocation(message: &str) -> Option<u64> {
    const MARK: &str = "allocate buffer of size: ";
    let at = message.find(MARK)? + MARK.len();
    let digits: String = message[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The device's failure as troupe's error: its allocation in MiB and the remedy when memory ran
/// out, else the failure's innermost cause, on one line.
pub fn device_error(stage: Stage, failure: impl Display) -> TroupeError {
    let message = failure.to_string();
    let reason = match failed_allocation(&message) {
        Some(bytes) => format!(
            "out of device memory (an allocation of {:.1} MiB failed); try {}",
            bytes as f64 / (1024.0 * 1024.0),
            stage.remedy()
        ),
        None => {
            // The chain's last line that says something ("Caused by:" lines are headings).
            let cause = message
                .lines()
                .map(str::trim)
                .rev()
                .find(|line| !line.is_empty() && !line.starts_with("Caused by") && !line.starts_with("No backtrace"))
                .unwrap_or("an unknown failure");
            cause.to_string()
        }
    };
    TroupeError::Device { during: stage.during(), reason }
}

/// `tensor`'s values as f32 on the host (converted from its dtype), or the device's failure.
pub fn to_vec<const D: usize>(tensor: Tensor<D>, stage: Stage) -> Result<Vec<f32>> {
    let data = tensor.try_into_data().map_err(|e| device_error(stage, e))?;
    data.try_cast_as::<f32>().and_then(|d| d.try_into_vec::<f32>()).map_err(|e| device_error(stage, format!("{e:?}")))
}

/// The one value of `tensor` as f32, or the device's failure.
pub fn to_scalar(tensor: Tensor<1>, stage: Stage) -> Result<f32> {
    let values = to_vec(tensor, stage)?;
    values.first().copied().ok_or_else(|| device_error(stage, "an empty tensor was read as a scalar"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_want_of_memory_names_its_size_the_stage_and_the_remedy() {
        // The chain cubecl's wgpu server gave for a failed allocation under lavapipe.
        let failure = "An error happened during execution\nCaused by:\n  Several failures at once\nCaused by:\n  \
                       The bytes were never written (failure #1, still claiming 16 buffer(s))\n  skipped \
                       `SampleKernel`: it needed memory ManagedMemoryId { value: 386 }\nCaused by:\n  An IO error \
                       happened\nCaused by:\n  can't allocate buffer of size: 167772160\nNo backtrace available";
        let message = device_error(Stage::Update, failure).to_string();
        assert_eq!(
            message,
            "the device failed while computing the update: out of device memory (an allocation of 160.0 MiB \
             failed); try smaller micro-batches (runtime.micro_batch_rows or runtime.micro_batch_tokens), \
             runtime.gradient_checkpointing: true, or a smaller model"
        );
        assert!(!message.contains('\n'));
    }

    #[test]
    fn a_base_too_big_is_found_while_decoding_and_a_save_takes_the_updates_remedy() {
        let failure = "Caused by:\n  can't allocate buffer of size: 1048576";
        let decoding = device_error(Stage::Decoding, failure).to_string();
        assert!(
            decoding.starts_with("the device failed while decoding: out of device memory (an allocation of 1.0 MiB")
        );
        assert!(decoding.contains("model.dtype: bf16"), "{decoding}");
        let saving = device_error(Stage::Saving, failure).to_string();
        assert!(saving.starts_with("the device failed while saving the adapters: "), "{saving}");
        assert!(saving.ends_with(Stage::Update.remedy()), "{saving}");
    }

    #[test]
    fn another_failure_gives_its_innermost_cause_on_one_line() {
        let failure = "An error happened during execution\nCaused by:\n  the kernel trapped\nNo backtrace available";
        let message = device_error(Stage::Decoding, failure).to_string();
        assert_eq!(message, "the device failed while decoding: the kernel trapped");
    }

    #[test]
    fn reads_on_the_cpu_give_the_values() {
        let device = burn::tensor::Device::flex();
        let t = Tensor::<2>::from_data([[1.0f32, 2.0], [3.0, 4.0]], &device);
        assert_eq!(to_vec(t, Stage::Scoring).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        let s = Tensor::<1>::from_data([5.5f32], &device);
        assert_eq!(to_scalar(s, Stage::Update).unwrap(), 5.5);
        let half = Tensor::<1>::from_data([1.5f32, -2.0], &device).cast(burn::tensor::FloatDType::BF16);
        assert_eq!(to_vec(half, Stage::Scoring).unwrap(), vec![1.5, -2.0]);
    }
}
