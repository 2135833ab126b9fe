//! Host-side bookkeeping that every backend does the same way before it launches
//! anything: strides and broadcasting, axes, Slice's read-back arguments, the op-code
//! tables that cuda/elementwise.cu and shaders/common.wgsl share, and attention's head and
//! mask checks. Only plain values go in and out, so a backend keeps its own buffer and
//! argument types and each rule lives once.

use crate::error::Result;
use crate::graph::infer::{norm_axis, pad_kept, slice_range};
use crate::graph::{Activation, Node, Op, PadMode, UnaryOp};
use crate::rng::Rng;
use crate::tensor::DType;

/// Row-major element strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as i64;
    }
    s
}

/// Strides of `inp` broadcast (numpy rules, right-aligned) to `out`: 0 along size-1 or
/// missing dims.
pub fn bcast_strides(inp: &[usize], out: &[usize]) -> Vec<i64> {
    let st = strides(inp);
    let pad = out.len() - inp.len().min(out.len());
    (0..out.len())
        .map(|d| {
            if d < pad || inp[d - pad] == 1 {
                0
            } else {
                st[d - pad]
            }
        })
        .collect()
}

/// `axis` (negative counts from the end) as a dim of a rank-`r` tensor.
pub fn axis_index(axis: i64, r: usize) -> Result<usize> {
    norm_axis(axis, r)
        .ok_or_else(|| crate::err!(Runtime, "axis {axis} is out of range for rank {r}"))
}

/// Like `axis_index`, the error naming the node.
pub fn node_axis(node: &Node, axis: i64, r: usize) -> Result<usize> {
    norm_axis(axis, r).ok_or_else(|| {
        crate::err!(
            Runtime,
            "{}: axis {axis} is out of range for rank {r}",
            node.describe()
        )
    })
}

/// The (start, step) that Slice reads along each dim of an input of shape `shape` (0, 1
/// where not sliced). `arg(i)` reads starts, ends, axes, steps (i = 0..4) back from the
/// device, `None` for an omitted one.
pub fn slice_steps(
    shape: &[usize],
    mut arg: impl FnMut(usize) -> Result<Option<Vec<i64>>>,
) -> Result<Vec<(i64, i64)>> {
    let (starts, ends) = (arg(0)?.unwrap_or_default(), arg(1)?.unwrap_or_default());
    let r = shape.len();
    let axes = arg(2)?.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = arg(3)?.unwrap_or_else(|| vec![1; starts.len()]);
    let mut out = vec![(0, 1); r];
    for (k, &ax) in axes.iter().enumerate() {
        let a = axis_index(ax, r)?;
        let (Some(&start), Some(&end), Some(&step)) = (starts.get(k), ends.get(k), steps.get(k))
        else {
            crate::bail!(
                Runtime,
                "Slice: starts, ends, axes and steps disagree in length"
            );
        };
        let (s, _) =
            slice_range(start, end, step, shape[a]).map_err(|m| crate::err!(Runtime, "{m}"))?;
        out[a] = (s, step);
    }
    Ok(out)
}

/// Output `i` when the executor wants it (`want[i]`), else None: gradients nobody reads
/// are not computed.
pub fn wanted<'a, T>(outs: &'a [T], want: &[bool], i: usize) -> Option<&'a T> {
    outs.get(i)
        .filter(|_| want.get(i).copied().unwrap_or(false))
}

/// The op code of a FusedMatMul activation (the unary maps' code table,
/// `cuda/opcodes.cuh` and `shaders/opcodes.wgsl`).
pub fn act_code(a: Activation) -> i32 {
    use crate::graph::elementwise as e;
    match a {
        Activation::None => e::NONE_CODE,
        Activation::Relu => UnaryOp::Relu.code(),
        Activation::Gelu => UnaryOp::Gelu.code(),
        Activation::GeluTanh => UnaryOp::GeluTanh.code(),
        Activation::Silu => e::SILU_CODE,
        Activation::Sigmoid => UnaryOp::Sigmoid.code(),
        Activation::Tanh => UnaryOp::Tanh.code(),
        Activation::Relu6 => e::RELU6_CODE,
    }
}

