//! Hand-written SVG charts for post-mortems: a Gantt chart of one node's chain (the whole
//! chain on one axis, then the agent's stages zoomed to the agent's own window), and a
//! fleet chart of per-interval and per-stage distributions on a log time axis (every
//! node's sample as a dot, the p50–p90 box, a p99 tick, min–max whiskers).
//!
//! Every stage bar is a `<rect class="bar stage" data-stage="...">`, every pre-agent bar a
//! `<rect class="bar pre">`, every fleet box a `<rect class="box" data-name="...">`, so
//! tests and scripts can find them.

use crate::fleet::chain::{Chain, StampKind, waited_on_name};
use crate::fleet::stats::{Dist, FleetReport};
use crate::timeline::{Outcome, fmt_ms};
use std::fmt::Write as _;

const FONT: &str = "font-family=\"Helvetica, Arial, sans-serif\"";
const W: f64 = 1100.0;
const LEFT: f64 = 230.0;
const RIGHT: f64 = 170.0;
const ROW: f64 = 22.0;
const BAR: f64 = 14.0;

const C_PASSED: &str = "#4e79a7";
const C_FAILED: &str = "#e15759";
const C_CANCELLED: &str = "#f28e2b";
const C_PRE: &str = "#9c9ea3";
const C_AGENT: &str = "#76b7b2";
const C_GRID: &str = "#e6e6e6";
const C_TEXT: &str = "#222222";
const C_MUTED: &str = "#666666";
const C_WORST: &str = "#e15759";

/// Escape text for XML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

/// A short axis label: `0`, `250ms`, `1.5s`, `2m`, `1m30s`, `1h`.
pub fn axis_label(ms: u64) -> String {
    if ms == 0 {
        "0".into()
    } else if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = ms as f64 / 1000.0;
        if ms.is_multiple_of(1000) {
            format!("{s:.0}s")
        } else {
            format!("{s:.1}s")
        }
    } else if ms < 3_600_000 {
        let (m, s) = (ms / 60_000, (ms % 60_000) / 1000);
        if s == 0 {
            format!("{m}m")
        } else {
            format!("{m}m{s:02}s")
        }
    } else {
        let (h, m) = (ms / 3_600_000, (ms % 3_600_000) / 60_000);
        if m == 0 {
            format!("{h}h")
        } else {
            format!("{h}h{m:02}m")
        }
    }
}

/// Tick steps people read on a time axis: 1-2-5 below a second, then 1, 2, 5, 10, 15,
/// 30 s, then whole minutes and hours.
const STEPS: [u64; 24] = [
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 15_000, 30_000, 60_000, 120_000, 300_000, 600_000,
    900_000, 1_800_000, 3_600_000, 7_200_000, 21_600_000,
];

/// The smallest time-friendly tick step giving at most about `target` ticks over `span_ms`.
pub fn nice_step(span_ms: u64, target: u64) -> u64 {
    let raw = span_ms.div_ceil(target.max(1)).max(1);
    STEPS
        .iter()
        .copied()
        .find(|s| *s >= raw)
        .unwrap_or_else(|| raw.div_ceil(3_600_000) * 3_600_000)
}

/// A short human duration for chart labels: `803ms`, `1.11s`, `28.8s`, `3m27s`, `1h05m`.
pub fn human_ms(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 10_000 {
        format!("{:.2}s", ms as f64 / 1000.0)
    } else if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 {
        let s = (ms + 500) / 1000;
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        let m = (ms + 30_000) / 60_000;
        format!("{}h{:02}m", m / 60, m % 60)
    }
}

/// Rough rendered width of `text` at `size` px (Helvetica-like average glyph width).
fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.56
}

/// A bar's value label: right of the bar when it fits inside the chart, else inside the
/// bar (white) when the bar is wide enough, else left of the bar.
fn bar_label(out: &mut String, x0: f64, x1: f64, y: f64, text: &str, color: &str) {
    let w = text_width(text, 11.0);
    let (x, anchor, fill) = if x1 + 5.0 + w <= W - 8.0 {
        (x1 + 5.0, "start", color)
    } else if x1 - x0 >= w + 12.0 {
        (x1 - 6.0, "end", "#ffffff")
    } else {
        (x0 - 5.0, "end", color)
    };
    let _ = writeln!(
        out,
        "<text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" fill=\"{fill}\" text-anchor=\"{anchor}\">{}</text>",
        y + BAR - 3.0,
        esc(text)
    );
}

