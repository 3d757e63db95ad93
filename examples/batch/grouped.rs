//! `--group N`: the tickets grouped N per call, against the same tickets one per call.
//!
//! Both runs send the same shared instructions (`--instructions`, by default the built-in
//! classification guide of about 1,800 tokens) and the same tickets through the governed
//! stack, with the crate's [`Grouper`]: one run with groups of one, one with groups of N.
//! Each answer is split by item id and checked (an `answer` must be present); an item left
//! out, named twice or answered badly is sent again, regrouped with the others to send again
//! (alone if that group fails it too), and an item that fails in the end is reported with its
//! reason. Against the embedded provider, `--answer-errors` makes the
//! model err like a real one, more often in larger groups.

use tower_llm_quota::pricing::TokenPrices;

use crate::report::{dollars, spend};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use serde_json::json;
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{Layer, Service, ServiceExt};
use tower_llm_quota::BoxError;
use tower_llm_quota::group::{
    ApiFormat, GroupConfig, GroupItem, GroupReport, Grouper, TextTemplate,
};
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota_sim::{GroupFaults, SimConfig, Simulator};

use crate::cli::Args;
use crate::run::{Meter, Metered};
use crate::workload::{TicketShape, ticket_texts};
use crate::{Failure, Provider, Settings};

/// The built-in shared instructions.
const INSTRUCTIONS: &str = include_str!("instructions.txt");

/// Output tokens each ticket's answer needs at most: a label and one sentence.
const ANSWER_TOKENS: u64 = 60;

type Llm =
    BoxCloneService<Request<Full<Bytes>>, Response<UnsyncBoxBody<Bytes, BoxError>>, BoxError>;

/// What one run measured.
struct GroupedRun {
    size: usize,
    calls: u64,
    input_tokens: u64,
    output_tokens: u64,
    wall: Duration,
    provider_429: u64,
    ok: usize,
    resent: u64,
    resent_alone: u64,
    failed: u64,
    failures: Vec<String>,
}

pub(crate) async fn run(
    args: &Args,
    settings: &Settings,
    provider: &Provider,
    size: usize,
) -> Result<ExitCode, Failure> {
    let (instructions, template) = prompt_parts(args)?;
    let items: Vec<GroupItem> = ticket_texts("ticket", args.items, TicketShape::SUPPORT, args.seed)
        .into_iter()
        .map(|(id, text)| GroupItem::new(id, text).expected_output(ANSWER_TOKENS))
        .collect();
    println!(
        "grouping {} tickets: shared instructions of {} characters, groups of 1, then of {size}",
        items.len(),
        instructions.chars().count()
    );
    let mut runs = Vec::new();
    for group in [1, size] {
        // A fresh stack per run: each starts with a full budget, as with its fresh provider.
        let stack = crate::governed_stack(args, settings).await?;
        // A group the budget could never admit at once is not formed.
        let config = GroupConfig::new()
            .max_items(group)?
            .fit_budget(stack.budget());
        let run = measure(
            args,
            settings,
            provider,
            &stack,
            &items,
            &instructions,
            &template,
            config,
        )
        .await?;
        println!(
            "groups of {group}: {} calls, {} items done, {} failed",
            run.calls, run.ok, run.failed
        );
        runs.push(run);
        if matches!(provider, Provider::Remote(_)) {
            println!("waiting one quota minute for the provider's quota to refill...");
            tokio::time::sleep(settings.quota.minute).await;
        }
    }
    print_table(&runs[0], &runs[1], args.prices().as_ref());
    if let Some(path) = &args.report {
        let report = json!({"one_per_call": run_json(&runs[0]), "grouped": run_json(&runs[1])});
        std::fs::write(path, format!("{report:#}\n"))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("report written to {}", path.display());
    }
    let clean = runs.iter().all(|r| r.provider_429 == 0);
    match (provider, clean) {
        (_, true) => {
            println!("check: both runs answered or reported every item without a provider 429");
            Ok(ExitCode::SUCCESS)
        }
        (Provider::Embedded(_), false) => {
            println!("CHECK FAILED: provider 429s in a governed run");
            Ok(ExitCode::FAILURE)
        }
        (Provider::Remote(_), false) => Ok(ExitCode::SUCCESS),
    }
}

/// The shared instructions and the template of `--instructions` and `--template`, or the
/// built-in ones.
pub(crate) fn prompt_parts(args: &Args) -> Result<(Arc<str>, TextTemplate), Failure> {
    let instructions: Arc<str> = match &args.instructions {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?
            .into(),
        None => INSTRUCTIONS.into(),
    };
    let template = match &args.template {
        Some(path) => read_template(path)?,
        None => TextTemplate::default(),
    };
    Ok((instructions, template))
}