/// Head sizes D (of Q, K) and Dv (of V) of at most `max`, the kernels' register budget.
pub fn check_heads(node: &Node, backend: &str, max: usize, d: usize, dv: usize) -> Result<()> {
    if d > max || dv > max {
        crate::bail!(
            Runtime,
            "{}: the {backend} backend takes head sizes up to {max}, got D = {d}, Dv = {dv}",
            node.describe()
        );
    }
    Ok(())
}

/// Attention's mask `(dtype, shape)`, broadcast over `[B, Hq, Sq, Skv]`: its element
/// strides there (0 along broadcast dims) and its kind (0 none, 1 bool keep-mask,
/// 2 additive in Q's dtype `qt`).
pub fn attn_mask(
    node: &Node,
    qt: DType,
    mask: Option<(DType, &[usize])>,
) -> Result<([i64; 4], i32)> {
    let (mut ms, mut kind) = ([0i64; 4], 0);
    if let Some((mt, shape)) = mask {
        kind = match mt {
            DType::Bool => 1,
            dt if dt == qt => 2,
            dt => crate::bail!(
                Runtime,
                "{}: attn_mask must be bool or {qt}, got {dt}",
                node.describe()
            ),
        };
        let mut s = 1i64;
        for (i, &n) in shape.iter().enumerate().rev() {
            ms[4 - shape.len() + i] = if n == 1 { 0 } else { s };
            s *= n as i64;
        }
    }
    Ok((ms, kind))
}

/// Dropout's ratio (the optional input, else the attribute), which must be in [0, 1).
pub fn dropout_ratio(node: &Node, ratio: f64) -> Result<f64> {
    if !(0.0..1.0).contains(&ratio) {
        crate::bail!(
            Runtime,
            "{}: ratio must be in [0, 1), got {ratio}",
            node.describe()
        );
    }
    Ok(ratio)
}

/// The base seed of a node's counter-based draws (Dropout's mask, the Random ops'
/// values), the same on every backend so that draws agree: the seed attribute, else one
/// drawn from the node's name.
pub fn base_seed(node: &Node, seed: Option<u64>) -> u64 {
    match seed {
        Some(s) => s,
        None => Rng::for_name(0, &node.name).next_u64(),
    }
}

