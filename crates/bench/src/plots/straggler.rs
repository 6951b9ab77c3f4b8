//! `straggler.png` of `elasticps bench straggler`.
//!
//! - Top: iterations/s per scenario, static and psld side by side (after the settle; value
//!   on top of each bar), the no-straggler baseline as a dashed line and the uncapped
//!   reference as a dotted one.
//! - Below, one panel per scenario (three to a row): worker 0's iteration time against the time since the
//!   start of training, static and psld, with psld's migrations as ticks along the top, the
//!   start of its measured window (the settle) as a dotted line, the straggler's start (d)
//!   and scaling events as dashed lines, and the baseline's median iteration time as a grey
//!   dashed line.
//!
//! Static is orange and psld blue everywhere. Text uses the font that
//! [`elasticps_report::plot::ensure_font`] embeds.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use elasticps_report::plot::{
    Chart, FONT, GRID_BOLD, MUTED_TEXT, PALETTE, decimals_for, ensure_font, house_style, legend, plot_err,
};

/// Width of `straggler.png`, pixels.
pub const WIDTH: u32 = 1800;
/// Height of the bar chart at the top, pixels.
const BARS_HEIGHT: u32 = 480;
/// Height of a row of scenario panels, pixels.
const ROW_HEIGHT: u32 = 400;
/// Scenario panels per row.
const PER_ROW: usize = 3;

/// Height of `straggler.png` for `scenarios` scenarios, pixels.
pub fn height(scenarios: usize) -> u32 {
    BARS_HEIGHT + ROW_HEIGHT * scenarios.div_ceil(PER_ROW).max(1) as u32
}

const STATIC: RGBColor = PALETTE[1];
const PSLD: RGBColor = PALETTE[0];
const STRAGGLER: RGBColor = PALETTE[3];

/// One run of a scenario.
#[derive(Clone, Debug, Default)]
pub struct RunSeries {
    /// Iterations/s over the measured window.
    pub it_s: f64,
    /// Worker 0: (end of iteration, s since the start of training; its duration, ms).
    pub series: Vec<(f64, f64)>,
    /// Migrations: (end, s since the start of training; source server).
    pub migrations: Vec<(f64, u32)>,
    /// Start of the measured window, s since the start of training.
    pub window_from_s: f64,
    /// Scaling events: (s since the start of training, action).
    pub scaling: Vec<(f64, String)>,
}

/// One scenario: its static and psld runs (absent when failed or not run).
#[derive(Clone, Debug, Default)]
pub struct ScenarioData {
    /// `a bandwidth`, ...
    pub label: String,
    /// When the straggler starts, if not at once.
    pub straggler_from_s: Option<f64>,
    /// The static run.
    pub static_run: Option<RunSeries>,
    /// The psld run.
    pub psld_run: Option<RunSeries>,
}

/// What the plot shows.
#[derive(Clone, Debug, Default)]
pub struct PlotData {
    /// A line under the title.
    pub subtitle: String,
    /// it/s of the no-straggler baseline.
    pub baseline_it_s: Option<f64>,
    /// it/s without any cap.
    pub uncapped_it_s: Option<f64>,
    /// The baseline's median iteration time, ms.
    pub baseline_iter_ms: Option<f64>,
    /// Every scenario, in order.
    pub scenarios: Vec<ScenarioData>,
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Draws `straggler.png` into `path`.
pub fn draw(path: &Path, data: &PlotData) -> elasticps_report::Result<()> {
    ensure_font()?;
    let n = data.scenarios.len();
    let root = BitMapBackend::new(path, (WIDTH, height(n))).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (top, bottom) = root.split_vertically(BARS_HEIGHT);
    bars(&root, &top, data)?;
    // Up to PER_ROW panels per row; a single short row is as wide as it needs.
    let cols = n.clamp(1, PER_ROW);
    let panels = bottom.split_evenly((n.div_ceil(PER_ROW).max(1), cols));
    for (panel, s) in panels.iter().zip(&data.scenarios) {
        timeline(panel, s, data.baseline_iter_ms)?;
    }
    if data.scenarios.is_empty() {
        no_data(&bottom, "no scenario ran")?;
    }
    root.present().map_err(plot_err)
}

fn bars(root: &Area<'_>, area: &Area<'_>, data: &PlotData) -> elasticps_report::Result<()> {
    let area = area.margin(6, 0, 10, 10);
    let (head, body) = area.split_vertically(58);
    let center = Pos::new(HPos::Center, VPos::Top);
    let w = head.dim_in_pixel().0 as i32;
    head.draw_text(
        "iterations/s after the balancer settles: static vs psld, per scenario",
        &TextStyle::from((FONT, 22).into_font()).pos(center),
        (w / 2, 4),
    )
    .map_err(plot_err)?;
    head.draw_text(
        &data.subtitle,
        &TextStyle::from((FONT, 15).into_font()).color(&MUTED_TEXT).pos(center),
        (w / 2, 34),
    )
    .map_err(plot_err)?;

    let n = data.scenarios.len().max(1) as f64;
    let values = data
        .scenarios
        .iter()
        .flat_map(|s| [s.static_run.as_ref(), s.psld_run.as_ref()])
        .flatten()
        .map(|r| r.it_s)
        .chain(data.baseline_it_s)
        .chain(data.uncapped_it_s)
        .filter(|v| v.is_finite());
    let max = values.fold(0.0f64, f64::max);
    let hi = if max > 0.0 { max * 1.18 } else { 1.0 };
    let mut chart = ChartBuilder::on(&body)
        .margin(10)
        .margin_right(30)
        .x_label_area_size(34)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n, 0.0..hi)
        .map_err(plot_err)?;
    let y_dec = decimals_for(hi);
    house_style(&mut chart.configure_mesh())
        .disable_x_mesh()
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .y_desc("iterations/s (all workers)")
        .y_labels(6)
        .y_label_formatter(&|v: &f64| format!("{v:.y_dec$}"))
        .max_light_lines(2)
        .draw()
        .map_err(plot_err)?;

