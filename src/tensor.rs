//! Host tensors: a dtype, a shape and row-major data, plus the element traits that let
//! kernels be written once for every dtype, and `.npy` / `.safetensors` in and out.

use crate::error::{Error, Result};
use bytemuck::Pod;
use half::{bf16, f16};
use std::fmt;
use std::io::{Read, Write};
use std::path::Path;

pub mod narrow;

/// Every element type, declared once: variant, Rust type, name, other names it is read
/// by, ONNX `TensorProto.DataType` code, `.npy` descr, safetensors dtype, and class.
/// `DType`, its names and codes, the file formats and the `with_*!` dispatch macros are
/// all generated from this table.
#[macro_export]
macro_rules! for_each_dtype {
    ($m:ident) => {
        $m! {
            (F32, f32, "f32", ["float32", "float"], 1, "<f4", F32, float),
            (F16, half::f16, "f16", ["float16", "half"], 10, "<f2", F16, float),
            (BF16, half::bf16, "bf16", ["bfloat16"], 16, "|V2", BF16, float),
            (F64, f64, "f64", ["float64", "double"], 11, "<f8", F64, float),
            (I64, i64, "i64", ["int64"], 7, "<i8", I64, int),
            (I32, i32, "i32", ["int32"], 6, "<i4", I32, int),
            (I16, i16, "i16", ["int16"], 5, "<i2", I16, int),
            (I8, i8, "i8", ["int8"], 3, "|i1", I8, int),
            (U64, u64, "u64", ["uint64"], 13, "<u8", U64, int),
            (U32, u32, "u32", ["uint32"], 12, "<u4", U32, int),
            (U16, u16, "u16", ["uint16"], 4, "<u2", U16, int),
            (U8, u8, "u8", ["uint8"], 2, "|u1", U8, int),
            (Bool, $crate::tensor::Bool, "bool", [], 9, "|b1", BOOL, bool),
            // The narrow types (`narrow.rs`): one byte an element, written to .npy and
            // safetensors as their bytes (the floats' bit patterns, the integers' values).
            (F8E4M3FN, $crate::tensor::narrow::F8E4M3FN, "f8e4m3fn", ["float8e4m3fn"], 17, "|u1", F8_E4M3, narrow),
            (F8E4M3FNUZ, $crate::tensor::narrow::F8E4M3FNUZ, "f8e4m3fnuz", ["float8e4m3fnuz"], 18, "|u1", F8_E4M3FNUZ, narrow),
            (F8E5M2, $crate::tensor::narrow::F8E5M2, "f8e5m2", ["float8e5m2"], 19, "|u1", F8_E5M2, narrow),
            (F8E5M2FNUZ, $crate::tensor::narrow::F8E5M2FNUZ, "f8e5m2fnuz", ["float8e5m2fnuz"], 20, "|u1", F8_E5M2FNUZ, narrow),
            (U4, $crate::tensor::narrow::U4, "u4", ["uint4"], 21, "|u1", U8, narrow),
            (I4, $crate::tensor::narrow::I4, "i4", ["int4"], 22, "|i1", I8, narrow),
            (F4E2M1, $crate::tensor::narrow::F4E2M1, "f4e2m1", ["float4e2m1"], 23, "|u1", U8, narrow),
            (U2, $crate::tensor::narrow::U2, "u2", ["uint2"], 25, "|u1", U8, narrow),
            (I2, $crate::tensor::narrow::I2, "i2", ["int2"], 26, "|i1", I8, narrow),
            (F8E8M0, $crate::tensor::narrow::F8E8M0, "f8e8m0", ["float8e8m0"], 24, "|u1", F8_E8M0, narrow)
        }
    };
}

macro_rules! dtype_enum {
    ($(($V:ident, $t:ty, $name:literal, [$($alias:literal),*], $onnx:literal, $npy:literal, $st:ident, $class:ident)),*) => {
        /// A tensor's element type.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum DType {
            $(
                #[doc = concat!("`", $name, "` (ONNX `TensorProto.DataType` ", $onnx, ").")]
                $V,
            )*
        }

        impl DType {
            /// Every dtype.
            pub const ALL: [DType; [$(DType::$V),*].len()] = [$(DType::$V),*];

            /// Its name in a model file and in messages (`f32`, `bf16`, `bool`).
            pub fn name(self) -> &'static str {
                match self {
                    $(DType::$V => $name,)*
                }
            }
            /// The dtype of a name: its own (`f32`) or numpy's and ONNX's (`float32`,
            /// `float`).
            pub fn parse(s: &str) -> Option<DType> {
                match s {
                    $($name $(| $alias)* => Some(DType::$V),)*
                    _ => None,
                }
            }
            /// ONNX TensorProto.DataType codes.
            pub fn from_onnx(code: i64) -> Option<DType> {
                match code {
                    $($onnx => Some(DType::$V),)*
                    _ => None,
                }
            }
            /// Its ONNX TensorProto.DataType code.
            pub fn onnx_code(self) -> i32 {
                match self {
                    $(DType::$V => $onnx,)*
                }
            }
            /// The `.npy` descr this dtype is written with (bf16, which numpy lacks, as 'V2').
            pub fn npy_descr(self) -> &'static str {
                match self {
                    $(DType::$V => $npy,)*
                }
            }
            fn from_npy(descr: &str) -> Option<DType> {
                // '<' little-endian, '|' not applicable, '=' native (little on every
                // machine graphrun builds for); big-endian is refused by name.
                let d = descr.trim_start_matches(['<', '|', '=']);
                [$(DType::$V),*].into_iter().find(|t| t.npy_descr()[1..] == *d)
            }
            fn safetensors(self) -> safetensors::Dtype {
                match self {
                    $(DType::$V => safetensors::Dtype::$st,)*
                }
            }
            fn from_safetensors(d: safetensors::Dtype) -> Option<DType> {
                [$(DType::$V),*].into_iter().find(|t| t.safetensors() == d)
            }
            /// The size of one element in bytes.
            pub fn size(self) -> usize {
                match self {
                    $(DType::$V => std::mem::size_of::<$t>(),)*
                }
            }
            /// Floating dtypes (f32, f16, bf16, f64).
            pub fn is_float(self) -> bool {
                match self {
                    $(DType::$V => stringify!($class) == "float",)*
                }
            }
            /// Integer dtypes (not bool).
            pub fn is_int(self) -> bool {
                match self {
                    $(DType::$V => stringify!($class) == "int",)*
                }
            }
        }
    };
}
for_each_dtype!(dtype_enum);

