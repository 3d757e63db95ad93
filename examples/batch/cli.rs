//! The command line.

use std::path::PathBuf;

use clap::{ArgGroup, Parser, ValueEnum};

/// Classify support tickets against a rate-limited LLM provider, first naively, then through
/// the governed stack, and compare.
#[derive(Debug, Parser)]
#[command(name = "batch", version, about)]
#[command(group(ArgGroup::new("shared_store").args(["redis_url", "postgres_url"])))]
pub(crate) struct Args {
    /// An OpenAI-compatible endpoint (plain HTTP) instead of the embedded simulated provider:
    /// a base URL as OpenAI's SDKs take it (`http://host/v1`), or the full chat completions
    /// URL (`http://host/v1/chat/completions`).
    #[arg(long, value_name = "URL", value_parser = chat_completions_url)]
    pub(crate) url: Option<String>,
    /// The embedded provider's API: OpenAI's Chat Completions, or Google's native Gemini API
    /// (`generateContent`, its quota requests and input tokens a minute, as Google counts).
    #[arg(long, value_enum, default_value = "openai", conflicts_with_all = ["url", "group", "durable"])]
    pub(crate) provider: Api,
    /// The environment variable holding the API key for --url.
    #[arg(long, value_name = "VAR", default_value = "OPENAI_API_KEY")]
    pub(crate) api_key_env: String,
    /// Requests per minute of the quota.
    #[arg(long, value_name = "N", default_value_t = 500)]
    pub(crate) rpm: u64,
    /// Tokens per minute of the quota [default: 30000; 120000 with --group, the scale of the
    /// batch article's account, where a group of ten tickets fits the budget's burst].
    #[arg(long, value_name = "N")]
    pub(crate) tpm: Option<u64>,
    /// How long the quota's minute lasts, in milliseconds [default: 2000 with the embedded
    /// provider, 60000 with --url].
    #[arg(long, value_name = "MS")]
    pub(crate) minute_ms: Option<u64>,
    /// Calls in flight at most, for the governed run.
    #[arg(long, value_name = "N", default_value = "64")]
    pub(crate) concurrency: std::num::NonZeroUsize,
    /// A fixed share of the quota for the governed run, in (0, 1] [default: the crate's
    /// adaptive share, the fleet's with --redis-url; a fixed 0.85 with --call-per-admission].
    #[arg(long, value_name = "SHARE")]
    pub(crate) headroom: Option<f64>,
    /// The share of a limit that may be spent at once, in (0, 1] [default: the crate's 1/6].
    #[arg(long, value_name = "FRACTION")]
    pub(crate) burst: Option<f64>,
    /// Work items, one JSON object a line: id, prompt, max_tokens, priority
    /// (interactive|async|batch), optional arrive_ms.
    #[arg(long, value_name = "FILE.jsonl")]
    pub(crate) input: Option<PathBuf>,
    /// Generated tickets when no --input is given.
    #[arg(long, value_name = "N", default_value_t = 500)]
    pub(crate) items: usize,
    /// The seed of the generated tickets and of the simulated provider.
    #[arg(long, value_name = "N", default_value_t = 7)]
    pub(crate) seed: u64,
    /// Skip the naive run.
    #[arg(long)]
    pub(crate) governed_only: bool,
    /// Write the figures as JSON.
    #[arg(long, value_name = "FILE.json")]
    pub(crate) report: Option<PathBuf>,
    /// Prices in US dollars per million tokens, `INPUT,OUTPUT` (decimals, read exactly): the
    /// tables gain a spend row. None ships with the example: enter your model's.
    #[arg(long, value_name = "INPUT,OUTPUT", value_parser = prices)]
    pub(crate) prices: Option<tower_llm_quota::pricing::TokenPrices>,
    /// The same from a price table in TOML (the crate's `pricing` format): the prices of the
    /// workload's model, `gpt-4o-mini`, at the standard tier.
    #[arg(long, value_name = "FILE.toml", conflicts_with = "prices", value_parser = price_file)]
    pub(crate) prices_file: Option<tower_llm_quota::pricing::TokenPrices>,
    /// Draw tokens admitted per simulated second against the quota, as SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
    /// Share the governed run's quota with other processes through this Redis server.
    #[arg(long, value_name = "URL")]
    pub(crate) redis_url: Option<String>,
    /// Share the governed run's quota with other processes through this Postgres database
    /// (its schema migrated at start), instead of Redis.
    #[arg(long, value_name = "URL", conflicts_with = "redis_url")]
    pub(crate) postgres_url: Option<String>,
    /// The name of the shared quota in its store: processes naming the same key share it.
    #[arg(long, value_name = "NAME", default_value = "batch-example")]
    pub(crate) quota_key: String,
    /// How many processes share the quota: while its store is out of reach each falls back
    /// to this share of it.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub(crate) instances: u32,
    /// With --redis-url or --postgres-url: renew the process's leased share of the quota
    /// every MS milliseconds [default: 100].
    #[arg(
        long,
        value_name = "MS",
        requires = "shared_store",
        conflicts_with = "call_per_admission"
    )]
    pub(crate) leased_shares: Option<u64>,
    /// With --redis-url or --postgres-url: one store call per admission instead of a leased
    /// share (planning a fixed 85 % of the quota unless --headroom says otherwise).
    #[arg(long, requires = "shared_store")]
    pub(crate) call_per_admission: bool,
    /// Attempts per call in the governed stack, the first included, for every class
    /// [default: the crate's, 8 for batch work]; with --durable, a job whose call fails
    /// transiently that often is rescheduled.
    #[arg(long, value_name = "N")]
    pub(crate) retry_attempts: Option<std::num::NonZeroU32>,
    /// Run the batch as durable jobs (apalis) in Redis or Postgres, shared by every worker
    /// process of the same --queue; needs --redis-url or --postgres-url.
    #[arg(long, requires = "shared_store")]
    pub(crate) durable: bool,
    /// With --durable: enqueue the items, work the queue, or both (enqueue, then work).
    #[arg(long, value_enum, default_value = "both")]
    pub(crate) role: Role,
    /// With --durable: the job queue's name.
    #[arg(long, value_name = "NAME", default_value = "batch-jobs")]
    pub(crate) queue: String,
    /// With --durable: this worker's name (unique among live workers).
    #[arg(long, value_name = "NAME", default_value = "worker-1")]
    pub(crate) worker_name: String,
    /// With --durable: how long a job's claim on its idempotency key holds without renewal.
    /// A live worker renews it every third of it while the job's call is queued or in flight;
    /// a job re-run after its worker died waits at most this long [default: two heartbeats].
    #[arg(long, value_name = "MS")]
    pub(crate) lease_ms: Option<u64>,
    /// Group N items per call, and compare with one item per call: the same tickets, shared
    /// instructions (`--instructions`) sent once per call, each answer checked per item, bad
    /// items regrouped and sent again (alone if they fail again).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub(crate) group: Option<u16>,
    /// With --group: the shared instructions, as plain text [default: the built-in
    /// classification guide, about 2,000 tokens].
    #[arg(long, value_name = "FILE.txt", requires = "group")]
    pub(crate) instructions: Option<PathBuf>,
    /// With --group: the group template, TOML with `system`, `user` and `item` texts (see
    /// `examples/batch/group-template.toml`) [default: the crate's].
    #[arg(long, value_name = "FILE.toml", requires = "group")]
    pub(crate) template: Option<PathBuf>,
    /// With --group against the embedded provider: the share of answers that are malformed,
    /// of items left out and of items answered invalidly; and a tenth of it per extra item in
    /// a group (answers get worse as groups grow).
    #[arg(long, value_name = "SHARE", default_value_t = 0.01)]
    pub(crate) answer_errors: f64,
    /// With --durable: the worker heartbeat, in whole seconds (apalis keeps heartbeats in
    /// seconds); a worker silent for two beats is dead, and its jobs are re-enqueued.
    #[arg(long, value_name = "SECS", default_value_t = 5)]
    pub(crate) heartbeat_secs: u64,
}

