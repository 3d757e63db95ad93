//! The figures of a run, the before/after table and the JSON report.

use std::time::Duration;

use serde_json::{Value, json};
use tower_llm_quota::Priority;

use crate::plot::Panel;
use tower_llm_quota::pricing::{PricedTokens, TokenPrices};

use crate::run::{Binding, Consumption, Outcome, QuotaSpec, quantile};

/// Queue wait by class: p50, p95 and max.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WaitStats {
    pub(crate) priority: Priority,
    pub(crate) count: usize,
    pub(crate) p50: Duration,
    pub(crate) p95: Duration,
    pub(crate) max: Duration,
}

/// What one run (naive or governed) measured.
#[derive(Debug, Clone)]
pub(crate) struct RunFigures {
    pub(crate) items: usize,
    pub(crate) ok: usize,
    pub(crate) failed: usize,
    /// Calls that reached the provider, retries included.
    pub(crate) attempts: u64,
    pub(crate) provider_429: u64,
    pub(crate) wall: Duration,
    /// What the provider charged (the simulator's own count, or the usage in the bodies).
    pub(crate) used: Consumption,
    pub(crate) waits: Vec<WaitStats>,
    /// A few failure messages, to say why items failed.
    pub(crate) failures: Vec<String>,
    pub(crate) panel: Panel,
}

impl RunFigures {
    /// Counts `outcomes`; the rest is measured by the caller.
    pub(crate) fn from_outcomes(
        outcomes: &[Outcome],
        attempts: u64,
        provider_429: u64,
        wall: Duration,
        used: Consumption,
        panel: Panel,
    ) -> Self {
        let ok = outcomes.iter().filter(|o| o.result.is_ok()).count();
        let failures = outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().err().map(|e| format!("{}: {e}", o.id)))
            .take(3)
            .collect();
        Self {
            items: outcomes.len(),
            ok,
            failed: outcomes.len() - ok,
            attempts,
            provider_429,
            wall,
            used,
            waits: wait_stats(outcomes),
            failures,
            panel,
        }
    }
}

fn wait_stats(outcomes: &[Outcome]) -> Vec<WaitStats> {
    Priority::ALL
        .into_iter()
        .filter_map(|priority| {
            let mut waits: Vec<Duration> = outcomes
                .iter()
                .filter(|o| o.priority == priority)
                .filter_map(|o| o.result.as_ref().ok().map(|done| done.waited))
                .collect();
            (!waits.is_empty()).then(|| WaitStats {
                priority,
                count: waits.len(),
                p50: quantile(&mut waits, 0.50),
                p95: quantile(&mut waits, 0.95),
                max: quantile(&mut waits, 1.0),
            })
        })
        .collect()
}

/// The quota and the work, against which both runs are measured.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Frame {
    pub(crate) quota: QuotaSpec,
    pub(crate) minimum: Duration,
    /// The shortest wall time with the provider's initial bucket (a minute of quota) spent at
    /// once.
    pub(crate) bound: Duration,
    pub(crate) binding: Binding,
    /// The prices of `--prices`, for a spend row.
    pub(crate) prices: Option<TokenPrices>,
}

/// Nano-dollars as dollars, to the micro-dollar.
pub(crate) fn dollars(nano: u64) -> String {
    format!(
        "${}.{:06}",
        nano / 1_000_000_000,
        nano % 1_000_000_000 / 1_000
    )
}

/// The spend of `input` and `output` tokens at `prices`, in nano-dollars.
pub(crate) fn spend(prices: &TokenPrices, input: u64, output: u64) -> u64 {
    let tokens = PricedTokens {
        input,
        output,
        ..PricedTokens::default()
    };
    prices.spend(tokens)
}

impl Frame {
    /// The frame of the work the governed run did (every item, once).
    pub(crate) fn of(quota: QuotaSpec, governed: &RunFigures) -> Self {
        let (minimum, binding) = quota.theoretical_minimum(governed.used);
        Self {
            quota,
            minimum,
            bound: quota.burst_bound(governed.used),
            binding,
            prices: None,
        }
    }

    /// The same frame, pricing the runs at `prices`.
    pub(crate) fn with_prices(self, prices: Option<TokenPrices>) -> Self {
        Self { prices, ..self }
    }

    fn spend(&self, run: &RunFigures) -> Option<u64> {
        self.prices
            .as_ref()
            .map(|p| spend(p, run.used.input, run.used.output))
    }

    fn utilisation(&self, run: &RunFigures) -> f64 {
        self.quota.utilisation(run.used, self.binding, run.wall)
    }
}