fn read_template(path: &std::path::Path) -> Result<TextTemplate, Failure> {
    #[derive(serde::Deserialize)]
    struct Texts {
        system: String,
        user: String,
        item: String,
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let texts: Texts =
        toml::from_str(&text).map_err(|e| format!("{} is not a template: {e}", path.display()))?;
    Ok(TextTemplate::new(texts.system, texts.user, texts.item)?)
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    args: &Args,
    settings: &Settings,
    provider: &Provider,
    stack: &QuotaStack,
    items: &[GroupItem],
    instructions: &Arc<str>,
    template: &TextTemplate,
    config: GroupConfig,
) -> Result<GroupedRun, Failure> {
    let size = config.items_limit();
    let start = Instant::now();
    let meter = Meter::new(start);
    let target = &settings.target;
    let (client, simulator) = match provider {
        Provider::Embedded(sim) => {
            let share = args.answer_errors.clamp(0.0, 1.0);
            let faults = GroupFaults::none()
                .malformed(share)
                .missing(share)
                .invalid(share)
                .per_extra_item(share / 10.0);
            let simulator = Simulator::new(SimConfig::clone(sim).group_faults(faults));
            let client = boxed(stack.layer(Metered::new(simulator.service(), Arc::clone(&meter))));
            (client, Some(simulator))
        }
        Provider::Remote(client) => {
            let client = crate::remote::Reqwest::plain(client.clone());
            (
                boxed(stack.layer(Metered::new(client, Arc::clone(&meter)))),
                None,
            )
        }
    };
    let grouper = Grouper::new(client, ApiFormat::OpenAiChat, Arc::clone(instructions))
        .uri(target.url.parse()?)
        .header(
            http::header::AUTHORIZATION,
            format!("Bearer {}", target.api_key).parse()?,
        )
        .template(template.clone())
        .config(config);
    let report: GroupReport<_> = grouper.run(items.to_vec()).await;
    let wall = start.elapsed();
    let stats = report.stats;
    let (input_tokens, output_tokens, provider_429) = match &simulator {
        Some(simulator) => {
            let sim = simulator.stats();
            (sim.prompt_tokens, sim.completion_tokens, sim.rate_limited)
        }
        None => (
            stats.input_tokens,
            stats.output_tokens,
            meter.rate_limited_at().len() as u64,
        ),
    };
    let failures = report
        .outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err().map(|e| format!("{}: {e}", o.id)))
        .take(3)
        .collect();
    Ok(GroupedRun {
        size,
        calls: meter.attempts(),
        input_tokens,
        output_tokens,
        wall,
        provider_429,
        ok: report.outcomes.iter().filter(|o| o.result.is_ok()).count(),
        resent: stats.items_resent,
        resent_alone: stats.items_resent_alone,
        failed: stats.items_failed,
        failures,
    })
}

fn boxed<S, B>(service: S) -> Llm
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    BoxCloneService::new(
        service
            .map_response(|response: Response<B>| {
                response.map(|body| body.map_err(Into::into).boxed_unsync())
            })
            .map_err(Into::into),
    )
}

fn print_table(alone: &GroupedRun, grouped: &GroupedRun, prices: Option<&TokenPrices>) {
    let total = |r: &GroupedRun| r.input_tokens + r.output_tokens;
    type Cell<'a> = Box<dyn Fn(&GroupedRun) -> String + 'a>;
    let mut rows: Vec<(&str, Cell<'_>)> = vec![
        ("calls (attempts)", Box::new(|r| r.calls.to_string())),
        ("input tokens", Box::new(|r| r.input_tokens.to_string())),
        ("output tokens", Box::new(|r| r.output_tokens.to_string())),
        ("total tokens", Box::new(move |r| total(r).to_string())),
    ];
    if let Some(prices) = prices {
        let at = move |r: &GroupedRun| dollars(spend(prices, r.input_tokens, r.output_tokens));
        rows.push(("spend (at the prices given)", Box::new(at)));
    }
    rows.extend::<[(&str, Cell<'_>); 5]>([
        (
            "wall time",
            Box::new(|r| format!("{:.1} s", r.wall.as_secs_f64())),
        ),
        ("provider 429s", Box::new(|r| r.provider_429.to_string())),
        ("items re-sent", Box::new(|r| r.resent.to_string())),
        (
            "items re-sent alone",
            Box::new(|r| r.resent_alone.to_string()),
        ),
        (
            "items done / failed",
            Box::new(|r| format!("{} / {}", r.ok, r.failed)),
        ),
    ]);
    println!();
    let grouped_head = format!("groups of {}", grouped.size);
    println!("{:<24} {:>16} {:>16}", "", "one per call", grouped_head);
    for (name, cell) in rows {
        println!("{name:<24} {:>16} {:>16}", cell(alone), cell(grouped));
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    println!(
        "grouped: {:.1}x fewer calls, {:.1} % fewer tokens, {:.2}x the wall time",
        ratio(alone.calls as f64, grouped.calls as f64),
        100.0 * (1.0 - ratio(total(grouped) as f64, total(alone) as f64)),
        ratio(grouped.wall.as_secs_f64(), alone.wall.as_secs_f64()),
    );
    for run in [alone, grouped] {
        if !run.failures.is_empty() {
            println!(
                "groups of {} failures, e.g.: {}",
                run.size,
                run.failures.join("; ")
            );
        }
    }
}

fn run_json(run: &GroupedRun) -> serde_json::Value {
    json!({
        "group_size": run.size,
        "calls": run.calls,
        "input_tokens": run.input_tokens,
        "output_tokens": run.output_tokens,
        "wall_ms": run.wall.as_secs_f64() * 1_000.0,
        "provider_429": run.provider_429,
        "items_done": run.ok,
        "items_resent": run.resent,
        "items_resent_alone": run.resent_alone,
        "items_failed": run.failed,
        "failures": run.failures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_file_spells_the_crate_s_default() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples/batch/group-template.toml");
        let template = read_template(&path).expect("the file reads");
        assert_eq!(template, TextTemplate::default());
    }

    #[test]
    fn a_template_that_cannot_be_split_is_an_error() {
        let dir = std::env::temp_dir().join(format!("group-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.toml");
        std::fs::write(
            &path,
            "system = \"\"\nuser = \"no items\"\nitem = \"{{id}} {{text}}\"\n",
        )
        .unwrap();
        let error = read_template(&path).unwrap_err().to_string();
        assert_eq!(
            error,
            "invalid group template: the user text has no {{items}}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