struct Linear {
    t0: i64,
    t1: i64,
    x0: f64,
    x1: f64,
}

impl Linear {
    fn x(&self, t: i64) -> f64 {
        let span = (self.t1 - self.t0).max(1) as f64;
        self.x0 + (t - self.t0) as f64 / span * (self.x1 - self.x0)
    }
}

fn header(out: &mut String, h: f64, title: &str, subtitle: &str) {
    let _ = write!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{h}\" viewBox=\"0 0 {W} {h}\" {FONT}>\n\
         <rect x=\"0\" y=\"0\" width=\"{W}\" height=\"{h}\" fill=\"#ffffff\"/>\n\
         <text x=\"24\" y=\"32\" font-size=\"19\" font-weight=\"bold\" fill=\"{C_TEXT}\">{}</text>\n\
         <text x=\"24\" y=\"52\" font-size=\"12\" fill=\"{C_MUTED}\">{}</text>\n",
        esc(title),
        esc(subtitle)
    );
}

fn section(out: &mut String, y: f64, text: &str) {
    let _ = writeln!(
        out,
        "<text x=\"24\" y=\"{y}\" font-size=\"13\" font-weight=\"bold\" fill=\"{C_TEXT}\">{}</text>",
        esc(text)
    );
}

/// Vertical grid and tick labels for a linear axis (offsets from `t0`).
fn linear_axis(out: &mut String, ax: &Linear, top: f64, bottom: f64) {
    let span = (ax.t1 - ax.t0).max(1) as u64;
    let step = nice_step(span, 8);
    let mut t = 0u64;
    while t <= span {
        let x = ax.x(ax.t0 + t as i64);
        let _ = writeln!(
            out,
            "<line x1=\"{x:.1}\" y1=\"{top:.1}\" x2=\"{x:.1}\" y2=\"{bottom:.1}\" stroke=\"{C_GRID}\" stroke-width=\"1\"/>\
             <text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"{C_MUTED}\" text-anchor=\"middle\">+{}</text>",
            bottom + 13.0,
            esc(&axis_label(t))
        );
        t += step;
    }
}

fn outcome_color(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Passed => C_PASSED,
        Outcome::Failed => C_FAILED,
        _ => C_CANCELLED,
    }
}

fn legend(out: &mut String, y: f64, items: &[(&str, &str)]) {
    let mut x = 24.0;
    for (color, label) in items {
        let _ = writeln!(
            out,
            "<rect x=\"{x}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{color}\" rx=\"2\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" fill=\"{C_TEXT}\">{}</text>",
            y - 10.0,
            x + 17.0,
            y,
            esc(label)
        );
        x += 30.0 + label.len() as f64 * 6.2;
    }
}

