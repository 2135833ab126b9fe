//! TensorProto → `Tensor`: the element data from `raw_data`, from the typed fields, or
//! from an external data file; every size checked against the dims before anything is
//! allocated, so that a corrupt file is an error rather than a huge allocation or a panic.

use super::proto::{TensorProto, DATA_LOCATION_EXTERNAL};
use crate::error::{Error, Result};
use crate::tensor::{checked_numel, fmt_shape, DType, Tensor};
use half::{bf16, f16};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

pub use crate::tensor::onnx_dtype_name;

/// The graphrun dtype of an ONNX element type, or an error naming `what`.
pub fn dtype_of(code: i64, what: &str) -> Result<DType> {
    DType::from_onnx(code).ok_or_else(|| {
        Error::Graph(format!(
            "{what} has element type {}, which graphrun does not support \
             (it reads every numeric type up to 64 bits, BOOL, the FLOAT8 types but E8M0, \
             FLOAT4E2M1, INT4, UINT4, INT2 and UINT2)",
            onnx_dtype_name(code)
        ))
    })
}

/// Converts a TensorProto; `base` is the folder external data paths are relative to,
/// `what` names the tensor in errors ("initializer 'w'").
pub fn from_proto(t: &TensorProto, base: &Path, what: &str) -> Result<Tensor> {
    let err = |msg: String| Error::Graph(format!("{what}: {msg}"));
    let dtype = dtype_of(t.data_type as i64, what)?;
    let mut shape = Vec::with_capacity(t.dims.len());
    for &d in &t.dims {
        let d = usize::try_from(d).map_err(|_| err(format!("negative dim {d} in {:?}", t.dims)))?;
        shape.push(d);
    }
    let n = checked_numel(&shape)
        .filter(|n| n.checked_mul(dtype.size()).is_some())
        .ok_or_else(|| err(format!("dims {:?} overflow the address space", t.dims)))?;
    let packed = dtype.narrow_bits().is_some_and(|b| b < 8);
    if t.data_location == DATA_LOCATION_EXTERNAL && packed {
        return Err(err(format!(
            "{dtype} (packed, several elements a byte) in external data is not read"
        )));
    }
    if t.data_location == DATA_LOCATION_EXTERNAL {
        return read_external(t, base, dtype, &shape, what).map_err(err);
    }
    if let Some(bits) = dtype.narrow_bits() {
        return narrow(t, dtype, &shape, n, bits).map_err(err);
    }
    if !t.raw_data.is_empty() || n == 0 {
        return Tensor::from_bytes(dtype, &shape, &t.raw_data).map_err(|e| err(e.to_string()));
    }
    let count = |len: usize, field: &str| -> Result<()> {
        if len == n {
            Ok(())
        } else if len == 0 {
            Err(err(format!(
                "no data: the shape {} has {n} elements but neither raw_data, {field} nor external data is set",
                fmt_shape(&shape)
            )))
        } else {
            Err(err(format!(
                "{field} holds {len} values but the shape {} has {n} elements",
                fmt_shape(&shape)
            )))
        }
    };
    match dtype {
        DType::F32 => {
            count(t.float_data.len(), "float_data")?;
            Tensor::from_vec(&shape, t.float_data.clone())
        }
        DType::F64 => {
            count(t.double_data.len(), "double_data")?;
            Tensor::from_vec(&shape, t.double_data.clone())
        }
        DType::I64 => {
            count(t.int64_data.len(), "int64_data")?;
            Tensor::from_vec(&shape, t.int64_data.clone())
        }
        DType::I32 => {
            count(t.int32_data.len(), "int32_data")?;
            Tensor::from_vec(&shape, t.int32_data.clone())
        }
        // The narrow integers and bool travel widened in int32_data, u32 and u64 in
        // uint64_data; each narrows back as a cast does.
        DType::I16 | DType::I8 | DType::U16 | DType::U8 | DType::Bool => {
            count(t.int32_data.len(), "int32_data")?;
            Tensor::from_vec(&shape, t.int32_data.clone()).map(|w| w.cast(dtype))
        }
        DType::U64 | DType::U32 => {
            count(t.uint64_data.len(), "uint64_data")?;
            Tensor::from_vec(&shape, t.uint64_data.clone()).map(|w| w.cast(dtype))
        }
        // 16-bit floats travel as their bit patterns in int32_data.
        DType::F16 => {
            count(t.int32_data.len(), "int32_data")?;
            let v: Vec<f16> = t
                .int32_data
                .iter()
                .map(|&x| f16::from_bits(x as u16))
                .collect();
            Tensor::from_vec(&shape, v)
        }
        DType::BF16 => {
            count(t.int32_data.len(), "int32_data")?;
            let v: Vec<bf16> = t
                .int32_data
                .iter()
                .map(|&x| bf16::from_bits(x as u16))
                .collect();
            Tensor::from_vec(&shape, v)
        }
        // Read by `narrow` above.
        _ => Err(crate::err!(Graph, "{dtype} data in typed fields")),
    }
    .map_err(|e| err(e.to_string()))
}

