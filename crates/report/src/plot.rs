//! `curves.png`: the training curves of a run, drawn with plotters.
//!
//! The image is [`WIDTH`]x[`HEIGHT`] pixels with two panels side by side:
//!
//! * left, *training loss vs time (s)*: one line per worker rank. The raw loss
//!   samples are drawn faintly, a centred moving average on top in full colour
//!   (the window grows with the number of samples, up to 25 points).
//! * right, *test accuracy vs time (s)*: every point carrying a
//!   `test_accuracy`, as a line with markers, in percent; the last value is
//!   annotated.
//!
//! Both panels share the time axis. Non-finite values are skipped; a panel
//! without data shows "no data" instead of failing.
//!
//! Text is rendered by plotters' `ab_glyph` backend, which has no access to
//! system fonts: DejaVu Sans (`crates/report/assets/DejaVuSans.ttf`, licence in
//! `crates/report/assets/FONT-LICENSE`) is embedded in the binary and registered
//! as the `"sans-serif"` family on first use.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use crate::{ReportError, Result};
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::CurvePoint;

/// Width of `curves.png`, in pixels.
pub const WIDTH: u32 = 1200;
/// Height of `curves.png`, in pixels.
pub const HEIGHT: u32 = 500;

/// Path of the embedded font, relative to the crate root (for messages).
const FONT_FILE: &str = "crates/report/assets/DejaVuSans.ttf";
/// DejaVu Sans, embedded so that rendering needs no system fonts.
static FONT_BYTES: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
/// Font family every text style in the plot uses.
pub const FONT: &str = "sans-serif";

/// Qualitative palette (matplotlib's "tab10"); ranks cycle through it.
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
/// At most this many ranks get a legend entry (the rest are still drawn).
const MAX_LEGEND_ENTRIES: usize = 10;

const GRID_LIGHT: RGBColor = RGBColor(238, 238, 238);
/// Colour of the major grid lines.
pub const GRID_BOLD: RGBColor = RGBColor(205, 205, 205);

/// The house style of every chart's mesh (also `bench sync`'s): fonts and grid colours.
pub fn house_style<'m, 'a, 'b, X: Ranged, Y: Ranged, DB: DrawingBackend>(
    mesh: &'m mut plotters::chart::MeshStyle<'a, 'b, X, Y, DB>,
) -> &'m mut plotters::chart::MeshStyle<'a, 'b, X, Y, DB> {
    mesh.label_style((FONT, 14)).axis_desc_style((FONT, 16)).light_line_style(GRID_LIGHT).bold_line_style(GRID_BOLD)
}
/// Colour of secondary text (notes, "no data").
pub const MUTED_TEXT: RGBColor = RGBColor(120, 120, 120);

/// Registers the embedded font with plotters exactly once per process.
///
/// The outcome of the single registration attempt is cached, so a failure is
/// reported (not retried, not panicking) on every call.
pub fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES).map_err(|_| {
                format!(
                    "registering embedded font {FONT_FILE} ({} bytes): not a valid TrueType/OpenType font",
                    FONT_BYTES.len()
                )
            })
        })
        .clone()
        .map_err(ReportError::Font)
}

/// Draws the two-panel training-curve plot of `curve` into the PNG file
/// `path` (see the module docs for the layout). An empty curve yields a valid
/// PNG with two empty, labelled panels.
pub fn draw_curves(path: &Path, curve: &[CurvePoint]) -> Result<()> {
    ensure_font()?;
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;

    let time = time_range(curve);
    let panels = root.split_evenly((1, 2));
    draw_loss_panel(&panels[0], curve, time.clone()).map_err(|e| e.drawing("the loss panel"))?;
    draw_accuracy_panel(&panels[1], curve, time).map_err(|e| e.drawing("the accuracy panel"))?;

    root.present().map_err(plot_err).map_err(|e| e.drawing(format!("(saving {})", path.display())))
}

type Panel<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

fn draw_loss_panel(area: &Panel<'_>, curve: &[CurvePoint], time: std::ops::Range<f64>) -> Result<()> {
    let series = by_rank(curve, |p| p.loss);
    let values = series.values().flatten().map(|&(_, y)| y);
    let (lo, hi) = padded_range(values, 0.05).unwrap_or((0.0, 1.0));
    let all_non_negative = series.values().flatten().all(|&(_, y)| y >= 0.0);
    let lo = if all_non_negative { lo.max(0.0) } else { lo };

    let mut chart = ChartBuilder::on(area)
        .caption("training loss vs time (s)", (FONT, 22))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(68)
        .build_cartesian_2d(time.clone(), lo..hi)
        .map_err(plot_err)?;

    let x_dec = decimals_for(time.end - time.start);
    let y_dec = decimals_for(hi - lo);
    let x_fmt = |v: &f64| format!("{v:.x_dec$}");
    let y_fmt = |v: &f64| format!("{v:.y_dec$}");
    house_style(&mut chart.configure_mesh())
        .x_desc("time (s)")
        .y_desc("training loss")
        .x_labels(8)
        .y_labels(8)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .max_light_lines(4)
        .draw()
        .map_err(plot_err)?;

    if series.is_empty() {
        no_data(&chart, "no training loss recorded")?;
        return Ok(());
    }

    let mut labelled = 0;
    for (i, (rank, points)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        // Raw samples, faint, behind the smoothed line.
        chart.draw_series(LineSeries::new(points.iter().copied(), color.mix(0.3).stroke_width(1))).map_err(plot_err)?;
        let smoothed = moving_average(points, smoothing_half_window(points.len()));
        let drawn = chart.draw_series(LineSeries::new(smoothed, color.stroke_width(2))).map_err(plot_err)?;
        if labelled < MAX_LEGEND_ENTRIES {
            labelled += 1;
            drawn
                .label(format!("worker {rank}"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 22, y)], color.stroke_width(3)));
        }
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}

