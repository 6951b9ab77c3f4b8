//! `sim.png` of `elasticps bench sim`: iterations/s (virtual time) against workers, both
//! axes log scale, a line per sync policy (part 4 of the benchmark).

use std::path::Path;

use elasticps_report::plot::{FONT, GRID_BOLD, MUTED_TEXT, PALETTE, ensure_font, house_style, plot_err};
use plotters::prelude::*;

/// What `sim.png` shows: iterations/s against workers, one line per policy.
#[derive(Clone, Debug, Default)]
pub struct PlotData {
    /// (policy, [(workers, iterations/s)]), in legend order.
    pub series: Vec<(String, Vec<(u32, f64)>)>,
    /// A line under the title.
    pub subtitle: String,
}

/// Draws `sim.png`: iterations/s (virtual) against workers, both axes log scale, a line
/// per policy.
pub fn draw(path: &Path, data: &PlotData) -> elasticps_report::Result<()> {
    ensure_font()?;
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let pts =
        || data.series.iter().flat_map(|(_, v)| v.iter().copied()).filter(|(w, r)| *w > 0 && r.is_finite() && *r > 0.0);
    let (x_lo, x_hi) =
        pts().fold((f64::INFINITY, 0.0f64), |(lo, hi), (w, _)| (lo.min(f64::from(w)), hi.max(f64::from(w))));
    let (x_lo, x_hi) = if x_lo.is_finite() { (x_lo / 1.5, x_hi * 1.5) } else { (1.0, 1000.0) };
    let (y_lo, y_hi) = pts().fold((f64::INFINITY, 0.0f64), |(lo, hi), (_, r)| (lo.min(r), hi.max(r)));
    let (y_lo, y_hi) = if y_lo.is_finite() { (y_lo / 2.0, y_hi * 2.0) } else { (1.0, 1000.0) };
    let (top, body) = root.split_vertically(30);
    top.draw_text(&data.subtitle, &TextStyle::from((FONT, 14).into_font()).color(&MUTED_TEXT), (80, 10))
        .map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&body)
        .caption("iterations/s vs workers, per sync policy", (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(70)
        .build_cartesian_2d((x_lo..x_hi).log_scale(), (y_lo..y_hi).log_scale())
        .map_err(plot_err)?;
    house_style(&mut chart.configure_mesh())
        .x_desc("workers (log scale)")
        .y_desc("iterations/s, all workers (virtual time, log scale)")
        .x_label_formatter(&|v: &f64| format!("{v:.0}"))
        .y_label_formatter(&|v: &f64| if *v >= 10.0 { format!("{v:.0}") } else { format!("{v:.1}") })
        .max_light_lines(1)
        .draw()
        .map_err(plot_err)?;
    for (i, (policy, series)) in data.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let line: Vec<(f64, f64)> = series
            .iter()
            .filter(|(w, r)| *w > 0 && r.is_finite() && *r > 0.0)
            .map(|(w, r)| (f64::from(*w), *r))
            .collect();
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(2)).point_size(4))
            .map_err(plot_err)?
            .label(policy.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 22, y)], color.stroke_width(3)));
    }
    if data.series.is_empty() {
        let area = chart.plotting_area().strip_coord_spec();
        let (w, h) = area.dim_in_pixel();
        let style = TextStyle::from((FONT, 18).into_font()).color(&MUTED_TEXT);
        area.draw_text("no policy run", &style, (w as i32 / 2 - 50, h as i32 / 2)).map_err(plot_err)?;
    } else {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .margin(12)
            .label_font((FONT, 14))
            .background_style(WHITE.mix(0.85))
            .border_style(GRID_BOLD)
            .draw()
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)
}
