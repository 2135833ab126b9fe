//! Conv and its gradients on the host, an image and a group at a time: the group's
//! columns are laid out in a buffer of one image's size (cache-sized for most layers,
//! never the whole batch's) and multiplied on `gemm`; a 1×1 stride-1 convolution reads
//! the image itself as its columns. Where an image's output is too small for a product
//! worth the name (the last layers of a CNN on small images), several images' columns
//! go side by side into one product. Depthwise convolutions (one input channel a group)
//! would be products of a single row, so they are summed directly instead.
//!
//! Everything is computed in the accumulation type (f32 for f16/bf16), rounded once.

use super::super::common::{self, ConvGeom, WindowGeom};
use super::matmul::{activate_row, fill_acc, widen};
use super::window::{axis_tables, walk_row};
use super::{nt, simd, Shared};
use crate::error::Result;
use crate::graph::{Activation, Node};
use crate::tensor::{Real, Tensor};
use rayon::prelude::*;

type Tabs = [Vec<i64>; 3];

/// Below this many multiply-adds an image, images go to threads one each (gemm on one
/// thread); above it the images are taken in turn with gemm's own threads.
const PER_IMAGE_THREADING: usize = 1 << 22;

/// `dst[m×n] (row stride ldd) = [dst +] A·B`, A and B strided views `(ptr, row stride,
/// column stride)`.
///
/// # Safety
/// Every element the sizes and strides reach must lie inside the three buffers.
#[allow(clippy::too_many_arguments)]
unsafe fn mm<F: Real>(
    (m, n, k): (usize, usize, usize),
    dst: *mut F,
    ldd: usize,
    accumulate: bool,
    a: (*const F, usize, usize),
    b: (*const F, usize, usize),
    par: gemm::Parallelism,
) {
    if m > 0 && n > 0 && k > 0 && nt::takes::<F>(a.2 as isize, b.1 as isize) {
        // Both operands K-contiguous (the filter gradient: dY by the columns read
        // transposed): dot products of rows, where gemm would pack the columns.
        let (lda, ldb) = (a.1, b.2);
        let a = std::slice::from_raw_parts(a.0.cast::<f32>(), (m - 1) * lda + k);
        let b = std::slice::from_raw_parts(b.0.cast::<f32>(), (n - 1) * ldb + k);
        let out = std::slice::from_raw_parts_mut(dst.cast::<f32>(), (m - 1) * ldd + n);
        let par = !matches!(par, gemm::Parallelism::None);
        return nt::product((m, n, k), a, lda, b, ldb, 1.0, out, ldd, accumulate, par);
    }
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        ldd as isize,
        accumulate,
        a.0,
        a.2 as isize,
        a.1 as isize,
        b.0,
        b.2 as isize,
        b.1 as isize,
        F::one(),
        F::one(),
        false,
        false,
        false,
        par,
    )
}

/// The columns `[cs·K, L]` of channels `img` (`[cs, hw]`), zero where they read padding,
/// each row of `cols` `ld` apart (`ld ≥ L`: the columns of several images side by side).
fn im2col<F: Real>(g: &WindowGeom, tabs: &Tabs, img: &[F], cols: &mut [F], ld: usize, par: bool) {
    let (k, l, hw) = (g.k(), g.l(), g.hw());
    let row = |(r, o): (usize, &mut [F])| {
        let plane = &img[(r / k) * hw..][..hw];
        let o = &mut o[..l];
        walk_row(g, tabs, r % k, |i, s| {
            o[i] = if s >= 0 { plane[s as usize] } else { F::zero() }
        });
    };
    if l == 0 {
        return;
    }
    // Rows r·ld .. r·ld + l, the last one ending the slice.
    let rows = (cols.len() + ld - l) / ld;
    let cols = &mut cols[..(rows - 1) * ld + l];
    if par {
        cols.par_chunks_mut(ld).enumerate().for_each(row);
    } else {
        cols.chunks_mut(ld).enumerate().for_each(row);
    }
}

/// One group's columns `[ckg, L]` as (start, row stride): the group's channels `src`
/// themselves when the convolution is pointwise, else laid out in `cols`.
fn group_columns<F: Real>(
    cg: &ConvGeom,
    tabs: &Tabs,
    src: &[F],
    cols: &mut Vec<F>,
    par: bool,
) -> (*const F, usize) {
    let g = &cg.g;
    if cg.pointwise() {
        return (src.as_ptr(), g.hw());
    }
    cols.resize(cg.ckg() * g.l(), F::zero());
    im2col(g, tabs, src, cols, g.l(), par);
    (cols.as_ptr(), g.l())
}

