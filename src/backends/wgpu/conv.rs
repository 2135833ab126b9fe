//! Conv and ConvGrad on wgpu as batched GEMMs (matmul.rs) over the columns Im2Col lays out
//! in scratch (shape.rs), or over the image itself for a 1×1 stride-1 convolution. The
//! bias rides on the GEMM epilogue's residual term (a per-row value: strides (1, 0)).

use super::elementwise::{binary, map_code};
use super::matmul::{launch, Bufs, Product, ACCUM};
use super::reduce;
use super::shape::{col2im_geom, im2col_geom};
use super::{Wgpu, V};
use crate::backends::common::{self, ConvGeom};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Activation, BinaryOp, Node, ReduceKind};

/// The columns of every image of `x` (`[N, C·K, L]`) in scratch, or `x` itself when the
/// convolution is pointwise.
fn columns(w: &mut Wgpu, node: &Node, cg: &ConvGeom, x: &V) -> Result<wgpu::Buffer> {
    if cg.pointwise() {
        return Ok(x.buf.clone());
    }
    let g = &cg.g;
    let ty = ValueType::new(x.dtype(), &[g.n, g.c * g.k(), g.l()]);
    let buf = w.scratch(ty.bytes().max(16));
    im2col_geom(w, node, g, x, &V { buf: &buf, ty: &ty })?;
    Ok(buf)
}

/// Parts to split a convolution's summed axis into: where its product fills few of the
/// GEMM's 64×64 output tiles over a long sum (ResNet-50's last 3×3 convolutions at batch
/// 1: 8 tiles over 4 608 terms, 1.2 ms each on an H100), the largest divisor of the sum's
/// length that leaves each part 128 terms or more and the parts about 128 workgroups;
/// 1 where the product fills the GPU already.
fn k_parts(tiles: usize, k: usize) -> usize {
    if tiles >= 32 || k < 1024 {
        return 1;
    }
    let most = (128 / tiles).min(64).min(k / 128);
    (1..=most).rev().find(|s| k.is_multiple_of(*s)).unwrap_or(1)
}

/// Y[n, group] = W[group] · columns(X)[n, group] (+ B).
pub fn conv(w: &mut Wgpu, node: &Node, x: &V, wt: &V, b: Option<V>, y: &V) -> Result<()> {
    let cg = common::conv_geom(node, x.shape(), wt.shape())?;
    let (g, l, ckg, mg) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg());
    if y.numel() == 0 {
        return Ok(());
    }
    let cols = columns(w, node, &cg, x)?;
    let tiles = mg.div_ceil(64) * l.div_ceil(64) * g.n * cg.group;
    let parts = if cg.group == 1 {
        k_parts(tiles, ckg)
    } else {
        1
    };
    if parts > 1 {
        return split_conv(w, node, (&cg, parts), (wt, &cols), b, y);
    }
    let mut p = Product::new(x.dtype(), mg, l, ckg, (ckg as i64, 1), (l as i64, 1));
    p.batch = vec![g.n, cg.group];
    p.bst[0] = vec![0, (mg * ckg) as i64];
    p.bst[1] = vec![(cg.group * ckg * l) as i64, (ckg * l) as i64];
    if b.is_some() {
        p.r = (1, 0);
        p.bst[2] = vec![0, mg as i64];
    }
    let bufs = Bufs {
        a: wt.buf,
        b: &cols,
        d: y.buf,
        bias: None,
        res: b.map(|b| b.buf),
        pre: None,
    };
    launch(w, node, Activation::None, &p, bufs)
}

/// A convolution of one group whose sum is split into `parts` (`k_parts`): the parts'
/// products as one batch into scratch `[N, parts, M, L]`, summed over the parts into Y
/// (a thread per output, `reduce::reduce`), then B added.
fn split_conv(
    w: &mut Wgpu,
    node: &Node,
    (cg, parts): (&ConvGeom, usize),
    (wt, cols): (&V, &wgpu::Buffer),
    b: Option<V>,
    y: &V,
) -> Result<()> {
    let (g, l, k, m) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg());
    let kp = k / parts;
    let mut p = Product::new(y.dtype(), m, l, kp, (k as i64, 1), (l as i64, 1));
    p.batch = vec![g.n, parts];
    p.bst[0] = vec![0, kp as i64];
    p.bst[1] = vec![(k * l) as i64, (kp * l) as i64];
    let part_ty = ValueType::new(y.dtype(), &[g.n, parts, m * l]);
    let partial = w.scratch(part_ty.bytes());
    let bufs = Bufs {
        a: wt.buf,
        b: cols,
        d: &partial,
        bias: None,
        res: None,
        pre: None,
    };
    launch(w, node, Activation::None, &p, bufs)?;
    let summed = V {
        buf: &partial,
        ty: &part_ty,
    };
    let Some(b) = b else {
        return reduce::reduce(w, node, ReduceKind::Sum, &summed, &[1], y);
    };
    let sum_buf = w.scratch(y.ty.bytes().max(16));
    let sum = V {
        buf: &sum_buf,
        ty: y.ty,
    };
    reduce::reduce(w, node, ReduceKind::Sum, &summed, &[1], &sum)?;
    // B `[M]` as `[M, 1, ...]` against Y `[N, M, ...]`.
    let mut bshape = vec![m];
    bshape.resize(y.shape().len() - 1, 1);
    let bt = ValueType::new(b.dtype(), &bshape);
    binary(
        w,
        node,
        BinaryOp::Add,
        &sum,
        &V {
            buf: b.buf,
            ty: &bt,
        },
        y,
    )
}