/// The seed of step `step`: step 0 (a plain run) keeps the draws of the base seed alone;
/// training steps mix in the step number, so every step draws afresh, reproducibly.
/// Dropout's element i keeps when `Rng::new(seed + i).uniform() >= ratio`.
/// (cuda/elementwise.cu `step_seed` does the same mixing on the device.)
pub fn step_seed(base: u64, step: u64) -> u64 {
    match step {
        0 => base,
        t => Rng::new(base ^ t.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64(),
    }
}

/// The top `bits` bits of `Rng::new(seed)`'s first draw, as a number in [0, 1).
fn unit(seed: u64, bits: u32) -> f64 {
    (Rng::new(seed).next_u64() >> (64 - bits)) as f64 / (1u64 << bits) as f64
}

/// Element `i` of a Random node's draw under seed `seed`, in f64: uniform in [a, b) from
/// counter `seed + i`, or normal with mean a and scale b by Box–Muller from counters
/// `seed + 2i` and `seed + 2i + 1`. `bits` is 53 for an f64 output and 24 for narrower
/// ones, so that a device computing in f32 (WebGPU) draws the same numbers, to rounding.
/// (cuda/elementwise.cu `random_k` and shaders/elementwise.wgsl `random` are the same.)
pub fn random_value(normal: bool, a: f64, b: f64, seed: u64, i: u64, bits: u32) -> f64 {
    if normal {
        let u1 = 1.0 - unit(seed.wrapping_add(i.wrapping_mul(2)), bits); // (0, 1]
        let u2 = unit(seed.wrapping_add(i.wrapping_mul(2)).wrapping_add(1), bits);
        a + b * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    } else {
        a + (b - a) * unit(seed.wrapping_add(i), bits)
    }
}

/// The bits of a Random draw for an output of `dtype` (see `random_value`).
pub fn random_bits(dtype: crate::tensor::DType) -> u32 {
    if dtype == crate::tensor::DType::F64 {
        53
    } else {
        24
    }
}

/// A Random node's seed attribute as the bits `base_seed` takes.
pub fn random_seed(seed: Option<f64>) -> Option<u64> {
    seed.map(f64::to_bits)
}

/// Input `i` of `node` (`ins[i]` is None for an omitted optional input), or an error
/// naming the node when a required one is missing.
pub fn required<T: Copy>(node: &Node, ins: &[Option<T>], i: usize) -> Result<T> {
    ins.get(i).copied().flatten().ok_or_else(|| {
        crate::err!(
            Runtime,
            "{}: required input {i} is missing",
            node.describe()
        )
    })
}

/// NonZero, Unique and ResizeMatrix on a device: a plan never runs them there, since inference computes
/// them on the host and the plan holds their outputs as constants
/// (`infer::computed_at_plan_time`).
pub fn plan_time_only(node: &Node) -> Result<()> {
    Err(crate::err!(
        Runtime,
        "{}: its output's shape depends on its input's values, so it is computed on the host when the plan is made; no device kernel runs it",
        node.describe()
    ))
}

/// GatherElements and GatherND (and their gradients) as flat gathers: the offset in data
/// of every output element, from the indices' values (negative ones count from the end;
/// out-of-range ones are an error naming the node). Every backend then runs them with its
/// Gather kernels on flat views (axis 0, one element a row), so that the index arithmetic
/// lives here once.
pub fn take_offsets(
    node: &Node,
    data: &[usize],
    idx_shape: &[usize],
    idx: &[i64],
) -> Result<Vec<i64>> {
    let st = row_major(data);
    let norm = |i: i64, d: usize, axis: usize| index_in(node, i, d, axis);
    // A scatter writes where the matching gather reads.
    let base = match node.op.grad_base().unwrap_or_else(|| node.op.clone()) {
        Op::ScatterElements { axis, .. } => Op::GatherElements { axis },
        Op::ScatterND { .. } => Op::GatherND { batch_dims: 0 },
        op => op,
    };
    match base {
        Op::GatherElements { axis } => {
            let a = axis_index(axis, data.len())?;
            let ist = row_major(idx_shape);
            (0..idx.len())
                .map(|p| {
                    let mut off = 0i64;
                    for d in 0..data.len() {
                        let c = (p / ist[d].max(1)) % idx_shape[d].max(1);
                        let c = if d == a {
                            norm(idx[p], data[a], a)?
                        } else {
                            c as i64
                        };
                        off += c * st[d] as i64;
                    }
                    Ok(off)
                })
                .collect()
        }
        Op::GatherND { batch_dims: b } => {
            let k = idx_shape.last().copied().unwrap_or(0);
            let rows = idx
                .len()
                .checked_div(k)
                .unwrap_or_else(|| crate::tensor::numel(&idx_shape[..idx_shape.len() - 1]));
            let per_batch = crate::tensor::numel(&idx_shape[b..idx_shape.len() - 1]).max(1);
            let slice = crate::tensor::numel(&data[b + k..]);
            let batch_stride = if b == 0 { 0 } else { st[b - 1] };
            let mut out = Vec::with_capacity(rows * slice);
            for r in 0..rows {
                let mut off = ((r / per_batch) * batch_stride) as i64;
                for j in 0..k {
                    off += norm(idx[r * k + j], data[b + j], b + j)? * st[b + j] as i64;
                }
                out.extend((0..slice as i64).map(|e| off + e));
            }
            Ok(out)
        }
        op => crate::bail!(Runtime, "{}: not a gather ({})", node.describe(), op.name()),
    }
}

/// Scatter's plan for the GPU kernels, where one thread owns each output element so that
/// repeated indices neither race nor lose updates: `slot[e]` is the group of updates that
/// land on output element e (-1 for none), group g's updates are
/// `order[starts[g]..starts[g + 1]]` in index order, and all three lists are packed into
/// one i32 buffer, `slot` first, `starts` at `starts_at`, `order` at `order_at`.
pub struct ScatterPlan {
    pub aux: Vec<i32>,
    pub starts_at: usize,
    pub order_at: usize,
}

/// The plan of a ScatterElements or ScatterND node whose data has shape `data`.
pub fn scatter_plan(
    node: &Node,
    data: &[usize],
    idx_shape: &[usize],
    idx: &[i64],
) -> Result<ScatterPlan> {
    let tgt = take_offsets(node, data, idx_shape, idx)?;
    let n = crate::tensor::numel(data);
    if n + 2 * tgt.len() + 1 > i32::MAX as usize {
        crate::bail!(
            Runtime,
            "{}: {} updates into {n} elements exceed the GPU kernels' 32-bit plan",
            node.describe(),
            tgt.len()
        );
    }
    let mut order: Vec<usize> = (0..tgt.len()).collect();
    order.sort_by_key(|&j| tgt[j]);
    let mut aux = vec![-1i32; n];
    let mut starts = vec![];
    for (q, &j) in order.iter().enumerate() {
        let t = tgt[j] as usize;
        if aux[t] < 0 {
            aux[t] = starts.len() as i32;
            starts.push(q as i32);
        }
    }
    starts.push(order.len() as i32);
    let starts_at = aux.len();
    aux.extend(starts);
    let order_at = aux.len();
    aux.extend(order.into_iter().map(|j| j as i32));
    Ok(ScatterPlan {
        aux,
        starts_at,
        order_at,
    })
}

/// Pad's and PadGrad's gather offsets (`pad_offsets`) over an input (the forward's) of
/// shape `x`; `arg(i)` reads input i (pads, axes) back as integers, `None` when omitted.
pub fn pad_plan(
    node: &Node,
    x: &[usize],
    mut arg: impl FnMut(usize) -> Result<Option<Vec<i64>>>,
) -> Result<Vec<i64>> {
    let (mode, axes_at) = match node.op {
        Op::Pad { mode } => (mode, 3),
        Op::PadGrad { mode } => (mode, 2),
        _ => crate::bail!(Runtime, "{}: not a Pad", node.describe()),
    };
    let pads = arg(1)?.unwrap_or_default();
    let axes = arg(axes_at)?;
    let pairs = crate::graph::infer::pad_pairs(x.len(), &pads, axes.as_deref())
        .map_err(|m| crate::err!(Runtime, "{}: {m}", node.describe()))?;
    pad_offsets(node, x, &pairs, mode)
}

/// Pad as a gather: for every output element, the flat offset in the input it copies, or
/// -1 where it takes the constant. `pairs` are the (begin, end) pads per dim
/// (`infer::pad_pairs`); negative ones first remove elements, and reflect, edge and wrap
/// then read from what is left.
fn pad_offsets(node: &Node, x: &[usize], pairs: &[(i64, i64)], mode: PadMode) -> Result<Vec<i64>> {
    let st = row_major(x);
    // Per dim, the input index each output index reads (-1: the constant).
    let mut maps: Vec<Vec<i64>> = vec![];
    for (d, (&n, &(b, e))) in x.iter().zip(pairs).enumerate() {
        let (lo, m) = ((-b).max(0), pad_kept(n, (b, e)));
        let out = m + b.max(0) + e.max(0);
        if m <= 0 && out > 0 && mode != PadMode::Constant {
            crate::bail!(
                Runtime,
                "{}: {} padding of axis {d} needs at least one element left, and it has none",
                node.describe(),
                mode.name()
            );
        }
        let map = (0..out.max(0))
            .map(|i| {
                let j = i - b.max(0);
                let k = if (0..m).contains(&j) {
                    j
                } else {
                    match mode {
                        PadMode::Constant => return -1,
                        PadMode::Edge => j.clamp(0, m - 1),
                        PadMode::Wrap => j.rem_euclid(m),
                        // numpy's reflect: period 2(m-1), one element repeats.
                        PadMode::Reflect if m == 1 => 0,
                        PadMode::Reflect => {
                            let p = 2 * (m - 1);
                            let k = j.rem_euclid(p);
                            if k >= m {
                                p - k
                            } else {
                                k
                            }
                        }
                    }
                };
                (lo + k) * st[d] as i64
            })
            .collect();
        maps.push(map);
    }
    let total = maps.iter().try_fold(1usize, |a, m| a.checked_mul(m.len()));
    let mut out = try_vec(node, total.unwrap_or(usize::MAX))?;
    // An odometer over the output's indices, adding each dim's offset.
    let mut idx = vec![0usize; x.len()];
    for _ in 0..out.capacity() {
        let mut off = 0i64;
        for (d, &i) in idx.iter().enumerate() {
            let v = maps[d][i];
            if v < 0 {
                off = -1;
                break;
            }
            off += v;
        }
        out.push(off);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < maps[d].len() {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}

/// An empty vector with room for `n` elements, or an error naming the node when the host
/// cannot hold them.
fn try_vec<T>(node: &Node, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        crate::err!(
            Runtime,
            "{}: cannot allocate the host plan of {n} elements",
            node.describe()
        )
    })?;
    Ok(v)
}

/// Row-major element strides of `shape`.
fn row_major(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1] * shape[d + 1];
    }
    st
}