/// Adds the columns `[cs·K, L]` (rows `ld` apart) back into the channels `img`
/// (`[cs, hw]`) they read.
fn col2im_add<F: Real>(
    g: &WindowGeom,
    tabs: &Tabs,
    cols: &[F],
    ld: usize,
    img: &mut [F],
    par: bool,
) {
    let (k, l, hw) = (g.k(), g.l(), g.hw());
    let plane = |(c, p): (usize, &mut [F])| {
        for j in 0..k {
            let row = &cols[(c * k + j) * ld..][..l];
            walk_row(g, tabs, j, |i, s| {
                if s >= 0 {
                    p[s as usize] = p[s as usize] + row[i];
                }
            });
        }
    };
    if par {
        img.par_chunks_mut(hw).enumerate().for_each(plane);
    } else {
        img.chunks_mut(hw).enumerate().for_each(plane);
    }
}

/// How the images of a batch are spread over threads: `(one image per thread, gemm's
/// parallelism)`.
fn spread(cg: &ConvGeom) -> (bool, gemm::Parallelism) {
    let macs = cg.m * cg.g.l() * cg.ckg();
    if cg.g.n > 1 && macs < PER_IMAGE_THREADING {
        (true, gemm::Parallelism::None)
    } else {
        (false, gemm::Parallelism::Rayon(0))
    }
}

/// Whether the direct depthwise sums serve (one input channel per group).
fn depthwise(cg: &ConvGeom) -> bool {
    cg.group > 1 && cg.cg() == 1
}

/// Products at least this wide: below it an image's product is nearly a matrix-vector
/// one, which reads all of W for a few columns.
const MIN_COLUMNS: usize = 64;

/// How many images to multiply at once: one, unless the output is so small (the last
/// layers of a CNN on small images: 1×1, 2×2) that an image's product is too narrow;
/// then enough images side by side for `MIN_COLUMNS` columns.
fn images_at_once(cg: &ConvGeom) -> usize {
    let l = cg.g.l().max(1);
    if depthwise(cg) || l >= MIN_COLUMNS || cg.g.n < 2 {
        1
    } else {
        MIN_COLUMNS.div_ceil(l).min(cg.g.n)
    }
}

/// The images `n0..n0 + nb` side by side: each group's columns `[ckg, nb·L]` (image b's
/// at column b·L) for `each(grp, columns)`.
fn block_columns<F: Real>(
    cg: &ConvGeom,
    tabs: &Tabs,
    x: &[F],
    (n0, nb): (usize, usize),
    cols: &mut Vec<F>,
    mut each: impl FnMut(usize, &[F]),
) {
    let g = &cg.g;
    let (c, hw, l, cgc, ckg) = (g.c, g.hw(), g.l(), cg.cg(), cg.ckg());
    cols.resize(ckg * nb * l, F::zero());
    for grp in 0..cg.group {
        for b in 0..nb {
            let src = &x[((n0 + b) * c + grp * cgc) * hw..][..cgc * hw];
            im2col(g, tabs, src, &mut cols[b * l..], nb * l, true);
        }
        each(grp, cols);
    }
}

/// Where row r of group `grp`'s block of image n0 + b lies in an `[N, M, L]` tensor, for
/// the images `n0..n0 + nb` side by side as `[mg, nb·L]`: (offset in the tensor, offset
/// in the side-by-side block) of each run of L values.
fn side_by_side(
    cg: &ConvGeom,
    (n0, nb): (usize, usize),
    grp: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let (l, m, mg) = (cg.g.l(), cg.m, cg.mg());
    (0..nb).flat_map(move |b| {
        (0..mg).map(move |r| (((n0 + b) * m + grp * mg + r) * l, (r * nb + b) * l))
    })
}

/// Y = conv(X, W) + B.
pub fn conv(node: &Node, x: &Tensor, w: &Tensor, b: Option<&Tensor>, y: &mut Tensor) -> Result<()> {
    fused_conv(
        node,
        [x, w],
        b,
        None,
        Activation::None,
        std::slice::from_mut(y),
    )
}

/// FusedConv: Y = act(conv(X, W) + B + Z), and Pre = conv(X, W) + B + Z when `outs` has
/// a second tensor. Without Pre the epilogue runs on each image's output as it is made.
pub fn fused_conv(
    node: &Node,
    [x, w]: [&Tensor; 2],
    b: Option<&Tensor>,
    z: Option<&Tensor>,
    act: Activation,
    outs: &mut [Tensor],
) -> Result<()> {
    let cg = common::conv_geom(node, x.shape(), w.shape())?;
    let (y, pre) = outs.split_at_mut(1);
    crate::with_float!(x.dtype(), T => {
        let (xa, wa) = (widen(x.as_slice::<T>()), widen(w.as_slice::<T>()));
        let ba = b.map(|b| widen(b.as_slice::<T>()));
        let za = z.map(|z| widen(z.as_slice::<T>()));
        let ep = Epilogue { bias: ba.as_deref(), z: za.as_deref(), act, l: cg.g.l(), m: cg.m };
        match pre.first_mut() {
            None => fill_acc(y[0].as_mut_slice::<T>(), |ya| forward(&cg, &xa, &wa, &ep, ya)),
            Some(pre) => {
                let sums = Epilogue { act: Activation::None, ..ep };
                fill_acc(pre.as_mut_slice::<T>(), |pa| forward(&cg, &xa, &wa, &sums, pa));
                let pa = widen(pre.as_slice::<T>());
                fill_acc(y[0].as_mut_slice::<T>(), |ya| {
                    ya.par_chunks_mut(1 << 14).zip(pa.par_chunks(1 << 14)).for_each(|(y, p)| {
                        y.copy_from_slice(p);
                        activate_row(act, y);
                    })
                });
            }
        }
        Ok(())
    }, _ => crate::bail!(Runtime, "{}: {} takes floating tensors, got {}", node.describe(), node.op.name(), x.dtype()))
}