/// Gantt chart of one node's chain.
pub fn gantt_svg(c: &Chain) -> String {
    let first = c.stamps.first().map(|s| s.at_ms).unwrap_or(0);
    let last = c.stamps.last().map(|s| s.at_ms).unwrap_or(first);
    let agent_start = c
        .stamps
        .iter()
        .find(|s| s.kind == StampKind::AgentStart)
        .map(|s| s.at_ms)
        .unwrap_or(first);
    let verdict = c.verdict();
    let agent_end = verdict
        .map(|v| v.at_ms)
        .into_iter()
        .chain(c.stages.iter().map(|s| s.end_ms))
        .max()
        .unwrap_or(agent_start)
        .max(agent_start);
    // Panel A rows: each pre-agent interval up to the agent start, then the agent window.
    let pre: Vec<(&str, &str, i64, i64)> = c
        .stamps
        .windows(2)
        .filter(|w| w[1].at_ms <= agent_start && w[0].kind == StampKind::Pre)
        .map(|w| (w[0].name.as_str(), w[1].name.as_str(), w[0].at_ms, w[1].at_ms))
        .collect();
    let after: Vec<(&str, i64)> = c
        .stamps
        .iter()
        .filter(|s| s.kind == StampKind::Pre && s.at_ms > agent_start)
        .map(|s| (s.name.as_str(), s.at_ms))
        .collect();
    let rows_a = pre.len() + 1 + after.len();
    let rows_b = c.stages.len().max(1);
    let top_a = 96.0;
    let bottom_a = top_a + rows_a as f64 * ROW;
    let top_b = bottom_a + 62.0;
    let bottom_b = top_b + rows_b as f64 * ROW;
    let h = bottom_b + 70.0;

    let verdict_text = match verdict {
        Some(v) => format!(
            "{} ({}) {} after {}",
            v.name,
            v.reason.map(crate::reasons::Reason::as_str).unwrap_or(""),
            fmt_ms((v.at_ms - first).max(0) as u64),
            c.stamps.first().map(|s| s.name.as_str()).unwrap_or("-")
        ),
        None => "no verdict recorded".into(),
    };
    let mut out = String::new();
    header(
        &mut out,
        h,
        &format!("Node-ready timeline — {}", c.node),
        &format!(
            "{verdict_text} · agent start {} · GPU backend {}{}",
            c.agent_start,
            c.gpu,
            if c.truncated { " · annotation truncated" } else { "" }
        ),
    );

    // Panel A: whole chain.
    section(
        &mut out,
        top_a - 18.0,
        "Whole chain: pre-agent waits and the agent's window",
    );
    let ax = Linear {
        t0: first,
        t1: last.max(first + 1),
        x0: LEFT,
        x1: W - RIGHT,
    };
    linear_axis(&mut out, &ax, top_a - 4.0, bottom_a);
    let mut y = top_a;
    for (from, to, a, b) in &pre {
        let (x0, x1) = (ax.x(*a), ax.x(*b));
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"{C_TEXT}\" text-anchor=\"end\">{}</text>\
             <rect class=\"bar pre\" data-from=\"{}\" data-to=\"{}\" x=\"{x0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{BAR}\" fill=\"{C_PRE}\" rx=\"2\"><title>{}</title></rect>",
            LEFT - 10.0,
            y + BAR - 2.0,
            esc(&format!("→ {to}")),
            esc(from),
            esc(to),
            y,
            (x1 - x0).max(1.5),
            esc(&format!(
                "{from} → {to}: {} — {}",
                fmt_ms((b - a).max(0) as u64),
                waited_on_name(to)
            )),
        );
        bar_label(
            &mut out,
            x0,
            x1.max(x0 + 1.5),
            y,
            &human_ms((b - a).max(0) as u64),
            C_MUTED,
        );
        y += ROW;
    }
    {
        let (x0, x1) = (ax.x(agent_start), ax.x(agent_end));
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" font-weight=\"bold\" fill=\"{C_TEXT}\" text-anchor=\"end\">agent: evidence → verdict</text>\
             <rect class=\"bar agent\" x=\"{x0:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{BAR}\" fill=\"{C_AGENT}\" rx=\"2\"><title>agent window {}</title></rect>",
            LEFT - 10.0,
            y + BAR - 2.0,
            (x1 - x0).max(1.5),
            esc(&fmt_ms((agent_end - agent_start).max(0) as u64)),
        );
        let label = human_ms((agent_end - agent_start).max(0) as u64);
        bar_label(&mut out, x0, x1.max(x0 + 1.5), y, &label, C_MUTED);
        y += ROW;
    }
    for (name, at) in &after {
        let x = ax.x(*at);
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"{C_TEXT}\" text-anchor=\"end\">{}</text>\
             <path d=\"M{x:.1},{y:.1} l6,7 l-6,7 l-6,-7 z\" fill=\"{C_PRE}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" fill=\"{C_MUTED}\">+{} after the verdict</text>",
            LEFT - 10.0,
            y + BAR - 2.0,
            esc(name),
            x + 10.0,
            y + BAR - 2.0,
            esc(&fmt_ms((*at - agent_end).max(0) as u64))
        );
        y += ROW;
    }

    // Panel B: stages, zoomed to the agent's window.
    section(
        &mut out,
        top_b - 18.0,
        &format!(
            "Agent stages (zoomed: agent start → verdict, {})",
            fmt_ms((agent_end - agent_start).max(0) as u64)
        ),
    );
    let bx = Linear {
        t0: agent_start,
        t1: agent_end.max(agent_start + 1),
        x0: LEFT,
        x1: W - RIGHT,
    };
    linear_axis(&mut out, &bx, top_b - 4.0, bottom_b);
    // The release waited on the last evidence; a held node waited on its failure instead.
    let released = verdict.is_some_and(|v| v.name != "held");
    let last_evidence = c
        .stages
        .iter()
        .filter(|s| released && s.outcome == Outcome::Passed && s.stage != "untaint")
        .max_by_key(|s| s.end_ms)
        .map(|s| s.stage.as_str());
    let mut y = top_b;
    for s in &c.stages {
        let (x0, x1) = (bx.x(s.start_ms), bx.x(s.end_ms));
        let dur = human_ms((s.end_ms - s.start_ms).max(0) as u64);
        let crit = last_evidence == Some(s.stage.as_str());
        let note = match (s.outcome, s.reason, crit) {
            (Outcome::Passed, _, true) => format!("{dur} · last evidence"),
            (Outcome::Passed, _, false) => dur.clone(),
            (o, None, _) => format!("{dur} · {}", o.as_str()),
            (o, Some(r), _) => format!("{dur} · {}: {r}", o.as_str()),
        };
        let stroke = if crit {
            " stroke=\"#1b1b1b\" stroke-width=\"1.5\""
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"{C_TEXT}\" text-anchor=\"end\"{}>{}</text>\
             <rect class=\"bar stage\" data-stage=\"{}\" data-outcome=\"{}\" x=\"{x0:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{BAR}\" fill=\"{}\" rx=\"2\"{stroke}><title>{}</title></rect>",
            LEFT - 10.0,
            y + BAR - 2.0,
            if crit { " font-weight=\"bold\"" } else { "" },
            esc(&s.stage),
            esc(&s.stage),
            s.outcome.as_str(),
            (x1 - x0).max(1.5),
            outcome_color(s.outcome),
            esc(&format!(
                "{}: +{} → +{} ({dur}) {}",
                s.stage,
                fmt_ms((s.start_ms - agent_start).max(0) as u64),
                fmt_ms((s.end_ms - agent_start).max(0) as u64),
                s.outcome.as_str()
            )),
        );
        let color = if s.outcome == Outcome::Passed {
            C_MUTED
        } else {
            C_FAILED
        };
        bar_label(&mut out, x0, x1.max(x0 + 1.5), y, &note, color);
        y += ROW;
    }
    if let Some(v) = verdict {
        let x = bx.x(v.at_ms);
        let color = if v.name == "held" { C_FAILED } else { C_TEXT };
        let _ = writeln!(
            out,
            "<line class=\"verdict\" x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{bottom_b:.1}\" stroke=\"{color}\" stroke-width=\"1.5\" stroke-dasharray=\"5,3\"/>\
             <text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" font-weight=\"bold\" fill=\"{color}\" text-anchor=\"end\">{} +{}</text>",
            top_b - 6.0,
            top_b - 8.0,
            esc(&v.name),
            esc(&fmt_ms((v.at_ms - agent_start).max(0) as u64))
        );
    }
    legend(
        &mut out,
        h - 24.0,
        &[
            (C_PRE, "pre-agent wait"),
            (C_AGENT, "agent window"),
            (C_PASSED, "stage passed"),
            (C_FAILED, "stage failed"),
            (C_CANCELLED, "cancelled"),
        ],
    );
    out.push_str("</svg>\n");
    out
}

