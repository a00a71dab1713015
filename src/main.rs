//! The `lily` command line. Each subcommand lives in its own file under `src/cli/`.

use clap::Parser;

mod cli;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = cli::Cli::parse();
    if let Err(e) = cli::run(args) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
