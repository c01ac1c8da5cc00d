//! Learning curves from `RUN_DIR/metrics.jsonl` to `RUN_DIR/plots/*.png` (`troupe plot`).
//!
//! One PNG per curve — mean return per agent (with a ±1 std band), invalid-action rate, loss,
//! gradient norm per agent — and `learning_curves.png` with all four. Drawn with `plotters`'
//! bitmap backend; text uses the embedded Noto Sans font (Apache-2.0, from the `ttf-noto-sans`
//! crate) through `ab_glyph`, so no system font library is needed. Each PNG is written to a
//! temporary file and renamed into place, so a reader never sees half an image.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::metrics::{metrics_path, read_metrics, IterationMetrics};
use crate::error::{Result, RunError, TroupeError};

/// The plots' folder inside a run directory.
pub const PLOTS_DIR: &str = "plots";

/// The family name the embedded font is registered under.
const FONT: &str = "sans-serif";

/// Size of a single-curve PNG.
const SINGLE: (u32, u32) = (900, 560);
/// Size of the overview PNG (four or six panels).
const OVERVIEW: (u32, u32) = (1600, 1000);

/// One line of a chart, with an optional band (low, high) around it.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (iteration, value) points; non-finite values are skipped.
    pub points: Vec<(f64, f64)>,
    /// (iteration, low, high) of a shaded band, e.g. mean ± std.
    pub band: Vec<(f64, f64, f64)>,
}

/// One chart: a title, a y-axis label and its series.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    /// The PNG's file stem (`mean_return`).
    pub file_stem: &'static str,
    /// Caption.
    pub title: String,
    /// The y-axis description.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

/// One series per key that any record has (an agent id, an adapter name), from the
/// `(value, spread)` of that key in each record; a positive spread draws a ±spread band.
fn keyed_series<K: Ord + Clone>(
    records: &[IterationMetrics],
    keys: impl Fn(&IterationMetrics) -> Vec<K>,
    name: impl Fn(&K) -> String,
    value: impl Fn(&IterationMetrics, &K) -> Option<(f64, f64)>,
) -> Vec<Series> {
    let all: BTreeSet<K> = records.iter().flat_map(keys).collect();
    all.iter()
        .map(|key| {
            let values: Vec<(f64, f64, f64)> = records
                .iter()
                .filter_map(|r| value(r, key).map(|(v, spread)| (r.iteration as f64, v, spread)))
                .collect();
            Series {
                name: name(key),
                points: values.iter().map(|&(x, y, _)| (x, y)).collect(),
                band: values
                    .iter()
                    .filter(|(_, _, spread)| spread.is_finite() && *spread > 0.0)
                    .map(|&(x, y, spread)| (x, y - spread, y + spread))
                    .collect(),
            }
        })
        .collect()
}