/// A narrow type's elements (`bits` each, several to a byte below 8, lowest bits first)
/// from raw_data or int32_data (a packed byte in each), one byte an element in the tensor.
fn narrow(
    t: &TensorProto,
    dtype: DType,
    shape: &[usize],
    n: usize,
    bits: u32,
) -> Result<Tensor, String> {
    let need = n.div_ceil(8 / bits as usize);
    let packed: std::borrow::Cow<[u8]> = match (t.raw_data.is_empty(), t.int32_data.is_empty()) {
        (false, _) => (&t.raw_data[..]).into(),
        (true, false) => t.int32_data.iter().map(|&x| x as u8).collect::<Vec<u8>>().into(),
        (true, true) if n == 0 => Vec::new().into(),
        (true, true) => {
            return Err(format!(
                "no data: the shape {} has {n} elements but neither raw_data, int32_data nor external data is set",
                fmt_shape(shape)
            ))
        }
    };
    if packed.len() != need {
        return Err(format!(
            "{dtype} data of shape {} takes {need} bytes ({bits} bits an element), got {}",
            fmt_shape(shape),
            packed.len()
        ));
    }
    let mut out = Tensor::try_zeros(dtype, shape, "a tensor").map_err(|e| e.to_string())?;
    crate::tensor::narrow::unpack(dtype, &packed, out.bytes_mut());
    Ok(out)
}

/// Reads external data straight into the tensor `t` becomes. The file must resolve
/// (symlinks followed) inside `base`, the model's folder, as the ONNX checker requires;
/// the tensor's size was checked against the memory cap before it was allocated.
fn read_external(
    t: &TensorProto,
    base: &Path,
    dtype: DType,
    shape: &[usize],
    what: &str,
) -> Result<Tensor, String> {
    let entry = |k: &str| {
        t.external_data
            .iter()
            .find(|e| e.key == k)
            .map(|e| e.value.as_str())
    };
    let number = |k: &str| -> Result<Option<u64>, String> {
        entry(k)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| format!("external data {k} '{v}' is not a non-negative integer"))
            })
            .transpose()
    };
    let Some(location) = entry("location") else {
        return Err("external data without a 'location'".into());
    };
    let path = crate::files::resolve_inside(base, Path::new(location))
        .map_err(|e| format!("external data location: {e}"))?;
    let offset = number("offset")?.unwrap_or(0);
    let mut out = Tensor::try_zeros(dtype, shape, what).map_err(|e| e.to_string())?;
    let bytes = out.size_bytes();
    if let Some(len) = number("length")? {
        if len != bytes as u64 {
            return Err(format!(
                "external data length {len} does not match the {bytes} bytes its dims need"
            ));
        }
    }
    let (mut f, size) = crate::files::open(&path, what).map_err(|e| e.to_string())?;
    let size = size.unwrap_or(0);
    if offset
        .checked_add(bytes as u64)
        .is_none_or(|end| end > size)
    {
        return Err(format!(
            "{} holds {size} bytes; the tensor needs {bytes} from offset {offset}",
            path.display()
        ));
    }
    f.seek(SeekFrom::Start(offset))
        .and_then(|_| f.read_exact(out.bytes_mut()))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    out.normalize_bools();
    Ok(out)
}
