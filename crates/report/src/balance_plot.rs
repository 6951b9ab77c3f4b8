//! `balance.png`: how the load of a run moved between servers, drawn from its
//! [`BalanceLog`].
//!
//! Three panels stacked on one time axis (seconds since the scheduler started):
//!
//! 1. *bytes owned per server* (MB), one line per server, a server's colour taken from
//!    [`PALETTE`] by its id. Every migration is a short vertical tick at the top of the
//!    panel, at the time it ended, in the colour of the server the block left (a failed
//!    migration is a grey cross).
//! 2. *estimated service time per iteration per server* (ms), the balancer's view; points
//!    where a server was flagged as a straggler are circled.
//! 3. *mean worker iteration time* (ms) over each stats interval, with the balancer's
//!    verdicts (`balance.decisions`) at the time each was judged, at the iteration time
//!    measured after the decision: a green triangle for a decision kept, a red cross for
//!    one reverted, labelled with the change of the iteration time measured and the one
//!    predicted (percent; negative is faster).
//!
//! Scaling events are dashed vertical lines through all three panels, labelled with their
//! action and server at the top of the first. The time of `settled_s` is a dotted line.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::BalanceLog;
use super::plot::{Chart, FONT, MUTED_TEXT, PALETTE, decimals_for, ensure_font, house_style, plot_err};
use crate::Result;

/// Width of `balance.png`, pixels.
pub const WIDTH: u32 = 1200;
/// Height of `balance.png`, pixels.
pub const HEIGHT: u32 = 1000;

/// Colour of a server: its id picks from the palette.
pub fn server_color(id: u32) -> RGBColor {
    PALETTE[id as usize % PALETTE.len()]
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Draws `balance.png` for `log` into `path`. A log without timeline or events still
/// gives a valid PNG with empty, labelled panels.
pub fn draw(path: &Path, log: &BalanceLog) -> Result<()> {
    ensure_font()?;
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (title, body) = root.split_vertically(66);
    let ok = log.migrations.iter().filter(|m| m.error.is_none()).count();
    let moved: u64 = log.migrations.iter().filter(|m| m.error.is_none()).map(|m| m.bytes).sum();
    let head = format!(
        "load balance ({}): {} migration{}, {:.1} MB moved, {} scaling event{}",
        if log.mode.is_empty() { "?" } else { &log.mode },
        ok,
        if ok == 1 { "" } else { "s" },
        moved as f64 / 1e6,
        log.scaling.len(),
        if log.scaling.len() == 1 { "" } else { "s" },
    );
    title
        .draw_text(
            &head,
            &TextStyle::from((FONT, 22).into_font()).pos(Pos::new(HPos::Center, VPos::Center)),
            (WIDTH as i32 / 2, 20),
        )
        .map_err(plot_err)?;
    server_legend(&title, &server_ids(log))?;
    let h = body.dim_in_pixel().1;
    let (top, rest) = body.split_vertically(h * 36 / 100);
    let (middle, bottom) = rest.split_vertically(h * 33 / 100);
    let time = time_range(log);
    bytes_panel(&top, log, time.clone())?;
    service_panel(&middle, log, time.clone())?;
    iteration_panel(&bottom, log, time)?;
    root.present().map_err(plot_err)
}

/// One row under the title: a line sample and the name of every server, centred.
fn server_legend(area: &Area<'_>, ids: &[u32]) -> Result<()> {
    const ENTRY: i32 = 110;
    let shown = &ids[..ids.len().min(10)];
    let mut x = WIDTH as i32 / 2 - ENTRY * shown.len() as i32 / 2;
    let y = 50;
    let style = TextStyle::from((FONT, 15).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for &id in shown {
        let color = server_color(id);
        area.draw(&PathElement::new([(x, y), (x + 26, y)], color.stroke_width(4))).map_err(plot_err)?;
        area.draw_text(&format!("server {id}"), &style, (x + 32, y)).map_err(plot_err)?;
        x += ENTRY;
    }
    Ok(())
}

/// The x range: every sample and event, from 0 (or earlier) to 2% past the last.
fn time_range(log: &BalanceLog) -> std::ops::Range<f64> {
    let times = log
        .timeline
        .iter()
        .map(|s| s.t_s)
        .chain(log.migrations.iter().map(|m| m.at_s))
        .chain(log.scaling.iter().map(|e| e.at_s))
        .chain(log.settled_s)
        .filter(|t| t.is_finite());
    let (lo, hi) = times.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), t| (lo.min(t), hi.max(t)));
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    // Start at the first sample (training starts some seconds after the scheduler), on a
    // whole second.
    let lo = lo.floor().max(0.0);
    let hi = if hi > lo { hi + (hi - lo) * 0.02 } else { lo + 1.0 };
    lo..hi
}

