//! Compiles every variant of troupe's own GPU kernels with NVRTC, as cubecl's CUDA runtime would
//! on their first launch, on a machine without a GPU or a CUDA driver: NVRTC alone (the
//! toolkit's `libnvrtc` and its headers) turns CUDA C++ into PTX, and where the toolkit has
//! `bin/ptxas`, ptxas assembles that PTX for the device as the driver does when it loads it. A
//! kernel that fails here would fail its first launch on a GPU.
//!
//! ```bash
//! bash tools/cuda_kernels_check.sh                 # fetches NVRTC and ptxas from PyPI, then runs this
//! LD_LIBRARY_PATH=$CUDA/lib CUDA_PATH=$CUDA \
//!     cargo run --features cuda --example cuda_kernels -- [--arch 90] [--driver 13000] [--out DIR]
//! ```
//!
//! `--arch` is the compute capability (90: H100 and H200, compiled for `sm_90a` as cubecl does
//! from 9.0 on), `--driver` the CUDA driver version the properties assume (it picks the PTX
//! version only), `CUDA_PATH` the toolkit whose `include/` holds `cuda_bf16.h` and its peers (by
//! default `/usr/local/cuda`). `--out DIR` writes each variant's source (`NAME.cu`), its PTX
//! (`NAME.ptx`) and, for a failure, NVRTC's log (`NAME.log`). Prints one line per kernel (with
//! ptxas, the most registers a unit of any variant uses and the bytes it spills) and exits 1 if
//! any variant fails.
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};
use troupe::model::fused::gpu::cuda_source::kernel_sources;

struct Args {
    arch: u32,
    driver: i32,
    out: Option<PathBuf>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args { arch: 90, driver: 13000, out: None };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("`{flag}` needs a value"));
        match flag.as_str() {
            "--arch" => {
                let v = value()?;
                args.arch =
                    v.parse().with_context(|| format!("invalid `--arch` {v:?}: a compute capability such as 90"))?;
            }
            "--driver" => {
                let v = value()?;
                args.driver =
                    v.parse().with_context(|| format!("invalid `--driver` {v:?}: a version such as 13000"))?;
            }
            "--out" => args.out = Some(PathBuf::from(value()?)),
            other => bail!("unknown argument `{other}` (expected --arch N, --driver N, --out DIR)"),
        }
    }
    Ok(args)
}

/// The options cubecl's CUDA runtime hands NVRTC for a device of compute capability `arch`.
fn options(arch: u32, include: &Path) -> CompileOptions {
    let mut options = vec![
        if arch >= 90 { format!("--gpu-architecture=sm_{arch}a") } else { format!("--gpu-architecture=sm_{arch}") },
        format!("--include-path={}", include.display()),
        "-lineinfo".to_string(),
    ];
    let cccl = include.join("cccl");
    if cccl.exists() {
        options.push(format!("--include-path={}", cccl.display()));
    }
    CompileOptions { options, ..Default::default() }
}

/// NVRTC's verdict on `source`: its PTX or its log.
fn compile(source: &str, arch: u32, include: &Path) -> Result<std::result::Result<String, String>> {
    // cudarc panics when it cannot load libnvrtc: that panic is caught below, so its report is
    // kept off the terminal while NVRTC runs.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(|| compile_ptx_with_opts(source, options(arch, include)));
    std::panic::set_hook(hook);
    match outcome {
        Ok(Ok(ptx)) => Ok(Ok(ptx.to_src())),
        Ok(Err(CompileError::CompileError { log, .. })) => Ok(Err(log.to_string_lossy().into_owned())),
        Ok(Err(other)) => Ok(Err(format!("{other}"))),
        Err(_) => bail!(
            "NVRTC could not be loaded: put the CUDA toolkit's libnvrtc (e.g. libnvrtc.so.13) on LD_LIBRARY_PATH \
             (tools/cuda_kernels_check.sh fetches it from PyPI)"
        ),
    }
}

fn file_name(variant: &str) -> String {
    variant.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '=' { c } else { '_' }).collect()
}