/// The (outer, length, inner) split of `shape` around `axis` (checked against its rank):
/// the `outer · inner` lines that CumSum and CumProd (whose axis is their second input's
/// one value), ArgMax, ArgMin and TopK run along, each `inner` elements apart.
pub fn line_dims(node: &Node, shape: &[usize], axis: i64) -> Result<(usize, usize, usize)> {
    let Some(a) = norm_axis(axis, shape.len()) else {
        crate::bail!(
            Runtime,
            "{}: axis {axis} is out of range for rank {}",
            node.describe(),
            shape.len()
        );
    };
    Ok((
        crate::tensor::numel(&shape[..a]),
        shape[a],
        crate::tensor::numel(&shape[a + 1..]),
    ))
}

/// Index `i` into an axis of size `d`: negative ones count from the end, out-of-range ones
/// are an error naming the node (Gather and its kin, on every backend).
pub fn index_in(node: &Node, i: i64, d: usize, axis: usize) -> Result<i64> {
    let j = if i < 0 { i + d as i64 } else { i };
    if j < 0 || j >= d as i64 {
        crate::bail!(
            Runtime,
            "{}: index {i} is out of range for axis {axis} of size {d}",
            node.describe()
        );
    }
    Ok(j)
}

/// What an Im2Col or Col2Im launch needs, the spatial rank padded to 3 with leading axes
/// of size 1 (kernel 1, stride 1, no padding), so one kernel serves 1-, 2- and 3-D.
#[derive(Clone, Copy, Debug)]
pub struct WindowGeom {
    pub n: usize,
    pub c: usize,
    pub image: [usize; 3],
    pub out: [usize; 3],
    pub kernel: [usize; 3],
    pub strides: [usize; 3],
    pub dilations: [usize; 3],
    pub begin: [usize; 3],
    pub end: [usize; 3],
    /// Im2Col's pad and beyond values (0 for Col2Im).
    pub fill: [f64; 2],
}