/// The API the embedded provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Api {
    /// OpenAI's Chat Completions: RPM and TPM (input plus output).
    Openai,
    /// Google's native Gemini API: RPM and TPM over the input.
    Gemini,
}

/// What a durable process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Role {
    /// Push one job per item, then exit.
    Enqueue,
    /// Work the queue until every enqueued job is done or dead.
    Work,
    /// Enqueue, then work.
    Both,
}

/// The chat completions URL for `--url`: a full one as it is, a base URL (`http://host/v1`,
/// with or without a trailing slash) with `/chat/completions` appended to its path, any query
/// (Azure's `api-version`) kept.
pub(crate) fn chat_completions_url(url: &str) -> Result<String, String> {
    const ENDPOINT: &str = "/chat/completions";
    let uri: http::Uri = url.parse().map_err(|e| format!("not a URL ({e}): {url}"))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.authority().is_some() => {}
        _ => return Err(format!("not an http:// URL: {url}")),
    }
    let path = uri.path().trim_end_matches('/');
    if path.ends_with(ENDPOINT) {
        return Ok(url.to_owned());
    }
    let query = uri.query().map_or_else(String::new, |q| format!("?{q}"));
    let authority = uri.authority().map_or("", |a| a.as_str());
    let scheme = uri.scheme_str().unwrap_or("http");
    Ok(format!("{scheme}://{authority}{path}{ENDPOINT}{query}"))
}

