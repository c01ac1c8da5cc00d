//! Choosing the compute device. burn picks the backend from the device: `flex` (the CPU
//! backend, using every core and the CPU's SIMD) by default, CUDA with the `cuda` feature,
//! wgpu (Vulkan or Metal; on a machine without a GPU, Mesa's lavapipe) with the `wgpu` feature.

use burn::tensor::Device;

use crate::error::{Result, TroupeError};

/// The device names `--device` accepts.
pub const DEVICE_NAMES: &str = "cpu, cuda (with the `cuda` feature), wgpu (with the `wgpu` feature)";

/// Parses a device name: `cpu` (burn's flex backend) or `cuda` / `cuda:N`.
pub fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" | "flex" => Ok(Device::flex()),
        #[cfg(feature = "wgpu")]
        "wgpu" => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
        #[cfg(not(feature = "wgpu"))]
        "wgpu" => Err(TroupeError::invalid("device", "\"wgpu\" needs troupe built with `--features wgpu`")),
        #[cfg(feature = "cuda")]
        _ if name == "cuda" || name.starts_with("cuda:") => {
            let index = match name.strip_prefix("cuda:") {
                Some(i) => i
                    .parse::<usize>()
                    .map_err(|_| TroupeError::invalid("device", format!("bad CUDA index in {name:?}")))?,
                None => 0,
            };
            start_cuda(index)
        }
        _ if name.starts_with("cuda") => {
            Err(TroupeError::invalid("device", format!("{name:?} needs troupe built with `--features cuda`")))
        }
        _ => Err(TroupeError::invalid("device", format!("unknown device {name:?} (known: {DEVICE_NAMES})"))),
    }
}

/// Starts CUDA device `index` with a one-element tensor. burn starts its CUDA runtime on first
/// use and, without a driver or a GPU, panics on its runner thread (then on the caller's): starting
/// it here turns that into an error naming the device, before any work is done. Each device is
/// started once per process; the panic hook is swapped only while a lock is held, so concurrent
/// callers cannot leave each other's hook installed.
#[cfg(feature = "cuda")]
fn start_cuda(index: usize) -> Result<Device> {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};
    static STARTED: Mutex<BTreeMap<usize, std::result::Result<(), String>>> = Mutex::new(BTreeMap::new());

    let device = Device::cuda(index);
    let mut started = STARTED.lock().unwrap_or_else(|e| e.into_inner());
    let outcome = started.entry(index).or_insert_with(|| {
        let first_panic = Arc::new(Mutex::new(None::<String>));
        let previous_hook = std::panic::take_hook();
        let recorder = Arc::clone(&first_panic);
        std::panic::set_hook(Box::new(move |info| {
            let text = info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            recorder.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(text);
        }));
        let probe = std::panic::catch_unwind(|| {
            burn::tensor::Tensor::<1>::zeros([1], &device).into_data().try_to_vec::<f32>().is_ok()
        });
        std::panic::set_hook(previous_hook);
        match probe {
            Ok(true) => Ok(()),
            _ => {
                let cause = first_panic.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
                // cudarc's message goes on to list every library name it tried.
                Err(cause.split(" - searched").next().unwrap_or_default().trim().to_string())
            }
        }
    });
    match outcome {
        Ok(()) => Ok(device),
        Err(cause) => Err(TroupeError::invalid("device", format!("cuda:{index} could not be started: {cause}"))),
    }
}

/// Whether `device` is a CUDA device (where `model.dtype: auto` is bf16), with or without autodiff.
pub fn is_cuda(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            burn::backend::DispatchDevice::Cube(burn_cubecl::CubeDevice::Cuda(_))
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// Whether `device` is a wgpu device, with or without autodiff.
pub fn is_wgpu(device: &Device) -> bool {
    #[cfg(feature = "wgpu")]
    {
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            burn::backend::DispatchDevice::Cube(burn_cubecl::CubeDevice::Wgpu(_))
        )
    }
    #[cfg(not(feature = "wgpu"))]
    {
        let _ = device;
        false
    }
}

/// The device used when none is named: `TROUPE_DEVICE` if set, else the CPU.
pub fn default_device() -> Result<Device> {
    match std::env::var("TROUPE_DEVICE") {
        Ok(name) if !name.is_empty() => parse_device(&name),
        _ => Ok(Device::flex()),
    }
}