struct LogAxis {
    lo: f64,
    hi: f64,
    x0: f64,
    x1: f64,
}

impl LogAxis {
    fn x(&self, ms: u64) -> f64 {
        let v = (ms as f64).clamp(self.lo, self.hi);
        self.x0 + (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10()) * (self.x1 - self.x0)
    }
}

const LOG_TICKS: [u64; 9] = [1, 10, 100, 1_000, 10_000, 60_000, 600_000, 3_600_000, 36_000_000];

fn log_axis(out: &mut String, ax: &LogAxis, top: f64, bottom: f64) {
    for t in LOG_TICKS {
        let tf = t as f64;
        if tf < ax.lo || tf > ax.hi {
            continue;
        }
        let x = ax.x(t);
        let _ = writeln!(
            out,
            "<line x1=\"{x:.1}\" y1=\"{top:.1}\" x2=\"{x:.1}\" y2=\"{bottom:.1}\" stroke=\"{C_GRID}\" stroke-width=\"1\"/>\
             <text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"{C_MUTED}\" text-anchor=\"middle\">{}</text>",
            bottom + 13.0,
            esc(&axis_label(t))
        );
    }
}

/// Deterministic jitter in [-1, 1] for a sample index (so charts are reproducible).
fn jitter(i: usize) -> f64 {
    let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
    (h % 2001) as f64 / 1000.0 - 1.0
}