fn draw_accuracy_panel(area: &Panel<'_>, curve: &[CurvePoint], time: std::ops::Range<f64>) -> Result<()> {
    let series: BTreeMap<u32, Vec<(f64, f64)>> = by_rank(curve, |p| p.test_accuracy)
        .into_iter()
        .map(|(rank, pts)| (rank, pts.into_iter().map(|(t, a)| (t, a * 100.0)).collect()))
        .collect();
    let (lo, hi) = percent_range(series.values().flatten().map(|&(_, y)| y));

    let mut chart = ChartBuilder::on(area)
        .caption("test accuracy vs time (s)", (FONT, 22))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(68)
        .build_cartesian_2d(time.clone(), lo..hi)
        .map_err(plot_err)?;

    let x_dec = decimals_for(time.end - time.start);
    let y_dec = if hi - lo >= 5.0 { 0 } else { 1 };
    let x_fmt = |v: &f64| format!("{v:.x_dec$}");
    let y_fmt = |v: &f64| format!("{v:.y_dec$}%");
    house_style(&mut chart.configure_mesh())
        .x_desc("time (s)")
        .y_desc("test accuracy (%)")
        .x_labels(8)
        .y_labels(8)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .max_light_lines(4)
        .draw()
        .map_err(plot_err)?;

    if series.is_empty() {
        no_data(&chart, "no test accuracy recorded")?;
        return Ok(());
    }

    let single = series.len() == 1;
    let mut labelled = 0;
    for (i, (rank, points)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let drawn = chart
            .draw_series(LineSeries::new(points.iter().copied(), color.filled().stroke_width(2)).point_size(4))
            .map_err(plot_err)?;
        if labelled < MAX_LEGEND_ENTRIES {
            labelled += 1;
            let label = if single { "test accuracy".to_string() } else { format!("test accuracy (rank {rank})") };
            drawn.label(label).legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new([(0, 0), (22, 0)], color.stroke_width(2))
                    + Circle::new((11, 0), 4, color.filled())
            });
        }
        // Annotate the final value, just above and left of the last marker.
        if let Some(&(t, acc)) = points.last() {
            let style = TextStyle::from((FONT, 15).into_font()).color(&color).pos(Pos::new(HPos::Right, VPos::Bottom));
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((t, acc)) + Text::new(format!("{acc:.2}%"), (-6, -6), style),
                ))
                .map_err(plot_err)?;
        }
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)
}

/// A chart of f64 against f64 on a bitmap.
pub type Chart<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draws the series labels in the house style.
pub fn legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>, position: SeriesLabelPosition) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .margin(12)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(GRID_BOLD)
        .draw()
        .map_err(plot_err)
}

/// Writes `message` in the middle of an empty plotting area.
fn no_data(chart: &Chart<'_, '_>, message: &str) -> Result<()> {
    let area = chart.plotting_area();
    let (w, h) = area.dim_in_pixel();
    let style = TextStyle::from((FONT, 18).into_font()).color(&MUTED_TEXT).pos(Pos::new(HPos::Center, VPos::Center));
    area.strip_coord_spec().draw_text(message, &style, (w as i32 / 2, h as i32 / 2)).map_err(plot_err)
}

