//! `bench-report --results DIR --out DIR`: reads `<server>-c<conc>-r<round>.json`
//! files written by `pagoda bench serve` (see bench/compare.sh), takes the
//! median over rounds, and writes `compare.md` (a table) and `compare.png`
//! (output throughput against concurrency, and TTFT p50/p99).

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Figures of one server at one concurrency, medians over rounds.
#[derive(Debug, Default, Clone)]
struct Point {
    throughput: f64,
    ttft_p50: f64,
    ttft_p99: f64,
    tpot_p50: f64,
    itl_p50: f64,
    failed: f64,
    rounds: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// server → concurrency → point
type Table = BTreeMap<String, BTreeMap<u32, Point>>;

fn load(dir: &Path) -> Result<Table> {
    let mut raw: BTreeMap<(String, u32), Vec<Value>> = BTreeMap::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
        let p = e?.path();
        let Some(stem) = p.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if p.extension().is_none_or(|x| x != "json") {
            continue;
        }
        // <server>-c<conc>-r<round>
        let parts: Vec<&str> = stem.rsplitn(3, '-').collect();
        if parts.len() != 3 || !parts[0].starts_with('r') || !parts[1].starts_with('c') {
            continue;
        }
        let conc: u32 = parts[1][1..]
            .parse()
            .with_context(|| format!("{}: bad concurrency", p.display()))?;
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&p)?)
            .with_context(|| format!("{}: not JSON", p.display()))?;
        raw.entry((parts[2].to_string(), conc)).or_default().push(v);
    }
    if raw.is_empty() {
        bail!("{}: no <server>-c<N>-r<K>.json result files", dir.display());
    }
    let mut t = Table::new();
    for ((server, conc), runs) in raw {
        let f = |k: &str| median(runs.iter().filter_map(|r| r[k].as_f64()).collect());
        t.entry(server).or_default().insert(
            conc,
            Point {
                throughput: f("output_throughput"),
                ttft_p50: f("median_ttft_ms"),
                ttft_p99: f("p99_ttft_ms"),
                tpot_p50: f("median_tpot_ms"),
                itl_p50: f("median_itl_ms"),
                failed: f("failed"),
                rounds: runs.len(),
            },
        );
    }
    Ok(t)
}

fn markdown(t: &Table) -> String {
    let mut s = String::from(
        "| server | concurrency | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) | failed | rounds |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (server, points) in t {
        for (c, p) in points {
            s.push_str(&format!(
                "| {server} | {c} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {} |\n",
                p.throughput, p.ttft_p50, p.ttft_p99, p.tpot_p50, p.itl_p50, p.failed, p.rounds
            ));
        }
    }
    // Ratios against every other server, per concurrency.
    if let Some(ours) = t.get("pagoda") {
        for (peer, points) in t.iter().filter(|(k, _)| k.as_str() != "pagoda") {
            s.push_str(&format!("\nThroughput ratio pagoda / {peer}:"));
            for (c, p) in points {
                if let Some(o) = ours.get(c) {
                    s.push_str(&format!(" c={c}: {:.2}×;", o.throughput / p.throughput));
                }
            }
            s.push('\n');
        }
    }
    s
}

fn chart(t: &Table, out: &Path) -> Result<()> {
    let font = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ]
    .iter()
    .find_map(|p| std::fs::read(p).ok())
    .context("no DejaVuSans.ttf found: apt-get install fonts-dejavu-core")?;
    // plotters keeps registered fonts for the life of the process.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::anyhow!("cannot register the chart font"))?;
    let root = BitMapBackend::new(out, (1200, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(600);
    let max_c = t
        .values()
        .flat_map(|p| p.keys())
        .copied()
        .max()
        .unwrap_or(16) as f64;
    let colors = [
        RGBColor(200, 60, 40),
        RGBColor(40, 90, 200),
        RGBColor(40, 160, 80),
        RGBColor(150, 80, 180),
    ];
    let max_tp = t
        .values()
        .flat_map(|p| p.values())
        .map(|p| p.throughput)
        .fold(0.0, f64::max)
        * 1.15;
    let mut c1 = ChartBuilder::on(&left)
        .caption("Output throughput (tok/s)", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..max_c * 1.05, 0.0..max_tp.max(1.0))?;
    c1.configure_mesh()
        .x_desc("concurrent requests")
        .label_style(("sans-serif", 14))
        .draw()?;
    for (i, (server, points)) in t.iter().enumerate() {
        let color = colors[i % colors.len()];
        let series: Vec<(f64, f64)> = points
            .iter()
            .map(|(c, p)| (*c as f64, p.throughput))
            .collect();
        c1.draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))?
            .label(server.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        c1.draw_series(
            series
                .into_iter()
                .map(|xy| Circle::new(xy, 4, color.filled())),
        )?;
    }
    c1.configure_series_labels()
        .label_font(("sans-serif", 14))
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    let max_ttft = t
        .values()
        .flat_map(|p| p.values())
        .map(|p| p.ttft_p99)
        .fold(0.0, f64::max)
        * 1.15;
    let mut c2 = ChartBuilder::on(&right)
        .caption("TTFT p50 (solid) and p99 (dashed), ms", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_c * 1.05, 0.0..max_ttft.max(1.0))?;
    c2.configure_mesh()
        .x_desc("concurrent requests")
        .label_style(("sans-serif", 14))
        .draw()?;
    for (i, (server, points)) in t.iter().enumerate() {
        let color = colors[i % colors.len()];
        let p50: Vec<(f64, f64)> = points
            .iter()
            .map(|(c, p)| (*c as f64, p.ttft_p50))
            .collect();
        let p99: Vec<(f64, f64)> = points
            .iter()
            .map(|(c, p)| (*c as f64, p.ttft_p99))
            .collect();
        c2.draw_series(LineSeries::new(p50, color.stroke_width(2)))?
            .label(server.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        c2.draw_series(DashedLineSeries::new(p99, 6, 4, color.stroke_width(1)))?;
    }
    c2.configure_series_labels()
        .label_font(("sans-serif", 14))
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    root.present()?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from)
    };
    let results = get("--results").context("usage: bench-report --results DIR --out DIR")?;
    let out = get("--out").context("usage: bench-report --results DIR --out DIR")?;
    std::fs::create_dir_all(&out)?;
    let t = load(&results)?;
    let md = markdown(&t);
    std::fs::write(out.join("compare.md"), &md)?;
    chart(&t, &out.join("compare.png"))?;
    print!("{md}");
    Ok(())
}