fn dist_rows(out: &mut String, rows: &[&Dist], ax: &LogAxis, top: f64, class: &str, worst: Option<&str>, row_h: f64) {
    let mut y = top;
    for d in rows {
        let is_worst = worst == Some(d.name.as_str());
        let mid = y + row_h / 2.0;
        let color = if is_worst { C_WORST } else { C_PASSED };
        let _ = writeln!(
            out,
            "<g class=\"dist {class}\" data-name=\"{}\">\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"{C_TEXT}\" text-anchor=\"end\"{}>{}</text>",
            esc(&d.name),
            LEFT - 10.0,
            mid + 4.0,
            if is_worst { " font-weight=\"bold\"" } else { "" },
            esc(&d.name)
        );
        // Whisker min..max.
        let _ = writeln!(
            out,
            "<line x1=\"{:.1}\" y1=\"{mid:.1}\" x2=\"{:.1}\" y2=\"{mid:.1}\" stroke=\"#8a8a8a\" stroke-width=\"1\"/>",
            ax.x(d.min),
            ax.x(d.max)
        );
        // Every node's sample.
        for (i, s) in d.samples.iter().enumerate() {
            let _ = write!(
                out,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"1.6\" fill=\"{color}\" fill-opacity=\"0.28\"/>",
                ax.x(*s),
                mid + jitter(i) * (row_h / 2.0 - 4.0)
            );
        }
        out.push('\n');
        let (b0, b1) = (ax.x(d.p50), ax.x(d.p90));
        let _ = writeln!(
            out,
            "<rect class=\"box\" data-name=\"{}\" x=\"{b0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\" fill-opacity=\"0.55\" stroke=\"{color}\" stroke-width=\"1.2\"><title>{}</title></rect>\
             <line x1=\"{b0:.1}\" y1=\"{:.1}\" x2=\"{b0:.1}\" y2=\"{:.1}\" stroke=\"#1b1b1b\" stroke-width=\"2\"/>\
             <line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#1b1b1b\" stroke-width=\"1.5\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" fill=\"{}\">{}</text></g>",
            esc(&d.name),
            mid - 6.0,
            (b1 - b0).max(2.0),
            12.0,
            esc(&format!(
                "{}: n={} p50 {} p90 {} p99 {} max {}",
                d.name,
                d.n,
                fmt_ms(d.p50),
                fmt_ms(d.p90),
                fmt_ms(d.p99),
                fmt_ms(d.max)
            )),
            mid - 7.0,
            mid + 7.0,
            ax.x(d.p99),
            mid - 5.0,
            ax.x(d.p99),
            mid + 5.0,
            W - RIGHT + 8.0,
            mid + 4.0,
            if is_worst { C_WORST } else { C_MUTED },
            esc(&format!(
                "{} / {} / {}",
                human_ms(d.p50),
                human_ms(d.p90),
                human_ms(d.p99)
            ))
        );
        y += row_h;
    }
}