impl DType {
    /// Unsigned integer dtypes.
    pub fn is_unsigned(self) -> bool {
        matches!(
            self,
            DType::U8 | DType::U16 | DType::U32 | DType::U64 | DType::U4 | DType::U2
        )
    }
    /// The smallest and largest value of an integer dtype, the 4- and 2-bit ones included
    /// (`None` for floats and bool).
    pub fn int_range(self) -> Option<(i128, i128)> {
        let narrow = matches!(self, DType::I4 | DType::U4 | DType::I2 | DType::U2);
        let bits = match narrow {
            true => self.narrow_bits().unwrap_or(8),
            false => 8 * self.size() as u32,
        };
        match self {
            _ if !self.is_int() && !narrow => None,
            _ if self.is_unsigned() => Some((0, (1i128 << bits) - 1)),
            _ => Some((-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An element type a tensor can hold.
pub trait Elem: Pod + Send + Sync + PartialOrd + fmt::Debug + 'static {
    /// The dtype of a tensor of these elements.
    const DTYPE: DType;
    /// The value as f64 (rounded for the integers f64 cannot hold; bool is 0 or 1).
    fn to_f64(self) -> f64;
    /// The element nearest `v` (`as`-cast semantics for integers; bool is `v != 0`).
    fn from_f64(v: f64) -> Self;
    /// The value of an integer or bool element, exactly (`None` for floats): casts
    /// between integer dtypes go through it, as f64 cannot hold every i64 or u64.
    fn int_value(self) -> Option<i128> {
        None
    }
    /// Wraps `v` to this integer type (two's complement, as C and numpy cast).
    fn from_int(v: i128) -> Self {
        Self::from_f64(v as f64)
    }
}

/// The arithmetic type kernels compute in: f32 for f32/f16/bf16 (f32 accumulation), f64 for f64.
pub trait Real:
    num_traits::Float + num_traits::FromPrimitive + std::iter::Sum + Send + Sync + fmt::Debug + 'static
{
    /// The error function.
    fn erf(self) -> Self;
    /// The error function written with arithmetic only, so that a loop over a row
    /// vectorises: f32 uses a rational approximation (within 8 ulp; 5e-7 absolute), f64
    /// the library's.
    fn erf_v(self) -> Self;
    /// tanh written with arithmetic only, so that a loop over a row vectorises (the C
    /// library's tanh is one call per element): f32 uses a rational approximation, f64
    /// the library's.
    fn tanh_v(self) -> Self;
    /// exp written with arithmetic and selects only, so that a loop over a row vectorises:
    /// f32 reduces to 2ⁿ·e^r with |r| ≤ ln2/2 and a degree-6 polynomial (within 2 ulp of
    /// exp over all of f32, subnormal results included; 0 below −104, ∞ above 88.73, NaN
    /// kept), f64 the library's.
    fn exp_v(self) -> Self;
    /// The constant `v` in this type.
    fn c(v: f64) -> Self {
        <Self as num_traits::FromPrimitive>::from_f64(v).unwrap()
    }
}
impl Real for f32 {
    fn erf(self) -> f32 {
        libm::erff(self)
    }
    /// x·p(x²)/q(x²) on x clamped to ±7.905, where tanh is 1 to within f32 rounding: the
    /// minimax rational approximation Eigen uses (within a few ulp of tanh over all of
    /// f32; exact 0 at 0, odd, and ±1 at the clamp). NaN stays NaN.
    #[inline(always)]
    fn tanh_v(self) -> f32 {
        const A: [f32; 7] = [
            4.893_524_6e-3,
            6.372_619_3e-4,
            1.485_722_4e-5,
            5.122_297e-8,
            -8.604_672e-11,
            2.000_188e-13,
            -2.760_768_5e-16,
        ];
        const B: [f32; 4] = [4.893_525e-3, 2.268_434_6e-3, 1.185_347_1e-4, 1.198_258_4e-6];
        // Plain products and sums, not mul_add: without the FMA target feature that is a
        // library call per element.
        let x = self.clamp(-7.905_311, 7.905_311);
        let x2 = x * x;
        let p = ((A[6] * x2 + A[5]) * x2 + A[4]) * x2 + A[3];
        let p = ((p * x2 + A[2]) * x2 + A[1]) * x2 + A[0];
        let q = ((B[3] * x2 + B[2]) * x2 + B[1]) * x2 + B[0];
        x * p / q
    }
    /// x·p(x²)/q(x²), the rational approximation Eigen uses for f32, up to |x| = 3.95;
    /// ±1 beyond, as erf rounds there. NaN stays NaN.
    #[inline(always)]
    fn erf_v(self) -> f32 {
        const A: [f32; 7] = [
            -1.609_603_3e-2,
            -2.954_6e-3,
            -7.349_906_3e-4,
            -5.692_506_4e-5,
            -2.101_024e-6,
            2.770_681_4e-8,
            -2.726_142_3e-10,
        ];
        const B: [f32; 5] = [
            -1.426_474e-2,
            -7.373_329e-3,
            -1.682_827e-3,
            -2.133_740_6e-4,
            -1.456_607_2e-5,
        ];
        let x = self.clamp(-4.0, 4.0);
        let x2 = x * x;
        let p = ((A[6] * x2 + A[5]) * x2 + A[4]) * x2 + A[3];
        let p = ((p * x2 + A[2]) * x2 + A[1]) * x2 + A[0];
        let q = ((B[4] * x2 + B[3]) * x2 + B[2]) * x2 + B[1];
        let q = q * x2 + B[0];
        // Past 3.95, erf rounds to ±1 in f32 (the rational falls 2 ulps short of it).
        if self.abs() > 3.95 {
            1f32.copysign(self)
        } else {
            x * p / q
        }
    }
    #[inline(always)]
    fn exp_v(self) -> f32 {
        // Cephes' expf: n = round(x·log2 e), r = x − n·ln2 in two parts (the first exact
        // in f32), e^r by its minimax polynomial. 2ⁿ is applied as two powers of two so
        // that n down to −150 (subnormal results) and up to 128 stays exact.
        let x = self.clamp(-104.0, 88.73);
        // Rounded to nearest by adding and taking away 1.5·2²³ (f32::round is a library
        // call on the baseline target).
        const SHIFTER: f32 = 12_582_912.0;
        let n = (x * std::f32::consts::LOG2_E + SHIFTER) - SHIFTER;
        let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
        let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
            * r
            + 0.166_666_65)
            * r
            + 0.5;
        let e = p * r * r + r + 1.0;
        let n = n as i32;
        let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
        let y = e * pow2(n >> 1) * pow2(n - (n >> 1));
        if self < -104.0 {
            0.0
        } else if self > 88.73 {
            f32::INFINITY
        } else if self.is_nan() {
            self
        } else {
            y
        }
    }
}
impl Real for f64 {
    fn erf(self) -> f64 {
        libm::erf(self)
    }
    fn tanh_v(self) -> f64 {
        self.tanh()
    }
    fn exp_v(self) -> f64 {
        self.exp()
    }
    fn erf_v(self) -> f64 {
        libm::erf(self)
    }
}

/// A floating element type, with the type it accumulates in.
pub trait Float: Elem {
    /// The type it is computed in (f32 for f32, f16 and bf16; f64 for f64).
    type Acc: Real;
    /// The value in the accumulation type.
    fn to_acc(self) -> Self::Acc;
    /// The element nearest `v` (rounded to nearest for f16 and bf16).
    fn from_acc(v: Self::Acc) -> Self;
    /// `s` itself where the type is its own accumulation type (f32, f64), so a kernel can
    /// read it in place instead of widening a copy.
    fn as_acc(s: &[Self]) -> Option<&[Self::Acc]>;
    /// [`as_acc`](Float::as_acc) for writing.
    fn as_acc_mut(s: &mut [Self]) -> Option<&mut [Self::Acc]>;
}

/// Integer element types (for shape arithmetic and indices).
pub trait Int: Elem + Ord {
    /// The value as i64 (`as`-cast: u64 beyond i64's range wraps).
    fn to_i64(self) -> i64;
    /// `v` wrapped to this type (`as`-cast).
    fn from_i64(v: i64) -> Self;
}

macro_rules! float_elem {
    // Whether the type is its own accumulation type: the slice as it is, or None.
    (@same true, $s:expr) => {
        Some($s)
    };
    (@same false, $s:expr) => {{
        let _ = $s;
        None
    }};
    ($t:ty, $d:ident, $acc:ty, $to:expr, $from:expr, $same:tt) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
            fn to_f64(self) -> f64 {
                let f: fn($t) -> $acc = $to;
                f(self) as f64
            }
            fn from_f64(v: f64) -> Self {
                let f: fn($acc) -> $t = $from;
                f(v as $acc)
            }
        }
        impl Float for $t {
            type Acc = $acc;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                let f: fn($t) -> $acc = $to;
                f(self)
            }
            #[inline(always)]
            fn from_acc(v: $acc) -> Self {
                let f: fn($acc) -> $t = $from;
                f(v)
            }
            #[inline(always)]
            fn as_acc(s: &[$t]) -> Option<&[$acc]> {
                float_elem!(@same $same, s)
            }
            #[inline(always)]
            fn as_acc_mut(s: &mut [$t]) -> Option<&mut [$acc]> {
                float_elem!(@same $same, s)
            }
        }
    };
}
float_elem!(f32, F32, f32, |x| x, |x| x, true);
float_elem!(f64, F64, f64, |x| x, |x| x, true);
float_elem!(f16, F16, f32, |x| x.to_f32(), f16::from_f32, false);
float_elem!(bf16, BF16, f32, |x| x.to_f32(), bf16::from_f32, false);

