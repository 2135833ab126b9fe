//! The elementwise operators, each declared once, in one row of a table: its variant and
//! float attributes (with ONNX's defaults), its ONNX name and first opset, the op code the
//! device kernels switch on, the dtypes it takes, and its CPU formula and derivative.
//!
//! The tables are "X-macros": `for_each_unary!(m)` hands every row to macro `m`, and each
//! consumer expands only what it needs — this module the enum, names, attributes and
//! codes; the CPU backend the formulas, as one monomorphised loop per op. The CUDA and WGSL
//! op codes are generated from the rows into `cuda/opcodes.cuh` and `shaders/opcodes.wgsl`
//! (`opcodes_cuda`, `opcodes_wgsl`; tests/opcodes.rs keeps the files current), and every
//! device `switch` over them ends in a trap, so a code without a case fails loudly.
//!
//! Adding a unary op: one row here, one `case` in `cuda/elementwise.cu` (`act_fwd`,
//! `act_bwd`) and one in `shaders/common.wgsl`, and its float64 reference in
//! `tests/op_matrix.rs` (an exhaustive match: the compiler asks for it); then regenerate
//! the headers. The op-matrix test then runs it on every backend and dtype.

/// Every unary map, one row each:
/// `(Variant {attr = default, ...}, "OnnxName", since_opset, code, dtypes, |x| f(x), grad)`
/// where `dtypes` is `float` (floating dtypes) or `signed` (floats and signed integers), and
/// `grad` is `|dy, x| dy·f'(x)` or `none` for a map whose derivative is zero wherever it
/// exists (the backward graph treats it as a constant). Formulas are in the accumulation
/// type `F: Real` (f32 or f64); attributes arrive converted to `F`.
macro_rules! for_each_unary {
    ($m:ident) => {
        $m! {
            (Relu, "Relu", 1, 1, signed, |v| act::relu(v), |g, v| act::relu_grad(g, v)),
            (Gelu, "Gelu", 20, 2, float, |v| act::gelu(v), |g, v| act::gelu_grad(g, v)),
            (GeluTanh, "Gelu", 20, 3, float, |v| act::gelu_tanh(v), |g, v| act::gelu_tanh_grad(g, v)),
            (Sigmoid, "Sigmoid", 1, 5, float, |v| act::sigmoid(v), |g, v| act::sigmoid_grad(g, v)),
            (Tanh, "Tanh", 1, 6, float, |v| v.tanh_v(), |g, v| act::tanh_grad(g, v)),
            (Neg, "Neg", 1, 7, signed, |v| -v, |g, _v| -g),
            (Exp, "Exp", 1, 8, float, |v| v.exp_v(), |g, v| g * v.exp_v()),
            (Log, "Log", 1, 9, float, |v| v.ln(), |g, v| g / v),
            (Sqrt, "Sqrt", 1, 10, float, |v| v.sqrt(), |g, v| g * F::c(0.5) / v.sqrt()),
            (Reciprocal, "Reciprocal", 1, 11, float, |v| F::one() / v, |g, v| -g / (v * v)),
            (Abs, "Abs", 1, 12, signed, |v| v.abs(), |g, v| g * act::sign(v)),
            (Erf, "Erf", 9, 13, float, |v| v.erf_v(),
                |g, v| g * F::c(std::f64::consts::FRAC_2_SQRT_PI) * (-v * v).exp_v()),
            (LeakyRelu {alpha = 0.01}, "LeakyRelu", 1, 14, float,
                |v| if v >= F::zero() { v } else { alpha * v },
                |g, v| if v > F::zero() { g } else { alpha * g }),
            (Sign, "Sign", 9, 15, signed, |v| act::sign(v), none),
            (Floor, "Floor", 1, 16, float, |v| v.floor(), none),
            (Ceil, "Ceil", 1, 17, float, |v| v.ceil(), none),
            (Round, "Round", 11, 18, float, |v| act::round_even(v), none),
            (Sin, "Sin", 7, 19, float, |v| v.sin(), |g, v| g * v.cos()),
            (Cos, "Cos", 7, 20, float, |v| v.cos(), |g, v| -g * v.sin()),
            (Tan, "Tan", 7, 21, float, |v| v.tan(), |g, v| g * (F::one() + v.tan() * v.tan())),
            (Asin, "Asin", 7, 22, float, |v| v.asin(), |g, v| g / (F::one() - v * v).sqrt()),
            (Acos, "Acos", 7, 23, float, |v| v.acos(), |g, v| -g / (F::one() - v * v).sqrt()),
            (Atan, "Atan", 7, 24, float, |v| v.atan(), |g, v| g / (F::one() + v * v)),
            (Sinh, "Sinh", 9, 25, float, |v| v.sinh(), |g, v| g * v.cosh()),
            (Cosh, "Cosh", 9, 26, float, |v| v.cosh(), |g, v| g * v.sinh()),
            (Asinh, "Asinh", 9, 27, float, |v| v.asinh(), |g, v| g / (v * v + F::one()).sqrt()),
            (Acosh, "Acosh", 9, 28, float, |v| v.acosh(), |g, v| g / (v * v - F::one()).sqrt()),
            (Atanh, "Atanh", 9, 29, float, |v| v.atanh(), |g, v| g / (F::one() - v * v)),
            (Softplus, "Softplus", 1, 30, float, |v| act::softplus(v), |g, v| g * act::sigmoid(v)),
            (Softsign, "Softsign", 1, 31, float, |v| v / (F::one() + v.abs()),
                |g, v| g / ((F::one() + v.abs()) * (F::one() + v.abs()))),
            (Elu {alpha = 1.0}, "Elu", 1, 32, float,
                |v| if v < F::zero() { alpha * (v.exp() - F::one()) } else { v },
                |g, v| if v > F::zero() { g } else { g * alpha * v.exp() }),
            (Selu {alpha = 1.673_263_2, gamma = 1.050_701}, "Selu", 1, 33, float,
                |v| if v > F::zero() { gamma * v } else { gamma * alpha * (v.exp() - F::one()) },
                |g, v| if v > F::zero() { g * gamma } else { g * gamma * alpha * v.exp() }),
            (Celu {alpha = 1.0}, "Celu", 12, 34, float,
                |v| if v > F::zero() { v } else { alpha * ((v / alpha).exp() - F::one()) },
                |g, v| if v > F::zero() { g } else { g * (v / alpha).exp() }),
            (HardSigmoid {alpha = 0.2, beta = 0.5}, "HardSigmoid", 1, 35, float,
                |v| (alpha * v + beta).max(F::zero()).min(F::one()),
                |g, v| act::inside(alpha * v + beta, F::zero(), F::one(), g * alpha)),
            (HardSwish, "HardSwish", 14, 36, float,
                |v| v * (v / F::c(6.0) + F::c(0.5)).max(F::zero()).min(F::one()),
                |g, v| act::hard_swish_grad(g, v)),
            (Mish, "Mish", 18, 37, float, |v| v * act::softplus(v).tanh(), |g, v| act::mish_grad(g, v)),
            (ThresholdedRelu {alpha = 1.0}, "ThresholdedRelu", 10, 38, float,
                |v| if v > alpha { v } else { F::zero() },
                |g, v| if v > alpha { g } else { F::zero() }),
            (Swish {alpha = 1.0}, "Swish", 24, 39, float,
                |v| v * act::sigmoid(alpha * v),
                |g, v| act::swish_grad(g, v, alpha)),
        }
    };
}
pub(crate) use for_each_unary;