impl WindowGeom {
    /// The window's size K.
    pub fn k(&self) -> usize {
        self.kernel.iter().product()
    }
    /// The number of output positions L.
    pub fn l(&self) -> usize {
        self.out.iter().product()
    }
    /// The image's spatial size.
    pub fn hw(&self) -> usize {
        self.image.iter().product()
    }
    /// A column entry that reads padding.
    pub const PAD: i64 = -1;
    /// One that reads past the padding (ceil_mode's last windows); it wins over padding on
    /// another axis.
    pub const BEYOND: i64 = -2;

    /// The 27 integers a device kernel takes: image, out, kernel, strides, dilations,
    /// begin, end (3 each), then N, C, K, L, image size, and 1 spare.
    pub fn words(&self) -> Vec<i64> {
        let mut v = vec![];
        for a in [
            self.image,
            self.out,
            self.kernel,
            self.strides,
            self.dilations,
            self.begin,
            self.end,
        ] {
            v.extend(a.iter().map(|&x| x as i64));
        }
        v.extend([self.n, self.c, self.k(), self.l(), self.hw(), 0].map(|x| x as i64));
        v
    }
}

/// The window geometry of an Im2Col, a MaxPool or a MaxPoolGrad (`image` = X's shape) or
/// a Col2Im (`image` = the output's shape); `read(i)` reads plan-time input i (the
/// kernel's dims when the op's attribute is empty).
pub fn window_geom(
    node: &Node,
    image: &[usize],
    mut read: impl FnMut(usize) -> Result<Option<Vec<i64>>>,
) -> Result<WindowGeom> {
    let fail = |m: String| crate::error::Error::Runtime(format!("{}: {m}", node.describe()));
    let (attr, window, slot, fill) = match &node.op {
        Op::Im2Col {
            kernel,
            window,
            pad_value,
            beyond_value,
        } => (kernel, window, 1, [*pad_value, *beyond_value]),
        Op::Col2Im { block, window } => (block, window, 2, [0.0; 2]),
        Op::MaxPool { kernel, window } | Op::MaxPoolGrad { kernel, window } => {
            (kernel, window, 0, [f64::NEG_INFINITY; 2])
        }
        _ => unreachable!("window_geom is for Im2Col, Col2Im and the pools"),
    };
    let kernel = if attr.is_empty() {
        let v = read(slot)?.ok_or_else(|| fail("the kernel's dims are missing".into()))?;
        crate::graph::window::dims_of(&v, "kernel_shape").map_err(fail)?
    } else {
        attr.clone()
    };
    place(window, &kernel, &window.channels_first(image), fill).map_err(fail)
}

