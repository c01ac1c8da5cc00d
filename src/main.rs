//! The `troupe` binary: see `troupe --help` and DESIGN.md's "Command line".

use clap::{Parser, Subcommand};

use troupe::cli;

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
    InitModel(cli::model::InitModelArgs),
    /// Print log p(token i+1 | tokens ..= i) of a text as JSON.
    Logprobs(cli::model::LogprobsArgs),
    /// Continue a prompt; prints JSON with the tokens and text.
    Generate(cli::model::GenerateArgs),
    /// Models: inspect a directory or GGUF file.
    #[command(subcommand)]
    Model(cli::model::ModelCommand),
    /// LoRA adapters: inspect a directory, merge one into its base.
    #[command(subcommand)]
    Adapters(cli::adapters::AdaptersCommand),
    /// Environments: list, play, bench, record, replay.
    #[command(subcommand)]
    Env(cli::env::EnvCommand),
    /// Run coding problems' tests in the sandbox.
    #[command(subcommand)]
    Code(cli::code::CodeCommand),
    /// Train the agents' adapters by MAGRPO self-play (or resume a run).
    Train(cli::train::TrainArgs),
    /// Evaluate adapters on held-out episodes; prints JSON.
    Eval(cli::eval::EvalArgs),
    /// Draw a run's learning curves (metrics.jsonl) to RUN_DIR/plots/*.png.
    Plot(cli::plot::PlotArgs),
}

fn main() -> std::process::ExitCode {
    troupe::device::tune_allocator();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let device = || match &cli.device {
        Some(name) => troupe::device::parse_device(name),
        None => troupe::device::default_device(),
    };
    // For commands whose config names a device: only an explicit choice overrides it.
    let explicit_device = || -> troupe::error::Result<Option<burn::tensor::Device>> {
        match &cli.device {
            Some(name) => troupe::device::parse_device(name).map(Some),
            None => match std::env::var("TROUPE_DEVICE") {
                Ok(name) if !name.is_empty() => troupe::device::parse_device(&name).map(Some),
                _ => Ok(None),
            },
        }
    };
    let result = match cli.command {
        Command::InitModel(args) => cli::model::init_model(args),
        Command::Logprobs(args) => device().map_err(Into::into).and_then(|d| cli::model::logprobs(args, &d)),
        Command::Generate(args) => device().map_err(Into::into).and_then(|d| cli::model::generate_text(args, &d)),
        Command::Model(command) => cli::model::run_model(command),
        Command::Adapters(command) => device().map_err(Into::into).and_then(|d| cli::adapters::run(command, &d)),
        Command::Env(command) => cli::env::run(command),
        Command::Code(command) => cli::code::run(command),
        Command::Plot(args) => cli::plot::run(args),
        Command::Train(args) => explicit_device().map_err(Into::into).and_then(|d| cli::train::run(args, d)),
        Command::Eval(args) => explicit_device().map_err(Into::into).and_then(|d| cli::eval::run(args, d)),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