/// Fleet chart: per-interval distributions (and per-stage durations).
pub fn fleet_svg(r: &FleetReport) -> String {
    let shown: Vec<&Dist> = r.intervals.iter().filter(|d| d.max > 0).collect();
    let omitted = r.intervals.len() - shown.len();
    let stages: Vec<&Dist> = r.stages.iter().map(|(d, _)| d).filter(|d| d.max > 0).collect();
    let row_h = 26.0;
    let top_a = 104.0;
    let bottom_a = top_a + shown.len().max(1) as f64 * row_h;
    let top_b = bottom_a + 70.0;
    let bottom_b = top_b + stages.len().max(1) as f64 * row_h;
    let h = bottom_b + 74.0;
    let hi_ms = shown
        .iter()
        .chain(stages.iter())
        .map(|d| d.max)
        .max()
        .unwrap_or(1000)
        .max(1000);
    // The axis ends at the next tick above the largest sample.
    let hi = LOG_TICKS.iter().copied().find(|t| *t >= hi_ms).unwrap_or(hi_ms) as f64;
    // Start the axis at 1 ms only when some interval lives below 10 ms.
    let lo = if shown.iter().chain(stages.iter()).any(|d| d.min < 10) {
        1.0
    } else {
        10.0
    };
    let ax = LogAxis {
        lo,
        hi,
        x0: LEFT,
        x1: W - RIGHT,
    };
    let mut out = String::new();
    let worst = r.worst.as_deref();
    header(
        &mut out,
        h,
        &format!("Node-ready intervals across {} nodes", r.nodes),
        &format!(
            "{} released, {} held{} · nearest-rank percentiles · box p50–p90, tick p99, whiskers min–max, dots = nodes · log time axis",
            r.released,
            r.held,
            r.selector
                .as_deref()
                .map(|s| format!(" · selector {s}"))
                .unwrap_or_default()
        ),
    );
    let worst_note = match worst.and_then(|w| r.intervals.iter().find(|d| d.name == w)) {
        Some(d) => format!(
            "Largest p90: {} — {} — p90 {}, p99 {}",
            d.name,
            waited_on_name(&d.name),
            human_ms(d.p90),
            human_ms(d.p99)
        ),
        None => "No interval with a non-zero p90".into(),
    };
    let _ = writeln!(
        out,
        "<text x=\"24\" y=\"72\" font-size=\"13\" font-weight=\"bold\" fill=\"{C_WORST}\">{}</text>",
        esc(&worst_note)
    );
    section(
        &mut out,
        top_a - 12.0,
        &format!(
            "Interval before each stamp{}",
            if omitted > 0 {
                format!(
                    " ({omitted} always-zero interval{} omitted)",
                    if omitted == 1 { "" } else { "s" }
                )
            } else {
                String::new()
            }
        ),
    );
    let _ = writeln!(
        out,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"{C_MUTED}\">p50 / p90 / p99</text>",
        W - RIGHT + 8.0,
        top_a - 12.0
    );
    log_axis(&mut out, &ax, top_a - 4.0, bottom_a);
    dist_rows(&mut out, &shown, &ax, top_a, "interval", worst, row_h);
    section(&mut out, top_b - 12.0, "Stage durations");
    log_axis(&mut out, &ax, top_b - 4.0, bottom_b);
    dist_rows(&mut out, &stages, &ax, top_b, "stage", None, row_h);
    legend(
        &mut out,
        h - 24.0,
        &[
            (C_PASSED, "p50–p90 (box), p99 (tick)"),
            (C_WORST, "largest p90 interval"),
            ("#8a8a8a", "min–max"),
        ],
    );
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_steps() {
        assert_eq!(axis_label(0), "0");
        assert_eq!(axis_label(250), "250ms");
        assert_eq!(axis_label(1500), "1.5s");
        assert_eq!(axis_label(90_000), "1m30s");
        assert_eq!(axis_label(3_600_000), "1h");
        assert_eq!(nice_step(10_000, 8), 2_000);
        assert_eq!(nice_step(176_000, 8), 30_000);
        assert_eq!(human_ms(803), "803ms");
        assert_eq!(human_ms(1_110), "1.11s");
        assert_eq!(human_ms(28_829), "28.8s");
        assert_eq!(human_ms(207_021), "3m27s");
        assert_eq!(nice_step(0, 8), 1);
        assert_eq!(esc("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