/// A chart on `area` with the house style, `y` from 0 to `y_hi`.
fn chart<'a, 'b>(
    area: &'a Area<'b>,
    caption: &str,
    y_desc: &str,
    time: std::ops::Range<f64>,
    y_hi: f64,
    x_desc: bool,
) -> Result<Chart<'a, 'b>> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18))
        .margin(10)
        .margin_right(24)
        .x_label_area_size(if x_desc { 44 } else { 26 })
        .y_label_area_size(72)
        .build_cartesian_2d(time.clone(), 0.0..y_hi)
        .map_err(plot_err)?;
    let x_dec = decimals_for(time.end - time.start);
    let y_dec = decimals_for(y_hi);
    let x_fmt = |v: &f64| format!("{v:.x_dec$}");
    let y_fmt = |v: &f64| format!("{v:.y_dec$}");
    let mut mesh = chart.configure_mesh();
    house_style(&mut mesh)
        .y_desc(y_desc)
        .x_labels(12)
        .y_labels(6)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .max_light_lines(2);
    if x_desc {
        mesh.x_desc("seconds since the scheduler started");
    }
    mesh.draw().map_err(plot_err)?;
    Ok(chart)
}

/// Upper end of a y axis showing values up to `max`: 12% headroom, at least `min_hi`.
fn y_top(max: f64, min_hi: f64) -> f64 {
    if max.is_finite() && max > 0.0 { (max * 1.12).max(min_hi) } else { min_hi }
}

/// Every server id of the timeline, in order.
fn server_ids(log: &BalanceLog) -> Vec<u32> {
    let mut ids: Vec<u32> = log.timeline.iter().flat_map(|s| s.servers.iter().map(|p| p.id)).collect();
    ids.extend(log.migrations.iter().flat_map(|m| [m.from, m.to]));
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// `(t, value)` of server `id` over the timeline, with a break (a new segment) wherever the
/// server is absent from a sample.
fn server_segments(log: &BalanceLog, id: u32, value: impl Fn(&super::ServerPoint) -> f64) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
    for s in &log.timeline {
        match s.servers.iter().find(|p| p.id == id).map(&value).filter(|v| v.is_finite() && s.t_s.is_finite()) {
            Some(v) => out.last_mut().expect("never empty").push((s.t_s, v)),
            None => {
                if out.last().is_some_and(|seg| !seg.is_empty()) {
                    out.push(Vec::new());
                }
            }
        }
    }
    out.retain(|seg| !seg.is_empty());
    out
}