/// The precision of the base's matrices when none is named (benchmarks, examples):
/// `TROUPE_DTYPE` (`auto`, `bf16`, `f16`, `f32`) if set, else `auto` (bf16 on CUDA, f32 on the CPU).
pub fn default_precision() -> Result<crate::model::Precision> {
    match std::env::var("TROUPE_DTYPE") {
        Ok(name) if !name.is_empty() => {
            <crate::model::Precision as clap::ValueEnum>::from_str(&name, true).map_err(|_| {
                TroupeError::invalid("TROUPE_DTYPE", format!("unknown dtype {name:?} (known: auto, bf16, f16, f32)"))
            })
        }
        _ => Ok(crate::model::Precision::Auto),
    }
}

/// The attention kernel on a GPU when none is named (benchmarks): `TROUPE_ATTENTION` (`auto`,
/// `flash`, `materialized`; `runtime.attention` in a config) if set, else `auto`.
pub fn default_attention_kernel() -> Result<crate::model::AttentionKernel> {
    match std::env::var("TROUPE_ATTENTION") {
        Ok(name) if !name.is_empty() => <crate::model::AttentionKernel as clap::ValueEnum>::from_str(&name, true)
            .map_err(|_| {
                TroupeError::invalid(
                    "TROUPE_ATTENTION",
                    format!("unknown attention kernel {name:?} (known: auto, flash, materialized)"),
                )
            }),
        _ => Ok(crate::model::AttentionKernel::Auto),
    }
}

/// Whether troupe's own GPU kernels run the forwards without gradients on a `cuda` or `wgpu`
/// device (the RMS norm, the rotary embedding, attention's softmax and the SwiGLU gate, one
/// kernel each: `model::fused::gpu`): `TROUPE_GPU_KERNELS` = `troupe` (the default) or `burn`
/// (burn's composites, a kernel per operation, as before them; to compare the two on one GPU).
pub fn fused_gpu_kernels() -> Result<bool> {
    match std::env::var("TROUPE_GPU_KERNELS") {
        Ok(name) if name.eq_ignore_ascii_case("troupe") || name.is_empty() => Ok(true),
        Ok(name) if name.eq_ignore_ascii_case("burn") => Ok(false),
        Ok(name) => {
            Err(TroupeError::invalid("TROUPE_GPU_KERNELS", format!("unknown kernels {name:?} (known: troupe, burn)")))
        }
        Err(_) => Ok(true),
    }
}

/// The routine of the frozen base's products on a GPU (`model::matmul_kernel`): `TROUPE_MATMUL`
/// (`auto`, the default, or one of cubek's routines by troupe's name for it) if set.
pub fn matmul_kernel() -> Result<crate::model::MatmulKernel> {
    parse_matmul_kernel(std::env::var("TROUPE_MATMUL").ok().as_deref())
}

/// One routine's name as `TROUPE_MATMUL` takes it (`None` or blank: `auto`); an unknown one is an
/// error naming `TROUPE_MATMUL` and the known names.
pub fn parse_matmul_kernel(value: Option<&str>) -> Result<crate::model::MatmulKernel> {
    match value.map(str::trim) {
        None | Some("") => Ok(crate::model::MatmulKernel::Auto),
        Some(name) => <crate::model::MatmulKernel as clap::ValueEnum>::from_str(name, true).map_err(|_| {
            let known: Vec<String> = crate::model::MatmulKernel::all().iter().map(|k| k.name()).collect();
            TroupeError::invalid(
                "TROUPE_MATMUL",
                format!("unknown matmul kernel {name:?} (known: {})", known.join(", ")),
            )
        }),
    }
}

/// The multiple of slots a batch's rows are padded to on a GPU (`CausalLm::width_step`):
/// `TROUPE_WIDTH_STEP` (a positive count; 1 pads only to the longest row, as the CPU does, to
/// compare the two on one GPU) if set, else [`crate::model::GPU_WIDTH_STEP`].
pub fn gpu_width_step() -> Result<usize> {
    parse_width_step(std::env::var("TROUPE_WIDTH_STEP").ok().as_deref())
}

fn parse_width_step(value: Option<&str>) -> Result<usize> {
    match value.map(str::trim) {
        None | Some("") => Ok(crate::model::GPU_WIDTH_STEP),
        Some(text) => match text.parse::<usize>() {
            Ok(step) if step >= 1 => Ok(step),
            _ => Err(TroupeError::invalid("TROUPE_WIDTH_STEP", format!("{text:?} is not a positive count of slots"))),
        },
    }
}

/// The model presets a benchmark runs at: `TROUPE_BENCH_PRESETS` (preset names separated by
/// commas, e.g. `small,qwen3-0.6b`) if set, else `default`.
pub fn bench_presets(default: &[crate::model::Preset]) -> Result<Vec<crate::model::Preset>> {
    match std::env::var("TROUPE_BENCH_PRESETS") {
        Ok(names) if !names.trim().is_empty() => parse_presets(&names),
        _ => Ok(default.to_vec()),
    }
}