/// The geometry of `kernel` sliding over `image` (`[N, C, *spatial]`).
fn place(
    window: &crate::graph::window::Window,
    kernel: &[usize],
    image: &[usize],
    fill: [f64; 2],
) -> std::result::Result<WindowGeom, String> {
    let r = kernel.len();
    if image.len() != r + 2 || r > 3 {
        return Err(format!(
            "graphrun's windows are 1-, 2- or 3-D; got a kernel of rank {r} on an image of shape {image:?}"
        ));
    }
    let placed = window.place(&image[2..], kernel)?;
    let pad3 = |v: &[usize], fill: usize| {
        let mut a = [fill; 3];
        a[3 - r..].copy_from_slice(v);
        a
    };
    Ok(WindowGeom {
        n: image[0],
        c: image[1],
        image: pad3(&image[2..], 1),
        out: pad3(&placed.out, 1),
        kernel: pad3(kernel, 1),
        strides: pad3(&placed.strides, 1),
        dilations: pad3(&placed.dilations, 1),
        begin: pad3(&placed.begin, 0),
        end: pad3(&placed.end, 0),
        fill,
    })
}

/// What a Conv or ConvGrad launch needs: the window over X (all C channels, zero
/// padding) and the output channels M in `group` groups.
#[derive(Clone, Copy, Debug)]
pub struct ConvGeom {
    pub g: WindowGeom,
    pub m: usize,
    pub group: usize,
    /// The spatial rank (1 to 3; `g` pads it to 3).
    pub rank: usize,
    /// The operands are stored channels-last (`Window::channels_last`).
    pub channels_last: bool,
}