/// What follows the product on each output channel's plane: `act(y + B + Z)`.
struct Epilogue<'a, F> {
    bias: Option<&'a [F]>,
    z: Option<&'a [F]>,
    act: Activation,
    /// Output positions a plane, and output channels.
    l: usize,
    m: usize,
}

impl<F: Real> Epilogue<'_, F> {
    fn nothing(&self) -> bool {
        self.bias.is_none() && self.z.is_none() && self.act == Activation::None
    }
    /// Applies it to `y`, the positions `off..` of plane `p` of Y (plane p is image p / M,
    /// channel p % M).
    fn span(&self, p: usize, off: usize, y: &mut [F]) {
        let b = self.bias.map_or(F::zero(), |b| b[p % self.m]);
        let z = self.z.map(|z| &z[p * self.l + off..][..y.len()]);
        simd::vectorize(|| match z {
            Some(z) => y.iter_mut().zip(z).for_each(|(v, &r)| *v = *v + b + r),
            None if self.bias.is_some() => y.iter_mut().for_each(|v| *v = *v + b),
            None => {}
        });
        activate_row(self.act, y);
    }
    /// Applies it to the planes `ys` that start at plane `p0` of Y; across threads when
    /// `par`.
    fn apply(&self, p0: usize, ys: &mut [F], par: bool) {
        if self.nothing() {
            return;
        }
        let plane = |(i, y): (usize, &mut [F])| self.span(p0 + i, 0, y);
        let l = self.l.max(1);
        if par {
            ys.par_chunks_mut(l).enumerate().for_each(plane);
        } else {
            ys.chunks_mut(l).enumerate().for_each(plane);
        }
    }
}

/// Whether the window is 1- or 2-D (its leading axis of one), so that a block of whole
/// output rows can be laid out row by row (`tile_columns`, `Depthwise`).
fn planar(g: &WindowGeom) -> bool {
    g.image[0] == 1 && g.out[0] == 1 && g.kernel[0] == 1
}

/// On a 2-D window's last axis, kernel column `kx`: the output columns `lo..hi` whose
/// input column `ox·stride + off` lies inside the image (the rest read padding).
fn inside(g: &WindowGeom, kx: usize) -> (usize, usize, isize) {
    let (iw, ow, sw) = (g.image[2] as isize, g.out[2], g.strides[2] as isize);
    let off = (kx * g.dilations[2]) as isize - g.begin[2] as isize;
    let count = |v: isize| if v <= 0 { 0 } else { (v + sw - 1) / sw } as usize;
    let lo = count(-off).min(ow);
    (lo, count(iw - off).clamp(lo, ow), off)
}

/// On a 2-D window's first axis, output row `oy` and kernel row `ky`: the input row read,
/// if inside the image.
fn input_row(g: &WindowGeom, oy: usize, ky: usize) -> Option<usize> {
    let iy = (oy * g.strides[1] + ky * g.dilations[1]) as isize - g.begin[1] as isize;
    (iy >= 0 && iy < g.image[1] as isize).then_some(iy as usize)
}

/// The columns of output rows `oy0..oy1` of a planar window for the channels `img`
/// (`[cs, hw]`): row (c, ky, kx) holds, for each output position of those rows, the input
/// it reads or zero, rows `ld` apart. Contiguous runs are copied whole at stride 1.
fn tile_columns<F: Real>(
    g: &WindowGeom,
    img: &[F],
    (oy0, oy1): (usize, usize),
    cols: &mut [F],
    ld: usize,
) {
    let (iw, ow, hw) = (g.image[2], g.out[2], g.hw());
    let (kh, kw, sw) = (g.kernel[1], g.kernel[2], g.strides[2]);
    for (r, out) in cols.chunks_mut(ld).enumerate() {
        let (c, ky, kx) = (r / (kh * kw), (r / kw) % kh, r % kw);
        let plane = &img[c * hw..][..hw];
        let (lo, hi, off) = inside(g, kx);
        for (t, oy) in (oy0..oy1).enumerate() {
            let o = &mut out[t * ow..][..ow];
            let Some(iy) = input_row(g, oy, ky) else {
                o.fill(F::zero());
                continue;
            };
            let row = &plane[iy * iw..][..iw];
            o[..lo].fill(F::zero());
            o[hi..].fill(F::zero());
            if lo == hi {
                // No column reads inside the image (a kernel wider than the padded row
                // leaves `lo + off` below zero): nothing to copy.
            } else if sw == 1 {
                let s = (lo as isize + off) as usize;
                o[lo..hi].copy_from_slice(&row[s..s + hi - lo]);
            } else {
                for (ox, v) in o[lo..hi].iter_mut().enumerate() {
                    *v = row[(((lo + ox) * sw) as isize + off) as usize];
                }
            }
        }
    }
}

