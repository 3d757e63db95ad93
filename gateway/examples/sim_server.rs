//! The simulated provider as its own process, for measuring the gateway from outside (the
//! benchmark script `bench/external.py`): an OpenAI-style chat completions endpoint that
//! answers at once, with a quota that never binds.
//!
//! ```sh
//! cargo run --release -p tower-llm-quota-gateway --example sim_server -- --listen 127.0.0.1:9001
//! ```
//!
//! It prints `simulator listening on http://ADDR` and serves until Ctrl-C (SIGINT). Calls
//! carry `Authorization: Bearer sim-key`.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use tower_llm_quota_sim::{SimConfig, Simulator};

/// The key the simulator accepts.
const SIM_KEY: &str = "sim-key";

#[derive(Debug, Parser)]
#[command(about = "The simulated LLM provider over HTTP, answering at once")]
struct Args {
    /// The address to listen on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let simulator = Simulator::new(
        SimConfig::openai(u64::MAX / 4, u64::MAX / 4)
            .latency(Duration::ZERO, Duration::ZERO)
            .key(SIM_KEY, "org"),
    );
    let server = simulator.serve(args.listen).await?;
    println!("simulator listening on {}", server.url());
    tokio::signal::ctrl_c().await?;
    Ok(())
}
