//! Im2Col, Col2Im, MaxPool and its gradient on the host (`common::WindowGeom` says where
//! each window entry reads).

use super::super::common::{self, WindowGeom};
use crate::error::Result;
use crate::graph::Node;
use crate::tensor::{Elem, Float, Tensor};
use num_traits::Zero;
use rayon::prelude::*;

fn read(ins: &[Option<&Tensor>], i: usize) -> Result<Option<Vec<i64>>> {
    Ok(ins.get(i).copied().flatten().map(Tensor::to_i64_vec))
}

/// Per axis, where kernel offset jd and output position od read (`jd · out + od`): the
/// position on that axis, or `PAD` / `BEYOND`.
pub(super) fn axis_tables(g: &WindowGeom) -> [Vec<i64>; 3] {
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

/// Calls `f(i, s)` for each output position `i` of kernel offset `j`'s row, walking the
/// axes from the per-axis tables (no division per element): `s` is the image's flat
/// spatial offset, or `PAD` / `BEYOND` (past the padding on any axis wins over padding).
#[inline]
pub(super) fn walk_row(
    g: &WindowGeom,
    tabs: &[Vec<i64>; 3],
    j: usize,
    mut f: impl FnMut(usize, i64),
) {
    let [_, h1, h2] = g.image.map(|d| d as i64);
    let [o0, o1, o2] = g.out;
    let [_, k1, k2] = g.kernel;
    let (j0, j1, j2) = (j / (k1 * k2), (j / k2) % k1, j % k2);
    let (t0, t1, t2) = (
        &tabs[0][j0 * o0..][..o0],
        &tabs[1][j1 * o1..][..o1],
        &tabs[2][j2 * o2..][..o2],
    );
    let mut i = 0;
    for &p0 in t0 {
        for &p1 in t1 {
            for &p2 in t2 {
                let beyond = WindowGeom::BEYOND;
                f(
                    i,
                    if p0 == beyond || p1 == beyond || p2 == beyond {
                        beyond
                    } else if p0 < 0 || p1 < 0 || p2 < 0 {
                        WindowGeom::PAD
                    } else {
                        (p0 * h1 + p1) * h2 + p2
                    },
                );
                i += 1;
            }
        }
    }
}

/// Im2Col: out[n, c·K + j, o] = x[n, c, source(j, o)], or the pad / beyond value; a task
/// per row (n, c, j).
pub fn im2col(node: &Node, x: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let g = common::window_geom(node, x.shape(), |i| read(ins, i))?;
    let [pad_value, beyond_value] = g.fill;
    let tabs = axis_tables(&g);
    let (hw, k, l) = (g.hw(), g.k(), g.l());
    crate::with_any!(x.dtype(), T => {
        let (pad, beyond) = (T::from_f64(pad_value), T::from_f64(beyond_value));
        let xs = x.as_slice::<T>();
        out.as_mut_slice::<T>()
            .par_chunks_mut(l.max(1))
            .enumerate()
            .for_each(|(row, o)| {
                let img = &xs[(row / k) * hw..(row / k + 1) * hw];
                walk_row(&g, &tabs, row % k, |i, s| {
                    o[i] = match s {
                        WindowGeom::PAD => pad,
                        WindowGeom::BEYOND => beyond,
                        s => img[s as usize],
                    }
                });
            });
    });
    Ok(())
}

/// Col2Im: each image element the sum of the column entries that read it, in a fixed
/// order (kernel offset, then output position).
pub fn col2im(node: &Node, cols: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let g = common::window_geom(node, out.shape(), |i| read(ins, i))?;
    let tabs = axis_tables(&g);
    let (hw, k, l) = (g.hw(), g.k(), g.l());
    crate::with_float!(out.dtype(), T => {
        let cs = cols.as_slice::<T>();
        out.as_mut_slice::<T>()
            .par_chunks_mut(hw.max(1))
            .enumerate()
            .for_each(|(plane, img)| {
                let mut acc = vec![<<T as Float>::Acc as Zero>::zero(); hw];
                for j in 0..k {
                    let row = &cs[(plane * k + j) * l..][..l];
                    walk_row(&g, &tabs, j, |i, s| {
                        if s >= 0 {
                            acc[s as usize] += row[i].to_acc();
                        }
                    });
                }
                img.iter_mut().zip(acc).for_each(|(o, a)| *o = T::from_acc(a));
            });
        Ok(())
    }, _ => crate::bail!(Runtime, "{}: Col2Im takes floating tensors, got {}", node.describe(), out.dtype()))
}

/// For each output position of one plane's windows, the image offset (within the plane)
/// of the first element in window order holding the window's maximum (the first NaN, if
/// any), and that value; -1 and -inf where the window reads none of the image.
fn window_max<T: Float>(g: &WindowGeom, tabs: &[Vec<i64>; 3], img: &[T]) -> (Vec<i64>, Vec<T::Acc>)
where
    T::Acc: num_traits::Float,
{
    let l = g.l();
    let mut at = vec![-1i64; l];
    let mut best = vec![<T::Acc as num_traits::Float>::neg_infinity(); l];
    for j in 0..g.k() {
        walk_row(g, tabs, j, |i, s| {
            if s >= 0 {
                let v = img[s as usize].to_acc();
                let b = best[i];
                if at[i] < 0
                    || v > b
                    || (num_traits::Float::is_nan(v) && !num_traits::Float::is_nan(b))
                {
                    best[i] = v;
                    at[i] = s;
                }
            }
        });
    }
    (at, best)
}

/// MaxPool: each window's maximum (NaN where it holds one, -inf where it reads none of the
/// image); a task per plane (n, c).
pub fn max_pool(node: &Node, x: &Tensor, out: &mut Tensor) -> Result<()> {
    let g = common::window_geom(node, x.shape(), |_| Ok(None))?;
    let tabs = axis_tables(&g);
    let (hw, l) = (g.hw(), g.l());
    crate::with_float!(x.dtype(), T => {
        let xs = x.as_slice::<T>();
        out.as_mut_slice::<T>()
            .par_chunks_mut(l.max(1))
            .enumerate()
            .for_each(|(plane, o)| {
                let (_, best) = window_max(&g, &tabs, &xs[plane * hw..][..hw]);
                o.iter_mut().zip(best).for_each(|(o, b)| *o = T::from_acc(b));
            });
        Ok(())
    }, _ => crate::bail!(Runtime, "{}: MaxPool takes floating tensors, got {}", node.describe(), x.dtype()))
}

/// MaxPoolGrad: dX, each window's dY added at its maximum's first position; summed per
/// plane in output order.
pub fn max_pool_grad(node: &Node, dy: &Tensor, x: &Tensor, out: &mut Tensor) -> Result<()> {
    let g = common::window_geom(node, x.shape(), |_| Ok(None))?;
    let tabs = axis_tables(&g);
    let (hw, l) = (g.hw(), g.l());
    crate::with_float!(x.dtype(), T => {
        let (xs, dys) = (x.as_slice::<T>(), dy.as_slice::<T>());
        out.as_mut_slice::<T>()
            .par_chunks_mut(hw.max(1))
            .enumerate()
            .for_each(|(plane, dx)| {
                let (at, _) = window_max(&g, &tabs, &xs[plane * hw..][..hw]);
                let mut acc = vec![<<T as Float>::Acc as Zero>::zero(); hw];
                for (&s, d) in at.iter().zip(&dys[plane * l..][..l]) {
                    if s >= 0 {
                        acc[s as usize] += d.to_acc();
                    }
                }
                dx.iter_mut().zip(acc).for_each(|(o, a)| *o = T::from_acc(a));
            });
        Ok(())
    }, _ => crate::bail!(Runtime, "{}: MaxPoolGrad takes floating tensors, got {}", node.describe(), x.dtype()))
}
