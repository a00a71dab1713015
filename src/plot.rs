//! A small line chart rendered to PNG, for the benchmark sweeps: no plotting library, no fonts
//! on the system — a 5×7 bitmap font and straight lines are all a tok/s-vs-context plot needs.

/// One line of the chart.
pub struct Series {
    pub name: String,
    pub color: [u8; 3],
    /// (x, y) points; x > 0 (the x axis is logarithmic, base 2).
    pub points: Vec<(f64, f64)>,
}

/// A chart with a log₂ x axis and a linear y axis from 0.
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

const W: usize = 900;
const H: usize = 560;
const LEFT: usize = 90;
const RIGHT: usize = 240;
const TOP: usize = 50;
const BOTTOM: usize = 70;

/// Distinct colours for up to eight series.
pub const PALETTE: [[u8; 3]; 8] = [
    [31, 119, 180],
    [214, 39, 40],
    [44, 160, 44],
    [255, 127, 14],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [23, 190, 207],
];

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < W && (y as usize) < H {
            let i = 3 * (y as usize * W + x as usize);
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }
    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: [u8; 3], width: i64) {
        let steps = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as i64).max(1);
        for s in 0..=steps {
            let t = s as f64 / steps as f64;
            let (x, y) = (
                (x0 + t * (x1 - x0)).round() as i64,
                (y0 + t * (y1 - y0)).round() as i64,
            );
            for dx in -(width / 2)..=(width / 2) {
                for dy in -(width / 2)..=(width / 2) {
                    self.set(x + dx, y + dy, c);
                }
            }
        }
    }
    fn text(&mut self, x: i64, y: i64, s: &str, c: [u8; 3], scale: i64) {
        for (i, ch) in s.chars().enumerate() {
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0x10 >> col) != 0 {
                        for sx in 0..scale {
                            for sy in 0..scale {
                                self.set(
                                    x + (i as i64 * 6 + col) * scale + sx,
                                    y + row as i64 * scale + sy,
                                    c,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

fn text_width(s: &str, scale: i64) -> i64 {
    s.chars().count() as i64 * 6 * scale
}

/// A "nice" step for about `n` ticks over `0..max`.
fn tick_step(max: f64, n: f64) -> f64 {
    let raw = max / n;
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

fn fmt_num(v: f64) -> String {
    if v >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if v >= 1e3 {
        format!("{}K", trim(v / 1e3))
    } else {
        trim(v)
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.1}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

impl Chart {
    /// Renders the chart as PNG bytes.
    pub fn to_png(&self) -> Vec<u8> {
        let mut cv = Canvas {
            px: vec![255; W * H * 3],
        };
        let black = [0, 0, 0];
        let grey = [220, 220, 220];
        let all: Vec<(f64, f64)> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().copied())
            .filter(|p| p.0 > 0.0)
            .collect();
        let (xmin, xmax) = all.iter().fold((f64::MAX, f64::MIN), |(a, b), p| {
            (a.min(p.0.log2()), b.max(p.0.log2()))
        });
        let (xmin, xmax) = if all.is_empty() {
            (0.0, 1.0)
        } else if xmax > xmin {
            (xmin, xmax)
        } else {
            (xmin - 1.0, xmax + 1.0)
        };
        let ymax = all.iter().fold(0f64, |m, p| m.max(p.1)).max(1e-9) * 1.08;
        let (pw, ph) = ((W - LEFT - RIGHT) as f64, (H - TOP - BOTTOM) as f64);
        let sx = |x: f64| LEFT as f64 + (x.log2() - xmin) / (xmax - xmin) * pw;
        let sy = |y: f64| TOP as f64 + ph - y / ymax * ph;

        // Grid and y ticks.
        let step = tick_step(ymax, 6.0);
        let mut y = 0.0;
        while y <= ymax {
            cv.line((LEFT as f64, sy(y)), (LEFT as f64 + pw, sy(y)), grey, 1);
            let label = fmt_num(y);
            cv.text(
                LEFT as i64 - 8 - text_width(&label, 1),
                sy(y) as i64 - 3,
                &label,
                black,
                1,
            );
            y += step;
        }
        // x ticks at the distinct x values.
        let mut xs: Vec<f64> = all.iter().map(|p| p.0).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        for &x in &xs {
            cv.line((sx(x), TOP as f64), (sx(x), TOP as f64 + ph), grey, 1);
            let label = fmt_num(x);
            cv.text(
                sx(x) as i64 - text_width(&label, 1) / 2,
                (TOP as f64 + ph) as i64 + 8,
                &label,
                black,
                1,
            );
        }
        // Axes.
        cv.line(
            (LEFT as f64, TOP as f64),
            (LEFT as f64, TOP as f64 + ph),
            black,
            1,
        );
        cv.line(
            (LEFT as f64, TOP as f64 + ph),
            (LEFT as f64 + pw, TOP as f64 + ph),
            black,
            1,
        );
        // Lines, points and legend.
        for (i, s) in self.series.iter().enumerate() {
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|p| p.0 > 0.0)
                .map(|&(x, y)| (sx(x), sy(y)))
                .collect();
            for w in pts.windows(2) {
                cv.line(w[0], w[1], s.color, 3);
            }
            for &p in &pts {
                cv.line((p.0 - 3.0, p.1), (p.0 + 3.0, p.1), s.color, 5);
            }
            let ly = TOP as i64 + 10 + 22 * i as i64;
            let lx = (LEFT as f64 + pw) as i64 + 20;
            cv.line(
                (lx as f64, ly as f64 + 6.0),
                (lx as f64 + 24.0, ly as f64 + 6.0),
                s.color,
                4,
            );
            cv.text(lx + 32, ly + 3, &s.name, black, 1);
        }
        cv.text(
            (W as i64 - text_width(&self.title, 2)) / 2,
            14,
            &self.title,
            black,
            2,
        );
        cv.text(
            LEFT as i64 + (pw as i64 - text_width(&self.x_label, 2)) / 2,
            H as i64 - 30,
            &self.x_label,
            black,
            2,
        );
        cv.text(8, TOP as i64 - 22, &self.y_label, black, 2);

        let mut out = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut out, W as u32, H as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut writer = enc.write_header().expect("PNG header to a Vec");
            writer.write_image_data(&cv.px).expect("PNG data to a Vec");
        }
        out
    }
}

/// 5×7 glyphs, one byte per row, bit 4 = leftmost column. Lower case draws as upper case;
/// unknown characters as a small box.
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        ' ' => [0; 7],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        '/' => [0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '+' => [0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        '@' => [0x0E, 0x11, 0x17, 0x15, 0x17, 0x10, 0x0E],
        _ => [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F],
    }
}
