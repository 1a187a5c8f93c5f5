//! The chart: step time and memory per rank against the number of ranks, as SVG.

use std::fmt::Write as _;

use crate::{PLAIN_COLOUR, Report, STAGE_COLOURS, formula};

impl Report {
    /// The whole chart: step time on the left, model state per rank on the right, the legend
    /// beside them, the title above and the machine and dates below.
    pub(crate) fn svg(&self) -> String {
        let (width, height) = (1010.0, 420.0);
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
             viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
        );
        let sizes = self.world_sizes();
        let names = self.names();
        self.time_panel(&mut svg, &sizes, &names);
        self.memory_panel(&mut svg, &sizes, &names);
        self.legend(&mut svg, &names);
        self.captions(&mut svg, width, height);
        svg.push_str("</svg>\n");
        svg
    }

    /// The left panel: each configuration's median step time against N, with plain Burn's
    /// single-rank step as a dashed horizontal line.
    fn time_panel(&self, svg: &mut String, sizes: &[u64], names: &[String]) {
        let time_series: Vec<(String, Vec<(u64, f64)>)> = names
            .iter()
            .map(|name| {
                let points = sizes
                    .iter()
                    .filter_map(|n| self.run(name, *n).map(|r| (*n, r.step_ms)))
                    .filter(|(_, ms)| ms.is_finite())
                    .collect();
                (name.clone(), points)
            })
            .collect();
        let max_time = time_series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, t)| *t))
            .chain(self.plain_ms.map(|(p, _)| p))
            .filter(|t| t.is_finite())
            .fold(0.0, f64::max);
        let left = Panel {
            x: 70.0,
            y: 50.0,
            w: 330.0,
            h: 300.0,
            y_max: nice_ceiling(max_time),
        };
        left.axes(
            svg,
            sizes,
            "step time (ms), lower is better",
            "ranks N (threads on 2 cores)",
        );
        if let Some((plain, _)) = self.plain_ms {
            let y = left.to_y(plain);
            let _ = writeln!(
                svg,
                "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"{PLAIN_COLOUR}\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/>",
                left.x,
                left.x + left.w
            );
        }
        for (name, points) in &time_series {
            left.line(svg, sizes, points, colour(name), false);
        }
    }

    /// The right panel: model state per rank against N, measured (solid) and by the ZeRO
    /// formula (dashed), leaving out the cached stage-3 run (its model state equals stage 3's),
    /// and a remark where stages 1 and 2 measure the same at N = 4.
    fn memory_panel(&self, svg: &mut String, sizes: &[u64], names: &[String]) {
        let psi = self.psi as f64;
        let memory_names: Vec<&String> = names.iter().filter(|n| *n != "stage3_cached").collect();
        let max_memory = self
            .runs
            .iter()
            .map(|r| (r.model_state() as f64).max(formula(r.stage, r.world_size as f64) * psi))
            .fold(0.0, f64::max)
            / 1e6;
        let right = Panel {
            x: 500.0,
            y: 50.0,
            w: 330.0,
            h: 300.0,
            y_max: nice_ceiling(max_memory),
        };
        right.axes(
            svg,
            sizes,
            "model state per rank (MB): measured —, formula - -",
            "ranks N",
        );
        for name in &memory_names {
            let measured: Vec<(u64, f64)> = sizes
                .iter()
                .filter_map(|n| {
                    self.run(name, *n)
                        .map(|r| (*n, r.model_state() as f64 / 1e6))
                })
                .collect();
            let theory: Vec<(u64, f64)> = sizes
                .iter()
                .filter_map(|n| {
                    self.run(name, *n)
                        .map(|r| (*n, formula(r.stage, *n as f64) * psi / 1e6))
                })
                .collect();
            right.line(svg, sizes, &theory, colour(name), true);
            right.line(svg, sizes, &measured, colour(name), false);
        }

        if let (Some(a), Some(b)) = (self.run("stage1", 4), self.run("stage2", 4))
            && a.model_state() == b.model_state()
        {
            let _ = writeln!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" fill=\"#555\">stage 1 measured = stage 2 measured</text>",
                right.x + 5.0,
                right.y + 15.0
            );
        }
    }

    /// The legend right of the panels: plain Burn's dashed line (when measured), then one
    /// coloured line per configuration.
    fn legend(&self, svg: &mut String, names: &[String]) {
        let mut y = 70.0;
        let legend_x = 850.0;
        if self.plain_ms.is_some() {
            let _ = writeln!(
                svg,
                "<line x1=\"{legend_x}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{PLAIN_COLOUR}\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/><text x=\"{}\" y=\"{}\">plain Burn</text>",
                legend_x + 20.0,
                legend_x + 25.0,
                y + 4.0
            );
            y += 20.0;
        }
        for name in names {
            let text = match name.as_str() {
                "stage3" => "stage 3".to_string(),
                "stage3_cached" => "stage 3, cache".to_string(),
                other => other.replace("stage", "stage "),
            };
            let _ = writeln!(
                svg,
                "<line x1=\"{legend_x}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{}\" stroke-width=\"2.5\"/><text x=\"{}\" y=\"{}\">{text}</text>",
                legend_x + 20.0,
                colour(name),
                legend_x + 25.0,
                y + 4.0
            );
            y += 20.0;
        }
    }

    /// The title (model, Ψ and batch) at the top and the machine and measurement dates at the
    /// bottom of a `width` × `height` chart.
    fn captions(&self, svg: &mut String, width: f64, height: f64) {
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"24\" font-size=\"14\" font-weight=\"bold\" text-anchor=\"middle\">burn-zero scaling: GPT {} (Ψ = {}), NdArray f32, global batch {}×{}</text>",
            width / 2.0,
            self.preset,
            self.psi,
            self.batch,
            self.seq
        );
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{}\" font-size=\"11\" fill=\"#555\" text-anchor=\"middle\">{}; {}</text>",
            width / 2.0,
            height - 12.0,
            escape(&self.machine),
            escape(&self.measured)
        );
    }
}

