//! The `taintgate` binary.

use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = taintgate::cli::Cli::parse();
    let code = taintgate::cli::main_with(cli).await;
    std::process::exit(code);
}
