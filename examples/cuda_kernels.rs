//! Compiles every variant of troupe's own GPU kernels with NVRTC, as cubecl's CUDA runtime would
//! on their first launch, on a machine without a GPU or a CUDA driver: NVRTC alone (the
//! toolkit's `libnvrtc` and its headers) turns CUDA C++ into PTX. A kernel that fails here would
//! fail its first launch on a GPU.
//!
//! ```bash
//! bash tools/cuda_kernels_check.sh                 # fetches NVRTC from PyPI, then runs this
//! LD_LIBRARY_PATH=$CUDA/lib CUDA_PATH=$CUDA \
//!     cargo run --features cuda --example cuda_kernels -- [--arch 90] [--driver 13000] [--out DIR]
//! ```
//!
//! `--arch` is the compute capability (90: H100 and H200, compiled for `sm_90a` as cubecl does
//! from 9.0 on), `--driver` the CUDA driver version the properties assume (it picks the PTX
//! version only), `CUDA_PATH` the toolkit whose `include/` holds `cuda_bf16.h` and its peers (by
//! default `/usr/local/cuda`). `--out DIR` writes each variant's source (`NAME.cu`) and, for a
//! failure, NVRTC's log (`NAME.log`). Prints one line per kernel and exits 1 if any variant fails.
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

/// NVRTC's verdict on `source`: `Ok` or its log.
fn compile(source: &str, arch: u32, include: &Path) -> Result<std::result::Result<(), String>> {
    // cudarc panics when it cannot load libnvrtc: that panic is caught below, so its report is
    // kept off the terminal while NVRTC runs.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(|| compile_ptx_with_opts(source, options(arch, include)));
    std::panic::set_hook(hook);
    match outcome {
        Ok(Ok(_)) => Ok(Ok(())),
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
    let sources = kernel_sources(args.arch, args.driver);
    // Per kernel: variants, and the failures' names.
    let mut tally: BTreeMap<String, (usize, Vec<String>)> = BTreeMap::new();
    for kernel in &sources {
        let base = kernel.name.split('[').next().unwrap_or(&kernel.name).to_string();
        let verdict = match &kernel.source {
            Ok(source) => compile(source, args.arch, &include)?,
            Err(error) => Err(error.clone()),
        };
        if let Some(out) = &args.out {
            let stem = out.join(file_name(&kernel.name));
            if let Ok(source) = &kernel.source {
                std::fs::write(stem.with_extension("cu"), source)?;
            }
            if let Err(log) = &verdict {
                std::fs::write(stem.with_extension("log"), log)?;
            }
        }
        let entry = tally.entry(base).or_default();
        entry.0 += 1;
        if let Err(log) = verdict {
            let first = log.lines().find(|l| l.contains("error")).unwrap_or(log.lines().next().unwrap_or("")).trim();
            entry.1.push(format!("{}: {first}", kernel.name));
        }
    }
    let mut failed = 0;
    for (kernel, (variants, failures)) in &tally {
        if failures.is_empty() {
            println!("ok      {kernel} ({variants} variants)");
        } else {
            println!("FAILED  {kernel} ({} of {variants} variants)", failures.len());
            for failure in failures {
                println!("        {failure}");
            }
            failed += failures.len();
        }
    }
    println!(
        "{} variants of {} kernels compiled by NVRTC for sm_{}{}: {failed} failed",
        sources.len(),
        tally.len(),
        args.arch,
        if args.arch >= 90 { "a" } else { "" }
    );
    Ok(failed == 0)
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
