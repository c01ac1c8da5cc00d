//! troupe's own kernels as the CUDA C++ a CUDA device would compile, built on a machine without
//! one, so that NVRTC can check them before a GPU is at hand (`examples/cuda_kernels.rs`).
//!
//! On a GPU, cubecl expands each kernel on first launch (its comptime arguments and element
//! types fixed), transpiles it to CUDA C++ and hands that to NVRTC; a kernel NVRTC refuses fails
//! the launch. lavapipe runs the same kernels through another compiler (SPIR-V), so its tests say
//! nothing about NVRTC. Here every kernel is expanded the way a launch expands it
//! (`create_dummy_kernel`: the same argument registration), against the properties and
//! compilation options cubecl's CUDA runtime gives a device of the chosen compute capability
//! ([`cubecl_cuda::offline_properties`]), for each variant troupe launches: every comptime flag,
//! and the element types its tensors take (f32, bf16 and f16 values; u8 and u32 boolean masks;
//! i32 and i64 ids). The tensors' shapes and handles are stand-ins: only the kernel's source is
//! built, nothing runs.

use std::sync::Arc;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{BoolStore, DType};
use burn_cubecl::cubecl::ir::{DeviceProperties, ElemType, TargetProperties};
use burn_cubecl::cubecl::prelude::{CubeCount, CubeDim, TensorArg};
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::cubecl::zspace::{Shape, Strides};
use burn_cubecl::cubecl::{define_kernel, Compiler, CubeKernel};
use cubecl_common::device::{DeviceId, ServiceId};
use cubecl_cuda::{offline_properties, CudaCompilationOptions, CudaCompiler, CudaRuntime};
use cubecl_environment::stream::StreamId;

use super::{
    attention, cache_write, decode_attention, lora, low_rank_group, norm_rope, rms_norm, rope, sample, swiglu,
    token_logprob,
};

/// One variant of one kernel: its name with the comptime arguments and element types it was
/// expanded with, and its CUDA C++ source, or why cubecl could not build it.
pub struct KernelSource {
    /// `kernel[argument=value, ...]`.
    pub name: String,
    /// The source NVRTC compiles, or cubecl's error expanding or transpiling the kernel.
    pub source: Result<String, String>,
}

/// Every variant of troupe's kernels, as CUDA C++ for a device of compute capability
/// `arch_version` (`90`: H100, H200) under a driver of `driver_version` (`13000`: CUDA 13.0).
pub fn kernel_sources(arch_version: u32, driver_version: i32) -> Vec<KernelSource> {
    let (properties, options) = offline_properties(arch_version, &format!("sm_{arch_version}"), driver_version);
    let mut build = Build {
        properties: Arc::new(properties),
        target: Arc::new(<CudaRuntime as burn_cubecl::cubecl::__private::Runtime>::target_properties()),
        options,
        sources: Vec::new(),
    };
    build.attention();
    build.cache_write();
    build.decode_attention();
    build.lora();
    build.norm_rope();
    build.rms_norm();
    build.rope();
    build.sample();
    build.swiglu();
    build.token_logprob();
    build.sources
}

/// A row kernel's cube size: the widest [`super::row_launch`] takes.
const UNITS: usize = 256;

/// The element types a value tensor is held in.
const VALUES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The element types a boolean mask is held in (burn's cubecl backends never hold one natively).
const MASKS: [DType; 2] = [DType::Bool(BoolStore::U8), DType::Bool(BoolStore::U32)];

/// The element types ids (tokens, a row's group) are held in.
const IDS: [DType; 2] = [DType::I32, DType::I64];

/// A half-precision rounding of a kernel's output: whether it is written, and its element type
/// (f32, unwritten, without one), as [`super::rounded_output`] gives them.
const ROUNDINGS: [(bool, DType); 3] = [(false, DType::F32), (true, DType::BF16), (true, DType::F16)];

/// The short name of an element type, for a variant's name.
fn short(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::Bool(BoolStore::U8) => "bool-u8",
        DType::Bool(BoolStore::U32) => "bool-u32",
        _ => "other",
    }
}

fn elem(dtype: DType) -> ElemType {
    dtype_to_storage_type(dtype)
}

/// A stand-in tensor argument of `shape` (contiguous, 4 bytes a value): registration reads its
/// rank and length; no kernel runs on it.
fn tensor(shape: &[usize]) -> TensorArg {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let bytes = shape.iter().product::<usize>() as u64 * 4;
    let handle =
        Handle::new(ServiceId::of::<KernelSource>(DeviceId { type_id: 0, index_id: 0 }), StreamId { value: 0 }, bytes);
    // SAFETY: the argument is only registered and expanded, never bound to a launch, so its
    // shape and strides need not describe memory.
    unsafe { TensorArg::from_raw_parts(handle, Strides::new(&strides), shape.iter().copied().collect::<Shape>()) }
}