macro_rules! int_elem {
    ($($t:ty => $d:ident),*) => {$(
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn int_value(self) -> Option<i128> {
                Some(self as i128)
            }
            fn from_int(v: i128) -> Self {
                v as $t
            }
        }
        impl Int for $t {
            fn to_i64(self) -> i64 {
                self as i64
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    )*};
}
int_elem!(i64 => I64, i32 => I32, i16 => I16, i8 => I8, u64 => U64, u32 => U32, u16 => U16, u8 => U8);

/// A `bool` element: one byte that is 0 or 1 (Rust's `bool` may not be viewed from
/// arbitrary bytes, so tensors hold this instead).
#[repr(transparent)]
#[derive(
    Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, bytemuck::Pod, bytemuck::Zeroable,
)]
pub struct Bool(pub u8);

impl Bool {
    /// false (0).
    pub const FALSE: Bool = Bool(0);
    /// true (1).
    pub const TRUE: Bool = Bool(1);
    /// The value as a `bool` (any non-zero byte is true).
    pub fn get(self) -> bool {
        self.0 != 0
    }
}
impl From<bool> for Bool {
    fn from(b: bool) -> Bool {
        Bool(b as u8)
    }
}
impl fmt::Debug for Bool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.get().fmt(f)
    }
}

impl Elem for Bool {
    const DTYPE: DType = DType::Bool;
    fn to_f64(self) -> f64 {
        self.get() as u8 as f64
    }
    fn from_f64(v: f64) -> Self {
        Bool::from(v != 0.0)
    }
    fn int_value(self) -> Option<i128> {
        Some(self.get() as i128)
    }
    fn from_int(v: i128) -> Self {
        Bool::from(v != 0)
    }
}

/// Runs `$body` with `$T` bound to the Rust type of a floating dtype; other dtypes take `$else`.
#[macro_export]
macro_rules! with_float {
    ($dt:expr, $T:ident => $body:expr, _ => $else:expr) => {
        $crate::with_dtypes!($dt, $T => $body,
            [F32 f32, F64 f64, F16 half::f16, BF16 half::bf16], _ => $else)
    };
}
/// Like `with_float!` for every dtype.
#[macro_export]
macro_rules! with_any {
    ($dt:expr, $T:ident => $body:expr) => {
        $crate::with_dtypes!($dt, $T => $body,
            [F32 f32, F64 f64, F16 half::f16, BF16 half::bf16, I64 i64, I32 i32, I16 i16, I8 i8,
             U64 u64, U32 u32, U16 u16, U8 u8, Bool $crate::tensor::Bool,
             F8E4M3FN $crate::tensor::narrow::F8E4M3FN, F8E4M3FNUZ $crate::tensor::narrow::F8E4M3FNUZ,
             F8E5M2 $crate::tensor::narrow::F8E5M2, F8E5M2FNUZ $crate::tensor::narrow::F8E5M2FNUZ,
             F4E2M1 $crate::tensor::narrow::F4E2M1, I4 $crate::tensor::narrow::I4,
             U4 $crate::tensor::narrow::U4, I2 $crate::tensor::narrow::I2, U2 $crate::tensor::narrow::U2,
             F8E8M0 $crate::tensor::narrow::F8E8M0])
    };
}
/// Like `with_float!` for the numeric (non-bool) dtypes.
#[macro_export]
macro_rules! with_num {
    ($dt:expr, $T:ident => $body:expr, _ => $else:expr) => {
        $crate::with_dtypes!($dt, $T => $body,
            [F32 f32, F64 f64, F16 half::f16, BF16 half::bf16, I64 i64, I32 i32, I16 i16, I8 i8,
             U64 u64, U32 u32, U16 u16, U8 u8], _ => $else)
    };
}
/// The one `match` behind `with_float!`, `with_any!` and `with_num!`: an arm per listed
/// `DType` variant binding `$T` to its Rust type, then `$else` for the rest (if given).
#[doc(hidden)]
#[macro_export]
macro_rules! with_dtypes {
    ($dt:expr, $T:ident => $body:expr, [$($V:ident $ty:ty),*] $(, _ => $else:expr)?) => {
        match $dt {
            $(
                $crate::tensor::DType::$V => {
                    type $T = $ty;
                    $body
                }
            )*
            $(_ => $else,)?
        }
    };
}

