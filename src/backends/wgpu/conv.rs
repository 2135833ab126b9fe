//! Conv and ConvGrad on wgpu as batched GEMMs (matmul.rs) over the columns Im2Col lays out
//! in scratch (shape.rs), or over the image itself for a 1×1 stride-1 convolution. The
//! bias rides on the GEMM epilogue's residual term (a per-row value: strides (1, 0)).

use super::elementwise::{binary, map_code};
use super::matmul::{launch, Bufs, Product, ACCUM};
use super::shape::{col2im_geom, im2col_geom};
use super::{Wgpu, V};
use crate::backends::common::{self, ConvGeom};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Activation, BinaryOp, Node};

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

/// Y[n, group] = W[group] · columns(X)[n, group] (+ B).
pub fn conv(w: &mut Wgpu, node: &Node, x: &V, wt: &V, b: Option<V>, y: &V) -> Result<()> {
    let cg = common::conv_geom(node, x.shape(), wt.shape())?;
    let (g, l, ckg, mg) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg());
    if y.numel() == 0 {
        return Ok(());
    }
    let cols = columns(w, node, &cg, x)?;
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