/// The stand-in launch a kernel's expansion records (its count is not read).
fn count() -> CubeCount {
    CubeCount::Static(1, 1, 1)
}

/// A cube of `units` units along x.
fn cube(units: usize) -> CubeDim {
    CubeDim::new_1d(units as u32)
}

/// The variants built so far, and what every kernel is built against.
struct Build {
    properties: Arc<DeviceProperties>,
    target: Arc<TargetProperties>,
    options: CudaCompilationOptions,
    sources: Vec<KernelSource>,
}

impl Build {
    fn props(&self) -> (Arc<DeviceProperties>, Arc<TargetProperties>) {
        (self.properties.clone(), self.target.clone())
    }

    /// Expands `kernel` and transpiles it as cubecl's CUDA runtime does on its first launch.
    fn add(&mut self, name: String, kernel: impl CubeKernel) {
        let source = define_kernel(&kernel)
            .map_err(|e| format!("expanding: {e}"))
            .and_then(|definition| {
                CudaCompiler::default().compile(definition, &self.options).map_err(|e| format!("transpiling: {e}"))
            })
            .map(|representation| representation.to_string());
        self.sources.push(KernelSource { name, source });
    }

    fn attention(&mut self) {
        for mask in MASKS.into_iter().chain([DType::F32]) {
            let (p, t) = self.props();
            let kernel = attention::kernel::masked_softmax_kernel::create_dummy_kernel(
                p,
                t,
                count(),
                cube(UNITS),
                tensor(&[4, 64]),
                tensor(&[4, 64]),
                tensor(&[4, 64]),
                4,
                0.125,
                UNITS,
                elem(mask),
            );
            self.add(format!("masked_softmax_kernel[mask={}]", short(mask)), kernel);
        }
        let (p, t) = self.props();
        let kernel = attention::kernel::softmax_backward_kernel::create_dummy_kernel(
            p,
            t,
            count(),
            cube(UNITS),
            tensor(&[4, 64]),
            tensor(&[4, 64]),
            tensor(&[4, 64]),
            4,
            64,
            0.125,
            UNITS,
        );
        self.add("softmax_backward_kernel".into(), kernel);
    }

    fn cache_write(&mut self) {
        for room in VALUES {
            let (p, t) = self.props();
            let kernel = cache_write::kernel::cache_write_kernel::create_dummy_kernel(
                p,
                t,
                count(),
                cube(256),
                tensor(&[1, 2, 1, 64]),
                tensor(&[1, 2, 1, 64]),
                tensor(&[1, 2, 8, 64]),
                tensor(&[1, 2, 8, 64]),
                3,
                elem(room),
            );
            self.add(format!("cache_write_kernel[room={}]", short(room)), kernel);
        }
    }

    fn decode_attention(&mut self) {
        for mask in MASKS {
            for (round, rounded) in ROUNDINGS {
                for cache in VALUES {
                    // One part: the row's own tensors and the mask stand in for the prompt's.
                    let parts = [(false, mask)].into_iter().chain(IDS.map(|id| (true, id)));
                    for (two_parts, group) in parts {
                        let (p, t) = self.props();
                        let kernel = decode_attention::kernel::decode_attention_kernel::create_dummy_kernel(
                            p,
                            t,
                            count(),
                            cube(64),
                            tensor(&[2, 2, 2, 64]),
                            tensor(&[1, 2, 16, 64]),
                            tensor(&[1, 2, 16, 64]),
                            tensor(&[2]),
                            tensor(&[2, 2, 8, 64]),
                            tensor(&[2, 2, 8, 64]),
                            tensor(&[2, 1, 1, 24]),
                            tensor(&[2, 2, 2, 64]),
                            tensor(&[2, 2, 2, 64]),
                            8,
                            0.125,
                            two_parts,
                            round,
                            64,
                            elem(mask),
                            elem(group),
                            elem(rounded),
                            elem(cache),
                        );
                        self.add(
                            format!(
                                "decode_attention_kernel[mask={}, group={}, rounded={}, cache={}, two_parts={two_parts}, round={round}]",
                                short(mask),
                                short(group),
                                short(rounded),
                                short(cache)
                            ),
                            kernel,
                        );
                    }
                }
            }
        }
    }