/// The most bytes one host tensor may take (0: not yet decided). By default the machine's
/// physical memory: with overcommit, a larger request would "succeed" and the process
/// would be killed while filling it, instead of getting an error.
static MAX_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Caps the bytes one host tensor may take (`--max-memory`, `GRAPHRUN_MAX_BYTES`).
pub fn set_max_bytes(bytes: usize) {
    MAX_BYTES.store(bytes.max(1), std::sync::atomic::Ordering::Relaxed);
}

/// The current cap: `set_max_bytes`, else `GRAPHRUN_MAX_BYTES`, else physical memory.
pub fn max_bytes() -> usize {
    use std::sync::atomic::Ordering::Relaxed;
    match MAX_BYTES.load(Relaxed) {
        0 => {
            let from_env = std::env::var("GRAPHRUN_MAX_BYTES")
                .ok()
                .and_then(|v| parse_size(&v).ok());
            let v = from_env
                .or_else(physical_memory)
                .unwrap_or(usize::MAX)
                .max(1);
            // Only if no `set_max_bytes` came in meanwhile (it wins).
            match MAX_BYTES.compare_exchange(0, v, Relaxed, Relaxed) {
                Ok(_) => v,
                Err(set) => set,
            }
        }
        v => v,
    }
}

fn physical_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: usize = info
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// "8G", "512M", "64K" or plain bytes.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mul) = match s.trim().chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1usize << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        Some('T') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    num.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(|v| (v * mul as f64).min(usize::MAX as f64) as usize)
        .ok_or_else(|| format!("'{s}' is not a size (e.g. 8G, 512M, 1000000)"))
}

/// An error when a whole plan (activations and weights) is over the cap.
pub fn check_plan_bytes(activations: usize, weights: usize) -> Result<()> {
    let cap = max_bytes();
    if activations.saturating_add(weights) > cap {
        crate::bail!(
            Input,
            "running this needs {} bytes ({activations} of activations, {weights} of weights), over the memory limit of {cap} bytes (raise it with GRAPHRUN_MAX_BYTES, or --max-memory on the command line)",
            activations.saturating_add(weights)
        );
    }
    Ok(())
}