/// The activation code SiLU has in the op-code table: FusedMatMul's epilogue applies it,
/// no unary op is it (ONNX writes x·Sigmoid(x)).
pub const SILU_CODE: i32 = 4;
/// The code of "no activation".
pub const NONE_CODE: i32 = 0;
/// The activation code of ReLU6, `min(max(x, 0), 6)`: FusedMatMul's and FusedConv's
/// epilogues apply it; ONNX writes it as Clip, no unary op.
pub const RELU6_CODE: i32 = 40;

macro_rules! declare_unary {
    ($( ($v:ident $({$($f:ident = $d:expr),*})?, $onnx:literal, $since:literal, $code:literal,
         $class:ident, |$x:ident| $fwd:expr, $($grad:tt)+) ),* $(,)?) => {
        /// A unary map (see `for_each_unary!` for each op's definition).
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum UnaryOp {
            $(
                #[doc = declare_unary!(@doc $v $onnx)]
                $v $({ $(
                    #[doc = concat!("The `", stringify!($f), "` attribute (default ", stringify!($d), ").")]
                    $f: f32
                ),* })?
            ),*
        }

        impl UnaryOp {
            /// Every unary op, with its default attributes.
            pub const ALL: &'static [UnaryOp] = &[ $( UnaryOp::$v $({ $($f: $d as f32),* })? ),* ];

            /// The ONNX op name (Gelu's two forms share one).
            pub fn onnx_name(self) -> &'static str {
                match self { $( UnaryOp::$v { .. } => $onnx ),* }
            }
            /// The name of its gradient op.
            pub fn grad_name(self) -> &'static str {
                match self { $( UnaryOp::$v { .. } => concat!($onnx, "Grad") ),* }
            }
            /// The variant's own name (distinguishes Gelu's tanh form).
            pub fn variant(self) -> &'static str {
                match self { $( UnaryOp::$v { .. } => stringify!($v) ),* }
            }
            /// The opset that introduced the op.
            pub fn since(self) -> i64 {
                match self { $( UnaryOp::$v { .. } => $since ),* }
            }
            /// The op code of `cuda/opcodes.cuh` and `shaders/opcodes.wgsl`.
            pub fn code(self) -> i32 {
                match self { $( UnaryOp::$v { .. } => $code ),* }
            }
            /// Its float attributes in declaration order, padded with zeros: what the device
            /// kernels take as `alpha` and `beta`.
            pub fn params(self) -> [f32; 2] {
                match self {
                    $( UnaryOp::$v $({ $($f),* })? => {
                        let v: &[f32] = &[$($($f),*)?];
                        [v.first().copied().unwrap_or(0.0), v.get(1).copied().unwrap_or(0.0)]
                    } ),*
                }
            }
            /// Its attributes by ONNX name, defaults included.
            pub fn attrs(self) -> Vec<(&'static str, f32)> {
                match self {
                    $( UnaryOp::$v $({ $($f),* })? => vec![$($((stringify!($f), $f)),*)?] ),*
                }
            }
            /// Whether signed integer inputs are accepted (else floating ones only).
            pub fn takes_ints(self) -> bool {
                match self { $( UnaryOp::$v { .. } => declare_unary!(@ints $class) ),* }
            }
            /// Whether the op has a derivative to propagate (else the backward graph treats
            /// its output as a constant: the derivative is zero wherever it exists).
            pub fn differentiable(self) -> bool {
                match self { $( UnaryOp::$v { .. } => declare_unary!(@diff $($grad)+) ),* }
            }
            /// The op named `name` with attributes read by `attr` (name, default) — the
            /// parser's hook. Gelu's `approximate` is read by the parser.
            pub(crate) fn parse(
                name: &str,
                mut attr: impl FnMut(&'static str, f64) -> crate::error::Result<f64>,
            ) -> Option<crate::error::Result<UnaryOp>> {
                let mut build = || -> crate::error::Result<Option<UnaryOp>> {
                    Ok(match name {
                        $( $onnx if stringify!($v) != "GeluTanh" => Some(UnaryOp::$v $({ $($f: attr(stringify!($f), $d)? as f32),* })? ), )*
                        _ => None,
                    })
                };
                build().transpose()
            }
        }
    };
    (@doc Gelu $onnx:literal) => { "ONNX `Gelu` in its exact (erf) form, `approximate = \"none\"`." };
    (@doc GeluTanh $onnx:literal) => { "ONNX `Gelu` with `approximate = \"tanh\"`." };
    (@doc $v:ident $onnx:literal) => { concat!("ONNX `", $onnx, "`.") };
    (@ints signed) => { true };
    (@ints float) => { false };
    (@diff none) => { false };
    (@diff |$g:ident, $gv:ident| $e:expr) => { true };
}
for_each_unary!(declare_unary);

