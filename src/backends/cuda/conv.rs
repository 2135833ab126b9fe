//! Conv and ConvGrad on CUDA: through cuDNN where it is found and takes the convolution
//! (cudnn.rs), or as cuBLASLt products over Im2Col columns in scratch (Col2Im for dX), or
//! over the image itself for a 1×1 stride-1 convolution. Where both can run, the first
//! eager call of each shape times both and keeps the faster: cuDNN's NCHW kernels win at
//! large batches, the products over columns at batch 1 (ResNet-50 on the H100, bf16:
//! docs/BENCHMARKS.md).

use super::cudnn::{ConvShape, Which};
use super::device::{strides, word, Arg, Strided};
use super::elementwise::{act_epilogue, binary};
use super::matmul::strided_batch;
use super::shape::{col2im_geom, im2col_geom};
use super::{Cuda, V};
use crate::backends::common::{self, ConvGeom};
use crate::error::Result;
use crate::graph::{Activation, BinaryOp, Node};
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
    /// Runs convolution `which` on `ptrs` (its two inputs and output, as `Cudnn::conv`
    /// takes them) by cuDNN or by `fallback`, whichever the shape's first eager call
    /// measured faster.
    fn conv_by_choice(
        &self,
        which: Which,
        cg: &ConvGeom,
        dt: DType,
        ptrs: (u64, u64, u64),
        bias: Option<u64>,
        fallback: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let dnn = match crate::backends::tuning::tuning().cuda_cudnn {
            true => self.cudnn()?,
            false => None,
        };
        let Some((dnn, s)) =
            dnn.and_then(|d| Some(d).zip(cudnn_shape(cg, dt).filter(|s| d.supports(s))))
        else {
            return fallback();
        };
        let (a, b, out) = ptrs;
        let by_dnn = || dnn.conv(which, &s, a, b, out, bias, &|bytes| self.scratch(bytes));
        let key = (which, s.clone());
        let chosen = self.conv_choice.borrow().get(&key).copied();
        // Safety: the stream is ours; only its capture status is read.
        let capturing =
            unsafe { cudarc::driver::result::stream::is_capturing(self.stream.cu_stream()) }
                .map(|st| {
                    st != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
                })
                .unwrap_or(true);
        match chosen {
            Some(true) => return if by_dnn()? { Ok(()) } else { fallback() },
            Some(false) => return fallback(),
            // Timing reruns the call: not while a step is being recorded.
            None if capturing => return if by_dnn()? { Ok(()) } else { fallback() },
            None => {}
        }
        // Each way once to warm up (cuDNN times its own algorithms then), then three
        // times; scratch is taken afresh from the node's first slot each run.
        let fb = self.time_runs(&|| {
            self.steps.node_begins();
            fallback().map(|_| true)
        })?;
        let dn = self.time_runs(&|| {
            self.steps.node_begins();
            by_dnn()
        })?;
        let use_dnn = matches!((dn, fb), (Some(d), Some(f)) if d < f);
        self.conv_choice.borrow_mut().insert(key, use_dnn);
        // The last run left the slower way's result: the same values, so either serves;
        // run the chosen one so that the step's work is what later steps repeat.
        self.steps.node_begins();
        if use_dnn {
            by_dnn().map(|_| ())
        } else {
            fallback()
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
    let (g, l, ckg, mg, es) = (&cg.g, cg.g.l(), cg.ckg(), cg.mg(), dt.size() as u64);
    let fallback = || -> Result<()> {
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
    };
    c.conv_by_choice(
        Which::Forward,
        &cg,
        dt,
        (x.p, w.p, y.p),
        b.map(|b| b.p),
        &fallback,
    )
}

/// FusedConv: `Y = act(conv(X, W) + B + Z)`, and Pre = conv + B + Z when asked for. The
/// convolution (with its bias) writes Pre, or Y itself; Z is added in place and the
/// activation applied by one elementwise pass each.
#[allow(clippy::too_many_arguments)]
pub fn fused_conv(
    c: &Cuda,
    node: &Node,
    [x, w]: [&V; 2],
    b: Option<V>,
    z: Option<V>,
    act: Activation,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let y = &outs[0];
    let pre = common::wanted(outs, want, 1);
    let sum = pre.unwrap_or(y);
    conv(c, node, x, w, b, sum)?;
    if let Some(z) = z {
        binary(c, node, BinaryOp::Add, sum, &z, sum)?;
    }
    if act != Activation::None || pre.is_some() {
        act_epilogue(c, act, sum.p, None, y)?;
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
        let fallback = || -> Result<()> {
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
            Ok(())
        };
        c.conv_by_choice(Which::Data, &cg, dt, (dy.p, w.p, dx.p), None, &fallback)?;
    }
    if want.get(1) == Some(&true) && w.numel() > 0 {
        let dw = &outs[1];
        if g.n == 0 || l == 0 {
            return c.memset0(dw);
        }
        let fallback = || -> Result<()> {
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
            Ok(())
        };
        c.conv_by_choice(Which::Filter, &cg, dt, (x.p, dy.p, dw.p), None, &fallback)?;
    }
    Ok(())
}
