//! PNG charts (plotters' bitmap backend, text drawn with ab_glyph from a TrueType file read at
//! run time, so no fontconfig is needed): latency percentiles against load, and the TTFT and
//! ITL distributions (CDFs), every configuration of a comparison side by side.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::report::Report;

/// Why the charts could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// No usable TrueType font (the message says where it looked).
    #[error("{0}")]
    Font(String),
    /// `write_charts` was given no reports.
    #[error("nothing to plot")]
    Empty,
    /// The output directory could not be created.
    #[error("creating {}", path.display())]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// plotters could not draw or encode a chart (its error types are generic over the
    /// backend, so the message is kept as text).
    #[error("chart {chart}: {message}")]
    Draw {
        /// The chart's title or file.
        chart: String,
        /// What plotters said.
        message: String,
    },
}

/// Turns a plotters error into [`PlotError::Draw`] for `chart`.
fn draw_error<E: std::fmt::Display>(chart: impl std::fmt::Display) -> impl FnOnce(E) -> PlotError {
    move |e| PlotError::Draw {
        chart: chart.to_string(),
        message: e.to_string(),
    }
}

/// Where fonts are looked for, after `$CLEAVE_FONT` (Debian's fonts-dejavu-core first).
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
];

static FONT: OnceLock<Result<(), String>> = OnceLock::new();

/// Registers a TrueType font as plotters' "sans-serif" once per process.
///
/// # Errors
/// When no font file is found or it does not parse (install fonts-dejavu-core or set
/// `CLEAVE_FONT` to a .ttf file).
// CLEAVE_FONT names a font file for the charts: a tool's location, not a serving setting.
#[allow(clippy::disallowed_methods)]
pub fn ensure_font() -> Result<(), PlotError> {
    FONT.get_or_init(|| {
        let mut candidates: Vec<PathBuf> = std::env::var_os("CLEAVE_FONT").map(PathBuf::from).into_iter().collect();
        candidates.extend(FONT_PATHS.iter().map(PathBuf::from));
        for path in &candidates {
            if let Ok(bytes) = std::fs::read(path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                return plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                    .map_err(|_| format!("{} is not a usable TrueType font", path.display()));
            }
        }
        Err(format!(
            "no font for the charts: install fonts-dejavu-core or set CLEAVE_FONT to a .ttf file (looked at {})",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ))
    })
    .clone()
    .map_err(PlotError::Font)
}

type Line = (String, Vec<(f64, f64)>);

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

/// Draws `lines` into `area` as a line chart with markers; lines from `dashed_from` on are
/// thin and reuse the first lines' colours.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    lines: &[Line],
    dashed_from: usize,
) -> Result<(), PlotError>
where
    DB::ErrorType: 'static,
{
    let styles: Vec<(usize, u32)> = (0..lines.len())
        .map(|i| (i % dashed_from.max(1), if i >= dashed_from { 1 } else { 2 }))
        .collect();
    styled_panel(area, title, xlabel, ylabel, lines, &styles)
}

/// Draws `lines` into `area`, line `i` in colour `styles[i].0` and width `styles[i].1`.
fn styled_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    lines: &[Line],
    styles: &[(usize, u32)],
) -> Result<(), PlotError>
where
    DB::ErrorType: 'static,
{
    let pts = lines.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 - x0 < 1e-9 {
        (x0, x1) = (x0 - 0.5 * x0.abs().max(1.0), x1 + 0.5 * x1.abs().max(1.0));
    }
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, 0.0..(y1 * 1.1).max(1e-3))
        .map_err(draw_error(title))?;
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(ylabel)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(draw_error(title))?;
    for (i, (name, p)) in lines.iter().enumerate() {
        let (ci, width) = styles.get(i).copied().unwrap_or((i, 2));
        let c = color(ci);
        let style = c.stroke_width(width);
        chart
            .draw_series(LineSeries::new(p.iter().copied(), style))
            .map_err(draw_error(title))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], style));
        if p.len() <= 20 {
            chart
                .draw_series(p.iter().map(|&xy| Circle::new(xy, 3, c.filled())))
                .map_err(draw_error(title))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(draw_error(title))?;
    Ok(())
}