/// The learning curves of `records`: mean return, score (when the environment reports one;
/// held-out evaluations with their standard error), invalid rate, loss and gradient norms.
pub fn learning_curves(records: &[IterationMetrics]) -> Vec<Chart> {
    let single = |name: &str, get: fn(&IterationMetrics) -> f64| {
        let points = records.iter().map(|r| (r.iteration as f64, get(r))).collect();
        vec![Series { name: name.to_string(), points, band: vec![] }]
    };
    let extra = |key: &'static str| move |r: &IterationMetrics| r.extra.get(key).copied();
    let score = Chart {
        file_stem: "score",
        title: "Score: training games and held-out whole games (band: ±1 s.e.)".to_string(),
        y_label: "score".to_string(),
        series: [
            ("training games", extra("score"), None),
            ("held-out games", extra("eval_score"), Some(extra("eval_score_stderr"))),
        ]
        .into_iter()
        .filter_map(|(name, value, spread)| {
            let values: Vec<(f64, f64, f64)> = records
                .iter()
                .filter_map(|r| {
                    value(r).map(|v| (r.iteration as f64, v, spread.as_ref().and_then(|s| s(r)).unwrap_or(0.0)))
                })
                .collect();
            (!values.is_empty()).then(|| Series {
                name: name.to_string(),
                points: values.iter().map(|&(x, y, _)| (x, y)).collect(),
                band: values.iter().filter(|v| v.2 > 0.0).map(|&(x, y, e)| (x, y - e, y + e)).collect(),
            })
        })
        .collect(),
    };
    let mut charts = vec![
        Chart {
            file_stem: "mean_return",
            title: "Mean return per agent (band: ±1 std)".to_string(),
            y_label: "return".to_string(),
            series: keyed_series(
                records,
                |r| r.mean_return.keys().copied().collect(),
                |agent| format!("agent {agent}"),
                |r, agent| r.mean_return.get(agent).map(|&m| (m, r.std_return.get(agent).copied().unwrap_or(0.0))),
            ),
        },
        Chart {
            file_stem: "invalid_rate",
            title: "Invalid-action rate".to_string(),
            y_label: "invalid replies / replies".to_string(),
            series: single("invalid rate", |r| r.invalid_rate),
        },
        Chart {
            file_stem: "loss",
            title: "Policy loss".to_string(),
            y_label: "loss".to_string(),
            series: single("loss", |r| r.loss),
        },
        Chart {
            file_stem: "grad_norm",
            title: "Gradient norm per adapter (before clipping)".to_string(),
            y_label: "grad norm".to_string(),
            series: keyed_series(
                records,
                |r| r.grad_norm.keys().cloned().collect(),
                |adapter| adapter.clone(),
                |r, adapter| r.grad_norm.get(adapter).map(|&g| (g, 0.0)),
            ),
        },
    ];
    // No reply was ever invalid (`choice` mode cannot give one): a flat zero says nothing.
    if records.iter().all(|r| r.invalid_rate == 0.0) {
        charts.retain(|c| c.file_stem != "invalid_rate");
    }
    if !score.series.is_empty() {
        charts.insert(1, score);
    }
    charts
}

/// Draws the learning curves of `RUN_DIR/metrics.jsonl` into `RUN_DIR/plots/`; returns the
/// PNGs written. A metrics file with no complete line is an error.
pub fn plot_run(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let path = metrics_path(run_dir);
    let log = read_metrics(&path)?;
    if log.truncated_tail {
        tracing::warn!("{}: ignoring a partial last line (a run stopped while writing it)", path.display());
    }
    if log.records.is_empty() {
        return Err(TroupeError::Json { path, message: "no complete metrics line to plot".to_string() });
    }
    super::lock::refuse_links(run_dir)?;
    plot_metrics(&log.records, &run_dir.join(PLOTS_DIR))
}

/// Draws the learning curves of `records` into `out_dir` (created if needed): one PNG per chart
/// and `learning_curves.png` with all of them. Returns the PNGs written.
pub fn plot_metrics(records: &[IterationMetrics], out_dir: &Path) -> Result<Vec<PathBuf>> {
    register_font()?;
    std::fs::create_dir_all(out_dir).map_err(|e| TroupeError::io(out_dir, e))?;
    let charts = learning_curves(records);
    let mut written = Vec::new();
    for chart in &charts {
        let path = out_dir.join(format!("{}.png", chart.file_stem));
        write_png_atomic(&path, SINGLE, |area| draw_chart(area, chart, 1.0))?;
        written.push(path);
    }
    let path = out_dir.join("learning_curves.png");
    // Two rows from four charts on (the second row's panels share its width, so no slot is
    // left empty), one row below that.
    let rows = if charts.len() >= 4 { 2 } else { 1 };
    let per_row = charts.len().div_ceil(rows);
    let size = if per_row > 2 { (OVERVIEW.0 * per_row as u32 / 2, OVERVIEW.1) } else { OVERVIEW };
    write_png_atomic(&path, size, |area| {
        for (row, row_charts) in area.split_evenly((rows, 1)).iter().zip(charts.chunks(per_row)) {
            for (panel, chart) in row.split_evenly((1, row_charts.len())).iter().zip(row_charts) {
                draw_chart(panel, chart, 0.9)?;
            }
        }
        Ok(())
    })?;
    written.push(path);
    Ok(written)
}