    let value_style = TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    let mut labelled = [false, false];
    for (i, s) in data.scenarios.iter().enumerate() {
        let x = i as f64;
        for (k, (run, color, name)) in
            [(s.static_run.as_ref(), STATIC, "static"), (s.psld_run.as_ref(), PSLD, "psld")].into_iter().enumerate()
        {
            let (lo, hi_x) = if k == 0 { (x + 0.14, x + 0.48) } else { (x + 0.52, x + 0.86) };
            let mid = (lo + hi_x) / 2.0;
            let Some(r) = run else {
                chart
                    .draw_series(std::iter::once(
                        EmptyElement::at((mid, 0.0)) + Text::new("failed", (0, -4), value_style.clone()),
                    ))
                    .map_err(plot_err)?;
                continue;
            };
            let v = if r.it_s.is_finite() { r.it_s } else { 0.0 };
            let drawn = chart
                .draw_series(std::iter::once(Rectangle::new([(lo, 0.0), (hi_x, v)], color.filled())))
                .map_err(plot_err)?;
            if !labelled[k] {
                labelled[k] = true;
                drawn.label(name).legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], color.filled()));
            }
            let text = if r.it_s.is_finite() { format!("{:.2}", r.it_s) } else { "n/a".into() };
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((mid, v)) + Text::new(text, (0, -4), value_style.clone()),
                ))
                .map_err(plot_err)?;
        }
        // The scenario's name under its pair of bars, in the label area.
        let (px, py) = chart.backend_coord(&(x + 0.5, 0.0));
        root.draw_text(
            &s.label,
            &TextStyle::from((FONT, 16).into_font()).pos(Pos::new(HPos::Center, VPos::Top)),
            (px, py + 8),
        )
        .map_err(plot_err)?;
    }
    for (value, name, dash) in [(data.baseline_it_s, "baseline (no straggler)", 8), (data.uncapped_it_s, "uncapped", 2)]
    {
        if let Some(v) = value.filter(|v| v.is_finite()) {
            let style = BLACK.mix(0.55).stroke_width(2);
            chart
                .draw_series(DashedLineSeries::new([(0.0, v), (n, v)], dash, 5, style))
                .map_err(plot_err)?
                .label(format!("{name}: {v:.2}"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 22, y)], style));
        }
    }
    if data.scenarios.is_empty() {
        return Ok(());
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}