/// Prints the before/after table.
pub(crate) fn print_table(frame: &Frame, naive: Option<&RunFigures>, governed: &RunFigures) {
    let minute = frame.quota.minute.as_secs_f64();
    let cell = |f: &dyn Fn(&RunFigures) -> String| {
        (naive.map_or_else(|| String::from("-"), f), f(governed))
    };
    let mut rows: Vec<(String, (String, String))> = vec![
        (
            "items done / failed".into(),
            cell(&|r| format!("{} / {}", r.ok, r.failed)),
        ),
        ("calls (attempts)".into(), cell(&|r| r.attempts.to_string())),
        (
            "provider 429s".into(),
            cell(&|r| r.provider_429.to_string()),
        ),
        ("tokens used".into(), cell(&|r| r.used.tokens.to_string())),
    ];
    if frame.prices.is_some() {
        let at = |r: &RunFigures| frame.spend(r).map_or_else(String::new, dollars);
        rows.push(("spend (at the prices given)".into(), cell(&at)));
    }
    rows.extend([
        (
            "wall time".into(),
            cell(&|r| {
                let secs = r.wall.as_secs_f64();
                format!("{secs:.1} s = {:.2} quota min", secs / minute)
            }),
        ),
        (
            format!("utilisation ({})", frame.binding.name()),
            cell(&|r| format!("{:.1} %", 100.0 * frame.utilisation(r))),
        ),
        (
            "wall ÷ theoretical minimum".into(),
            cell(&|r| match frame.minimum.as_secs_f64() {
                0.0 => "-".to_owned(), // nothing was consumed
                minimum => format!("{:.3}", r.wall.as_secs_f64() / minimum),
            }),
        ),
        (
            "wall ÷ bound (full bucket)".into(),
            cell(&|r| match frame.bound.as_secs_f64() {
                0.0 => "-".to_owned(), // the work fits the provider's first minute
                bound => format!("{:.3}", r.wall.as_secs_f64() / bound),
            }),
        ),
    ]);
    for priority in Priority::ALL {
        let wait = |r: &RunFigures| {
            r.waits
                .iter()
                .find(|w| w.priority == priority)
                .map_or_else(|| String::from("-"), |w| format!("{:.0} ms", ms(w.p95)))
        };
        if governed.waits.iter().any(|w| w.priority == priority) {
            rows.push((format!("queue wait p95, {priority}"), cell(&wait)));
        }
    }
    println!();
    println!(
        "{:<30} {:>24} {:>24}",
        "", "naive (join_all)", "governed (QuotaStack)"
    );
    for (name, (before, after)) in rows {
        println!("{name:<30} {before:>24} {after:>24}");
    }
    println!(
        "theoretical minimum: {:.1} s = {:.2} quota min ({} used by the governed run / nominal {} rate)",
        frame.minimum.as_secs_f64(),
        frame.minimum.as_secs_f64() / minute,
        frame.binding.name(),
        match frame.binding {
            Binding::Tokens => "TPM",
            Binding::Requests => "RPM",
        }
    );
    println!(
        "bound (full bucket): {:.1} s: for each dimension, what the governed run consumed \
         beyond the provider's initial bucket (one minute of quota) / nominal rate; the longest",
        frame.bound.as_secs_f64()
    );
    println!(
        "utilisation: {} consumed / (nominal rate × wall time); above 100 % means the run \
         spent the provider's initial burst too",
        frame.binding.name()
    );
    for (name, run) in [("naive", naive), ("governed", Some(governed))] {
        if let Some(run) = run.filter(|r| !r.failures.is_empty()) {
            println!("{name} failures, e.g.: {}", run.failures.join("; "));
        }
    }
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}

/// The JSON report: the governed run's figures at the top, the naive run's under `naive`.
pub(crate) fn json_report(
    frame: &Frame,
    provider: &str,
    headroom: Option<f64>,
    naive: Option<&RunFigures>,
    governed: &RunFigures,
) -> Value {
    let mut report = run_json(frame, governed);
    report["provider"] = json!(provider);
    report["quota"] = json!({
        "rpm": frame.quota.rpm,
        "tpm": frame.quota.tpm,
        "minute_ms": frame.quota.minute.as_millis() as u64,
        "governed_headroom": headroom.map_or(json!("adaptive"), |h| json!(h)),
    });
    report["binding_dimension"] = json!(frame.binding.name());
    if let Some(naive) = naive {
        report["naive"] = run_json(frame, naive);
    }
    report
}

fn run_json(frame: &Frame, run: &RunFigures) -> Value {
    let waits: serde_json::Map<String, Value> = run
        .waits
        .iter()
        .map(|w| {
            let stats =
                json!({"count": w.count, "p50": ms(w.p50), "p95": ms(w.p95), "max": ms(w.max)});
            (w.priority.as_str().to_owned(), stats)
        })
        .collect();
    json!({
        "items": run.items,
        "ok": run.ok,
        "failed": run.failed,
        "provider_429": run.provider_429,
        "attempts": run.attempts,
        "wall_ms": ms(run.wall),
        "tokens_used": run.used.tokens,
        "input_tokens": run.used.input,
        "output_tokens": run.used.output,
        "spend_nano_usd": frame.spend(run),
        "requests_admitted": run.used.requests,
        "theoretical_min_ms": ms(frame.minimum),
        "bound_ms": ms(frame.bound),
        "utilisation": frame.utilisation(run),
        "queue_wait_ms": waits,
        "failures": run.failures,
    })
}