impl ConvGeom {
    /// Input channels per group.
    pub fn cg(&self) -> usize {
        self.g.c / self.group
    }
    /// Output channels per group.
    pub fn mg(&self) -> usize {
        self.m / self.group
    }
    /// A group's column height (C/group)·K.
    pub fn ckg(&self) -> usize {
        self.cg() * self.g.k()
    }
    /// Whether each column is the image itself (a 1×1 kernel, stride 1, no padding).
    pub fn pointwise(&self) -> bool {
        self.g.k() == 1
            && self.g.strides == [1; 3]
            && self.g.begin == [0; 3]
            && self.g.end == [0; 3]
    }
}

/// The geometry of a Conv (X, W) or ConvGrad (dY, X, W) node.
pub fn conv_geom(node: &Node, x: &[usize], w: &[usize]) -> Result<ConvGeom> {
    let (Op::Conv { window, group, .. }
    | Op::FusedConv { window, group, .. }
    | Op::ConvGrad { window, group, .. }) = &node.op
    else {
        unreachable!("conv_geom is for Conv, FusedConv and ConvGrad")
    };
    let fail = |m: String| crate::error::Error::Runtime(format!("{}: {m}", node.describe()));
    // The geometry is the same in either layout; it is described channels first.
    let (x, w) = (&window.channels_first(x)[..], &window.channels_first(w)[..]);
    if w.len() < 3 {
        return Err(fail(format!(
            "W must be [M, C/group, kernel...], got {w:?}"
        )));
    }
    let g = place(window, &w[2..], x, [0.0; 2]).map_err(fail)?;
    Ok(ConvGeom {
        g,
        m: w[0],
        group: *group,
        rank: w.len() - 2,
        channels_last: window.channels_last,
    })
}

/// The bits of `v` in dtype `dt` (converted as a Cast from f64 does: saturating for
/// integers), in the low bytes of a u64: Im2Col's fill values for the device kernels.
pub fn fill_bits(dt: DType, v: f64) -> u64 {
    use crate::tensor::Elem;
    let mut b = [0u8; 8];
    crate::with_any!(dt, T => {
        let x = T::from_f64(v);
        let bytes = bytemuck::bytes_of(&x);
        b[..bytes.len()].copy_from_slice(bytes);
    });
    u64::from_le_bytes(b)
}

/// The ops CUDA and WebGPU run on the narrow element types (`DType::narrow_bits`, a byte
/// an element on every backend): Cast converts them, the others only move their bytes.
pub fn takes_narrow(op: &crate::graph::Op) -> bool {
    use crate::graph::Op;
    matches!(
        op,
        Op::Cast { .. }
            | Op::CastLike
            | Op::Identity
            | Op::Reshape { .. }
            | Op::Squeeze { .. }
            | Op::Unsqueeze { .. }
            | Op::Flatten { .. }
            | Op::Transpose { .. }
            | Op::Expand
            | Op::Slice
            | Op::Concat { .. }
            | Op::Split { .. }
            | Op::Gather { .. }
            | Op::Where
            | Op::Im2Col { .. }
    )
}

/// CUDA and WebGPU leave arithmetic on the narrow element types to the CPU: for a node
/// other than `takes_narrow`'s, an error naming the node, the backend and the first such
/// type among its inputs and outputs.
pub fn refuse_narrow<'a>(
    node: &Node,
    backend: &str,
    types: impl IntoIterator<Item = &'a crate::graph::infer::ValueType>,
) -> Result<()> {
    if takes_narrow(&node.op) {
        return Ok(());
    }
    match types
        .into_iter()
        .map(|t| t.dtype)
        .find(|d| d.narrow_bits().is_some())
    {
        Some(dt) => Err(crate::err!(
            Runtime,
            "{}: dtype {dt} is not supported by the {backend} backend ({})",
            node.describe(),
            super::NARROW_WHY
        )),
        None => Ok(()),
    }
}