/// The empirical CDF of `values` (ms) as (value, fraction ≤ value).
fn cdf(values: impl Iterator<Item = f64>) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.map(|s| s * 1000.0).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter()
        .enumerate()
        .map(|(i, &x)| (x, (i + 1) as f64 / n))
        .collect()
}

/// Writes `latency_vs_load.png` (against the first point's kind of load), with closed-loop
/// points `latency_vs_concurrency.png`, and `ttft_cdf.png` and `itl_cdf.png` for `reports`
/// (name, report) into `dir`; returns the paths.
///
/// # Errors
/// No font, an unwritable directory, or a drawing error.
pub fn write_charts(dir: &Path, reports: &[(String, &Report)]) -> Result<Vec<PathBuf>, PlotError> {
    ensure_font()?;
    if reports.is_empty() {
        return Err(PlotError::Empty);
    }
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Dir {
        path: dir.to_owned(),
        source,
    })?;
    let first_kind = reports[0].1.points.first().map(|p| kind(&p.load));
    let xlabel = match reports[0].1.points.first().map(|p| p.load) {
        Some(crate::arrival::Load::Concurrency { .. }) => "concurrency",
        Some(crate::arrival::Load::Replay { .. }) => "1 / time scale",
        _ => "request rate (req/s)",
    };
    let mut paths = Vec::new();

    let path = dir.join("latency_vs_load.png");
    {
        let root = BitMapBackend::new(&path, (1500, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error(path.display()))?;
        let panels = root.split_evenly((1, 3));
        type Pick = fn(&crate::stats::PointStats) -> (f64, f64);
        let metrics: [(&str, Pick); 3] = [
            ("TTFT", |s| (s.ttft_ms.p50, s.ttft_ms.p99)),
            ("ITL", |s| (s.itl_ms.p50, s.itl_ms.p99)),
            ("E2E latency", |s| (s.e2e_ms.p50, s.e2e_ms.p99)),
        ];
        for (area, (title, pick)) in panels.iter().zip(metrics) {
            let mut lines: Vec<Line> = Vec::new();
            for (q, idx) in [("p50", 0), ("p99", 1)] {
                for (name, r) in reports {
                    let same_axis = r
                        .points
                        .iter()
                        .filter(|p| Some(kind(&p.load)) == first_kind);
                    let p = same_axis.map(|p| {
                        let v = pick(&p.stats);
                        (p.load.x(), if idx == 0 { v.0 } else { v.1 })
                    });
                    lines.push((format!("{name} {q}"), p.collect()));
                }
            }
            panel(
                area,
                &format!("{title} p50 (bold) / p99 (thin)"),
                xlabel,
                "ms",
                &lines,
                reports.len(),
            )?;
        }
        root.present().map_err(draw_error(path.display()))?;
    }
    paths.push(path);
    if let Some(path) = concurrency_chart(dir, reports)? {
        paths.push(path);
    }

    for (file, title, itl) in [
        ("ttft_cdf.png", "TTFT distribution (CDF)", false),
        ("itl_cdf.png", "ITL distribution (CDF)", true),
    ] {
        let path = dir.join(file);
        {
            let root = BitMapBackend::new(&path, (900, 550)).into_drawing_area();
            root.fill(&WHITE).map_err(draw_error(path.display()))?;
            let mut lines: Vec<Line> = Vec::new();
            for (name, r) in reports {
                for p in &r.points {
                    let ok = p.results.iter().filter(|r| r.error.is_none());
                    let values: Vec<f64> = if itl {
                        ok.flat_map(|r| r.itl_s.iter().copied()).collect()
                    } else {
                        ok.filter_map(|r| r.ttft_s).collect()
                    };
                    lines.push((
                        format!("{name} @ {}", p.load.label()),
                        cdf(values.into_iter()),
                    ));
                }
            }
            let n = lines.len();
            panel(&root, title, "ms", "fraction of samples ≤ x", &lines, n)?;
            root.present().map_err(draw_error(path.display()))?;
        }
        paths.push(path);
    }
    Ok(paths)
}