/// Registers the embedded font with plotters once per process.
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_ok());
    if ok {
        Ok(())
    } else {
        Err(TroupeError::Run(RunError::Plot {
            path: PathBuf::from(PLOTS_DIR),
            message: "the embedded font did not load".to_string(),
        }))
    }
}

/// A plotters drawing error as text.
type DrawResult = std::result::Result<(), String>;

/// Renders with `draw` into a PNG at `path`: a temporary `.png` beside it, synced, then renamed.
fn write_png_atomic(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> DrawResult,
) -> Result<()> {
    let fail = |message: String| TroupeError::Run(RunError::Plot { path: path.to_path_buf(), message });
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("plot");
    // The backend picks the encoder from the extension, so the temporary name ends in `.png`.
    let tmp = dir.join(format!(".{stem}.{}.tmp.png", std::process::id()));
    let result = (|| {
        {
            let root = BitMapBackend::new(&tmp, size).into_drawing_area();
            root.fill(&WHITE).map_err(|e| e.to_string())?;
            draw(&root)?;
            root.present().map_err(|e| e.to_string())?;
        }
        let file = std::fs::File::open(&tmp).map_err(|e| e.to_string())?;
        file.sync_all().map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, path).map_err(|e| e.to_string())
    })();
    if let Err(message) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(message));
    }
    Ok(())
}

/// The (min, max) of the finite values, padded so a flat or single-point curve still has a
/// visible range.
fn padded_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) =
        values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let span = hi - lo;
    let pad = if span > 0.0 { span * 0.05 } else { lo.abs().max(1.0) * 0.1 };
    (lo - pad, hi + pad)
}

