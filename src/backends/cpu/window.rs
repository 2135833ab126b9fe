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

/// Im2Col: out[n, c·K + j, o] = x[n, c, source(j, o)], or the pad / beyond value.
pub fn im2col(node: &Node, x: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    let g = common::window_geom(node, x.shape(), |i| read(ins, i))?;
    let [pad_value, beyond_value] = g.fill;
    let src = table(&g);
    let (hw, kl) = (g.hw(), g.k() * g.l());
    crate::with_any!(x.dtype(), T => {
        let (pad, beyond) = (T::from_f64(pad_value), T::from_f64(beyond_value));
        let xs = x.as_slice::<T>();
        out.as_mut_slice::<T>()
            .par_chunks_mut(kl.max(1))
            .enumerate()
            .for_each(|(plane, o)| {
                let img = &xs[plane * hw..(plane + 1) * hw];
                for (v, &s) in o.iter_mut().zip(&src) {
                    *v = match s {
                        WindowGeom::PAD => pad,
                        WindowGeom::BEYOND => beyond,
                        s => img[s as usize],
                    };
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