/// Which axis a load point belongs on (rate, replay and concurrency sweeps are not mixed).
fn kind(load: &crate::arrival::Load) -> u8 {
    match load {
        crate::arrival::Load::Rate { .. } => 0,
        crate::arrival::Load::Replay { .. } => 1,
        crate::arrival::Load::Concurrency { .. } => 2,
    }
}

/// `latency_vs_concurrency.png` when the run has closed-loop points: TTFT and ITL p50/p90/p99
/// and output tokens/s against concurrency, one colour per configuration (p50 thickest, p99
/// thinnest), so the crossovers between configurations show on one chart.
fn concurrency_chart(
    dir: &Path,
    reports: &[(String, &Report)],
) -> Result<Option<PathBuf>, PlotError> {
    let closed = |r: &Report| -> Vec<(f64, crate::stats::PointStats)> {
        r.points
            .iter()
            .filter(|p| matches!(p.load, crate::arrival::Load::Concurrency { .. }))
            .map(|p| (p.load.x(), p.stats.clone()))
            .collect()
    };
    if reports.iter().all(|(_, r)| closed(r).is_empty()) {
        return Ok(None);
    }
    let path = dir.join("latency_vs_concurrency.png");
    draw_concurrency(&path, reports, closed)?;
    Ok(Some(path))
}

fn draw_concurrency(
    path: &Path,
    reports: &[(String, &Report)],
    closed: impl Fn(&Report) -> Vec<(f64, crate::stats::PointStats)>,
) -> Result<(), PlotError> {
    let root = BitMapBackend::new(path, (1800, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_error(path.display()))?;
    let panels = root.split_evenly((1, 3));
    type Pick = fn(&crate::stats::PointStats) -> [f64; 3];
    let metrics: [(&str, Pick); 2] = [
        ("TTFT p50 (thick) / p90 / p99 (thin)", |s| {
            [s.ttft_ms.p50, s.ttft_ms.p90, s.ttft_ms.p99]
        }),
        ("ITL p50 (thick) / p90 / p99 (thin)", |s| {
            [s.itl_ms.p50, s.itl_ms.p90, s.itl_ms.p99]
        }),
    ];
    for (area, (title, pick)) in panels.iter().zip(metrics) {
        let (mut lines, mut styles): (Vec<Line>, Vec<(usize, u32)>) = (Vec::new(), Vec::new());
        for (q, (label, width)) in [("p50", 3), ("p90", 2), ("p99", 1)].iter().enumerate() {
            for (c, (name, r)) in reports.iter().enumerate() {
                let pts = closed(r).iter().map(|(x, s)| (*x, pick(s)[q])).collect();
                lines.push((format!("{name} {label}"), pts));
                styles.push((c, *width));
            }
        }
        styled_panel(
            area,
            title,
            "concurrency (requests in flight)",
            "ms",
            &lines,
            &styles,
        )?;
    }
    let (lines, styles): (Vec<Line>, Vec<(usize, u32)>) = reports
        .iter()
        .enumerate()
        .map(|(c, (name, r))| {
            let pts = closed(r)
                .iter()
                .map(|(x, s)| (*x, s.output_tokens_per_s))
                .collect();
            ((name.clone(), pts), (c, 2))
        })
        .unzip();
    styled_panel(
        &panels[2],
        "output tokens/s",
        "concurrency (requests in flight)",
        "tok/s",
        &lines,
        &styles,
    )?;
    root.present().map_err(draw_error(path.display()))
}