fn timeline(area: &Area<'_>, s: &ScenarioData, baseline_iter_ms: Option<f64>) -> elasticps_report::Result<()> {
    let runs: Vec<(&RunSeries, RGBColor)> = [(s.static_run.as_ref(), STATIC), (s.psld_run.as_ref(), PSLD)]
        .into_iter()
        .filter_map(|(r, c)| Some((r?, c)))
        .collect();
    let points =
        || runs.iter().flat_map(|(r, _)| r.series.iter().copied()).filter(|(t, v)| t.is_finite() && v.is_finite());
    let t_max = points().map(|p| p.0).fold(1.0f64, f64::max) * 1.03;
    let y_max = points().map(|p| p.1).chain(baseline_iter_ms).filter(|v| v.is_finite()).fold(0.0f64, f64::max);
    // Headroom for the legend and the migration ticks above the lines.
    let hi = if y_max > 0.0 { y_max * 1.6 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{}: worker 0 iteration time", s.label), (FONT, 17))
        .margin(8)
        .margin_right(16)
        .x_label_area_size(40)
        .y_label_area_size(58)
        .build_cartesian_2d(0.0..t_max, 0.0..hi)
        .map_err(plot_err)?;
    let x_dec = decimals_for(t_max);
    house_style(&mut chart.configure_mesh())
        .x_desc("s since training started")
        .y_desc("ms")
        .x_labels(6)
        .y_labels(6)
        .x_label_formatter(&|v: &f64| format!("{v:.x_dec$}"))
        .y_label_formatter(&|v: &f64| format!("{v:.0}"))
        .max_light_lines(2)
        .draw()
        .map_err(plot_err)?;
    if let Some(b) = baseline_iter_ms.filter(|b| b.is_finite()) {
        chart
            .draw_series(DashedLineSeries::new([(0.0, b), (t_max, b)], 8, 5, GRID_BOLD.mix(1.0).stroke_width(2)))
            .map_err(plot_err)?
            .label("baseline median")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 22, y)], GRID_BOLD.stroke_width(2)));
    }
    if let Some(t) = s.straggler_from_s {
        chart
            .draw_series(DashedLineSeries::new([(t, 0.0), (t, hi)], 6, 4, STRAGGLER.stroke_width(2)))
            .map_err(plot_err)?
            .label("straggler starts")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 22, y)], STRAGGLER.stroke_width(2)));
    }
    for (r, color) in &runs {
        let name = if *color == STATIC { "static" } else { "psld" };
        let line: Vec<(f64, f64)> = r.series.iter().copied().filter(|(t, v)| t.is_finite() && v.is_finite()).collect();
        let color = *color;
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(2)).point_size(2))
            .map_err(plot_err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 22, y)], color.stroke_width(3)));
    }
    if let Some(p) = s.psld_run.as_ref() {
        let (lo, top) = (hi * 0.93, hi * 0.99);
        chart
            .draw_series(
                p.migrations
                    .iter()
                    .filter(|(t, _)| t.is_finite())
                    .map(|(t, _)| PathElement::new([(*t, lo), (*t, top)], PSLD.stroke_width(2))),
            )
            .map_err(plot_err)?;
        if p.window_from_s.is_finite() {
            chart
                .draw_series(DashedLineSeries::new(
                    [(p.window_from_s, 0.0), (p.window_from_s, hi)],
                    2,
                    4,
                    PSLD.mix(0.8).stroke_width(2),
                ))
                .map_err(plot_err)?
                .label("psld measured from")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 22, y)], PSLD.mix(0.8).stroke_width(2)));
        }
        let style = TextStyle::from((FONT, 12).into_font()).pos(Pos::new(HPos::Left, VPos::Top));
        for (i, (t, action)) in p.scaling.iter().enumerate().filter(|(_, (t, _))| t.is_finite()) {
            chart
                .draw_series(DashedLineSeries::new([(*t, 0.0), (*t, hi)], 6, 4, BLACK.stroke_width(1)))
                .map_err(plot_err)?;
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((*t, hi)) + Text::new(action.clone(), (3, 4 + 14 * (i % 3) as i32), style.clone()),
                ))
                .map_err(plot_err)?;
        }
    }
    if runs.is_empty() {
        return no_data_chart(&chart, "no run completed");
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}

fn no_data(area: &Area<'_>, message: &str) -> elasticps_report::Result<()> {
    let (w, h) = area.dim_in_pixel();
    let style = TextStyle::from((FONT, 18).into_font()).color(&MUTED_TEXT).pos(Pos::new(HPos::Center, VPos::Center));
    area.draw_text(message, &style, (w as i32 / 2, h as i32 / 2)).map_err(plot_err)
}

fn no_data_chart(chart: &Chart<'_, '_>, message: &str) -> elasticps_report::Result<()> {
    no_data(&chart.plotting_area().strip_coord_spec(), message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_empty_and_partial_data() {
        let dir = std::env::temp_dir().join(format!("elasticps-straggler-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("straggler.png");
        draw(&png, &PlotData::default()).unwrap();
        let run = |it_s: f64, slow: f64| RunSeries {
            it_s,
            series: (0..20).map(|i| (i as f64 * 1.2, if i < 5 { slow } else { 1000.0 })).collect(),
            migrations: vec![(4.0, 1), (4.5, 1)],
            window_from_s: 5.0,
            scaling: vec![(7.0, "scale-out".into())],
        };
        let data = PlotData {
            subtitle: "test".into(),
            baseline_it_s: Some(4.0),
            uncapped_it_s: Some(5.5),
            baseline_iter_ms: Some(950.0),
            scenarios: vec![
                ScenarioData {
                    label: "a bandwidth".into(),
                    straggler_from_s: None,
                    static_run: Some(run(1.5, 2500.0)),
                    psld_run: Some(run(3.8, 2500.0)),
                },
                ScenarioData {
                    label: "b interference".into(),
                    straggler_from_s: Some(3.0),
                    static_run: None,
                    psld_run: Some(run(f64::NAN, 1.0)),
                },
            ],
        };
        draw(&png, &data).unwrap();
        assert!(std::fs::metadata(&png).unwrap().len() > 20_000);
        if std::env::var_os("ELASTICPS_KEEP_TEST_OUTPUT").is_some() {
            eprintln!("kept {}", png.display());
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