/// `--prices INPUT,OUTPUT`: dollars per million input and output tokens; cached input is
/// priced as input (the simulator caches nothing).
fn prices(text: &str) -> Result<tower_llm_quota::pricing::TokenPrices, String> {
    let (input, output) = text
        .split_once(',')
        .ok_or_else(|| format!("`{text}`: give INPUT,OUTPUT in dollars per million tokens"))?;
    tower_llm_quota::pricing::TokenPrices::per_million_usd(input, input, input, output)
        .map_err(|e| e.to_string())
}

/// `--prices-file FILE.toml`: the prices of the workload's model in a price table.
fn price_file(path: &str) -> Result<tower_llm_quota::pricing::TokenPrices, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let table: tower_llm_quota::pricing::PriceTable =
        toml::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let prices = table
        .prices(crate::workload::MODEL)
        .map_err(|e| format!("{path}: {e}"))?;
    Ok(*prices.tier(None))
}

impl Args {
    /// The prices of `--prices` or `--prices-file`, if given.
    pub(crate) fn prices(&self) -> Option<tower_llm_quota::pricing::TokenPrices> {
        self.prices.or(self.prices_file)
    }

    /// The store sharing the quota (`Redis` or `Postgres`) and its URL, if one is given.
    pub(crate) fn shared_store(&self) -> Option<(&'static str, &str)> {
        match (&self.redis_url, &self.postgres_url) {
            (Some(url), _) => Some(("Redis", url)),
            (None, Some(url)) => Some(("Postgres", url)),
            (None, None) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::chat_completions_url as url;

    #[test]
    fn a_base_url_or_the_full_url_is_accepted() {
        let full = "http://127.0.0.1:8080/v1/chat/completions";
        assert_eq!(url("http://127.0.0.1:8080/v1").unwrap(), full);
        assert_eq!(url("http://127.0.0.1:8080/v1/").unwrap(), full);
        assert_eq!(url(full).unwrap(), full);
        assert_eq!(
            url("https://host/openai/deployments/d?api-version=2024-10-21").unwrap(),
            "https://host/openai/deployments/d/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(url("http://host").unwrap(), "http://host/chat/completions");
        assert!(url("host/v1").is_err());
        assert!(url("/v1").unwrap_err().starts_with("not an http:// URL"));
        assert!(url("ftp://host/v1").is_err());
    }

    #[test]
    fn grouping_takes_a_size_and_its_files() {
        use clap::Parser;
        let args = super::Args::try_parse_from([
            "batch",
            "--group",
            "10",
            "--instructions",
            "guide.txt",
            "--template",
            "t.toml",
        ])
        .unwrap();
        assert_eq!(args.group, Some(10));
        assert!(args.instructions.is_some() && args.template.is_some());
        assert_eq!(args.answer_errors, 0.01);
        // A group of zero, or instructions without grouping, are refused.
        assert!(super::Args::try_parse_from(["batch", "--group", "0"]).is_err());
        assert!(super::Args::try_parse_from(["batch", "--instructions", "g.txt"]).is_err());
    }

    #[test]
    fn the_command_line_takes_a_base_url() {
        use clap::Parser;
        let args = super::Args::try_parse_from(["batch", "--url", "http://host/v1"]).unwrap();
        assert_eq!(args.url.as_deref(), Some("http://host/v1/chat/completions"));
    }

    #[test]
    fn prices_read_as_input_and_output_dollars_per_million() {
        let read = super::prices("0.15,0.60").unwrap();
        assert_eq!(read.input.pico_per_token(), 150_000);
        assert_eq!(read.output.pico_per_token(), 600_000);
        assert!(super::prices("0.15").unwrap_err().contains("INPUT,OUTPUT"));
        assert!(super::prices("0.15,x").is_err());
        let file = std::env::temp_dir().join(format!("batch-prices-{}.toml", std::process::id()));
        let table = "[models.\"gpt-4o*\"]\ninput = \"0.15\"\noutput = \"0.60\"\n";
        std::fs::write(&file, table).unwrap();
        let path = file.to_str().unwrap();
        assert_eq!(super::price_file(path), Ok(read));
        std::fs::write(
            &file,
            "[models.\"claude*\"]\ninput = \"3\"\noutput = \"15\"\n",
        )
        .unwrap();
        assert!(super::price_file(path).unwrap_err().contains("gpt-4o-mini"));
        std::fs::remove_file(&file).unwrap();
    }
}
