//! The `troupe` command line (DESIGN.md, "Command line"): JSON to stdout, logs to stderr.
//! [`main_with`] is the whole binary as a library function taking the registry, so a plug-in
//! crate's `main` is a few lines.

pub mod adapters;
pub mod code;
pub mod env;
pub mod eval;
pub mod model;
pub mod out_dir;
pub mod output;
pub mod plot;
pub mod train;

use clap::{Parser, Subcommand};
use troupe_envs::Registry;

/// troupe: train teams of LLM agents (one LoRA adapter each, one frozen base) by MAGRPO.
#[derive(Debug, Parser)]
#[command(name = "troupe", version, about)]
struct Cli {
    /// Compute device: cpu (default; burn's flex backend on every core), or cuda / cuda:N with
    /// the `cuda` feature. Also read from TROUPE_DEVICE.
    #[arg(long, global = true)]
    device: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write the built-in model as a Hugging Face model directory.
    InitModel(model::InitModelArgs),
    /// Print log p(token i+1 | tokens ..= i) of a text as JSON.
    Logprobs(model::LogprobsArgs),
    /// Continue a prompt; prints JSON with the tokens and text.
    Generate(model::GenerateArgs),
    /// Models: inspect a directory or GGUF file.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// LoRA adapters: inspect a directory, merge one into its base.
    #[command(subcommand)]
    Adapters(adapters::AdaptersCommand),
    /// Environments: list, play, bench, record, replay, serve.
    #[command(subcommand)]
    Env(env::EnvCommand),
    /// Run coding problems' tests in the sandbox.
    #[command(subcommand)]
    Code(code::CodeCommand),
    /// Train the agents' adapters by MAGRPO self-play (or resume a run).
    Train(train::TrainArgs),
    /// Evaluate adapters on held-out episodes; prints JSON.
    Eval(eval::EvalArgs),
    /// Draw a run's learning curves (metrics.jsonl) to RUN_DIR/plots/*.png.
    Plot(plot::PlotArgs),
}

/// Runs the `troupe` command line with the environments and baseline policies of `registry`:
/// what the `troupe` binary's `main` calls with the built-in ones, and what a plug-in crate's
/// `main` calls after registering its own, getting every command (train, resume, eval, plot,
/// env list/play/bench/record/replay/serve). Parses `std::env::args`, logs to stderr, and
/// returns the process's exit code (an error is printed as one `error: ...` line).
pub fn main_with(registry: Registry) -> std::process::ExitCode {
    crate::device::tune_allocator();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log redirected to a file stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let device = || match &cli.device {
        Some(name) => crate::device::parse_device(name),
        None => crate::device::default_device(),
    };
    // For commands whose config names a device: only an explicit choice overrides it.
    let explicit_device = || -> crate::error::Result<Option<burn::tensor::Device>> {
        match &cli.device {
            Some(name) => crate::device::parse_device(name).map(Some),
            None => match std::env::var("TROUPE_DEVICE") {
                Ok(name) if !name.is_empty() => crate::device::parse_device(&name).map(Some),
                _ => Ok(None),
            },
        }
    };
    // Checked here, before any work, so that a misspelt value stops with one line.
    let checked = crate::device::fused_gpu_kernels()
        .and_then(|_| crate::device::gpu_width_step())
        .and_then(|_| crate::device::matmul_kernel());
    let result = checked.map_err(Into::into).and_then(|_| match cli.command {
        Command::InitModel(args) => model::init_model(args),
        Command::Logprobs(args) => device().map_err(Into::into).and_then(|d| model::logprobs(args, &d)),
        Command::Generate(args) => device().map_err(Into::into).and_then(|d| model::generate_text(args, &d)),
        Command::Model(command) => model::run_model(command),
        Command::Adapters(command) => device().map_err(Into::into).and_then(|d| adapters::run(command, &d)),
        Command::Env(command) => env::run(command, &registry),
        Command::Code(command) => code::run(command),
        Command::Plot(args) => plot::run(args),
        Command::Train(args) => explicit_device().map_err(Into::into).and_then(|d| train::run(args, d, &registry)),
        Command::Eval(args) => explicit_device().map_err(Into::into).and_then(|d| eval::run(args, d, &registry)),
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) if output::is_stdout_closed(&err) => output::exit_for_closed_stdout(),
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
