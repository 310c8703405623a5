//! sbx: the daemon (`sbx serve`), its helpers (`shim`, `init`,
//! `exec-helper`), and the CLI client. The only place that picks an exit code.

mod api;
mod cli;
mod config;
mod egress;
mod imagesvc;
mod leases;
mod network;
mod pools;
mod reaper;
mod runs;
mod seal;
mod serve;
mod store;

use std::sync::OnceLock;

use clap::{Parser, Subcommand};

/// This daemon's name, for error bodies built far from the state.
pub static SERVER_NAME: OnceLock<String> = OnceLock::new();

#[derive(Parser)]
#[command(
    name = "sbx",
    version,
    about = "Isolated, ephemeral Linux sandboxes behind a REST API"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon.
    Serve(config::ServeFlags),
    #[command(flatten)]
    Client(cli::ClientCommand),
}

fn main() {
    // The helpers dispatch before anything else: the shim and the exec
    // helper must stay single-threaded.
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("shim") if args.get(2).is_some_and(|a| a == "--zygote") => {
            // libcontainer reports through tracing; the shim's stderr is its log file.
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new("error"))
                .with_ansi(false)
                .with_writer(std::io::stderr)
                .init();
            std::process::exit(sbx_runtime::shim::zygote_main())
        }
        Some("exec-helper") => std::process::exit(sbx_runtime::exec::helper_main()),
        _ => {}
    }
    let cli = Cli::parse();
    let code = match cli.cmd {
        Command::Serve(flags) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_env("SBX_LOG")
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_writer(std::io::stderr)
                .init();
            match serve::serve(flags) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("sbx serve: {e:#}");
                    1
                }
            }
        }
        Command::Client(c) => match cli::run(c) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("sbx: {e:#}");
                1
            }
        },
    };
    std::process::exit(code);
}