    fn lora(&mut self) {
        for slots in [8, 64] {
            for masked in [false, true] {
                for onto in [false, true] {
                    let (p, t) = self.props();
                    let kernel = lora::kernel::lora_delta_kernel::create_dummy_kernel(
                        p,
                        t,
                        count(),
                        cube(lora::UNITS),
                        tensor(&[4, 256]),
                        tensor(&[slots, 256]),
                        tensor(&[512, slots]),
                        tensor(&[4, slots]),
                        tensor(&[4, 512]),
                        tensor(&[4, 512]),
                        4,
                        1,
                        1,
                        lora::COLUMNS,
                        lora::UNITS,
                        slots,
                        low_rank_group(slots),
                        masked,
                        onto,
                    );
                    self.add(format!("lora_delta_kernel[slots={slots}, masked={masked}, onto={onto}]"), kernel);
                }
            }
        }
    }

    fn norm_rope(&mut self) {
        let (p, t) = self.props();
        let kernel = norm_rope::kernel::rms_norm_rope_kernel::create_dummy_kernel(
            p,
            t,
            count(),
            cube(64),
            tensor(&[4, 64]),
            tensor(&[64]),
            tensor(&[1, 32]),
            tensor(&[1, 32]),
            tensor(&[4, 64]),
            4,
            1e-6,
            64,
        );
        self.add("rms_norm_rope_kernel".into(), kernel);
        let (p, t) = self.props();
        let kernel = norm_rope::kernel::rms_norm_rope_pair_kernel::create_dummy_kernel(
            p,
            t,
            count(),
            cube(64),
            tensor(&[4, 64]),
            tensor(&[64]),
            tensor(&[2, 64]),
            tensor(&[64]),
            tensor(&[1, 32]),
            tensor(&[1, 32]),
            tensor(&[4, 64]),
            tensor(&[2, 64]),
            4,
            2,
            1e-6,
            64,
        );
        self.add("rms_norm_rope_pair_kernel".into(), kernel);
        for room in VALUES {
            for normed in [false, true] {
                let (p, t) = self.props();
                let kernel = norm_rope::kernel::rope_into_room_kernel::create_dummy_kernel(
                    p,
                    t,
                    count(),
                    cube(64),
                    tensor(&[1, 4, 1, 64]),
                    tensor(&[64]),
                    tensor(&[1, 2, 1, 64]),
                    tensor(&[64]),
                    tensor(&[1, 2, 1, 64]),
                    tensor(&[1, 32]),
                    tensor(&[1, 32]),
                    tensor(&[1, 4, 1, 64]),
                    tensor(&[1, 2, 8, 64]),
                    tensor(&[1, 2, 8, 64]),
                    4,
                    2,
                    3,
                    1e-6,
                    64,
                    normed,
                    elem(room),
                );
                self.add(format!("rope_into_room_kernel[room={}, normed={normed}]", short(room)), kernel);
            }
        }
    }

    fn rms_norm(&mut self) {
        for with_extra in [false, true] {
            for (low_rank, masked, slots) in [(false, false, 1), (true, false, 16), (true, true, 16), (true, true, 128)]
            {
                for (round, rounded) in ROUNDINGS {
                    let (p, t) = self.props();
                    let kernel = rms_norm::kernel::add_rms_norm_kernel::create_dummy_kernel(
                        p,
                        t,
                        count(),
                        cube(UNITS),
                        tensor(&[4, 512]),
                        tensor(&[4, 512]),
                        tensor(&[4, 512]),
                        tensor(&[4, 256]),
                        tensor(&[slots, 256]),
                        tensor(&[512, slots]),
                        tensor(&[4, slots]),
                        tensor(&[512]),
                        tensor(&[4, 512]),
                        tensor(&[4, 512]),
                        tensor(&[4, 512]),
                        4,
                        1,
                        1e-6,
                        UNITS,
                        with_extra,
                        low_rank,
                        masked,
                        slots,
                        low_rank_group(slots),
                        round,
                        elem(rounded),
                    );
                    self.add(
                        format!(
                            "add_rms_norm_kernel[with_extra={with_extra}, low_rank={low_rank}, masked={masked}, slots={slots}, rounded={}]",
                            short(rounded)
                        ),
                        kernel,
                    );
                }
            }
        }
        let (p, t) = self.props();
        let kernel = rms_norm::kernel::rms_norm_kernel::create_dummy_kernel(
            p,
            t,
            count(),
            cube(UNITS),
            tensor(&[4, 512]),
            tensor(&[512]),
            tensor(&[4, 512]),
            4,
            1e-6,
            UNITS,
        );
        self.add("rms_norm_kernel".into(), kernel);
        let (p, t) = self.props();
        let kernel = rms_norm::kernel::rms_norm_backward_kernel::create_dummy_kernel(
            p,
            t,
            count(),
            cube(UNITS),
            tensor(&[4, 512]),
            tensor(&[512]),
            tensor(&[4, 512]),
            tensor(&[4, 512]),
            4,
            1e-6,
            UNITS,
        );
        self.add("rms_norm_backward_kernel".into(), kernel);
    }