fn bytes_panel(area: &Area<'_>, log: &BalanceLog, time: std::ops::Range<f64>) -> Result<()> {
    let max = log.timeline.iter().flat_map(|s| s.servers.iter().map(|p| p.bytes as f64 / 1e6)).fold(0.0, f64::max);
    let hi = y_top(max, 1.0);
    let mut chart =
        chart(area, "bytes owned per server (MB); ticks: migrations, coloured by source", "MB", time, hi, false)?;
    let ids = server_ids(log);
    for &id in &ids {
        let color = server_color(id);
        for seg in server_segments(log, id, |p| p.bytes as f64 / 1e6) {
            chart.draw_series(LineSeries::new(seg, color.stroke_width(2))).map_err(plot_err)?;
        }
    }
    // Migration ticks along the top of the panel.
    let (tick_lo, tick_hi) = (hi * 0.91, hi * 0.99);
    for m in &log.migrations {
        if !m.at_s.is_finite() {
            continue;
        }
        if m.error.is_none() {
            let color = server_color(m.from);
            chart
                .draw_series(std::iter::once(PathElement::new(
                    [(m.at_s, tick_lo), (m.at_s, tick_hi)],
                    color.stroke_width(2),
                )))
                .map_err(plot_err)?;
        } else {
            chart
                .draw_series(std::iter::once(Cross::new(
                    (m.at_s, (tick_lo + tick_hi) / 2.0),
                    4,
                    MUTED_TEXT.stroke_width(2),
                )))
                .map_err(plot_err)?;
        }
    }
    scaling_lines(&mut chart, log, hi, true)?;
    if ids.is_empty() {
        no_data(&chart, "no load samples recorded")?;
    }
    Ok(())
}

fn service_panel(area: &Area<'_>, log: &BalanceLog, time: std::ops::Range<f64>) -> Result<()> {
    let max = log.timeline.iter().flat_map(|s| s.servers.iter().filter_map(service_ms)).fold(0.0, f64::max);
    let hi = y_top(max, 1.0);
    let mut chart = chart(
        area,
        "estimated service time per iteration per server (ms); circled: flagged straggler",
        "ms",
        time,
        hi,
        false,
    )?;
    let ids = server_ids(log);
    for &id in &ids {
        let color = server_color(id);
        for seg in server_segments(log, id, |p| service_ms(p).unwrap_or(f64::NAN)) {
            chart.draw_series(LineSeries::new(seg, color.stroke_width(2))).map_err(plot_err)?;
        }
        let flagged = log.timeline.iter().filter_map(|s| {
            let p = s.servers.iter().find(|p| p.id == id && p.straggler)?;
            Some((s.t_s, service_ms(p)?))
        });
        chart.draw_series(flagged.map(|at| Circle::new(at, 5, color.stroke_width(2)))).map_err(plot_err)?;
    }
    scaling_lines(&mut chart, log, hi, false)?;
    if max <= 0.0 {
        no_data(&chart, "no service-time estimate recorded")?;
    }
    Ok(())
}

/// A server's estimated service time, if its rate is known (with no rate estimate yet the
/// scheduler's figure is meaningless).
fn service_ms(p: &super::ServerPoint) -> Option<f64> {
    (p.rate_bps > 0.0 && p.service_ms.is_finite()).then_some(p.service_ms)
}

fn iteration_panel(area: &Area<'_>, log: &BalanceLog, time: std::ops::Range<f64>) -> Result<()> {
    let points: Vec<(f64, f64)> = log
        .timeline
        .iter()
        .filter_map(|s| s.iter_ms.filter(|v| v.is_finite() && s.t_s.is_finite()).map(|v| (s.t_s, v)))
        .collect();
    let verdicts: Vec<(f64, f64, bool, String)> = log
        .decisions
        .iter()
        .filter(|d| d.judged_s.is_finite())
        .map(|d| {
            let at = d.after_ms.filter(|v| v.is_finite()).unwrap_or(0.0);
            // The change of the iteration time: negative is faster.
            let label = format!("{:+.0}% (predicted {:+.0}%)", -d.measured_gain * 100.0, -d.predicted_gain * 100.0);
            (d.judged_s, at, d.kept(), label)
        })
        .collect();
    let max = points.iter().map(|p| p.1).chain(verdicts.iter().map(|v| v.1)).fold(0.0, f64::max);
    let hi = y_top(max, 1.0);
    let mut chart =
        chart(area, "mean worker iteration time (ms); verdicts: kept (green), reverted (red)", "ms", time, hi, true)?;
    let color = RGBColor(40, 40, 40);
    chart
        .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)).point_size(2))
        .map_err(plot_err)?;
    let (kept, reverted) = (RGBColor(30, 140, 60), RGBColor(200, 30, 30));
    let label = TextStyle::from((FONT, 12).into_font()).color(&BLACK).pos(Pos::new(HPos::Left, VPos::Bottom));
    for (at, ms, ok, text) in &verdicts {
        let mark = if *ok {
            chart.draw_series(std::iter::once(TriangleMarker::new((*at, *ms), 8, kept.filled())))
        } else {
            chart.draw_series(std::iter::once(Cross::new((*at, *ms), 7, reverted.stroke_width(3))))
        };
        mark.map_err(plot_err)?;
        chart
            .draw_series(std::iter::once(
                EmptyElement::at((*at, *ms)) + Text::new(text.clone(), (6, -6), label.clone()),
            ))
            .map_err(plot_err)?;
    }
    scaling_lines(&mut chart, log, hi, false)?;
    if points.is_empty() {
        no_data(&chart, "no iteration times recorded")?;
    }
    Ok(())
}