/// One depthwise output plane of a planar window, summed tap by tap: each tap adds
/// `w · input row` over the output columns that read inside the image (a vector
/// multiply-add at stride 1). For f64, and where `DepthwiseF32` does not serve.
struct Depthwise<'a, F> {
    g: &'a WindowGeom,
    img: &'a [F],
    w: &'a [F],
    plane: &'a mut [F],
}

impl<F: Real> simd::Kernel for Depthwise<'_, F> {
    type Output = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let g = self.g;
        let (iw, ow, sw) = (g.image[2], g.out[2], g.strides[2]);
        let (kh, kw) = (g.kernel[1], g.kernel[2]);
        self.plane.fill(F::zero());
        for (oy, o) in self.plane.chunks_mut(ow.max(1)).enumerate() {
            for ky in 0..kh {
                let Some(iy) = input_row(g, oy, ky) else {
                    continue;
                };
                let row = &self.img[iy * iw..][..iw];
                for kx in 0..kw {
                    let wv = self.w[ky * kw + kx];
                    let (lo, hi, off) = inside(g, kx);
                    if lo == hi {
                        // This tap reads only padding.
                    } else if sw == 1 {
                        let s = (lo as isize + off) as usize;
                        for (v, &r) in o[lo..hi].iter_mut().zip(&row[s..s + hi - lo]) {
                            *v = simd::madd::<F, FMA>(wv, r, *v);
                        }
                    } else {
                        for (ox, v) in o[lo..hi].iter_mut().enumerate() {
                            let r = row[(((lo + ox) * sw) as isize + off) as usize];
                            *v = simd::madd::<F, FMA>(wv, r, *v);
                        }
                    }
                }
            }
        }
    }
}

/// One depthwise output plane of a planar window in f32, all its taps summed in vector
/// registers. The input plane is first copied into a zero-padded one, each row padded to
/// whole vectors, so that every tap reads one contiguous run and no load needs an edge
/// case. With a horizontal stride s the row is summed at every column and every s-th kept:
/// s times the multiply-adds, which are cheap here, instead of gathering every s-th input
/// (one scalar move an input, which cost several times the sums).
struct DepthwiseF32<'a> {
    g: &'a WindowGeom,
    img: &'a [f32],
    w: &'a [f32],
    plane: &'a mut [f32],
    /// The padded plane, then one dense output row.
    scratch: &'a mut Vec<f32>,
}

/// The padded plane of `DepthwiseF32` for vectors of `lanes`: rows 0..ph (row r is input
/// row r - top) of pw columns (column c is input column c - left), and the width of a
/// dense output row. Saturating: a hostile geometry gives a size the caller refuses.
fn padded_plane(g: &WindowGeom, lanes: usize) -> (usize, usize, usize) {
    let (oh, ow, kh, kw) = (g.out[1], g.out[2], g.kernel[1], g.kernel[2]);
    let (sh, sw, dh, dw) = (g.strides[1], g.strides[2], g.dilations[1], g.dilations[2]);
    let u = |v: usize| v as u128;
    // Products of two usizes fit a u128; sums saturate.
    let extent = |o: usize, s: usize, k: usize, d: usize| {
        (u(o).saturating_sub(1) * u(s))
            .saturating_add(u(k).saturating_sub(1) * u(d))
            .saturating_add(1)
    };
    let wide = extent(ow, sw, 1, 0)
        .min(u(usize::MAX / 4))
        .next_multiple_of(u(lanes));
    let cap = |v: u128| v.min(u(usize::MAX / 4)) as usize;
    (
        cap(extent(oh, sh, kh, dh)),
        cap(wide.saturating_add(extent(1, 0, kw, dw) - 1)),
        cap(wide),
    )
}

impl pulp::WithSimd for DepthwiseF32<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        let g = self.g;
        let lanes = S::F32_LANES;
        let (ih, iw, ow) = (g.image[1], g.image[2], g.out[2]);
        let (kh, kw) = (g.kernel[1], g.kernel[2]);
        let (sh, sw, dh, dw) = (g.strides[1], g.strides[2], g.dilations[1], g.dilations[2]);
        let (top, left) = (g.begin[1], g.begin[2]);
        let (ph, pw, wide) = padded_plane(g, lanes);
        let scratch = &mut *self.scratch;
        scratch.clear();
        scratch.resize(ph * pw + if sw > 1 { wide } else { 0 }, 0.0);
        let (padded, dense) = scratch.split_at_mut(ph * pw);
        let (c0, c1) = (left.min(pw), (left + iw).min(pw));
        for r in top..ph.min(top + ih) {
            let src = &self.img[(r - top) * iw..][..c1 - c0];
            padded[r * pw + c0..][..c1 - c0].copy_from_slice(src);
        }
        // Each tap's offset in the padded plane from the output row's first padded row.
        let taps: Vec<(usize, f32)> = (0..kh * kw)
            .map(|t| ((t / kw) * dh * pw + (t % kw) * dw, self.w[t]))
            .collect();
        let padded = &*padded;
        for (oy, o) in self.plane.chunks_mut(ow).enumerate() {
            let row = &padded[oy * sh * pw..];
            let dst = if sw == 1 { &mut *o } else { &mut *dense };
            let mut x0 = 0;
            while x0 + 4 * lanes <= wide {
                depthwise_run::<S, 4>(simd, row, &taps, x0, dst);
                x0 += 4 * lanes;
            }
            while x0 < wide {
                depthwise_run::<S, 1>(simd, row, &taps, x0, dst);
                x0 += lanes;
            }
            if sw > 1 {
                for (v, &d) in o.iter_mut().zip(dense.iter().step_by(sw)) {
                    *v = d;
                }
            }
        }
    }
}