    fn rope(&mut self) {
        let (p, t) = self.props();
        let kernel = rope::kernel::rope_kernel::create_dummy_kernel(
            p,
            t,
            count(),
            cube(256),
            tensor(&[1, 4, 8, 64]),
            tensor(&[8, 32]),
            tensor(&[8, 32]),
            tensor(&[1, 4, 8, 64]),
        );
        self.add("rope_kernel".into(), kernel);
        let (p, t) = self.props();
        let kernel = rope::kernel::rope_backward_kernel::create_dummy_kernel(
            p,
            t,
            count(),
            cube(256),
            tensor(&[1, 4, 8, 64]),
            tensor(&[8, 32]),
            tensor(&[8, 32]),
            tensor(&[1, 4, 8, 64]),
        );
        self.add("rope_backward_kernel".into(), kernel);
    }

    fn sample(&mut self) {
        for greedy in [false, true] {
            let (p, t) = self.props();
            let kernel = sample::kernel::sample_kernel::create_dummy_kernel(
                p,
                t,
                count(),
                cube(UNITS),
                tensor(&[4, 1000]),
                tensor(&[4]),
                tensor(&[4, 2]),
                4,
                0.7,
                50,
                0.95,
                greedy,
                UNITS,
            );
            self.add(format!("sample_kernel[greedy={greedy}]"), kernel);
        }
    }

    fn swiglu(&mut self) {
        for (round, rounded) in ROUNDINGS {
            let (p, t) = self.props();
            let kernel = swiglu::kernel::swiglu_kernel::create_dummy_kernel(
                p,
                t,
                count(),
                cube(256),
                tensor(&[4, 512]),
                tensor(&[4, 512]),
                tensor(&[4, 512]),
                tensor(&[4, 512]),
                round,
                elem(rounded),
            );
            self.add(format!("swiglu_kernel[rounded={}]", short(rounded)), kernel);
        }
        let (p, t) = self.props();
        let kernel = swiglu::kernel::swiglu_backward_kernel::create_dummy_kernel(
            p,
            t,
            count(),
            cube(256),
            tensor(&[4, 512]),
            tensor(&[4, 512]),
            tensor(&[4, 512]),
            tensor(&[4, 1024]),
        );
        self.add("swiglu_backward_kernel".into(), kernel);
    }

    fn token_logprob(&mut self) {
        for ids in IDS {
            let (p, t) = self.props();
            let kernel = token_logprob::kernel::token_logprob_kernel::create_dummy_kernel(
                p,
                t,
                count(),
                cube(UNITS),
                tensor(&[4, 1000]),
                tensor(&[4]),
                tensor(&[4]),
                4,
                UNITS,
                elem(ids),
            );
            self.add(format!("token_logprob_kernel[targets={}]", short(ids)), kernel);
            let (p, t) = self.props();
            let kernel = token_logprob::kernel::token_logprob_complement_kernel::create_dummy_kernel(
                p,
                t,
                count(),
                cube(UNITS),
                tensor(&[4, 1000]),
                tensor(&[4]),
                tensor(&[4]),
                tensor(&[4, 1000]),
                4,
                UNITS,
                elem(ids),
            );
            self.add(format!("token_logprob_complement_kernel[targets={}]", short(ids)), kernel);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::kernel_sources;

    /// The kernels troupe launches: every `#[cube(launch...)]` function under `gpu/`.
    fn launched_kernels() -> BTreeSet<String> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/model/fused/gpu");
        let mut names = BTreeSet::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let mut lines = text.lines();
            while let Some(line) = lines.next() {
                if line.trim_start().starts_with("#[cube(launch") {
                    let signature = lines.by_ref().find(|l| l.contains(" fn ")).unwrap();
                    let name = signature.split(" fn ").nth(1).unwrap().split(['<', '(']).next().unwrap();
                    names.insert(name.to_string());
                }
            }
        }
        names
    }

    #[test]
    fn every_launched_kernel_transpiles_for_sm_90() {
        let sources = kernel_sources(90, 13000);
        let built: BTreeSet<String> = sources.iter().map(|k| k.name.split('[').next().unwrap().to_string()).collect();
        assert_eq!(built, launched_kernels(), "kernel_sources must build every kernel troupe launches");
        let names: BTreeSet<&str> = sources.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names.len(), sources.len(), "two variants share a name");
        for kernel in &sources {
            let source = kernel.source.as_ref().unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
            let base = kernel.name.split('[').next().unwrap();
            assert!(source.contains("extern \"C\" __global__"), "{}: no entry point", kernel.name);
            assert!(source.contains(base), "{}: entry point not named after the kernel", kernel.name);
        }
    }
}