/// The number of elements of a tensor of `shape` (1 for a scalar).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Number of elements, or `None` when the product overflows (hostile dims).
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// A shape as messages write it: `[2, 3]`.
pub fn fmt_shape(shape: &[usize]) -> String {
    format!(
        "[{}]",
        shape
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// A host tensor. Storage is 8-byte aligned words so any dtype can be viewed in place;
/// its capacity is kept when the tensor is re-shaped, which is how the CPU executor
/// reuses buffers without allocating per node.
#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    words: Vec<u64>,
}

/// A tensor of `shape` built from `n` values: they must be exactly its element count.
fn check_len(shape: &[usize], n: usize) -> Result<()> {
    if numel(shape) != n {
        crate::bail!(
            Input,
            "tensor of shape {} needs {} values, got {n}",
            fmt_shape(shape),
            numel(shape)
        );
    }
    Ok(())
}

impl Tensor {
    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Tensor {
        let mut t = Tensor {
            dtype,
            shape: vec![],
            words: vec![],
        };
        t.reset(dtype, shape);
        t
    }

    /// A zero-filled tensor for user-sized data: a shape over the memory cap
    /// (`set_max_bytes`) or an allocation the machine refuses is an error naming `what`
    /// and its shape, never an abort.
    pub fn try_zeros(dtype: DType, shape: &[usize], what: &str) -> Result<Tensor> {
        let bytes = checked_numel(shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| {
                crate::err!(
                    Input,
                    "{what} of shape {} is too large (its size overflows)",
                    fmt_shape(shape)
                )
            })?;
        let cap = max_bytes();
        if bytes > cap {
            crate::bail!(
                Input,
                "{what} ({dtype} {}) needs {bytes} bytes, over the memory limit of {cap} bytes (raise it with GRAPHRUN_MAX_BYTES, or --max-memory on the command line)",
                fmt_shape(shape)
            );
        }
        let words = bytes.div_ceil(8);
        let mut v: Vec<u64> = Vec::new();
        v.try_reserve_exact(words).map_err(|_| {
            crate::err!(
                Runtime,
                "out of memory: cannot allocate {bytes} bytes for {what} ({dtype} {})",
                fmt_shape(shape)
            )
        })?;
        v.resize(words, 0);
        Ok(Tensor {
            dtype,
            shape: shape.to_vec(),
            words: v,
        })
    }

    /// An untyped buffer of `bytes` bytes (a plan's buffer), allocated as `try_zeros`.
    pub fn try_alloc(bytes: usize) -> Result<Tensor> {
        Tensor::try_zeros(DType::U8, &[bytes], "a buffer")
    }

    /// Bool storage holds only the bytes 0 and 1: anything else read from a file is true.
    pub fn normalize_bools(&mut self) {
        if self.dtype == DType::Bool {
            for b in self.bytes_mut() {
                *b = (*b != 0) as u8;
            }
        }
    }

    /// Re-types and re-shapes in place, keeping (and growing) the allocation. Contents are
    /// unspecified afterwards: kernels overwrite every element.
    pub fn reset(&mut self, dtype: DType, shape: &[usize]) {
        self.dtype = dtype;
        self.shape.clear();
        self.shape.extend_from_slice(shape);
        let words = (numel(shape) * dtype.size()).div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
    }

    /// Bytes of storage this tensor holds (its capacity, not its current size).
    pub fn capacity_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// A tensor of `shape` holding `data` in row-major order; the length must match.
    pub fn from_vec<T: Elem>(shape: &[usize], data: Vec<T>) -> Result<Tensor> {
        check_len(shape, data.len())?;
        let mut t = Tensor::zeros(T::DTYPE, shape);
        t.as_mut_slice::<T>().copy_from_slice(&data);
        Ok(t)
    }

    /// A scalar (shape `[]`) holding `v`.
    pub fn scalar<T: Elem>(v: T) -> Tensor {
        Tensor::from_vec(&[], vec![v]).expect("one value")
    }

    /// Builds a tensor of `dtype` from f64 values (rounding as the dtype requires).
    pub fn from_f64(dtype: DType, shape: &[usize], data: &[f64]) -> Result<Tensor> {
        check_len(shape, data.len())?;
        let mut t = Tensor::zeros(dtype, shape);
        with_any!(dtype, T => {
            for (o, &v) in t.as_mut_slice::<T>().iter_mut().zip(data) {
                *o = T::from_f64(v);
            }
        });
        Ok(t)
    }

    /// A tensor of `dtype` and `shape` from its little-endian, row-major bytes; the
    /// length must match. Bool bytes other than 0 read as true.
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor> {
        let n = checked_numel(shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| crate::err!(Input, "shape {} is too large", fmt_shape(shape)))?;
        if n != bytes.len() {
            crate::bail!(
                Input,
                "{} tensor of shape {} needs {} bytes, got {}",
                dtype,
                fmt_shape(shape),
                n,
                bytes.len()
            );
        }
        let mut t = Tensor::try_zeros(dtype, shape, "a tensor")?;
        t.bytes_mut().copy_from_slice(bytes);
        t.normalize_bools();
        Ok(t)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The shape (empty for a scalar).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    /// The size of the elements in bytes.
    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// The elements' bytes, row-major.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.size_bytes()]
    }
    /// The elements' bytes, to be written (a bool tensor's with 0 or 1 only).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.size_bytes();
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// Views the data as `T`. Panics if `T` is not this tensor's dtype: that is a bug in
    /// graphrun (the executor checks dtypes before any kernel runs), never a user error.
    pub fn as_slice<T: Elem>(&self) -> &[T] {
        assert_eq!(T::DTYPE, self.dtype, "tensor viewed as the wrong dtype");
        let n = self.numel();
        &bytemuck::cast_slice(&self.words)[..n]
    }
    /// Views the data as `T`, to be written. Panics as `as_slice` does.
    pub fn as_mut_slice<T: Elem>(&mut self) -> &mut [T] {
        assert_eq!(T::DTYPE, self.dtype, "tensor viewed as the wrong dtype");
        let n = self.numel();
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// A bool tensor's elements as the bytes 0 and 1 (what kernels test and write).
    pub fn bool_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.as_slice::<Bool>())
    }
    /// A bool tensor's elements, to be written with 0 or 1 only.
    pub fn bool_bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self.as_mut_slice::<Bool>())
    }

    /// A copy of the elements as `T`. Panics as `as_slice` does.
    pub fn to_vec<T: Elem>(&self) -> Vec<T> {
        self.as_slice::<T>().to_vec()
    }

    /// Every element as f64 (bool as 0/1).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        with_any!(self.dtype, T => self.as_slice::<T>().iter().map(|v| v.to_f64()).collect())
    }

    /// Every element as f32 (bool as 0/1).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.to_f64_vec().into_iter().map(|v| v as f32).collect()
    }

    /// Integer contents (for shape-like inputs); floats are truncated, u64 wraps.
    pub fn to_i64_vec(&self) -> Vec<i64> {
        with_any!(self.dtype, T => self.as_slice::<T>().iter().map(|v| match v.int_value() {
            Some(i) => i as i64,
            None => v.to_f64() as i64,
        }).collect())
    }

    /// Converts to another dtype (round to nearest for floats, truncation for ints,
    /// non-zero → true for bool), as ONNX `Cast` does.
    pub fn cast(&self, to: DType) -> Tensor {
        if to == self.dtype {
            return self.clone();
        }
        let mut out = Tensor::zeros(to, &self.shape);
        cast_into(self, &mut out);
        out
    }

    /// A copy holding exactly its elements (no spare capacity from buffer reuse).
    pub fn clone_exact(&self) -> Tensor {
        let words = self.size_bytes().div_ceil(8);
        Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            words: self.words[..words].to_vec(),
        }
    }

    /// The rows `idx` of axis 0, in that order (batches of samples).
    pub fn take_rows(&self, idx: &[usize]) -> Result<Tensor> {
        let rows = self.shape().first().copied().unwrap_or(0);
        if let Some(&bad) = idx.iter().find(|&&i| i >= rows) {
            crate::bail!(Input, "row {bad} of a tensor of {rows} rows");
        }
        let row = self.size_bytes() / rows.max(1);
        let mut shape = self.shape().to_vec();
        shape[0] = idx.len();
        let mut bytes = Vec::with_capacity(row * idx.len());
        for &i in idx {
            bytes.extend_from_slice(&self.bytes()[i * row..(i + 1) * row]);
        }
        Tensor::from_bytes(self.dtype(), &shape, &bytes)
    }

    /// The same elements with another shape of the same element count.
    pub fn reshaped(mut self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.numel() {
            crate::bail!(
                Input,
                "cannot reshape {} to {}",
                fmt_shape(&self.shape),
                fmt_shape(shape)
            );
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    // ---- files --------------------------------------------------------------------
    //
    // Readers check a file's header (dtype, shape) against the memory cap before reading
    // its data, and read the data once, straight into the tensor's own buffer.

    /// Reads a .npy file.
    pub fn read_npy(path: &Path) -> Result<Tensor> {
        Tensor::read_npy_as(path, "the .npy file")
    }

    /// Reads a .npy file; `what` names it in errors ("input 'x'").
    pub fn read_npy_as(path: &Path, what: &str) -> Result<Tensor> {
        let (f, len) = crate::files::open(path, what)?;
        read_npy_from(&mut std::io::BufReader::new(f), len, what).map_err(|e| Error::io(path, e))
    }

    /// The shape of the array in a .npy file, from its header alone.
    pub fn npy_shape(path: &Path, what: &str) -> Result<Vec<usize>> {
        let (f, _) = crate::files::open(path, what)?;
        let head = read_npy_head(&mut std::io::BufReader::new(f))
            .map_err(|e| Error::Input(format!("{what} ({}): {e}", path.display())))?;
        let npy = npyz::NpyFile::new(&head[..]).map_err(|e| {
            Error::Input(format!(
                "{what} ({}): not a valid .npy file: {e}",
                path.display()
            ))
        })?;
        Ok(npy
            .shape()
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect())
    }

    /// Reads a tensor from the contents of a `.npy` file.
    pub fn from_npy_bytes(bytes: &[u8]) -> std::result::Result<Tensor, String> {
        read_npy_from(&mut { bytes }, Some(bytes.len() as u64), "the .npy array")
    }

    /// The `.npy` header of this tensor. bf16, which numpy lacks, is written as 'V2'.
    fn npy_header(&self) -> Vec<u8> {
        let descr = self.dtype.npy_descr();
        let shape = match self.shape.len() {
            0 => "()".to_string(),
            1 => format!("({},)", self.shape[0]),
            _ => format!(
                "({})",
                self.shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let mut header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        // Pad so that the data starts on a 64-byte boundary, ending with '\n'.
        let total = 10 + header.len() + 1;
        header.push_str(&" ".repeat((64 - total % 64) % 64));
        header.push('\n');
        let mut out = Vec::with_capacity(10 + header.len());
        out.extend_from_slice(b"\x93NUMPY\x01\x00");
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out
    }

    /// The `.npy` encoding of this tensor.
    pub fn to_npy_bytes(&self) -> Vec<u8> {
        let mut out = self.npy_header();
        out.extend_from_slice(self.bytes());
        out
    }

    /// Writes the `.npy` encoding to `w` without copying the data.
    pub fn write_npy_to(&self, w: &mut dyn Write) -> std::io::Result<()> {
        w.write_all(&self.npy_header())?;
        w.write_all(self.bytes())
    }

    /// Writes a .npy file whole or not at all (`files::write_atomic`).
    pub fn write_npy(&self, path: &Path) -> Result<()> {
        crate::files::write_atomic(path, |w| self.write_npy_to(w))
    }

    /// Reads every tensor of a safetensors file, in file order.
    pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
        let (f, len) = crate::files::open(path, "the .safetensors file")?;
        read_safetensors_from(&mut std::io::BufReader::new(f), len, None)
            .map_err(|e| Error::io(path, e))
    }

    /// Reads one tensor of a safetensors file, seeking past the others.
    pub fn read_safetensors_key(path: &Path, key: &str, what: &str) -> Result<Tensor> {
        let (f, len) = crate::files::open(path, what)?;
        let mut all = read_safetensors_from(&mut std::io::BufReader::new(f), len, Some(key))
            .map_err(|e| Error::io(path, e))?;
        match all.pop() {
            Some((_, t)) => Ok(t),
            None => Err(Error::io(path, format!("has no tensor named '{key}'"))),
        }
    }

    /// The tensors of a .safetensors file's bytes, in file order.
    pub fn from_safetensors_bytes(
        bytes: &[u8],
    ) -> std::result::Result<Vec<(String, Tensor)>, String> {
        read_safetensors_from(
            &mut std::io::Cursor::new(bytes),
            Some(bytes.len() as u64),
            None,
        )
    }

    /// Writes a .safetensors file whole or not at all.
    pub fn write_safetensors(tensors: &[(String, &Tensor)], path: &Path) -> Result<()> {
        crate::files::write_atomic(path, |w| Tensor::write_safetensors_to(tensors, w))
    }

    /// The .safetensors encoding, written to `w` (the data is not copied). Tensors keep
    /// the order given.
    pub fn write_safetensors_to(
        tensors: &[(String, &Tensor)],
        w: &mut dyn Write,
    ) -> std::io::Result<()> {
        let mut offset = 0;
        let infos = tensors
            .iter()
            .map(|(n, t)| {
                let info = safetensors::tensor::TensorInfo {
                    dtype: t.dtype.safetensors(),
                    shape: t.shape.clone(),
                    data_offsets: (offset, offset + t.size_bytes()),
                };
                offset += t.size_bytes();
                (n.clone(), info)
            })
            .collect();
        let meta =
            safetensors::tensor::Metadata::new(None, infos).map_err(std::io::Error::other)?;
        let mut header = serde_json::to_vec(&meta).map_err(std::io::Error::other)?;
        // The format aligns the data to 8 bytes by padding the header with spaces.
        header.resize(header.len().next_multiple_of(8), b' ');
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for (_, t) in tensors {
            w.write_all(t.bytes())?;
        }
        Ok(())
    }

    /// A short human summary: first values, mean, min, max.
    pub fn summary(&self) -> String {
        let v = self.to_f64_vec();
        let first: Vec<String> = v.iter().take(6).map(|x| fmt_num(*x)).collect();
        let more = if v.len() > 6 { ", ..." } else { "" };
        if v.is_empty() {
            return "[] (empty)".into();
        }
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        // min and max of the numbers; NaNs are counted apart (f64::min would skip them
        // silently, and an all-NaN tensor would read "min inf max -inf").
        let nans = v.iter().filter(|x| x.is_nan()).count();
        let (min, max) = if nans == v.len() {
            (f64::NAN, f64::NAN)
        } else {
            v.iter()
                .filter(|x| !x.is_nan())
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
                    (lo.min(x), hi.max(x))
                })
        };
        let nan_note = match nans {
            0 => String::new(),
            n if n == v.len() => " (all NaN)".to_string(),
            n => format!(" ({n} NaN)"),
        };
        format!(
            "[{}{}] mean {} min {} max {}{nan_note}",
            first.join(", "),
            more,
            fmt_num(mean),
            fmt_num(min),
            fmt_num(max)
        )
    }
}