fn colour(name: &str) -> &'static str {
    STAGE_COLOURS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or("#999999", |(_, c)| c)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The smallest of 1, 2, 2.5, 5 or 10 times a power of ten that is at least `value`.
fn nice_ceiling(value: f64) -> f64 {
    if value.is_nan() || value <= 0.0 {
        return 1.0;
    }
    let power = 10f64.powf(value.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .find(|v| *v >= value)
        .unwrap_or(10.0 * power)
}

/// A chart area: ranks on x (evenly spaced), values from 0 to `y_max` on y.
struct Panel {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
    y_max: f64,
}

impl Panel {
    fn to_x(&self, sizes: &[u64], n: u64) -> f64 {
        let i = sizes.iter().position(|s| *s == n).unwrap_or(0) as f64;
        let slots = sizes.len().max(2) as f64 - 1.0;
        self.x + 30.0 + i * (self.w - 60.0) / slots
    }

    fn to_y(&self, value: f64) -> f64 {
        self.y + self.h - value / self.y_max * self.h
    }

    fn axes(&self, svg: &mut String, sizes: &[u64], title: &str, x_label: &str) {
        let (x, y, w, h) = (self.x, self.y, self.w, self.h);
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-weight=\"bold\">{}</text>",
            x,
            y - 10.0,
            escape(title)
        );
        for i in 0..=5 {
            let value = self.y_max * i as f64 / 5.0;
            let ty = self.to_y(value);
            let _ = writeln!(
                svg,
                "<line x1=\"{x:.1}\" y1=\"{ty:.1}\" x2=\"{:.1}\" y2=\"{ty:.1}\" stroke=\"#e5e5e5\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                x + w,
                x - 6.0,
                ty + 4.0,
                trim(value)
            );
        }
        let _ = writeln!(
            svg,
            "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{h:.1}\" fill=\"none\" stroke=\"#999\"/>"
        );
        for n in sizes {
            let tx = self.to_x(sizes, *n);
            let _ = writeln!(
                svg,
                "<text x=\"{tx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{n}</text>",
                y + h + 16.0
            );
        }
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            x + w / 2.0,
            y + h + 34.0,
            escape(x_label)
        );
    }

    fn line(
        &self,
        svg: &mut String,
        sizes: &[u64],
        points: &[(u64, f64)],
        colour: &str,
        dashed: bool,
    ) {
        if points.is_empty() {
            return;
        }
        let path: Vec<String> = points
            .iter()
            .map(|(n, v)| format!("{:.1},{:.1}", self.to_x(sizes, *n), self.to_y(*v)))
            .collect();
        let style = if dashed {
            "stroke-width=\"1.5\" stroke-dasharray=\"5 4\""
        } else {
            "stroke-width=\"2.5\""
        };
        let _ = writeln!(
            svg,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{colour}\" {style}/>",
            path.join(" ")
        );
        if !dashed {
            for (n, v) in points {
                let _ = writeln!(
                    svg,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"{colour}\"/>",
                    self.to_x(sizes, *n),
                    self.to_y(*v)
                );
            }
        }
    }
}

/// A tick label without needless decimals.
fn trim(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}