/// V vectors of output row `o` from column `x0` on: each tap `(offset, weight)` adds its
/// weight times the padded plane from `offset + x0` on (`row` starting at the output
/// row's first padded row).
#[inline(always)]
fn depthwise_run<S: pulp::Simd, const V: usize>(
    simd: S,
    row: &[f32],
    taps: &[(usize, f32)],
    x0: usize,
    o: &mut [f32],
) {
    let lanes = S::F32_LANES;
    let mut acc = [simd.splat_f32s(0.0); V];
    for &(at, wv) in taps {
        let wv = simd.splat_f32s(wv);
        let src = &row[at + x0..][..V * lanes];
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: `src` holds V whole vectors.
            let x =
                unsafe { std::ptr::read_unaligned(src[i * lanes..].as_ptr() as *const S::f32s) };
            *a = simd.mul_add_e_f32s(wv, x, *a);
        }
    }
    for (i, a) in acc.iter().enumerate() {
        let at = x0 + i * lanes;
        if at + lanes <= o.len() {
            // SAFETY: the vector lies inside the output row.
            unsafe { std::ptr::write_unaligned(o[at..].as_mut_ptr() as *mut S::f32s, *a) };
        } else if at < o.len() {
            simd.partial_store_f32s(&mut o[at..], *a);
        }
    }
}

/// Column floats a tile aims for: its columns stay in the L2 cache while the product
/// packs them.
const TILE_FLOATS: usize = 1 << 17;

/// A planar convolution as independent tasks, one per (image, group, block of output
/// rows, block of output channels): each lays out its block's columns (cache-sized),
/// multiplies them on one thread into Y's block and applies the epilogue while the block
/// is hot. The blocks are cut small enough that every thread has work even for one image:
/// by rows while a block keeps `MIN_TASK_COLUMNS` output positions, then by channels (a
/// small late-stage map with many channels would otherwise leave each product a sliver
/// of columns, where the product kernel runs far below its rate).
fn tiled<F: Real>(cg: &ConvGeom, x: &[F], w: &[F], ep: &Epilogue<F>, y: &mut [F]) {
    let g = &cg.g;
    let (c, hw, l, m) = (g.c, g.hw(), g.l(), cg.m);
    let (cgc, mg, ckg) = (cg.cg(), cg.mg(), cg.ckg());
    let (oh, ow) = (g.out[1], g.out[2]);
    let blocks = g.n * cg.group;
    let mut rows = (TILE_FLOATS / (ckg * ow).max(1)).clamp(1, oh.max(1));
    let mut chans = mg.max(1);
    let want = 2 * rayon::current_num_threads();
    while blocks * oh.div_ceil(rows) * mg.div_ceil(chans) < want {
        if rows > 1 && rows.div_ceil(2) * ow >= MIN_TASK_COLUMNS {
            rows = rows.div_ceil(2);
        } else if chans >= 2 * CHANNEL_BLOCK {
            chans = chans.div_ceil(2 * CHANNEL_BLOCK) * CHANNEL_BLOCK;
        } else if rows > 1 {
            rows = rows.div_ceil(2);
        } else {
            break;
        }
    }
    let (tiles, cblocks) = (oh.div_ceil(rows), mg.div_ceil(chans));
    let yp = Shared(y.as_mut_ptr());
    let pointwise = cg.pointwise();
    (0..blocks * tiles * cblocks).into_par_iter().for_each_init(
        Vec::new,
        |cols: &mut Vec<F>, t| {
            let (cb, t) = (t % cblocks, t / cblocks);
            let (n, grp, tile) = (t / tiles / cg.group, (t / tiles) % cg.group, t % tiles);
            let (oy0, oy1) = (tile * rows, ((tile + 1) * rows).min(oh));
            let (l0, tl) = (oy0 * ow, (oy1 - oy0) * ow);
            let (c0, mb) = (cb * chans, chans.min(mg - cb * chans));
            let src = &x[(n * c + grp * cgc) * hw..][..cgc * hw];
            let (bp, brs) = if pointwise {
                (src[l0..].as_ptr(), hw)
            } else {
                cols.resize(ckg * tl, F::zero());
                tile_columns(g, src, (oy0, oy1), cols, tl);
                (cols.as_ptr(), tl)
            };
            let p0 = n * m + grp * mg + c0;
            // SAFETY: W's rows c0..c0 + mb of the group block [mg, ckg]; the columns
            // [ckg, tl] (rows brs apart); Y's rows p0.. at columns l0..l0 + tl, row stride
            // l: inside Y, and no other task writes those elements (tasks differ in
            // image, group, output rows or output channels).
            unsafe {
                let dst = yp.ptr().add(p0 * l + l0);
                mm(
                    (mb, tl, ckg),
                    dst,
                    l,
                    false,
                    (w[(grp * mg + c0) * ckg..].as_ptr(), ckg, 1),
                    (bp, brs, 1),
                    gemm::Parallelism::None,
                );
                if !ep.nothing() {
                    for r in 0..mb {
                        let span = std::slice::from_raw_parts_mut(dst.add(r * l), tl);
                        ep.span(p0 + r, l0, span);
                    }
                }
            }
        },
    );
}