/// Largest .npy header read (numpy writes a few hundred bytes; a hostile length is refused
/// before anything is allocated for it).
const NPY_MAX_HEADER: usize = 1 << 20;

/// Reads a .npy array from `r` (`len`: the bytes available, when known). The header is
/// read and checked first; the data goes straight into the tensor, whose size was checked
/// against the memory cap (`what` names it) before it was allocated.
/// The header of a `.npy` stream (magic, version, length and the header dict), checked to
/// be plain; the stream is left at the data.
fn read_npy_head(r: &mut dyn Read) -> std::result::Result<Vec<u8>, String> {
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "truncated .npy file".to_string(),
        _ => e.to_string(),
    };
    let mut head = vec![0u8; 10];
    r.read_exact(&mut head).map_err(io)?;
    if !head.starts_with(b"\x93NUMPY") {
        return Err("not a valid .npy file: it does not start with the .npy magic".into());
    }
    let hlen = if head[6] == 1 {
        u16::from_le_bytes([head[8], head[9]]) as usize
    } else {
        let mut more = [0u8; 2];
        r.read_exact(&mut more).map_err(io)?;
        head.extend_from_slice(&more);
        u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize
    };
    if hlen > NPY_MAX_HEADER {
        return Err(format!(
            "not a valid .npy file: a header of {hlen} bytes (graphrun reads up to {NPY_MAX_HEADER})"
        ));
    }
    let start = head.len();
    head.resize(start + hlen, 0);
    r.read_exact(&mut head[start..]).map_err(io)?;
    npy_header_plain(&head)?;
    Ok(head)
}

