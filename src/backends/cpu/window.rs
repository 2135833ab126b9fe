//! Im2Col and Col2Im on the host (`common::WindowGeom` says where each column entry
//! reads).

use super::super::common::{self, WindowGeom};
use crate::error::Result;
use crate::graph::Node;
use crate::tensor::{Elem, Float, Tensor};
use num_traits::Zero;
use rayon::prelude::*;

fn read(ins: &[Option<&Tensor>], i: usize) -> Result<Option<Vec<i64>>> {
    Ok(ins.get(i).copied().flatten().map(Tensor::to_i64_vec))
}

/// The per-(kernel offset, output position) source table: one row of K·L entries serves
/// every (n, c) plane.
fn table(g: &WindowGeom) -> Vec<i64> {
    let l = g.l();
    (0..g.k() * l).map(|i| g.source(i / l, i % l)).collect()
}

/// Per axis, where kernel offset jd and output position od read (`jd · out + od`): the
/// position on that axis, or `PAD` / `BEYOND`.
fn axis_tables(g: &WindowGeom) -> [Vec<i64>; 3] {
    std::array::from_fn(|d| {
        let (n, size) = (g.out[d], g.image[d] as i64);
        (0..g.kernel[d] * n)
            .map(|i| {
                let p =
                    ((i % n) * g.strides[d] + (i / n) * g.dilations[d]) as i64 - g.begin[d] as i64;
                if p >= size + g.end[d] as i64 {
                    WindowGeom::BEYOND
                } else if p < 0 || p >= size {
                    WindowGeom::PAD
                } else {
                    p
                }
            })
            .collect()
    })
}

/// Im2Col: out[n, c·K + j, o] = x[n, c, source(j, o)], or the pad / beyond value. A row
/// (n, c, j) walks its output positions axis by axis from small per-axis tables, with no
/// division per element.
pub fn im2col(node: &Node, x: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let g = common::window_geom(node, x.shape(), |i| read(ins, i))?;
    let [pad_value, beyond_value] = g.fill;
    let tabs = axis_tables(&g);
    let (hw, k, l) = (g.hw(), g.k(), g.l());
    let [_, h1, h2] = g.image;
    let [o0, o1, o2] = g.out;
    let [_, k1, k2] = g.kernel;
    crate::with_any!(x.dtype(), T => {
        let (pad, beyond) = (T::from_f64(pad_value), T::from_f64(beyond_value));
        let xs = x.as_slice::<T>();
        out.as_mut_slice::<T>()
            .par_chunks_mut(l.max(1))
            .enumerate()
            .for_each(|(row, o)| {
                let (plane, j) = (row / k, row % k);
                let img = &xs[plane * hw..(plane + 1) * hw];
                let (j0, j1, j2) = (j / (k1 * k2), (j / k2) % k1, j % k2);
                let (t0, t1, t2) = (&tabs[0][j0 * o0..][..o0], &tabs[1][j1 * o1..][..o1], &tabs[2][j2 * o2..][..o2]);
                let mut i = 0;
                for &p0 in t0 {
                    for &p1 in t1 {
                        for &p2 in t2 {
                            o[i] = if p0 == WindowGeom::BEYOND || p1 == WindowGeom::BEYOND || p2 == WindowGeom::BEYOND {
                                beyond
                            } else if p0 < 0 || p1 < 0 || p2 < 0 {
                                pad
                            } else {
                                img[((p0 as usize) * h1 + p1 as usize) * h2 + p2 as usize]
                            };
                            i += 1;
                        }
                    }
                }
            });
    });
    Ok(())
}

/// Col2Im: each image element the sum of the column entries that read it, in a fixed
/// order (kernel offset, then output position).
pub fn col2im(node: &Node, cols: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let g = common::window_geom(node, out.shape(), |i| read(ins, i))?;
    let src = table(&g);
    let (hw, kl) = (g.hw(), g.k() * g.l());
    crate::with_float!(out.dtype(), T => {
        let cs = cols.as_slice::<T>();
        out.as_mut_slice::<T>()
            .par_chunks_mut(hw.max(1))
            .enumerate()
            .for_each(|(plane, img)| {
                let mut acc = vec![<<T as Float>::Acc as Zero>::zero(); hw];
                for (&v, &s) in cs[plane * kl..(plane + 1) * kl].iter().zip(&src) {
                    if s >= 0 {
                        acc[s as usize] += v.to_acc();
                    }
                }
                img.iter_mut().zip(acc).for_each(|(o, a)| *o = T::from_acc(a));
            });
        Ok(())
    }, _ => crate::bail!(Runtime, "{}: Col2Im takes floating tensors, got {}", node.describe(), out.dtype()))
}