/// Draws one chart on `area`; `scale` shrinks the text for the four-panel overview.
fn draw_chart(area: &DrawingArea<BitMapBackend<'_>, Shift>, chart: &Chart, scale: f64) -> DrawResult {
    let text = |size: f64| (FONT, size * scale);
    let xs = chart.series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (mut x0, mut x1) = padded_range(xs);
    if x1 - x0 < 1.0 {
        (x0, x1) = (x0 - 0.5, x1 + 0.5);
    }
    let ys = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1).chain(s.band.iter().flat_map(|&(_, lo, hi)| [lo, hi])));
    let (y0, y1) = padded_range(ys);

    let mut ctx = ChartBuilder::on(area)
        .caption(&chart.title, text(26.0))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| e.to_string())?;
    ctx.configure_mesh()
        .x_labels(12)
        .x_label_formatter(&|x| if x.fract() == 0.0 { format!("{x:.0}") } else { format!("{x:.1}") })
        .x_desc("iteration")
        .y_desc(chart.y_label.as_str())
        .label_style(text(16.0))
        .axis_desc_style(text(18.0))
        .light_line_style(BLACK.mix(0.06))
        .draw()
        .map_err(|e| e.to_string())?;

    let count = chart.series.len();
    for (i, series) in chart.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        // Earlier curves are drawn wider, so a curve equal to a later one still shows around it.
        let width = 2 + 3 * (count - 1 - i) as u32;
        let radius = 3 + 3 * (count - 1 - i) as i32;
        let finite: Vec<(f64, f64)> = series.points.iter().copied().filter(|p| p.1.is_finite()).collect();
        if series.band.len() >= 2 {
            let mut outline: Vec<(f64, f64)> = series.band.iter().map(|&(x, _, hi)| (x, hi)).collect();
            outline.extend(series.band.iter().rev().map(|&(x, lo, _)| (x, lo)));
            ctx.draw_series(std::iter::once(Polygon::new(outline, color.mix(0.15).filled())))
                .map_err(|e| e.to_string())?;
        }
        ctx.draw_series(LineSeries::new(finite.iter().copied(), color.stroke_width(width)))
            .map_err(|e| e.to_string())?
            .label(series.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(3)));
        // Markers, so short runs (one or two iterations) are visible.
        if finite.len() <= 60 {
            ctx.draw_series(finite.iter().map(|&p| Circle::new(p, radius, color.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    // A single curve is named by the title; several get a legend, in the upper corner the
    // curves leave freer (right when they start high and fall, left otherwise).
    if chart.series.len() < 2 {
        return Ok(());
    }
    let position = if starts_higher_than_it_ends(chart) {
        SeriesLabelPosition::UpperRight
    } else {
        SeriesLabelPosition::UpperLeft
    };
    ctx.configure_series_labels()
        .position(position)
        .label_font(text(15.0))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Whether the chart's finite values in the first quarter of iterations average above those in
/// the last quarter.
fn starts_higher_than_it_ends(chart: &Chart) -> bool {
    let points: Vec<(f64, f64)> =
        chart.series.iter().flat_map(|s| s.points.iter().copied()).filter(|p| p.1.is_finite()).collect();
    let (x0, x1) = padded_range(points.iter().map(|p| p.0));
    let quarter = (x1 - x0) / 4.0;
    let mean = |keep: &dyn Fn(f64) -> bool| {
        let values: Vec<f64> = points.iter().filter(|p| keep(p.0)).map(|p| p.1).collect();
        values.iter().sum::<f64>() / values.len().max(1) as f64
    };
    mean(&|x| x <= x0 + quarter) > mean(&|x| x >= x1 - quarter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::run::metrics::MetricsWriter;

    fn record(iteration: u64) -> IterationMetrics {
        let t = iteration as f64;
        IterationMetrics {
            iteration,
            mean_return: [(0, t * 0.4), (1, t * 0.3 + 0.5)].into_iter().collect(),
            std_return: [(0, 0.5), (1, 0.25)].into_iter().collect(),
            invalid_rate: 0.8 / (1.0 + t),
            loss: 1.0 / (1.0 + t),
            grad_norm: [("agent_0".to_string(), 2.0 - t * 0.1), ("agent_1".to_string(), 1.0)].into_iter().collect(),
            lr: 1e-4,
            tokens_per_second: 100.0,
            seconds: 1.0,
            extra: Default::default(),
        }
    }

    #[test]
    fn curves_follow_the_records() {
        let records: Vec<_> = (1..=3).map(record).collect();
        let charts = learning_curves(&records);
        let stems: Vec<_> = charts.iter().map(|c| c.file_stem).collect();
        assert_eq!(stems, ["mean_return", "invalid_rate", "loss", "grad_norm"]);
        let returns = &charts[0].series;
        assert_eq!(returns.len(), 2);
        assert_eq!(returns[1].name, "agent 1");
        assert_eq!(returns[1].points, vec![(1.0, 0.8), (2.0, 1.1), (3.0, 1.4)]);
        assert_eq!(returns[0].band[0], (1.0, 0.4 - 0.5, 0.4 + 0.5));
        assert_eq!(charts[2].series[0].points, vec![(1.0, 0.5), (2.0, 1.0 / 3.0), (3.0, 0.25)]);
        let grad_names: Vec<_> = charts[3].series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(grad_names, ["agent_0", "agent_1"], "gradient norms are per adapter");
        assert!(charts[3].series[0].band.is_empty());
        assert!(!starts_higher_than_it_ends(&charts[0]), "returns rise");
        assert!(starts_higher_than_it_ends(&charts[1]), "the invalid rate falls");
    }

    #[test]
    fn the_score_chart_shows_training_and_held_out_scores() {
        let mut records: Vec<_> = (1..=4).map(record).collect();
        for r in &mut records {
            r.extra.insert("score".into(), r.iteration as f64 * 0.1);
        }
        records[1].extra.insert("eval_score".into(), 0.5);
        records[1].extra.insert("eval_score_stderr".into(), 0.25);
        records[3].extra.insert("eval_score".into(), 1.5);
        records[3].extra.insert("eval_score_stderr".into(), 0.0);
        let charts = learning_curves(&records);
        let stems: Vec<_> = charts.iter().map(|c| c.file_stem).collect();
        assert_eq!(stems, ["mean_return", "score", "invalid_rate", "loss", "grad_norm"]);
        let held_out = &charts[1].series[1];
        assert_eq!(held_out.name, "held-out games");
        assert_eq!(held_out.points, vec![(2.0, 0.5), (4.0, 1.5)]);
        assert_eq!(held_out.band, vec![(2.0, 0.25, 0.75)], "a band where the standard error is known");
        assert_eq!(charts[1].series[0].points.len(), 4);
    }

    #[test]
    fn a_run_without_invalid_replies_has_no_invalid_rate_panel() {
        let records: Vec<_> = (1..=3).map(|i| IterationMetrics { invalid_rate: 0.0, ..record(i) }).collect();
        let stems: Vec<_> = learning_curves(&records).iter().map(|c| c.file_stem).collect();
        assert_eq!(stems, ["mean_return", "loss", "grad_norm"]);
    }

    #[test]
    fn equal_curves_both_show() {
        // Agent 0's curve equals agent 1's, which is drawn after it: agent 0's colour must
        // still be visible in the picture (it is drawn wider, beneath).
        let records: Vec<_> = (1..=4)
            .map(|i| {
                let mut r = record(i);
                r.mean_return = [(0, 1.0 + i as f64), (1, 1.0 + i as f64)].into_iter().collect();
                r
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        plot_metrics(&records, dir.path()).unwrap();
        let png = std::fs::read(dir.path().join("mean_return.png")).unwrap();
        let decoded = image_pixels(&png);
        let colour = |i: usize| {
            let c = Palette99::pick(i).to_rgba();
            (c.0, c.1, c.2)
        };
        // Pixels of about the agent's colour (anti-aliasing blends the edges); the legend's
        // swatch alone is about 70.
        let near = |p: (u8, u8, u8), c: (u8, u8, u8)| {
            p.0.abs_diff(c.0) as u32 + p.1.abs_diff(c.1) as u32 + p.2.abs_diff(c.2) as u32 <= 60
        };
        for agent in 0..2 {
            let count = decoded.iter().filter(|&&p| near(p, colour(agent))).count();
            assert!(count > 500, "agent {agent}'s colour: {count} pixels");
        }
    }

    /// The RGB pixels of a PNG.
    fn image_pixels(png: &[u8]) -> Vec<(u8, u8, u8)> {
        let image = image::load_from_memory(png).unwrap().to_rgb8();
        image.pixels().map(|p| (p[0], p[1], p[2])).collect()
    }

    #[test]
    fn ranges_are_padded() {
        assert_eq!(padded_range([f64::NAN].into_iter()), (0.0, 1.0));
        assert_eq!(padded_range([2.0, 2.0].into_iter()), (1.8, 2.2));
        assert_eq!(padded_range([0.0, 10.0, f64::INFINITY].into_iter()), (-0.5, 10.5));
    }

    #[test]
    fn plots_a_run_directory_to_png() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = MetricsWriter::open(dir.path()).unwrap();
        for i in 1..=4 {
            let mut r = record(i);
            if i == 3 {
                r.loss = f64::NAN; // skipped, not fatal
            }
            writer.append(&r).unwrap();
        }
        let written = plot_run(dir.path()).unwrap();
        let names: Vec<_> = written.iter().map(|p| p.file_name().unwrap().to_str().unwrap().to_string()).collect();
        assert_eq!(names, ["mean_return.png", "invalid_rate.png", "loss.png", "grad_norm.png", "learning_curves.png"]);
        for path in &written {
            let bytes = std::fs::read(path).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
            assert!(bytes.len() > 5_000, "{} is suspiciously small", path.display());
        }
        let leftovers: Vec<_> = std::fs::read_dir(dir.path().join(PLOTS_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    }

    #[test]
    fn an_empty_run_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = plot_run(dir.path()).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl"), "{err}");
        std::fs::write(metrics_path(dir.path()), "{\"iteration\": 1, \"mea").unwrap();
        let err = plot_run(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no complete metrics line"), "{err}");
    }
}
