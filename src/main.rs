//! The `troupe` binary: see `troupe --help` and DESIGN.md's "Command line". The command line
//! itself is [`troupe::cli::main_with`], here with the built-in environments and policies.

fn main() -> std::process::ExitCode {
    troupe::cli::main_with(troupe_envs::Registry::with_builtins())
}
