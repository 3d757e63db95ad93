//! A hand-written SVG chart: tokens admitted per simulated second against the quota line,
//! with the 429s marked.

use std::fmt::Write;
use std::time::Duration;

const WIDTH: f64 = 900.0;
const PANEL_HEIGHT: f64 = 260.0;
const MARGIN_LEFT: f64 = 70.0;
const MARGIN_RIGHT: f64 = 20.0;
const MARGIN_TOP: f64 = 36.0;
const MARGIN_BOTTOM: f64 = 40.0;

/// One run's series, one point per simulated second.
#[derive(Debug, Clone, Default)]
pub(crate) struct Panel {
    pub(crate) title: String,
    /// Tokens admitted in each simulated second.
    pub(crate) tokens: Vec<u64>,
    /// 429s in each simulated second.
    pub(crate) rate_limited: Vec<u64>,
    /// The quota's tokens per simulated second (TPM / 60).
    pub(crate) quota: f64,
}

impl Panel {
    /// A panel from events measured by the client: `(instant, tokens)` of each admitted call
    /// and the instants of the 429s, binned into simulated seconds of `second`.
    pub(crate) fn from_events(
        title: String,
        admitted: impl IntoIterator<Item = (Duration, u64)>,
        rate_limited: &[Duration],
        second: Duration,
        quota: f64,
    ) -> Self {
        let bin = |at: Duration| (at.as_secs_f64() / second.as_secs_f64()) as usize;
        let mut panel = Self {
            title,
            quota,
            ..Self::default()
        };
        for (at, tokens) in admitted {
            *grow(&mut panel.tokens, bin(at)) += tokens;
        }
        for &at in rate_limited {
            *grow(&mut panel.rate_limited, bin(at)) += 1;
        }
        panel
    }
}

fn grow(values: &mut Vec<u64>, index: usize) -> &mut u64 {
    if values.len() <= index {
        values.resize(index + 1, 0);
    }
    &mut values[index]
}

/// The SVG document: one panel per run, stacked, sharing the time axis.
pub(crate) fn svg(panels: &[Panel]) -> String {
    let seconds = panels
        .iter()
        .map(|p| p.tokens.len().max(p.rate_limited.len()))
        .max()
        .unwrap_or(0)
        .max(1);
    let height = PANEL_HEIGHT * panels.len() as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (index, panel) in panels.iter().enumerate() {
        draw_panel(&mut out, panel, index as f64 * PANEL_HEIGHT, seconds);
    }
    out.push_str("</svg>\n");
    out
}

fn draw_panel(out: &mut String, panel: &Panel, top: f64, seconds: usize) {
    let plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT;
    let plot_h = PANEL_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM;
    // Long runs average the bars over a few seconds each, so that they stay readable.
    let group = seconds.div_ceil(150).max(1);
    let averaged: Vec<f64> = panel
        .tokens
        .chunks(group)
        .map(|chunk| chunk.iter().sum::<u64>() as f64 / chunk.len() as f64)
        .collect();
    let peak = averaged.iter().copied().fold(0.0, f64::max);
    let y_max = (peak.max(panel.quota) * 1.1).max(1.0);
    let x = |second: f64| MARGIN_LEFT + plot_w * second / seconds as f64;
    let y = |value: f64| top + MARGIN_TOP + plot_h * (1.0 - value / y_max);
    let bottom = y(0.0);
    let _ = writeln!(
        out,
        r#"<text x="{MARGIN_LEFT}" y="{}" font-size="14">{}</text>"#,
        top + 22.0,
        escape(&panel.title)
    );
    // Axes and labels.
    let _ = writeln!(
        out,
        r#"<line x1="{MARGIN_LEFT}" y1="{bottom}" x2="{}" y2="{bottom}" stroke="black"/><line x1="{MARGIN_LEFT}" y1="{}" x2="{MARGIN_LEFT}" y2="{bottom}" stroke="black"/>"#,
        x(seconds as f64),
        y(y_max)
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="end">{:.0}</text><text x="{}" y="{}" text-anchor="end">0</text>"#,
        MARGIN_LEFT - 6.0,
        y(y_max) + 4.0,
        y_max,
        MARGIN_LEFT - 6.0,
        bottom + 4.0
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">simulated seconds (0 to {seconds}); bars: tokens admitted per second{}</text>"#,
        MARGIN_LEFT + plot_w / 2.0,
        bottom + 30.0,
        if group > 1 {
            format!(", averaged over {group} s")
        } else {
            String::new()
        }
    );
    // Tokens admitted per second.
    let bar = (plot_w / seconds as f64).max(0.5);
    let wide = bar * group as f64;
    for (index, &tokens) in averaged.iter().enumerate() {
        let _ = writeln!(
            out,
            r##"<rect x="{:.2}" y="{:.2}" width="{wide:.2}" height="{:.2}" fill="#4a7bd0"/>"##,
            x((index * group) as f64),
            y(tokens),
            bottom - y(tokens)
        );
    }
    // The quota line.
    let _ = writeln!(
        out,
        r##"<line x1="{MARGIN_LEFT}" y1="{q:.2}" x2="{}" y2="{q:.2}" stroke="#d03030" stroke-dasharray="6 4"/><text x="{}" y="{:.2}" text-anchor="end" fill="#d03030">quota {:.0} tokens/s</text>"##,
        x(seconds as f64),
        x(seconds as f64),
        y(panel.quota) - 4.0,
        panel.quota,
        q = y(panel.quota)
    );
    // 429s: a red mark under the axis for every second that had some.
    for (second, &count) in panel.rate_limited.iter().enumerate() {
        if count > 0 {
            let _ = writeln!(
                out,
                r##"<rect x="{:.2}" y="{:.2}" width="{bar:.2}" height="8" fill="#d03030"><title>{count} × 429</title></rect>"##,
                x(second as f64),
                bottom + 2.0
            );
        }
    }
    let total: u64 = panel.rate_limited.iter().sum();
    let _ = writeln!(
        out,
        r##"<text x="{}" y="{}" text-anchor="end" fill="#d03030">{total} provider 429s (red marks)</text>"##,
        WIDTH - MARGIN_RIGHT,
        top + 22.0
    );
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