/// Preset names separated by commas (`small, qwen3-0.6b`), in order; an unknown one is an error
/// naming `TROUPE_BENCH_PRESETS` and the known names.
pub fn parse_presets(names: &str) -> Result<Vec<crate::model::Preset>> {
    names
        .split(',')
        .map(|name| {
            <crate::model::Preset as clap::ValueEnum>::from_str(name.trim(), true).map_err(|_| {
                let known: Vec<String> = <crate::model::Preset as clap::ValueEnum>::value_variants()
                    .iter()
                    .map(|p| preset_name(*p))
                    .collect();
                TroupeError::invalid(
                    "TROUPE_BENCH_PRESETS",
                    format!("unknown preset {:?} (known: {})", name.trim(), known.join(", ")),
                )
            })
        })
        .collect()
}

/// A preset's name as `--preset` and `TROUPE_BENCH_PRESETS` write it (`small`, `qwen3-0.6b`).
pub fn preset_name(preset: crate::model::Preset) -> String {
    clap::ValueEnum::to_possible_value(&preset).map_or_else(|| format!("{preset:?}"), |v| v.get_name().to_string())
}

/// Keeps tensor buffers in the process heap and the heap at its high-water mark, so the
/// allocator reuses them across forward passes rather than page-faulting hundreds of MB of
/// fresh, zeroed memory on every pass. glibc otherwise maps blocks over its mmap threshold
/// (at most 32 MB: a larger `M_MMAP_THRESHOLD` is refused) anew and unmaps them on free, and
/// returns the heap's free top to the kernel. Mapping is switched off (`M_MMAP_MAX` 0: a
/// thread arena that cannot hold a block retries in the main heap) and trimming too
/// (`M_TRIM_THRESHOLD` -1): resident memory stays at the run's peak, which it reaches every
/// iteration anyway. Measured on `writing_tldr` (small preset): 1.15 million page faults in
/// two iterations before. Call once at start-up.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation parameters; it is called before any other
    // thread allocates, and its arguments are valid parameter codes and values (mallopt(3)).
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn the_gpu_width_step_reads_a_positive_count_and_refuses_the_rest() {
        assert_eq!(parse_width_step(None).unwrap(), crate::model::GPU_WIDTH_STEP);
        assert_eq!(parse_width_step(Some("")).unwrap(), crate::model::GPU_WIDTH_STEP);
        assert_eq!(parse_width_step(Some("1")).unwrap(), 1);
        assert_eq!(parse_width_step(Some(" 16 ")).unwrap(), 16);
        for bad in ["0", "-8", "eight", "8.5"] {
            let err = parse_width_step(Some(bad)).unwrap_err().to_string();
            assert!(err.contains("TROUPE_WIDTH_STEP") && err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn the_matmul_kernel_reads_a_known_name_and_refuses_the_rest() {
        use crate::model::MatmulKernel;
        assert_eq!(parse_matmul_kernel(None).unwrap(), MatmulKernel::Auto);
        assert_eq!(parse_matmul_kernel(Some(" ")).unwrap(), MatmulKernel::Auto);
        assert_eq!(parse_matmul_kernel(Some("double-cmma")).unwrap(), MatmulKernel::DoubleCmma);
        assert_eq!(parse_matmul_kernel(Some(" Specialized-TMA-cmma ")).unwrap(), MatmulKernel::SpecializedTmaCmma);
        let err = parse_matmul_kernel(Some("cublas")).unwrap_err().to_string();
        assert!(err.contains("TROUPE_MATMUL") && err.contains("\"cublas\""), "{err}");
        assert!(err.contains("auto, simple-cmma, simple-mma") && err.contains("double-unit"), "{err}");
    }

    #[test]
    fn bench_presets_read_by_their_cli_names() {
        assert_eq!(parse_presets("small, qwen3-0.6b").unwrap(), vec![Preset::Small, Preset::Qwen3_0_6b]);
        assert_eq!(parse_presets("qwen3-4b").unwrap(), vec![Preset::Qwen3_4b]);
        let err = parse_presets("small,qwen3-7b").unwrap_err().to_string();
        assert!(err.contains("TROUPE_BENCH_PRESETS") && err.contains("\"qwen3-7b\""), "{err}");
        assert!(err.contains("tiny, small, qwen3-0.6b, qwen3-1.7b, qwen3-4b"), "{err}");
        for preset in [Preset::Tiny, Preset::Small, Preset::Qwen3_0_6b, Preset::Qwen3_1_7b, Preset::Qwen3_4b] {
            assert_eq!(parse_presets(&preset_name(preset)).unwrap(), vec![preset]);
        }
    }
}
