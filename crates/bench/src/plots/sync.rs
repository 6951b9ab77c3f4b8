//! `sync.png` of `elasticps bench sync`: three panels side by side.
//!
//! 1. iterations/s per policy on the synthetic ResNet-56 (bars, value on top);
//! 2. delayed (held) pulls per policy on the same runs (bars, log scale; 0 is written);
//! 3. MNIST test accuracy of worker 0 against time, a line per policy, with the budget of
//!    "accuracy after a fixed time" as a dashed vertical line.
//!
//! A policy has the same colour in every panel. Text uses the font that
//! [`elasticps_report::plot::ensure_font`] embeds.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use elasticps_report::plot::{FONT, MUTED_TEXT, PALETTE, decimals_for, ensure_font, house_style, legend, plot_err};

/// Width of `sync.png`, pixels.
pub const WIDTH: u32 = 1950;
/// Height of `sync.png`, pixels.
pub const HEIGHT: u32 = 620;

/// What the plot shows.
#[derive(Clone, Debug, Default)]
pub struct PlotData {
    /// Every policy, in the order that gives each its colour.
    pub policies: Vec<String>,
    /// Synthetic runs: (policy, iterations/s).
    pub rates: Vec<(String, f64)>,
    /// Synthetic runs: (policy, delayed pulls).
    pub held: Vec<(String, u64)>,
    /// MNIST runs: (policy, [(t_s, accuracy %)]).
    pub accuracy: Vec<(String, Vec<(f64, f64)>)>,
    /// The wall-clock budget, s.
    pub budget_s: Option<f64>,
    /// A line under the titles of the bar panels.
    pub subtitle: String,
}

impl PlotData {
    fn color(&self, policy: &str) -> RGBColor {
        let i = self.policies.iter().position(|p| p == policy).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    }
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Draws `sync.png` into `path`.
pub fn draw(path: &Path, data: &PlotData) -> elasticps_report::Result<()> {
    ensure_font()?;
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let panels = root.split_evenly((1, 3));
    let rates: Vec<(String, f64)> = data.rates.clone();
    bars(&panels[0], data, "iterations/s, synthetic:resnet56", "iterations/s (all workers)", &rates, false)?;
    let held: Vec<(String, f64)> = data.held.iter().map(|(p, h)| (p.clone(), *h as f64)).collect();
    bars(&panels[1], data, "delayed pulls, synthetic:resnet56", "pulls held by the servers (log)", &held, true)?;
    accuracy(&panels[2], data)?;
    root.present().map_err(plot_err)
}

/// One bar per policy; `log`: a log-scale y axis (values of 0 get no bar, only a label).
fn bars(
    area: &Area<'_>,
    data: &PlotData,
    title: &str,
    y_desc: &str,
    values: &[(String, f64)],
    log: bool,
) -> elasticps_report::Result<()> {
    let area = area.margin(6, 6, 6, 6);
    let (top, body) = area.split_vertically(54);
    top.draw_text(
        title,
        &TextStyle::from((FONT, 22).into_font()).pos(Pos::new(HPos::Center, VPos::Top)),
        (top.dim_in_pixel().0 as i32 / 2, 4),
    )
    .map_err(plot_err)?;
    top.draw_text(
        &data.subtitle,
        &TextStyle::from((FONT, 14).into_font()).color(&MUTED_TEXT).pos(Pos::new(HPos::Center, VPos::Top)),
        (top.dim_in_pixel().0 as i32 / 2, 32),
    )
    .map_err(plot_err)?;
    let n = values.len().max(1) as u32;
    let names: Vec<String> = values.iter().map(|(p, _)| p.clone()).collect();
    let max = values.iter().map(|(_, v)| *v).filter(|v| v.is_finite()).fold(0.0f64, f64::max);
    let x_fmt = |v: &SegmentValue<u32>| match v {
        SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
        _ => String::new(),
    };
    let label = |v: f64| if log || v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") };
    let label_style = TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    if log {
        let hi = (max.max(10.0)) * 4.0;
        let mut chart = ChartBuilder::on(&body)
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((0u32..n - 1).into_segmented(), (1f64..hi).log_scale())
            .map_err(plot_err)?;
        house_style(&mut chart.configure_mesh())
            .disable_x_mesh()
            .x_labels(n as usize)
            .x_label_formatter(&x_fmt)
            .max_light_lines(2)
            .y_desc(y_desc)
            .y_label_formatter(&|v: &f64| format!("{v:.0}"))
            .draw()
            .map_err(plot_err)?;
        for (i, (p, v)) in values.iter().enumerate() {
            let i = i as u32;
            if *v >= 1.0 {
                let mut bar = Rectangle::new(
                    [(SegmentValue::Exact(i), 1.0), (SegmentValue::Exact(i + 1), *v)],
                    data.color(p).filled(),
                );
                bar.set_margin(0, 0, 10, 10);
                chart.draw_series(std::iter::once(bar)).map_err(plot_err)?;
            }
            let at = (SegmentValue::CenterOf(i), v.max(1.0));
            chart
                .draw_series(std::iter::once(EmptyElement::at(at) + Text::new(label(*v), (0, -4), label_style.clone())))
                .map_err(plot_err)?;
        }
    } else {
        let hi = if max > 0.0 { max * 1.15 } else { 1.0 };
        let mut chart = ChartBuilder::on(&body)
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((0u32..n - 1).into_segmented(), 0f64..hi)
            .map_err(plot_err)?;
        house_style(&mut chart.configure_mesh())
            .disable_x_mesh()
            .x_labels(n as usize)
            .x_label_formatter(&x_fmt)
            .max_light_lines(2)
            .y_desc(y_desc)
            .y_label_formatter(&|v: &f64| format!("{v:.0}"))
            .draw()
            .map_err(plot_err)?;
        for (i, (p, v)) in values.iter().enumerate() {
            let i = i as u32;
            let v = if v.is_finite() { *v } else { 0.0 };
            let mut bar = Rectangle::new(
                [(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), v)],
                data.color(p).filled(),
            );
            bar.set_margin(0, 0, 10, 10);
            chart.draw_series(std::iter::once(bar)).map_err(plot_err)?;
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((SegmentValue::CenterOf(i), v))
                        + Text::new(label(v), (0, -4), label_style.clone()),
                ))
                .map_err(plot_err)?;
        }
    }
    if values.is_empty() {
        no_data(&body, "no synthetic run")?;
    }
    Ok(())
}