fn read_npy_from(
    r: &mut dyn Read,
    len: Option<u64>,
    what: &str,
) -> std::result::Result<Tensor, String> {
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "truncated .npy file".to_string(),
        _ => e.to_string(),
    };
    let head = read_npy_head(r)?;
    let npy = npyz::NpyFile::new(&head[..]).map_err(|e| format!("not a valid .npy file: {e}"))?;
    if npy.order() != npyz::Order::C {
        return Err("Fortran-order .npy arrays are not supported; save with C order".into());
    }
    let shape: Vec<usize> = npy
        .shape()
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
        .collect();
    let descr = match npy.dtype() {
        npyz::DType::Plain(ts) => ts.to_string(),
        other => return Err(format!("unsupported .npy dtype {other:?}")),
    };
    // Big-endian and other exotic layouts are rejected by name; what is left is stored
    // little-endian exactly as graphrun stores it (bf16 as numpy's raw 'V2').
    let Some(dtype) = DType::from_npy(&descr) else {
        return Err(format!(
            "unsupported .npy dtype '{descr}'; graphrun reads {}",
            DType::ALL
                .iter()
                .map(|d| &d.npy_descr()[1..])
                .fold(Vec::<&str>::new(), |mut v, d| {
                    if !v.contains(&d) {
                        v.push(d);
                    }
                    v
                })
                .join(", ")
        ));
    };
    let mut t = Tensor::try_zeros(dtype, &shape, what).map_err(|e| e.to_string())?;
    if let Some(len) = len {
        if len < (head.len() + t.size_bytes()) as u64 {
            return Err(format!(
                "truncated .npy file: {dtype} {} needs {} bytes of data, the file holds {}",
                fmt_shape(&shape),
                t.size_bytes(),
                len.saturating_sub(head.len() as u64)
            ));
        }
    }
    r.read_exact(t.bytes_mut()).map_err(io)?;
    t.normalize_bools();
    Ok(t)
}