/// Scaling events as dashed vertical lines (labelled when `labels`), and the settling time
/// as a dotted one.
fn scaling_lines(chart: &mut Chart<'_, '_>, log: &BalanceLog, hi: f64, labels: bool) -> Result<()> {
    let style = TextStyle::from((FONT, 13).into_font()).color(&BLACK).pos(Pos::new(HPos::Left, VPos::Top));
    for (i, e) in log.scaling.iter().enumerate() {
        if !e.at_s.is_finite() {
            continue;
        }
        let color = e.server.map_or(BLACK, server_color);
        chart
            .draw_series(DashedLineSeries::new([(e.at_s, 0.0), (e.at_s, hi)], 6, 4, color.stroke_width(2)))
            .map_err(plot_err)?;
        if labels {
            let text = match e.server {
                Some(s) => format!("{} {s}", e.action),
                None => e.action.clone(),
            };
            // Stagger the labels of events close in time.
            let dy = 4 + 16 * (i % 3) as i32;
            chart
                .draw_series(std::iter::once(EmptyElement::at((e.at_s, hi)) + Text::new(text, (4, dy), style.clone())))
                .map_err(plot_err)?;
        }
    }
    if let Some(s) = log.settled_s.filter(|s| s.is_finite()) {
        chart
            .draw_series(DashedLineSeries::new([(s, 0.0), (s, hi)], 2, 4, MUTED_TEXT.stroke_width(2)))
            .map_err(plot_err)?;
        if labels {
            let style = style.color(&MUTED_TEXT).pos(Pos::new(HPos::Right, VPos::Bottom));
            chart
                .draw_series(std::iter::once(EmptyElement::at((s, 0.0)) + Text::new("settled", (-4, -4), style)))
                .map_err(plot_err)?;
        }
    }
    Ok(())
}