/// The fewest output positions `tiled` gives one task before it splits by channels.
const MIN_TASK_COLUMNS: usize = 96;
/// `tiled` splits output channels in multiples of this (the product kernel's rows).
const CHANNEL_BLOCK: usize = 48;

fn forward<F: Real>(cg: &ConvGeom, x: &[F], w: &[F], ep: &Epilogue<F>, y: &mut [F]) {
    let g = &cg.g;
    let tabs = axis_tables(g);
    let (c, hw, l, m) = (g.c, g.hw(), g.l(), cg.m);
    if y.is_empty() {
        return;
    }
    if depthwise(cg) && planar(g) {
        let (k, mg) = (g.k(), cg.mg());
        // The padded plane is about the size of the input plane, but padding, strides and
        // dilations far past the image (a hostile file) could make it much larger than
        // the tensors the plan holds: such planes take the kernel without a copy.
        // (Sized for 16 lanes, the widest vector: narrower ones need less.)
        let (ph, pw, wide) = padded_plane(g, 16);
        let copy = ph.saturating_mul(pw).saturating_add(wide);
        let vector = nt::available() && nt::f32s(x).is_some() && copy <= 4 * (hw + l) + (1 << 16);
        y.par_chunks_mut(l)
            .enumerate()
            .for_each_init(Vec::new, |scratch, (p, plane)| {
                let (n, mo) = (p / m, p % m);
                let img = &x[(n * c + mo / mg) * hw..][..hw];
                let w = &w[mo * k..][..k];
                match (nt::f32s(img), nt::f32s(w), nt::f32s_mut(plane)) {
                    (Some(img), Some(w), Some(plane)) if vector => {
                        pulp::Arch::new().dispatch(DepthwiseF32 {
                            g,
                            img,
                            w,
                            plane,
                            scratch,
                        })
                    }
                    _ => simd::dispatch(Depthwise { g, img, w, plane }),
                }
                ep.apply(p, plane, false);
            });
        return;
    }
    if depthwise(cg) {
        // Y[n, m] = Σ_j W[m, j] · X[n, m / mg] at the window's offset j.
        let (k, mg) = (g.k(), cg.mg());
        y.par_chunks_mut(l).enumerate().for_each(|(p, plane)| {
            let (n, mo) = (p / m, p % m);
            let img = &x[(n * c + mo / mg) * hw..][..hw];
            plane.fill(F::zero());
            for j in 0..k {
                let wj = w[mo * k + j];
                walk_row(g, &tabs, j, |i, s| {
                    if s >= 0 {
                        plane[i] = plane[i] + wj * img[s as usize];
                    }
                });
            }
            ep.apply(p, plane, false);
        });
        return;
    }
    let (cgc, mg, ckg) = (cg.cg(), cg.mg(), cg.ckg());
    let at_once = images_at_once(cg);
    if at_once > 1 {
        let (mut cols, mut prod) = (vec![], vec![F::zero(); mg * at_once * l]);
        for n0 in (0..g.n).step_by(at_once) {
            let nb = at_once.min(g.n - n0);
            block_columns(cg, &tabs, x, (n0, nb), &mut cols, |grp, cols| {
                // SAFETY: W's group block [mg, ckg], the columns [ckg, nb·l], the
                // product [mg, nb·l].
                unsafe {
                    mm(
                        (mg, nb * l, ckg),
                        prod.as_mut_ptr(),
                        nb * l,
                        false,
                        (w[grp * mg * ckg..].as_ptr(), ckg, 1),
                        (cols.as_ptr(), nb * l, 1),
                        gemm::Parallelism::Rayon(0),
                    )
                }
                for (at, o) in side_by_side(cg, (n0, nb), grp) {
                    y[at..at + l].copy_from_slice(&prod[o..o + l]);
                }
            });
            ep.apply(n0 * m, &mut y[n0 * m * l..(n0 + nb) * m * l], true);
        }
        return;
    }
    if planar(g) {
        return tiled(cg, x, w, ep, y);
    }
    let (per_thread, par) = spread(cg);
    let image = |n: usize, yi: &mut [F], cols: &mut Vec<F>| {
        let img = &x[n * c * hw..][..c * hw];
        for grp in 0..cg.group {
            let src = &img[grp * cgc * hw..][..cgc * hw];
            let (bp, brs) = group_columns(cg, &tabs, src, cols, !per_thread);
            // SAFETY: W's group block is [mg, ckg], the columns [ckg, l] with row stride
            // brs, and Y's group block [mg, l]: all inside their buffers.
            unsafe {
                mm(
                    (mg, l, ckg),
                    yi[grp * mg * l..].as_mut_ptr(),
                    l,
                    false,
                    (w[grp * mg * ckg..].as_ptr(), ckg, 1),
                    (bp, brs, 1),
                    par,
                )
            }
        }
        ep.apply(n * m, yi, !per_thread);
    };
    if per_thread {
        y.par_chunks_mut(m * l)
            .enumerate()
            .for_each_init(Vec::new, |cols, (n, yi)| image(n, yi, cols));
    } else {
        let mut cols = vec![];
        for (n, yi) in y.chunks_mut(m * l).enumerate() {
            image(n, yi, &mut cols);
        }
    }
}