fn run() -> Result<bool> {
    let args = parse_args()?;
    let toolkit = std::env::var_os("CUDA_PATH").map_or_else(|| PathBuf::from("/usr/local/cuda"), PathBuf::from);
    let include = toolkit.join("include");
    if !include.join("cuda_bf16.h").exists() {
        bail!("no CUDA headers at {}: set CUDA_PATH to a toolkit whose include/ holds cuda_bf16.h", include.display());
    }
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    }
    let ptxas = toolkit.join("bin").join("ptxas");
    let ptxas = ptxas.exists().then_some(ptxas);
    let scratch = std::env::temp_dir().join(format!("troupe-cuda-kernels-{}", std::process::id()));
    if ptxas.is_some() {
        std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    }
    let sources = kernel_sources(args.arch, args.driver);
    let mut tally: BTreeMap<String, Tally> = BTreeMap::new();
    for kernel in &sources {
        let base = kernel.name.split('[').next().unwrap_or(&kernel.name).to_string();
        let verdict = match &kernel.source {
            Ok(source) => compile(source, args.arch, &include)?,
            Err(error) => Err(error.clone()),
        };
        let stem = file_name(&kernel.name);
        if let Some(out) = &args.out {
            if let Ok(source) = &kernel.source {
                std::fs::write(out.join(&stem).with_extension("cu"), source)?;
            }
            match &verdict {
                Ok(ptx) => std::fs::write(out.join(&stem).with_extension("ptx"), ptx)?,
                Err(log) => std::fs::write(out.join(&stem).with_extension("log"), log)?,
            }
        }
        // The PTX to machine code, as the driver does when it loads the module.
        let verdict = match (verdict, &ptxas) {
            (Ok(ptx), Some(ptxas)) => assemble(ptxas, &scratch.join(&stem), &ptx, args.arch)?,
            (Ok(_), None) => Ok(None),
            (Err(log), _) => Err(log),
        };
        let entry = tally.entry(base).or_default();
        entry.variants += 1;
        match verdict {
            Ok(usage) => {
                if let Some(usage) = usage {
                    entry.registers = entry.registers.max(usage.registers);
                    entry.spilled = entry.spilled.max(usage.spilled);
                }
            }
            Err(log) => {
                let first =
                    log.lines().find(|l| l.contains("error")).unwrap_or(log.lines().next().unwrap_or("")).trim();
                entry.failures.push(format!("{}: {first}", kernel.name));
            }
        }
    }
    if ptxas.is_some() {
        std::fs::remove_dir_all(&scratch).ok();
    }
    let mut failed = 0;
    for (kernel, t) in &tally {
        let usage = if ptxas.is_some() {
            format!(", at most {} registers a unit, {} bytes spilled", t.registers, t.spilled)
        } else {
            String::new()
        };
        if t.failures.is_empty() {
            println!("ok      {kernel} ({} variant{}{usage})", t.variants, if t.variants == 1 { "" } else { "s" });
        } else {
            println!("FAILED  {kernel} ({} of {} variants)", t.failures.len(), t.variants);
            for failure in &t.failures {
                println!("        {failure}");
            }
            failed += t.failures.len();
        }
    }
    let arch = format!("sm_{}{}", args.arch, if args.arch >= 90 { "a" } else { "" });
    let by = if ptxas.is_some() { "NVRTC and ptxas" } else { "NVRTC (no ptxas in CUDA_PATH/bin: not assembled)" };
    println!("{} variants of {} kernels compiled by {by} for {arch}: {failed} failed", sources.len(), tally.len());
    Ok(failed == 0)
}

/// One kernel's variants, the most registers and spilled bytes ptxas gave any, and the failures.
#[derive(Default)]
struct Tally {
    variants: usize,
    registers: u32,
    spilled: u32,
    failures: Vec<String>,
}

/// What ptxas reports a variant's unit uses.
struct Usage {
    registers: u32,
    spilled: u32,
}

/// ptxas's verdict on `ptx` for `arch` (written to `stem.ptx` first): its registers and spill
/// stores, or its log.
fn assemble(ptxas: &Path, stem: &Path, ptx: &str, arch: u32) -> Result<std::result::Result<Option<Usage>, String>> {
    let input = stem.with_extension("ptx");
    std::fs::write(&input, ptx).with_context(|| format!("writing {}", input.display()))?;
    let target = if arch >= 90 { format!("sm_{arch}a") } else { format!("sm_{arch}") };
    let output = std::process::Command::new(ptxas)
        .arg(format!("-arch={target}"))
        .arg("-v")
        .arg(&input)
        .arg("-o")
        .arg(stem.with_extension("cubin"))
        .output()
        .with_context(|| format!("running {}", ptxas.display()))?;
    let log = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        return Ok(Err(format!("ptxas: {log}")));
    }
    // `Used 32 registers, used 1 barriers` and `0 bytes stack frame, 0 bytes spill stores, ...`.
    let number_before = |unit: &str| {
        log.lines().find_map(|line| {
            let at = line.find(unit)?;
            line[..at].split_whitespace().last()?.parse::<u32>().ok()
        })
    };
    match (number_before(" registers"), number_before(" bytes spill stores")) {
        (Some(registers), Some(spilled)) => Ok(Ok(Some(Usage { registers, spilled }))),
        _ => Ok(Err(format!("ptxas gave no register count: {log}"))),
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