/// Writes `message` in the middle of an empty plotting area.
fn no_data(chart: &Chart<'_, '_>, message: &str) -> Result<()> {
    let area = chart.plotting_area();
    let (w, h) = area.dim_in_pixel();
    let style = TextStyle::from((FONT, 18).into_font()).color(&MUTED_TEXT).pos(Pos::new(HPos::Center, VPos::Center));
    area.strip_coord_spec().draw_text(message, &style, (w as i32 / 2, h as i32 / 2)).map_err(plot_err)
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use elasticps_node::scheduler::{DecisionRecord, LoadSample, MigrationEvent, ScaleEvent, ServerPoint};

    /// 4 servers; server 1 straggles from 5 s, the balancer moves 6 blocks off it, scales
    /// out at 20 s (server 4 joins), and settles at 24 s.
    pub fn sample_log() -> BalanceLog {
        let mut timeline = Vec::new();
        let mut bytes = [25.0e6, 25.0e6, 25.0e6, 25.0e6, 0.0];
        for t in 0..40 {
            let t_s = 2.0 + t as f64;
            if (8..14).contains(&t) {
                bytes[1] -= 3.0e6;
                bytes[(t % 3 + 2) as usize % 4] += 3.0e6;
            }
            if (20..24).contains(&t) {
                for b in &mut bytes[..4] {
                    *b -= 1.2e6;
                }
                bytes[4] += 4.8e6;
            }
            let n = if t >= 19 { 5 } else { 4 };
            let servers = (0..n)
                .map(|id| {
                    let rate = if id == 1 && t >= 3 { 25e6 } else { 100e6 };
                    let service_ms = bytes[id] * 4.0 / rate * 1e3;
                    ServerPoint {
                        id: id as u32,
                        blocks: (bytes[id] / 1e6) as u32,
                        bytes: bytes[id] as u64,
                        rate_bps: rate,
                        confidence: 0.9,
                        in_mbps: 0.0,
                        out_mbps: 0.0,
                        queued_ms_per_s: 0.0,
                        service_ms,
                        straggler: id == 1 && (3..14).contains(&t),
                        rows: None,
                    }
                })
                .collect();
            let iter_ms = if t < 3 {
                1100.0
            } else if t < 14 {
                4000.0 - 200.0 * (t.max(8) - 8) as f64
            } else {
                1150.0
            };
            timeline.push(LoadSample { t_s, iter_ms: Some(iter_ms), servers });
        }
        let migrations = (0..8)
            .map(|i| MigrationEvent {
                at_s: 10.0 + i as f64 * 0.7,
                block: 40 + i,
                from: 1,
                to: 2 + i % 2,
                bytes: 3_000_000,
                freeze_ms: 1.5,
                total_ms: 300.0,
                held: i % 3,
                error: (i == 5).then(|| "server 1 went away".to_string()),
            })
            .collect();
        let ev = |at_s: f64, action: &str, server: Option<u32>| ScaleEvent {
            at_s,
            action: action.into(),
            server,
            reason: format!("{action} because"),
        };
        BalanceLog {
            mode: "psld".into(),
            started_unix_ms: 1.7e12,
            migrations,
            scaling: vec![ev(20.0, "scale-out", None), ev(21.0, "joined", Some(4)), ev(30.0, "kept", Some(4))],
            timeline,
            settled_s: Some(24.0),
            decisions: vec![
                DecisionRecord {
                    at_s: 10.0,
                    judged_s: 19.0,
                    what: "straggler [1]".into(),
                    moves: 6,
                    predicted_gain: 0.5,
                    measured_gain: 0.4,
                    before_ms: Some(200.0),
                    after_ms: Some(120.0),
                    verdict: "kept".into(),
                },
                DecisionRecord {
                    at_s: 32.0,
                    judged_s: 40.0,
                    what: "probe server 1".into(),
                    moves: 1,
                    predicted_gain: 0.0,
                    measured_gain: -0.1,
                    before_ms: Some(120.0),
                    after_ms: Some(132.0),
                    verdict: "reverted".into(),
                },
            ],
        }
    }

    #[test]
    fn draws_full_and_empty_logs() {
        let dir = std::env::temp_dir().join(format!("elasticps-balance-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("balance.png");
        draw(&png, &sample_log()).unwrap();
        assert!(std::fs::metadata(&png).unwrap().len() > 20_000);
        draw(&png, &BalanceLog::default()).unwrap();
        let mut odd = sample_log();
        odd.timeline.truncate(1);
        odd.timeline[0].iter_ms = Some(f64::NAN);
        odd.timeline[0].servers[0].service_ms = f64::INFINITY;
        odd.migrations[0].at_s = f64::NAN;
        draw(&png, &odd).unwrap();
        if std::env::var_os("ELASTICPS_KEEP_TEST_OUTPUT").is_some() {
            draw(&png, &sample_log()).unwrap();
            eprintln!("kept {}", png.display());
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