/// ConvGrad: dX and dW (each when asked for) from dY, X and W.
pub fn conv_grad(
    node: &Node,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    outs: &mut [Tensor],
    want: &[bool],
) -> Result<()> {
    let cg = common::conv_geom(node, x.shape(), w.shape())?;
    crate::with_float!(x.dtype(), T => {
        let (dya, wa) = (widen(dy.as_slice::<T>()), widen(w.as_slice::<T>()));
        if want.first() == Some(&true) {
            fill_acc(outs[0].as_mut_slice::<T>(), |dx| data_grad(&cg, &dya, &wa, dx));
        }
        if want.get(1) == Some(&true) {
            let xa = widen(x.as_slice::<T>());
            fill_acc(outs[1].as_mut_slice::<T>(), |dw| filter_grad(&cg, &dya, &xa, dw));
        }
        Ok(())
    }, _ => crate::bail!(Runtime, "{}: ConvGrad takes floating tensors, got {}", node.describe(), x.dtype()))
}

/// dX[n] = Col2Im(Wᵀ · dY[n]) per group.
fn data_grad<F: Real>(cg: &ConvGeom, dy: &[F], w: &[F], dx: &mut [F]) {
    let g = &cg.g;
    let tabs = axis_tables(g);
    let (c, hw, l, m) = (g.c, g.hw(), g.l(), cg.m);
    if dx.is_empty() {
        return;
    }
    dx.fill(F::zero());
    let (k, mg) = (g.k(), cg.mg());
    if depthwise(cg) {
        dx.par_chunks_mut(hw).enumerate().for_each(|(p, plane)| {
            let (n, ci) = (p / c, p % c);
            for mo in ci * mg..(ci + 1) * mg {
                let d = &dy[(n * m + mo) * l..][..l];
                for j in 0..k {
                    let wj = w[mo * k + j];
                    walk_row(g, &tabs, j, |i, s| {
                        if s >= 0 {
                            plane[s as usize] = plane[s as usize] + wj * d[i];
                        }
                    });
                }
            }
        });
        return;
    }
    let (cgc, ckg) = (cg.cg(), cg.ckg());
    let at_once = images_at_once(cg);
    if at_once > 1 {
        let mut d = vec![F::zero(); mg * at_once * l];
        let mut cols = vec![F::zero(); ckg * at_once * l];
        for n0 in (0..g.n).step_by(at_once) {
            let nb = at_once.min(g.n - n0);
            for grp in 0..cg.group {
                for (at, o) in side_by_side(cg, (n0, nb), grp) {
                    d[o..o + l].copy_from_slice(&dy[at..at + l]);
                }
                // SAFETY: Wᵀ's group block [ckg, mg], dY's images side by side
                // [mg, nb·l], the columns [ckg, nb·l].
                unsafe {
                    mm(
                        (ckg, nb * l, mg),
                        cols.as_mut_ptr(),
                        nb * l,
                        false,
                        (w[grp * mg * ckg..].as_ptr(), 1, ckg),
                        (d.as_ptr(), nb * l, 1),
                        gemm::Parallelism::Rayon(0),
                    )
                }
                for b in 0..nb {
                    let dst = &mut dx[((n0 + b) * c + grp * cgc) * hw..][..cgc * hw];
                    col2im_add(g, &tabs, &cols[b * l..], nb * l, dst, true);
                }
            }
        }
        return;
    }
    let (per_thread, par) = spread(cg);
    let image = |n: usize, dxi: &mut [F], cols: &mut Vec<F>| {
        for grp in 0..cg.group {
            let d = &dy[(n * m + grp * mg) * l..][..mg * l];
            let wt = (w[grp * mg * ckg..].as_ptr(), 1, ckg);
            let dst = &mut dxi[grp * cgc * hw..][..cgc * hw];
            // SAFETY: Wᵀ's group block is [ckg, mg] (W read transposed), dY's [mg, l],
            // the destination [ckg, l] (the image itself when pointwise, where hw = l).
            unsafe {
                if cg.pointwise() {
                    mm(
                        (ckg, l, mg),
                        dst.as_mut_ptr(),
                        hw,
                        false,
                        wt,
                        (d.as_ptr(), l, 1),
                        par,
                    );
                } else {
                    cols.resize(ckg * l, F::zero());
                    let cp = cols.as_mut_ptr();
                    mm((ckg, l, mg), cp, l, false, wt, (d.as_ptr(), l, 1), par);
                    col2im_add(g, &tabs, cols, l, dst, !per_thread);
                }
            }
        }
    };
    if per_thread {
        dx.par_chunks_mut(c * hw)
            .enumerate()
            .for_each_init(Vec::new, |cols, (n, dxi)| image(n, dxi, cols));
    } else {
        let mut cols = vec![];
        for (n, dxi) in dx.chunks_mut(c * hw).enumerate() {
            image(n, dxi, &mut cols);
        }
    }
}