fn accuracy(area: &Area<'_>, data: &PlotData) -> elasticps_report::Result<()> {
    // The first evaluation (the initial model, about 10%) would squash the interesting part.
    let points = |pts: &[(f64, f64)]| -> Vec<(f64, f64)> {
        pts.iter().copied().skip(1).filter(|(t, a)| t.is_finite() && a.is_finite()).collect()
    };
    let series: Vec<(String, Vec<(f64, f64)>)> =
        data.accuracy.iter().map(|(p, pts)| (p.clone(), points(pts))).filter(|(_, v)| !v.is_empty()).collect();
    let all = || series.iter().flat_map(|(_, v)| v.iter().copied());
    let t_max = all().map(|(t, _)| t).fold(data.budget_s.unwrap_or(1.0), f64::max) * 1.03;
    let (lo, hi) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, a)| (lo.min(a), hi.max(a)));
    let (lo, hi) = if lo.is_finite() {
        (((lo - 2.0) / 5.0).floor().max(0.0) * 5.0, (((hi + 1.0) / 5.0).ceil() * 5.0).min(100.0))
    } else {
        (0.0, 100.0)
    };
    let mut chart = ChartBuilder::on(area)
        .caption("MLP/MNIST test accuracy vs time (worker 0)", (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(68)
        .build_cartesian_2d(0f64..t_max, lo..hi)
        .map_err(plot_err)?;
    let x_dec = decimals_for(t_max);
    house_style(&mut chart.configure_mesh())
        .x_desc("time since launch (s)")
        .y_desc("test accuracy (%)")
        .x_labels(8)
        .y_labels(8)
        .x_label_formatter(&|v: &f64| format!("{v:.x_dec$}"))
        .y_label_formatter(&|v: &f64| format!("{v:.0}%"))
        .max_light_lines(4)
        .draw()
        .map_err(plot_err)?;
    if series.is_empty() {
        let body = chart.plotting_area().strip_coord_spec();
        return no_data(&body, "no MNIST run");
    }
    if let Some(b) = data.budget_s {
        chart
            .draw_series(DashedLineSeries::new([(b, lo), (b, hi)], 8, 5, BLACK.mix(0.5).stroke_width(2)))
            .map_err(plot_err)?
            .label(format!("budget {b:.1} s"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 22, y)], BLACK.mix(0.5).stroke_width(2)));
    }
    for (p, pts) in &series {
        let color = data.color(p);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)).point_size(3))
            .map_err(plot_err)?
            .label(p.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 22, y)], color.stroke_width(3)));
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)
}

fn no_data(area: &Area<'_>, message: &str) -> elasticps_report::Result<()> {
    let (w, h) = area.dim_in_pixel();
    let style = TextStyle::from((FONT, 18).into_font()).color(&MUTED_TEXT).pos(Pos::new(HPos::Center, VPos::Center));
    area.draw_text(message, &style, (w as i32 / 2, h as i32 / 2)).map_err(plot_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_data_still_draws() {
        let dir = std::env::temp_dir().join(format!("elasticps-sync-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("empty.png");
        draw(&png, &PlotData::default()).unwrap();
        let data = PlotData {
            policies: vec!["bsp".into(), "asp".into()],
            rates: vec![("bsp".into(), 0.0), ("asp".into(), f64::NAN)],
            held: vec![("bsp".into(), 0), ("asp".into(), 0)],
            accuracy: vec![("bsp".into(), vec![(0.0, 10.0)])],
            budget_s: Some(1.0),
            subtitle: String::new(),
        };
        draw(&png, &data).unwrap();
        assert!(std::fs::metadata(&png).unwrap().len() > 1000);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
