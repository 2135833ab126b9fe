//! Makes the classification data set of the README's training demo: 28×28 images of
//! seven-segment digits 0–9 (784 features, like MNIST, so `models/mlp.yaml` takes them
//! as they are), each drawn with a random size, position, slant, stroke width and
//! brightness, plus pixel noise. Seeded: the same files on every machine.
//!
//! ```text
//! cargo run --release --example make_digits -- data/digits   # train_x/y.npy, test_x/y.npy
//! ```

use graphrun::rng::Rng;
use graphrun::Tensor;
use std::path::PathBuf;

const SIDE: usize = 28;

/// Segments a–g of each digit: top, upper right, lower right, bottom, lower left,
/// upper left, middle.
const SEGMENTS: [&str; 10] = [
    "abcdef", "bc", "abged", "abgcd", "fgbc", "afgcd", "afgedc", "abc", "abcdefg", "abcdfg",
];

/// Distance from p to the segment a–b.
fn dist(p: (f64, f64), a: (f64, f64), b: (f64, f64)) -> f64 {
    let (dx, dy) = (b.0 - a.0, b.1 - a.1);
    let len2 = dx * dx + dy * dy;
    let t = if len2 > 0.0 {
        (((p.0 - a.0) * dx + (p.1 - a.1) * dy) / len2).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let (qx, qy) = (a.0 + t * dx, a.1 + t * dy);
    ((p.0 - qx).powi(2) + (p.1 - qy).powi(2)).sqrt()
}

fn draw(digit: usize, r: &mut Rng, img: &mut [f32]) {
    let w = r.uniform_in(8.0, 14.0);
    let h = r.uniform_in(14.0, 22.0);
    let x0 = r.uniform_in(2.0, SIDE as f64 - 2.0 - w);
    let y0 = r.uniform_in(2.0, SIDE as f64 - 2.0 - h);
    let slant = r.uniform_in(-0.25, 0.25);
    let half = r.uniform_in(0.6, 1.6);
    let ink = r.uniform_in(0.6, 1.0);
    // Corners of the glyph, slanted about its middle row.
    let pt = |u: f64, v: f64| (x0 + u * w + slant * (0.5 - v) * h, y0 + v * h);
    let (tl, tr, ml, mr, bl, br) = (
        pt(0.0, 0.0),
        pt(1.0, 0.0),
        pt(0.0, 0.5),
        pt(1.0, 0.5),
        pt(0.0, 1.0),
        pt(1.0, 1.0),
    );
    let segs: Vec<((f64, f64), (f64, f64))> = SEGMENTS[digit]
        .chars()
        .map(|s| match s {
            'a' => (tl, tr),
            'b' => (tr, mr),
            'c' => (mr, br),
            'd' => (bl, br),
            'e' => (ml, bl),
            'f' => (tl, ml),
            _ => (ml, mr),
        })
        .collect();
    for y in 0..SIDE {
        for x in 0..SIDE {
            let p = (x as f64 + 0.5, y as f64 + 0.5);
            let d = segs
                .iter()
                .map(|&(a, b)| dist(p, a, b))
                .fold(f64::INFINITY, f64::min);
            // Anti-aliased stroke edge, then noise.
            let v = ink * (half + 0.5 - d).clamp(0.0, 1.0) + 0.15 * r.normal();
            img[y * SIDE + x] = v as f32;
        }
    }
}

fn make(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut r = Rng::new(seed);
    let mut x = vec![0f32; n * SIDE * SIDE];
    let mut y = vec![0i64; n];
    for (i, img) in x.chunks_mut(SIDE * SIDE).enumerate() {
        let d = r.int_in(0, 10) as usize;
        y[i] = d as i64;
        draw(d, &mut r, img);
    }
    (
        Tensor::from_vec(&[n, SIDE * SIDE], x).expect("sized"),
        Tensor::from_vec(&[n], y).expect("sized"),
    )
}

fn main() -> graphrun::Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "data/digits".into()),
    );
    std::fs::create_dir_all(&dir).map_err(|e| graphrun::Error::io(&dir, e))?;
    for (name, n, seed) in [("train", 20_000, 1), ("test", 4_000, 2)] {
        let (x, y) = make(n, seed);
        x.write_npy(&dir.join(format!("{name}_x.npy")))?;
        y.write_npy(&dir.join(format!("{name}_y.npy")))?;
        println!(
            "{}: {n} images",
            dir.join(format!("{name}_x.npy")).display()
        );
    }
    Ok(())
}