/// dW = Σ_n dY[n] · columns(X[n])ᵀ per group.
fn filter_grad<F: Real>(cg: &ConvGeom, dy: &[F], x: &[F], dw: &mut [F]) {
    let g = &cg.g;
    let tabs = axis_tables(g);
    let (nb, c, hw, l, m) = (g.n, g.c, g.hw(), g.l(), cg.m);
    dw.fill(F::zero());
    if dw.is_empty() || nb == 0 {
        return;
    }
    let (k, mg) = (g.k(), cg.mg());
    if depthwise(cg) {
        dw.par_chunks_mut(k).enumerate().for_each(|(mo, wrow)| {
            for n in 0..nb {
                let img = &x[(n * c + mo / mg) * hw..][..hw];
                let d = &dy[(n * m + mo) * l..][..l];
                for (j, wj) in wrow.iter_mut().enumerate() {
                    let mut acc = F::zero();
                    walk_row(g, &tabs, j, |i, s| {
                        if s >= 0 {
                            acc = acc + d[i] * img[s as usize];
                        }
                    });
                    *wj = *wj + acc;
                }
            }
        });
        return;
    }
    let (cgc, ckg) = (cg.cg(), cg.ckg());
    let at_once = images_at_once(cg);
    if at_once > 1 {
        let (mut cols, mut d) = (vec![], vec![F::zero(); mg * at_once * l]);
        for n0 in (0..nb).step_by(at_once) {
            let b = at_once.min(nb - n0);
            block_columns(cg, &tabs, x, (n0, b), &mut cols, |grp, cols| {
                for (at, o) in side_by_side(cg, (n0, b), grp) {
                    d[o..o + l].copy_from_slice(&dy[at..at + l]);
                }
                // SAFETY: dY's images side by side [mg, b·l], the columns read
                // transposed [b·l, ckg], dW's group block [mg, ckg].
                unsafe {
                    mm(
                        (mg, ckg, b * l),
                        dw[grp * mg * ckg..].as_mut_ptr(),
                        ckg,
                        true,
                        (d.as_ptr(), b * l, 1),
                        (cols.as_ptr(), 1, b * l),
                        gemm::Parallelism::Rayon(0),
                    )
                }
            });
        }
        return;
    }
    let (per_thread, par) = spread(cg);
    // Adds image n's contribution into `acc` ([M, ckg]).
    let image = |n: usize, acc: &mut [F], cols: &mut Vec<F>| {
        let img = &x[n * c * hw..][..c * hw];
        for grp in 0..cg.group {
            let src = &img[grp * cgc * hw..][..cgc * hw];
            let (cp, crs) = group_columns(cg, &tabs, src, cols, !per_thread);
            let d = &dy[(n * m + grp * mg) * l..][..mg * l];
            // SAFETY: dY's group block is [mg, l], the columns read transposed [l, ckg],
            // the destination dW's group block [mg, ckg].
            unsafe {
                mm(
                    (mg, ckg, l),
                    acc[grp * mg * ckg..].as_mut_ptr(),
                    ckg,
                    true,
                    (d.as_ptr(), l, 1),
                    (cp, 1, crs),
                    par,
                )
            }
        }
    };
    if per_thread {
        // A fixed split of the images over the threads, the partial sums added in
        // order: the same result on every run.
        let parts = rayon::current_num_threads().clamp(1, nb);
        let partial: Vec<Vec<F>> = (0..parts)
            .into_par_iter()
            .map(|p| {
                let (mut acc, mut cols) = (vec![F::zero(); dw.len()], vec![]);
                for n in (p * nb / parts)..((p + 1) * nb / parts) {
                    image(n, &mut acc, &mut cols);
                }
                acc
            })
            .collect();
        for p in partial {
            dw.iter_mut().zip(&p).for_each(|(a, &b)| *a = *a + b);
        }
    } else {
        let mut cols = vec![];
        for n in 0..nb {
            image(n, dw, &mut cols);
        }
    }
}