/// Reads the tensors of a .safetensors file from `r` (`len`: the bytes available), all of
/// them or only `only`. The header is checked (offsets, sizes, the memory cap for what is
/// read) before any tensor is allocated; each tensor is read straight into its buffer.
fn read_safetensors_from<R: Read + std::io::Seek>(
    r: &mut R,
    len: Option<u64>,
    only: Option<&str>,
) -> std::result::Result<Vec<(String, Tensor)>, String> {
    let bad = |m: &str| format!("not a valid .safetensors file: {m}");
    let mut n = [0u8; 8];
    r.read_exact(&mut n).map_err(|_| bad("truncated header"))?;
    let n = u64::from_le_bytes(n);
    // safetensors' own limit on the header.
    if n > 100_000_000 {
        return Err(bad(&format!("a header of {n} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    r.read_exact(&mut header)
        .map_err(|_| bad("truncated header"))?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(&e.to_string()))?;
    let data_start = 8 + n;
    if let Some(len) = len {
        if len != data_start + meta.data_len() as u64 {
            return Err(bad(&format!(
                "the header describes {} bytes of data, the file holds {}",
                meta.data_len(),
                len.saturating_sub(data_start)
            )));
        }
    }
    let names: Vec<String> = match only {
        Some(k) if meta.info(k).is_some() => vec![k.to_string()],
        Some(_) => vec![],
        None => meta.offset_keys(),
    };
    let total: usize = names
        .iter()
        .filter_map(|k| meta.info(k))
        .map(|i| i.data_offsets.1 - i.data_offsets.0)
        .sum();
    let cap = max_bytes();
    if total > cap {
        return Err(format!(
            "its tensors need {total} bytes, over the memory limit of {cap} bytes (raise it with GRAPHRUN_MAX_BYTES, or --max-memory on the command line)"
        ));
    }
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let info = meta.info(&name).expect("listed from the header");
        let Some(dtype) = DType::from_safetensors(info.dtype) else {
            return Err(format!(
                "tensor '{name}' has dtype {:?}, which graphrun does not support",
                info.dtype
            ));
        };
        let mut t = Tensor::try_zeros(dtype, &info.shape, &format!("tensor '{name}'"))
            .map_err(|e| e.to_string())?;
        r.seek(std::io::SeekFrom::Start(
            data_start + info.data_offsets.0 as u64,
        ))
        .and_then(|_| r.read_exact(t.bytes_mut()))
        .map_err(|e| format!("tensor '{name}': {e}"))?;
        t.normalize_bools();
        out.push((name, t));
    }
    Ok(out)
}

fn fmt_num(x: f64) -> String {
    if x == x.trunc() && x.abs() < 1e9 {
        format!("{x:.0}")
    } else if x.abs() >= 1e-3 && x.abs() < 1e5 {
        format!("{x:.4}")
    } else {
        format!("{x:.3e}")
    }
}

/// Offset of the data in an .npy file (after magic, version and header).
/// The header text and the data of a .npy file.
fn npy_split(bytes: &[u8]) -> std::result::Result<(&[u8], &[u8]), String> {
    if bytes.len() < 10 {
        return Err("truncated .npy header".into());
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        _ => return Err("truncated .npy header".into()),
    };
    match (bytes.get(start..start + hlen), bytes.get(start + hlen..)) {
        (Some(h), Some(d)) => Ok((h, d)),
        _ => Err("truncated .npy header".into()),
    }
}

/// The header of a plain array is one dict with one shape tuple. Anything nested deeper
/// (structured dtypes, or hostile input) is refused before npyz parses it: its header
/// parser takes exponential time on deeply nested brackets (a fuzzing finding).
fn npy_header_plain(bytes: &[u8]) -> std::result::Result<(), String> {
    let (h, _) = npy_split(bytes)?;
    let count = |c: u8| h.iter().filter(|&&b| b == c).count();
    if count(b'{') > 1 || count(b'(') > 1 || count(b'[') > 0 {
        return Err(
            "unsupported .npy header: only plain arrays (one dtype, one shape) are read".into(),
        );
    }
    Ok(())
}

/// Elementwise conversion between any two dtypes, into a tensor of the same shape.
pub fn cast_into(src: &Tensor, dst: &mut Tensor) {
    debug_assert_eq!(src.numel(), dst.numel());
    // To its own type a value stays as it is, NaN payloads and signs included.
    if src.dtype() == dst.dtype() {
        dst.bytes_mut().copy_from_slice(src.bytes());
        return;
    }
    with_any!(src.dtype(), S => {
        let s = src.as_slice::<S>();
        with_any!(dst.dtype(), D => {
            cast_slice::<S, D>(s, dst.as_mut_slice::<D>())
        })
    })
}

fn cast_slice<S: Elem, D: Elem>(s: &[S], d: &mut [D]) {
    // Between integers (and bool) exactly, wrapping as C and numpy do; otherwise through
    // f64, which holds every float exactly (f64 → f32/f16/bf16 rounds to nearest).
    let ints = D::DTYPE.int_range().is_some() || D::DTYPE == DType::Bool;
    for (o, &v) in d.iter_mut().zip(s) {
        *o = match v.int_value() {
            Some(i) if ints => D::from_int(i),
            _ => D::from_f64(v.to_f64()),
        };
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor({} {} {})",
            self.dtype,
            fmt_shape(&self.shape),
            self.summary()
        )
    }
}

impl PartialEq for Tensor {
    fn eq(&self, o: &Tensor) -> bool {
        self.dtype == o.dtype && self.shape == o.shape && self.bytes() == o.bytes()
    }
}

/// The name ONNX gives a TensorProto.DataType code, for messages.
pub fn onnx_dtype_name(code: i64) -> String {
    let name = match code {
        0 => "UNDEFINED",
        1 => "FLOAT",
        2 => "UINT8",
        3 => "INT8",
        4 => "UINT16",
        5 => "INT16",
        6 => "INT32",
        7 => "INT64",
        8 => "STRING",
        9 => "BOOL",
        10 => "FLOAT16",
        11 => "DOUBLE",
        12 => "UINT32",
        13 => "UINT64",
        14 => "COMPLEX64",
        15 => "COMPLEX128",
        16 => "BFLOAT16",
        17 => "FLOAT8E4M3FN",
        18 => "FLOAT8E4M3FNUZ",
        19 => "FLOAT8E5M2",
        20 => "FLOAT8E5M2FNUZ",
        21 => "UINT4",
        22 => "INT4",
        23 => "FLOAT4E2M1",
        24 => "FLOAT8E8M0",
        25 => "UINT2",
        26 => "INT2",
        _ => return format!("dtype code {code}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::Real;

    /// The f32 rational tanh against f64's over a dense sweep, the tails, and the special
    /// values: within 4 f32 ulps of the correctly rounded result everywhere.
    #[test]
    fn f32_tanh_is_within_a_few_ulps() {
        let mut worst = 0.0f64;
        let mut x = -12.0f32;
        let mut check = |x: f32| {
            let want = (x as f64).tanh();
            let got = x.tanh_v() as f64;
            let ulp = ((want as f32).abs().max(f32::MIN_POSITIVE) as f64) * f32::EPSILON as f64;
            worst = worst.max((got - want).abs() / ulp);
        };
        while x < 12.0 {
            check(x);
            x += 1.0 / 4096.0;
        }
        for k in -40..0 {
            check(2f32.powi(k));
            check(-(2f32.powi(k)));
        }
        assert!(worst <= 4.0, "{worst} ulps");
        assert_eq!(0.0f32.tanh_v(), 0.0);
        assert_eq!(f32::INFINITY.tanh_v(), 1.0);
        assert_eq!(f32::NEG_INFINITY.tanh_v(), -1.0);
        assert!(f32::NAN.tanh_v().is_nan());
    }

    /// The f32 polynomial exp against f64's over every exponent f32 can produce (normal
    /// and subnormal results) and the special values: within 2 ulps of the correctly
    /// rounded result (an ulp of a subnormal being the smallest subnormal).
    #[test]
    fn f32_exp_is_within_two_ulps() {
        let mut worst = (0.0f64, 0.0f32);
        let mut x = -104.5f32;
        while x < 89.0 {
            let want = (x as f64).exp();
            let got = x.exp_v() as f64;
            let w = want as f32;
            let ulp = if w == 0.0 || w.is_infinite() {
                f32::from_bits(1) as f64
            } else {
                (f32::from_bits(w.to_bits() + 1) - w) as f64
            };
            if w.is_infinite() {
                assert!(got.is_infinite(), "exp({x}) = {got}");
            } else if (got - want).abs() / ulp > worst.0 {
                worst = ((got - want).abs() / ulp, x);
            }
            x += 1.0 / 1024.0 + x.abs() * 1e-6;
        }
        assert!(worst.0 <= 2.0, "{} ulps at {}", worst.0, worst.1);
        assert_eq!(0.0f32.exp_v(), 1.0);
        assert_eq!(f32::NEG_INFINITY.exp_v(), 0.0);
        assert_eq!(f32::INFINITY.exp_v(), f32::INFINITY);
        assert!(f32::NAN.exp_v().is_nan());
    }

    /// The f32 rational erf against f64's: within 8 ulps (5e-7 absolute) everywhere.
    #[test]
    fn f32_erf_is_within_eight_ulps() {
        let mut worst = (0.0f64, 0.0f32);
        let mut x = -6.0f32;
        while x < 6.0 {
            let want = libm::erf(x as f64);
            let got = x.erf_v() as f64;
            let w = (want as f32).abs().max(1e-30);
            let ulp = (f32::from_bits(w.to_bits() + 1) - w) as f64;
            if (got - want).abs() / ulp > worst.0 {
                worst = ((got - want).abs() / ulp, x);
            }
            assert!((got - want).abs() <= 5e-7, "erf({x}) = {got}, not {want}");
            x += 1.0 / 8192.0;
        }
        assert!(worst.0 <= 8.0, "{} ulps at {}", worst.0, worst.1);
        assert_eq!(0.0f32.erf_v(), 0.0);
        assert_eq!(f32::INFINITY.erf_v(), 1.0);
        assert_eq!(f32::NEG_INFINITY.erf_v(), -1.0);
        assert!(f32::NAN.erf_v().is_nan());
    }
}