/// FusedConv: `Y = act(conv(X, W) + B + Z)`, and Pre = conv + B + Z when asked for: the
/// convolution (with its bias), then Z added and the activation applied by one
/// elementwise pass each (a shader may not read and write one buffer, so the steps go
/// through scratch where Pre is not asked for).
#[allow(clippy::too_many_arguments)]
pub fn fused_conv(
    w: &mut Wgpu,
    node: &Node,
    [x, wt]: [&V; 2],
    b: Option<V>,
    z: Option<V>,
    act: Activation,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let y = &outs[0];
    let pre = common::wanted(outs, want, 1);
    let bytes = y.ty.bytes().max(16);
    let (s1, s2) = (w.scratch(bytes), w.scratch(bytes));
    let at = |buf| V { buf, ty: y.ty };
    // Where conv + B + Z ends: Pre, or Y when nothing follows the sum.
    let sum = match pre {
        Some(p) => V {
            buf: p.buf,
            ty: p.ty,
        },
        None if act == Activation::None => V {
            buf: y.buf,
            ty: y.ty,
        },
        None => at(&s1),
    };
    match &z {
        Some(z) => {
            let c = at(if sum.buf == &s1 { &s2 } else { &s1 });
            conv(w, node, x, wt, b, &c)?;
            binary(w, node, BinaryOp::Add, &c, z, &sum)?;
        }
        None => conv(w, node, x, wt, b, &sum)?,
    }
    match act {
        Activation::None if sum.buf != y.buf => {
            w.rec.copy(sum.buf, y.buf, y.ty.bytes());
            Ok(())
        }
        Activation::None => Ok(()),
        _ => map_code(w, node, common::act_code(act), [0.0; 2], &sum, y),
    }
}

/// dX = Col2Im(Wᵀ · dY) and dW = Σ_n dY[n] · columns(X[n])ᵀ, per group, each when
/// asked for.
pub fn conv_grad(
    w: &mut Wgpu,
    node: &Node,
    [dy, x, wt]: [&V; 3],
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let cg = common::conv_geom(node, x.shape(), wt.shape())?;
    let (g, l, ckg, mg, m) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg(), cg.m);
    let dt = x.dtype();
    if want.first() == Some(&true) && x.numel() > 0 {
        let dx = &outs[0];
        let ty = ValueType::new(dt, &[g.n, g.c * g.k(), l]);
        let cols = if cg.pointwise() {
            dx.buf.clone()
        } else {
            w.scratch(ty.bytes().max(16))
        };
        let mut p = Product::new(dt, ckg, l, mg, (1, ckg as i64), (l as i64, 1));
        p.batch = vec![g.n, cg.group];
        p.bst[0] = vec![0, (mg * ckg) as i64];
        p.bst[1] = vec![(m * l) as i64, (mg * l) as i64];
        let bufs = Bufs {
            a: wt.buf,
            b: dy.buf,
            d: &cols,
            bias: None,
            res: None,
            pre: None,
        };
        launch(w, node, Activation::None, &p, bufs)?;
        if !cg.pointwise() {
            col2im_geom(
                w,
                node,
                g,
                &V {
                    buf: &cols,
                    ty: &ty,
                },
                dx,
            )?;
        }
    }
    if want.get(1) == Some(&true) && wt.numel() > 0 {
        let dw = &outs[1];
        if g.n == 0 || l == 0 {
            w.rec.clear(dw.buf, dw.ty.bytes());
            return Ok(());
        }
        let cols = columns(w, node, &cg, x)?;
        // One launch per image, each after the first adding onto dW (the images' sum is
        // not one strided K axis).
        for n in 0..g.n {
            let mut p = Product::new(dt, mg, ckg, l, (l as i64, 1), (1, l as i64));
            p.batch = vec![cg.group];
            p.bst[0] = vec![(mg * l) as i64];
            p.bst[1] = vec![(ckg * l) as i64];
            p.base = [(n * m * l) as i64, (n * cg.group * ckg * l) as i64, 0];
            if n > 0 {
                p.flags = ACCUM;
            }
            let bufs = Bufs {
                a: dy.buf,
                b: &cols,
                d: dw.buf,
                bias: None,
                res: None,
                pre: None,
            };
            launch(w, node, Activation::None, &p, bufs)?;
        }
    }
    Ok(())
}