/// Groups the finite `(t_s, value)` pairs selected by `value` by rank, each
/// group sorted by time.
fn by_rank(curve: &[CurvePoint], value: impl Fn(&CurvePoint) -> Option<f64>) -> BTreeMap<u32, Vec<(f64, f64)>> {
    let mut out: BTreeMap<u32, Vec<(f64, f64)>> = BTreeMap::new();
    for p in curve {
        if let Some(v) = value(p)
            && v.is_finite()
            && p.t_s.is_finite()
        {
            out.entry(p.rank).or_default().push((p.t_s, v));
        }
    }
    for points in out.values_mut() {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// The time axis shared by both panels: from `min(0, first)` to 3% past the last
/// finite timestamp (at least one second wide when there is no data).
fn time_range(curve: &[CurvePoint]) -> std::ops::Range<f64> {
    let times =
        curve.iter().filter(|p| p.loss.is_some() || p.test_accuracy.is_some()).map(|p| p.t_s).filter(|t| t.is_finite());
    let (min, max) = times.fold((0.0f64, f64::NEG_INFINITY), |(lo, hi), t| (lo.min(t), hi.max(t)));
    if max.is_finite() && max > min {
        min..max + (max - min) * 0.03
    } else if max.is_finite() {
        min..min + 1.0
    } else {
        0.0..1.0
    }
}

/// `[min, max]` of `values` widened by `pad` of the span on both sides (or by
/// a sensible amount when all values are equal); `None` when empty.
fn padded_range(values: impl Iterator<Item = f64>, pad: f64) -> Option<(f64, f64)> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() || !hi.is_finite() {
        return None;
    }
    let span = hi - lo;
    if span > f64::EPSILON * hi.abs().max(1.0) {
        Some((lo - span * pad, hi + span * pad))
    } else {
        let half = (hi.abs() * 0.1).max(0.5);
        Some((lo - half, hi + half))
    }
}

/// Y range for accuracies in percent: rounded outwards to multiples of 10
/// below and 5 above with a little headroom, clamped to `0..=100` (unless the
/// data itself leaves that range), and at least 10 points wide.
fn percent_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (min, max) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !min.is_finite() || !max.is_finite() {
        return (0.0, 100.0);
    }
    let mut lo = ((min - 2.0) / 10.0).floor() * 10.0;
    let mut hi = ((max + 2.0) / 5.0).ceil() * 5.0;
    if min >= 0.0 {
        lo = lo.max(0.0);
    }
    if max <= 100.0 {
        hi = hi.min(100.0);
    }
    if hi - lo < 10.0 {
        if hi - 10.0 >= 0.0 || min < 0.0 {
            lo = hi - 10.0;
        } else {
            hi = lo + 10.0;
        }
    }
    (lo, hi)
}

/// Half-width of the moving-average window for `n` samples: none for very
/// short series, then about 1/40 of the series, between 1 and 12.
fn smoothing_half_window(n: usize) -> usize {
    if n < 8 { 0 } else { (n / 40).clamp(1, 12) }
}

/// Centred moving average over `2 * half + 1` samples (shrinking at the
/// ends), keeping the original timestamps.
fn moving_average(points: &[(f64, f64)], half: usize) -> Vec<(f64, f64)> {
    if half == 0 {
        return points.to_vec();
    }
    let mut prefix = Vec::with_capacity(points.len() + 1);
    prefix.push(0.0);
    for &(_, y) in points {
        prefix.push(prefix.last().copied().unwrap_or(0.0) + y);
    }
    points
        .iter()
        .enumerate()
        .map(|(i, &(t, _))| {
            let a = i.saturating_sub(half);
            let b = (i + half + 1).min(points.len());
            (t, (prefix[b] - prefix[a]) / (b - a) as f64)
        })
        .collect()
}

/// Number of decimals for axis labels spanning `span`.
pub fn decimals_for(span: f64) -> usize {
    match span {
        s if s >= 10.0 => 0,
        s if s >= 1.0 => 1,
        s if s >= 0.1 => 2,
        _ => 3,
    }
}

/// A plotters error as the crate's error.
pub fn plot_err(e: impl std::fmt::Display) -> ReportError {
    ReportError::Plot(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn font_registers_and_is_idempotent() {
        ensure_font().unwrap();
        ensure_font().unwrap();
    }

    #[test]
    fn moving_average_smooths_and_keeps_times() {
        let pts: Vec<(f64, f64)> = (0..5).map(|i| (i as f64, if i % 2 == 0 { 0.0 } else { 2.0 })).collect();
        let s = moving_average(&pts, 1);
        assert_eq!(s.len(), 5);
        assert_eq!(s[0], (0.0, 1.0));
        assert!((s[2].1 - 4.0 / 3.0).abs() < 1e-12);
        assert_eq!(moving_average(&pts, 0), pts);
    }

    #[test]
    fn percent_ranges_are_sensible() {
        assert_eq!(percent_range([10.0, 97.0].into_iter()), (0.0, 100.0));
        assert_eq!(percent_range([91.0, 97.5].into_iter()), (80.0, 100.0));
        assert_eq!(percent_range([50.0].into_iter()), (40.0, 55.0));
        assert_eq!(percent_range([0.0].into_iter()), (0.0, 10.0));
        assert_eq!(percent_range([100.0].into_iter()), (90.0, 100.0));
        assert_eq!(percent_range(std::iter::empty()), (0.0, 100.0));
    }

    #[test]
    fn ranges_handle_degenerate_input() {
        assert_eq!(padded_range(std::iter::empty(), 0.05), None);
        let (lo, hi) = padded_range([2.0, 2.0].into_iter(), 0.05).unwrap();
        assert!(lo < 2.0 && hi > 2.0);
        let p = |t_s: f64| CurvePoint {
            t_s,
            iteration: 0,
            rank: 0,
            loss: Some(1.0),
            test_accuracy: None,
            metrics: Default::default(),
        };
        assert_eq!(time_range(&[]), 0.0..1.0);
        assert_eq!(time_range(&[p(0.0)]), 0.0..1.0);
        assert_eq!(time_range(&[p(f64::NAN), p(3.0)]).start, 0.0);
    }
}