/// Every binary map with numpy broadcasting, one row each:
/// `(Variant, "OnnxName", since_opset, kind, code)`, where `kind` says what it computes on:
/// - `arith`: two numbers of one dtype to that dtype (code: `BIN_*` of the headers),
/// - `compare`: two values of one dtype to bool (`CMP_*`),
/// - `logic`: two bools to bool (`CMP_*`, the same kernels),
/// - `pow`: Pow, whose exponent may have another dtype (its own kernels, no code).
///
/// Mod's two forms (`fmod` 0: the remainder takes the divisor's sign, as Python's `%`;
/// 1: the dividend's, as C's `fmod`) are two variants of one ONNX op, as Gelu's are.
macro_rules! for_each_binary {
    ($m:ident) => {
        $m! {
            (Add, "Add", 7, arith, 0),
            (Sub, "Sub", 7, arith, 1),
            (Mul, "Mul", 7, arith, 2),
            (Div, "Div", 7, arith, 3),
            (Mod, "Mod", 10, arith, 4),
            (Fmod, "Mod", 10, arith, 5),
            (Min, "Min", 1, arith, 6),
            (Max, "Max", 1, arith, 7),
            (PRelu, "PRelu", 7, arith, 8),
            (Pow, "Pow", 7, pow, 14),
            (Equal, "Equal", 7, compare, 0),
            (Less, "Less", 7, compare, 1),
            (Greater, "Greater", 7, compare, 2),
            (LessOrEqual, "LessOrEqual", 12, compare, 3),
            (GreaterOrEqual, "GreaterOrEqual", 12, compare, 4),
            (And, "And", 7, logic, 5),
            (Or, "Or", 7, logic, 6),
            (Xor, "Xor", 7, logic, 7),
            (BitwiseAnd, "BitwiseAnd", 18, bitwise, 9),
            (BitwiseOr, "BitwiseOr", 18, bitwise, 10),
            (BitwiseXor, "BitwiseXor", 18, bitwise, 11),
            (BitShiftLeft, "BitShift", 11, bitwise, 12),
            (BitShiftRight, "BitShift", 11, bitwise, 13),
        }
    };
}

