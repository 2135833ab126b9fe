//! Conv and ConvGrad on CUDA: through cuDNN where it is found and takes the convolution
//! (cudnn.rs), else as cuBLASLt products over Im2Col columns in scratch (Col2Im for dX),
//! or over the image itself for a 1×1 stride-1 convolution.

use super::cudnn::{ConvShape, Which};
use super::device::{strides, word, Arg, Strided};
use super::matmul::strided_batch;
use super::shape::{col2im_geom, im2col_geom};
use super::{Cuda, V};
use crate::backends::common::{self, ConvGeom};
use crate::error::Result;
use crate::graph::Node;
use crate::tensor::DType;

/// cuDNN's description of a convolution, when its padding is symmetric (cuDNN takes one
/// pad per axis).
fn cudnn_shape(cg: &ConvGeom, dt: DType) -> Option<ConvShape> {
    let g = &cg.g;
    let r = cg.rank;
    let tail = |a: [usize; 3]| a[3 - r..].to_vec();
    (g.begin == g.end).then(|| ConvShape {
        dt,
        n: g.n,
        c: g.c,
        m: cg.m,
        group: cg.group,
        image: tail(g.image),
        kernel: tail(g.kernel),
        out: tail(g.out),
        pads: tail(g.begin),
        strides: tail(g.strides),
        dilations: tail(g.dilations),
    })
}

impl Cuda {
    /// Runs `which` through cuDNN when it is there and takes the convolution; false when
    /// the caller must use the fallback.
    fn try_cudnn(
        &self,
        which: Which,
        cg: &ConvGeom,
        dt: DType,
        (a, b, out): (u64, u64, u64),
        bias: Option<u64>,
    ) -> Result<bool> {
        if !crate::backends::tuning::tuning().cuda_cudnn {
            return Ok(false);
        }
        let Some(dnn) = self.cudnn()? else {
            return Ok(false);
        };
        match cudnn_shape(cg, dt).filter(|s| dnn.supports(s)) {
            Some(s) => dnn.conv(which, &s, a, b, out, bias, &|bytes| self.scratch(bytes)),
            None => Ok(false),
        }
    }

    /// X's columns `[N, C·K, L]` in scratch (X itself when pointwise).
    fn columns(&self, cg: &ConvGeom, dt: DType, x: u64) -> Result<u64> {
        if cg.pointwise() {
            return Ok(x);
        }
        let g = &cg.g;
        let n = g.n * g.c * g.k() * g.l();
        let cols = self.scratch(n * dt.size())?;
        im2col_geom(self, g, dt, x, cols, n)?;
        Ok(cols)
    }
}

/// Y = conv(X, W) + B.
pub fn conv(c: &Cuda, node: &Node, x: &V, w: &V, b: Option<V>, y: &V) -> Result<()> {
    let dt = x.dtype();
    let cg = common::conv_geom(node, x.shape(), w.shape())?;
    if y.numel() == 0 {
        return Ok(());
    }
    if c.try_cudnn(Which::Forward, &cg, dt, (x.p, w.p, y.p), b.map(|b| b.p))? {
        return Ok(());
    }
    let (g, l, ckg, mg, es) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg(), dt.size() as u64);
    if let Some(b) = b {
        // Y starts as the bias broadcast over each channel; the products add onto it.
        let src: Vec<i64> = (0..y.shape().len()).map(|d| (d == 1) as i64).collect();
        let st = Strided::new(y.shape(), &[&src, &strides(y.shape())], &[])?;
        let n = y.numel();
        let args = [
            Arg::Ptr(b.p),
            Arg::Ptr(y.p),
            Arg::Strided(st),
            Arg::I64(n as i64),
        ];
        c.launch_n(&format!("copy_{}", word(dt)), n, &args)?;
    }
    let cols = c.columns(&cg, dt, x.p)?;
    for grp in 0..cg.group {
        // Y[n, group] = W[group] · columns[n, group], a product per image.
        strided_batch(
            c,
            dt,
            (mg, l, ckg),
            (false, false),
            g.n,
            (w.p + (grp * mg * ckg) as u64 * es, 0),
            (cols + (grp * ckg * l) as u64 * es, g.c * g.k() * l),
            (y.p + (grp * mg * l) as u64 * es, cg.m * l),
            b.is_some(),
        )?;
    }
    Ok(())
}

/// dX and dW (each when asked for) from dY, X and W.
pub fn conv_grad(
    c: &Cuda,
    node: &Node,
    [dy, x, w]: [&V; 3],
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let dt = x.dtype();
    let cg = common::conv_geom(node, x.shape(), w.shape())?;
    let (g, l, ckg, mg, m, es) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg(), cg.m, dt.size() as u64);
    let hw = g.hw();
    if want.first() == Some(&true) && x.numel() > 0 {
        let dx = &outs[0];
        if !c.try_cudnn(Which::Data, &cg, dt, (dy.p, w.p, dx.p), None)? {
            let n = g.n * g.c * g.k() * l;
            let (cols, rows) = if cg.pointwise() {
                (dx.p, g.c * hw)
            } else {
                (c.scratch(n * dt.size())?, g.c * g.k() * l)
            };
            for grp in 0..cg.group {
                // columns[n, group] = W[group]ᵀ · dY[n, group]
                strided_batch(
                    c,
                    dt,
                    (ckg, l, mg),
                    (true, false),
                    g.n,
                    (w.p + (grp * mg * ckg) as u64 * es, 0),
                    (dy.p + (grp * mg * l) as u64 * es, m * l),
                    (cols + (grp * ckg * l) as u64 * es, rows),
                    false,
                )?;
            }
            if !cg.pointwise() {
                col2im_geom(c, g, dt, cols, dx.p, dx.numel())?;
            }
        }
    }
    if want.get(1) == Some(&true) && w.numel() > 0 {
        let dw = &outs[1];
        if g.n == 0 || l == 0 {
            return c.memset0(dw);
        }
        if !c.try_cudnn(Which::Filter, &cg, dt, (x.p, dy.p, dw.p), None)? {
            let cols = c.columns(&cg, dt, x.p)?;
            let rows = if cg.pointwise() {
                g.c * hw
            } else {
                g.c * g.k() * l
            };
            for n in 0..g.n {
                // dW[group] (+)= dY[n, group] · columns[n, group]ᵀ, every group at once.
                strided_batch(
                    c,
                    dt,
                    (mg, ckg, l),
                    (false, true),
                    cg.group,
                    (dy.p + (n * m * l) as u64 * es, mg * l),
                    (cols + (n * rows) as u64 * es, ckg * l),
                    (dw.p, mg * ckg),
                    n > 0,
                )?;
            }
        }
    }
    Ok(())
}