/// What a binary map computes on (see `for_each_binary!`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryKind {
    /// Two numbers of one dtype to that dtype (Add, Sub, Mul, Div, Mod, Min, Max, PRelu).
    Arith,
    /// Two values of one dtype to bool (Equal, Less, Greater, ...).
    Compare,
    /// Two bools to bool (And, Or, Xor).
    Logic,
    /// Pow, whose exponent may have another dtype than its base.
    Pow,
    /// On integers only: And/Or/Xor of the bits and shifts. Their codes follow the
    /// arithmetic ones (`BIN_*`), so that the arithmetic kernels run them.
    Bitwise,
}

macro_rules! declare_binary {
    ($( ($v:ident, $onnx:literal, $since:literal, $kind:ident, $code:literal) ),* $(,)?) => {
        /// A broadcasting binary map (see `for_each_binary!`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum BinaryOp {
            $(
                #[doc = declare_binary!(@doc $v $onnx)]
                $v
            ),*
        }

        impl BinaryOp {
            /// Every binary op.
            pub const ALL: &'static [BinaryOp] = &[ $( BinaryOp::$v ),* ];
            /// The ONNX op name (Mod's and BitShift's two forms share one).
            pub fn onnx_name(self) -> &'static str {
                match self { $( BinaryOp::$v => $onnx ),* }
            }
            /// The variant's own name (distinguishes Mod's and BitShift's forms).
            pub fn variant(self) -> &'static str {
                match self { $( BinaryOp::$v => stringify!($v) ),* }
            }
            /// The opset that introduced the op.
            pub fn since(self) -> i64 {
                match self { $( BinaryOp::$v => $since ),* }
            }
            /// What it computes on.
            pub fn kind(self) -> BinaryKind {
                match self { $( BinaryOp::$v => declare_binary!(@kind $kind) ),* }
            }
            /// The op code of its kernel family (`BIN_*` or `CMP_*` of the headers).
            pub fn code(self) -> i32 {
                match self { $( BinaryOp::$v => $code ),* }
            }
            /// The op named `name` (Mod's and BitShift's forms are read by the parser).
            pub(crate) fn parse(name: &str) -> Option<BinaryOp> {
                match name {
                    $( $onnx if !matches!(stringify!($v), "Fmod" | "BitShiftRight") => Some(BinaryOp::$v), )*
                    _ => None,
                }
            }
        }
    };
    (@doc Mod $onnx:literal) => { "ONNX `Mod` with `fmod = 0`: the remainder takes the divisor's sign, as Python's `%`." };
    (@doc Fmod $onnx:literal) => { "ONNX `Mod` with `fmod = 1`: the remainder takes the dividend's sign, as C's `fmod`." };
    (@doc BitShiftLeft $onnx:literal) => { "ONNX `BitShift` with `direction = \"LEFT\"`." };
    (@doc BitShiftRight $onnx:literal) => { "ONNX `BitShift` with `direction = \"RIGHT\"`." };
    (@doc $v:ident $onnx:literal) => { concat!("ONNX `", $onnx, "`.") };
    (@kind arith) => { BinaryKind::Arith };
    (@kind compare) => { BinaryKind::Compare };
    (@kind logic) => { BinaryKind::Logic };
    (@kind pow) => { BinaryKind::Pow };
    (@kind bitwise) => { BinaryKind::Bitwise };
}
for_each_binary!(declare_binary);

impl BinaryOp {
    /// Whether the output is bool (comparisons and logic).
    pub fn is_comparison(self) -> bool {
        matches!(self.kind(), BinaryKind::Compare | BinaryKind::Logic)
    }
}

/// `cuda/opcodes.cuh`: a `#define` per op code (unary `OP_*`, binary `BIN_*`/`CMP_*`).
pub fn opcodes_cuda() -> String {
    header(|name, code| format!("#define {name} {code}"))
}

/// `shaders/opcodes.wgsl`: the same codes as WGSL constants.
pub fn opcodes_wgsl() -> String {
    header(|name, code| format!("const {name}: u32 = {code}u;"))
}

/// Every code, a line each as `line` writes it, under the generated-file notice.
fn header(line: impl Fn(&str, i32) -> String) -> String {
    let mut s = String::from(
        "// Generated from src/graph/elementwise.rs (tests/opcodes.rs checks it; regenerate with\n\
         // UPDATE_OPCODES=1 cargo test --test opcodes). The op codes of the elementwise maps.\n",
    );
    let unary = code_names()
        .into_iter()
        .map(|(n, c)| (format!("OP_{n}"), c));
    for (name, code) in unary.chain(binary_code_names()) {
        s += &line(&name, code);
        s.push('\n');
    }
    s
}

/// (`BIN_<VARIANT>` or `CMP_<VARIANT>`, code) of every binary map with a code.
fn binary_code_names() -> Vec<(String, i32)> {
    BinaryOp::ALL
        .iter()
        .map(|b| {
            let prefix = match b.kind() {
                // Pow's code is the integer power of the arithmetic kernels (WebGPU's).
                BinaryKind::Arith | BinaryKind::Bitwise | BinaryKind::Pow => "BIN",
                BinaryKind::Compare | BinaryKind::Logic => "CMP",
            };
            (format!("{prefix}_{}", screaming(b.variant())), b.code())
        })
        .collect()
}

/// (SCREAMING_CASE name, code) of every code, ascending.
fn code_names() -> Vec<(String, i32)> {
    let mut v: Vec<(String, i32)> = UnaryOp::ALL
        .iter()
        .map(|u| (screaming(u.variant()), u.code()))
        .collect();
    v.push(("NONE".into(), NONE_CODE));
    v.push(("SILU".into(), SILU_CODE));
    v.push(("RELU6".into(), RELU6_CODE));
    v.sort_by_key(|(_, c)| *c);
    v
}

/// `GeluTanh` → `GELU_TANH`, `PRelu` → `PRELU`.
fn screaming(s: &str) -> String {
    let mut out = String::new();
    let mut prev_lower = false;
    for ch in s.chars() {
        if ch.is_uppercase() && prev_lower {
            out.push('_');
        }
        prev_lower = ch.is_lowercase();
        out.push(ch.to_ascii_uppercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct() {
        let v = code_names();
        for w in v.windows(2) {
            assert_ne!(w[0].1, w[1].1, "{} and {} share a code", w[0].0, w[1].0);
        }
        let mut b = binary_code_names();
        b.sort_by_key(|(n, c)| (n[..3].to_string(), *c));
        for w in b.windows(2) {
            let same_family = w[0].0[..3] == w[1].0[..3];
            assert!(
                !same_family || w[0].1 != w[1].1,
                "{} and {} share a code",
                w[0].0,
                w[1].0
            );
        }
    }

    #[test]
    fn parse_reads_defaults_and_attributes() {
        let u = UnaryOp::parse("Selu", |_, d| Ok(d)).unwrap().unwrap();
        assert_eq!(u.params(), [1.6732632, 1.050701]);
        let u = UnaryOp::parse("Elu", |n, d| Ok(if n == "alpha" { 0.5 } else { d }))
            .unwrap()
            .unwrap();
        assert_eq!(u, UnaryOp::Elu { alpha: 0.5 });
        assert_eq!(
            UnaryOp::parse("Gelu", |_, d| Ok(d)).unwrap().unwrap(),
            UnaryOp::Gelu
        );
        assert!(UnaryOp::parse("Conv", |_, d| Ok(d)).is_none());
    }
}
