//! Every element type: file formats in and out, ONNX tensor data, and Cast between every
//! pair on every backend against references written here with Rust's own conversions
//! (integers exactly and wrapping, floats saturating into integers, NaN to 0).

mod common;
use common::*;
use graphrun::graph::Op;
use graphrun::onnx::proto::TensorProto;
use graphrun::onnx::tensor::from_proto;
use graphrun::{Bool, DType, Tensor};
use std::path::Path;

/// Values every dtype holds exactly: small non-negative integers, as f64.
fn small(n: usize) -> Vec<f64> {
    (0..n).map(|i| ((i * 37 + 11) % 100) as f64).collect()
}

#[test]
fn npy_and_safetensors_keep_every_dtype() {
    for dt in DType::ALL {
        let v: Vec<f64> = small(6)
            .iter()
            .map(|&x| {
                if dt == DType::Bool {
                    (x as i64 % 2) as f64
                } else {
                    x
                }
            })
            .collect();
        let t = Tensor::from_f64(dt, &[2, 3], &v).unwrap();
        // The narrow types travel as their bytes, read back as i8/u8 where the file format
        // has no such type.
        let same = |back: &Tensor, how: &str| match dt.narrow_bits() {
            Some(_) => {
                assert_eq!(back.bytes(), t.bytes(), "{dt} through {how}");
                assert!(
                    back.dtype() == dt || [DType::I8, DType::U8].contains(&back.dtype()),
                    "{dt} through {how}: read as {}",
                    back.dtype()
                );
            }
            None => assert_eq!(*back, t, "{dt} through {how}"),
        };
        same(&Tensor::from_npy_bytes(&t.to_npy_bytes()).unwrap(), ".npy");
        let dir = std::env::temp_dir().join(format!("graphrun_dtypes_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("{dt}.safetensors"));
        Tensor::write_safetensors(&[("t".to_string(), &t)], &p).unwrap();
        let read = Tensor::read_safetensors(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        same(&read[0].1, ".safetensors");
    }
}

#[test]
fn onnx_typed_fields_decode_every_integer_type() {
    // The narrow integers and bool travel widened in int32_data, u32/u64 in uint64_data.
    type Case = (DType, Vec<i32>, Vec<u64>, Vec<f64>);
    let cases: [Case; 7] = [
        (
            DType::I8,
            vec![-128, 127, -1],
            vec![],
            vec![-128.0, 127.0, -1.0],
        ),
        (DType::U8, vec![0, 255, 7], vec![], vec![0.0, 255.0, 7.0]),
        (
            DType::I16,
            vec![-32768, 32767, 5],
            vec![],
            vec![-32768.0, 32767.0, 5.0],
        ),
        (
            DType::U16,
            vec![0, 65535, 9],
            vec![],
            vec![0.0, 65535.0, 9.0],
        ),
        (DType::Bool, vec![0, 1, 1], vec![], vec![0.0, 1.0, 1.0]),
        (
            DType::U32,
            vec![],
            vec![0, 4294967295, 3],
            vec![0.0, 4294967295.0, 3.0],
        ),
        (
            DType::U64,
            vec![],
            vec![0, u64::MAX, 3],
            vec![0.0, u64::MAX as f64, 3.0],
        ),
    ];
    for (dt, i32s, u64s, want) in cases {
        let p = TensorProto {
            dims: vec![3],
            data_type: dt.onnx_code(),
            int32_data: i32s,
            uint64_data: u64s,
            ..Default::default()
        };
        let t = from_proto(&p, Path::new("."), "t").unwrap();
        assert_eq!(t.dtype(), dt);
        assert_eq!(t.to_f64_vec(), want, "{dt}");
    }
    // u64 beyond 2^53 is kept exactly (f64 would round it).
    let p = TensorProto {
        dims: vec![1],
        data_type: DType::U64.onnx_code(),
        uint64_data: vec![u64::MAX - 1],
        ..Default::default()
    };
    let t = from_proto(&p, Path::new("."), "t").unwrap();
    assert_eq!(t.to_vec::<u64>(), vec![u64::MAX - 1]);
}

/// `v` (an integer) wrapped to integer dtype `dt`, as C and numpy cast.
fn wrap(v: i128, dt: DType) -> f64 {
    let bits = dt.size() * 8;
    let m = 1i128 << bits;
    let r = v.rem_euclid(m);
    (if !dt.is_unsigned() && r >= m / 2 {
        r - m
    } else {
        r
    }) as f64
}

#[test]
fn casts_between_integers_are_exact_and_wrap() {
    let v: Vec<i64> = vec![300, -1, -129, 70000, i64::MAX, i64::MIN, 0, 255];
    let x = Tensor::from_vec(&[v.len()], v.clone()).unwrap();
    for dt in DType::ALL.into_iter().filter(|d| d.is_int()) {
        let got = x.cast(dt);
        let want: Vec<f64> = v.iter().map(|&i| wrap(i as i128, dt)).collect();
        assert_eq!(got.to_f64_vec(), want, "i64 -> {dt}");
    }
    // u64 above i64::MAX back to i64: the same bits.
    let u = Tensor::from_vec(&[2], vec![u64::MAX, 1u64 << 63]).unwrap();
    assert_eq!(u.cast(DType::I64).to_vec::<i64>(), vec![-1, i64::MIN]);
    // Bool: non-zero is true, either way.
    let b = Tensor::from_vec(&[3], vec![0u8, 2, 255])
        .unwrap()
        .cast(DType::Bool);
    assert_eq!(
        b.to_vec::<Bool>(),
        vec![Bool::FALSE, Bool::TRUE, Bool::TRUE]
    );
}

#[test]
fn floats_saturate_into_integers() {
    let v = vec![1e10, -1e10, 3.7, -3.7, f64::NAN, 200.5];
    let x = Tensor::from_vec(&[v.len()], v.clone()).unwrap();
    for dt in DType::ALL.into_iter().filter(|d| d.is_int()) {
        let got = x.cast(dt).to_f64_vec();
        let (lo, hi) = if dt.is_unsigned() {
            (0.0, 2f64.powi(dt.size() as i32 * 8) - 1.0)
        } else {
            let h = 2f64.powi(dt.size() as i32 * 8 - 1);
            (-h, h - 1.0)
        };
        let want: Vec<f64> = v
            .iter()
            .map(|&f| {
                if f.is_nan() {
                    0.0
                } else {
                    f.trunc().clamp(lo, hi)
                }
            })
            .collect();
        assert_eq!(got, want, "f64 -> {dt}");
        // The same from f32 on every backend (these values are exact in f32).
        let x32 = x.cast(DType::F32);
        for backend in backends() {
            let out = run_op(
                backend,
                Op::Cast { to: dt },
                &[inp(x32.clone())],
                1,
                DType::F32,
            )
            .unwrap_or_else(|e| panic!("f32 -> {dt} on {backend:?}: {e}"));
            assert_eq!(out[0].to_f64_vec(), want, "f32 -> {dt} on {backend:?}");
        }
    }
}

/// Cast between every pair of dtypes on every backend, on values every dtype holds
/// exactly (so the reference is the values themselves, 0/1 for bool). A backend may
/// refuse only dtypes it has no type for (`NOT_ON_BACKEND`).
#[test]
fn cast_between_every_pair_on_every_backend() {
    let v = small(10);
    for from in DType::ALL {
        for to in DType::ALL {
            // 0 and 1, which every type holds, where bool or a narrow type is involved.
            let narrow = [from, to].iter().any(|d| d.narrow_bits().is_some());
            let e8m0 = [from, to].contains(&DType::F8E8M0);
            let src: Vec<f64> = if e8m0 {
                // E8M0 holds powers of two only (no 0); bool and i2 hold 1 of them.
                let one = [from, to]
                    .iter()
                    .any(|&d| d == DType::Bool || d == DType::I2);
                v.iter()
                    .map(|&x| {
                        if one {
                            1.0
                        } else {
                            1.0 + (x as i64 % 2) as f64
                        }
                    })
                    .collect()
            } else if from == DType::Bool || narrow {
                v.iter().map(|&x| (x as i64 % 2) as f64).collect()
            } else {
                v.clone()
            };
            let x = Tensor::from_f64(from, &[2, 5], &src).unwrap();
            let want: Vec<f64> = src
                .iter()
                .map(|&s| {
                    if to == DType::Bool {
                        (s != 0.0) as u8 as f64
                    } else {
                        s
                    }
                })
                .collect();
            for backend in backends() {
                let r = run_op(backend, Op::Cast { to }, &[inp(x.clone())], 1, from);
                match r {
                    Ok(out) => {
                        assert_eq!(out[0].to_f64_vec(), want, "{from} -> {to} on {backend:?}")
                    }
                    Err(e) => assert!(
                        graphrun::backends::not_on(backend, from)
                            || graphrun::backends::not_on(backend, to),
                        "{from} -> {to} on {backend:?}: {e}"
                    ),
                }
            }
        }
    }
}

#[test]
fn arithmetic_wraps_in_the_narrow_type() {
    // u8: 200 + 100 = 44, 3 - 5 = 254, 16 * 17 = 16; i8: 100 + 100 = -56, -128 / -1 = -128.
    let a = Tensor::from_vec(&[3], vec![200u8, 3, 16]).unwrap();
    let b = Tensor::from_vec(&[3], vec![100u8, 5, 17]).unwrap();
    for backend in backends() {
        for (op, want) in [
            ("Add", [44.0, 8.0, 33.0]),
            ("Sub", [100.0, 254.0, 255.0]),
            ("Mul", [32.0, 15.0, 16.0]),
        ] {
            let out = run_op(
                backend,
                bin(op),
                &[inp(a.clone()), inp(b.clone())],
                1,
                DType::F32,
            )
            .unwrap();
            assert_eq!(out[0].to_f64_vec(), want, "u8 {op} on {backend:?}");
        }
        let x = Tensor::from_vec(&[2], vec![100i8, -128]).unwrap();
        let y = Tensor::from_vec(&[2], vec![100i8, -1]).unwrap();
        let out = run_op(
            backend,
            bin("Add"),
            &[inp(x.clone()), inp(y.clone())],
            1,
            DType::F32,
        )
        .unwrap();
        assert_eq!(out[0].to_f64_vec(), [-56.0, 127.0], "i8 Add on {backend:?}");
        let out = run_op(backend, bin("Div"), &[inp(x), inp(y)], 1, DType::F32).unwrap();
        assert_eq!(out[0].to_f64_vec(), [1.0, -128.0], "i8 Div on {backend:?}");
    }
}

#[test]
fn sixty_four_bit_arithmetic_wraps_on_every_backend() {
    // WebGPU runs these on 32-bit word pairs: carries, borrows, the wide product, the
    // long division and the signed comparisons all cross the word boundary here.
    let a = vec![
        i64::MAX,
        i64::MIN,
        -5,
        1 << 40,
        -(1 << 33) - 7,
        123_456_789_012,
    ];
    let b = vec![1, -1, 3, (1 << 30) + 3, 1 << 32, -1_000_003];
    let x = Tensor::from_vec(&[6], a.clone()).unwrap();
    let y = Tensor::from_vec(&[6], b.clone()).unwrap();
    type Map = fn(i64, i64) -> i64;
    let ops: [(&str, Map); 7] = [
        ("Add", i64::wrapping_add),
        ("Sub", i64::wrapping_sub),
        ("Mul", i64::wrapping_mul),
        ("Div", i64::wrapping_div),
        ("Min", i64::min),
        ("Max", i64::max),
        ("BitwiseXor", |p, q| p ^ q),
    ];
    for backend in backends() {
        for (name, f) in ops {
            let out = run_op(
                backend,
                bin(name),
                &[inp(x.clone()), inp(y.clone())],
                1,
                DType::F32,
            )
            .unwrap_or_else(|e| panic!("i64 {name} on {backend:?}: {e}"));
            let want: Vec<i64> = a.iter().zip(&b).map(|(&p, &q)| f(p, q)).collect();
            assert_eq!(out[0].to_vec::<i64>(), want, "i64 {name} on {backend:?}");
        }
        // Mod takes the divisor's sign, Fmod the dividend's.
        let m = Op::parse("Mod", &[], "node", None).unwrap();
        let out = run_op(backend, m, &[inp(x.clone()), inp(y.clone())], 1, DType::F32).unwrap();
        let want: Vec<i64> = a
            .iter()
            .zip(&b)
            .map(|(&p, &q)| {
                let r = p.wrapping_rem(q);
                if r != 0 && (r < 0) != (q < 0) {
                    r + q
                } else {
                    r
                }
            })
            .collect();
        assert_eq!(out[0].to_vec::<i64>(), want, "i64 Mod on {backend:?}");
        let out = run_op(
            backend,
            bin("Less"),
            &[inp(x.clone()), inp(y.clone())],
            1,
            DType::F32,
        )
        .unwrap();
        let want: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(p, q)| (p < q) as u8 as f64)
            .collect();
        assert_eq!(out[0].to_f64_vec(), want, "i64 Less on {backend:?}");
        // u64: above 2^63 compares and divides unsigned.
        let u = Tensor::from_vec(&[3], vec![u64::MAX, 1 << 63, 7]).unwrap();
        let v = Tensor::from_vec(&[3], vec![3u64, 1, u64::MAX]).unwrap();
        let out = run_op(
            backend,
            bin("Div"),
            &[inp(u.clone()), inp(v.clone())],
            1,
            DType::F32,
        )
        .unwrap();
        assert_eq!(
            out[0].to_vec::<u64>(),
            vec![u64::MAX / 3, 1 << 63, 0],
            "u64 Div on {backend:?}"
        );
        let out = run_op(backend, bin("Greater"), &[inp(u), inp(v)], 1, DType::F32).unwrap();
        assert_eq!(
            out[0].to_f64_vec(),
            vec![1.0, 1.0, 0.0],
            "u64 Greater on {backend:?}"
        );
    }
}

#[test]
fn clip_and_integer_powers_on_every_backend() {
    let clip = Op::parse("Clip", &[], "node", None).unwrap();
    let pow = bin("Pow");
    for dt in DType::ALL.into_iter().filter(|d| d.is_int()) {
        let v: Vec<f64> = vec![0.0, 1.0, 2.0, 3.0, 5.0, 7.0];
        let x = Tensor::from_f64(dt, &[6], &v).unwrap();
        let lo = Tensor::from_f64(dt, &[], &[1.0]).unwrap();
        let hi = Tensor::from_f64(dt, &[], &[5.0]).unwrap();
        let e = Tensor::from_f64(dt, &[6], &[3.0, 2.0, 5.0, 0.0, 1.0, 2.0]).unwrap();
        let ef = Tensor::from_f64(DType::F32, &[6], &[3.0, 2.0, 5.0, 0.0, 1.0, 2.0]).unwrap();
        // 2^5 and 7^2 fit every integer type; the powers wrap nowhere here.
        let powers = [0.0, 1.0, 32.0, 1.0, 5.0, 49.0];
        for backend in backends() {
            let args = [inp(x.clone()), inp(lo.clone()), inp(hi.clone())];
            let out = run_op(backend, clip.clone(), &args, 1, DType::F32)
                .unwrap_or_else(|e| panic!("{dt} Clip on {backend:?}: {e}"));
            assert_eq!(
                out[0].to_f64_vec(),
                [1.0, 1.0, 2.0, 3.0, 5.0, 5.0],
                "{dt} Clip on {backend:?}"
            );
            for exp in [&e, &ef] {
                let r = run_op(
                    backend,
                    pow.clone(),
                    &[inp(x.clone()), inp(exp.clone())],
                    1,
                    DType::F32,
                );
                match r {
                    Ok(out) => assert_eq!(
                        out[0].to_f64_vec(),
                        powers,
                        "{dt} ^ {} on {backend:?}",
                        exp.dtype()
                    ),
                    Err(err) => assert!(
                        graphrun::backends::not_on(backend, dt),
                        "{dt} ^ {} on {backend:?}: {err}",
                        exp.dtype()
                    ),
                }
            }
        }
    }
    // Wrapping: 3^41 in u8 keeps the low 8 bits (CPU reference: u8::wrapping_pow).
    let x = Tensor::from_vec(&[1], vec![3u8]).unwrap();
    let e = Tensor::from_vec(&[1], vec![41u8]).unwrap();
    for backend in backends() {
        let out = run_op(
            backend,
            pow.clone(),
            &[inp(x.clone()), inp(e.clone())],
            1,
            DType::F32,
        )
        .unwrap();
        assert_eq!(
            out[0].to_vec::<u8>(),
            vec![3u8.wrapping_pow(41)],
            "u8 Pow on {backend:?}"
        );
    }
}

fn bin(name: &str) -> Op {
    Op::parse(name, &[], "node", None).unwrap()
}

/// The bytes a narrow type stores: every pattern of the 8-bit floats, the low 4 bits of
/// E2M1, the sign- or zero-extended values of the 4- and 2-bit integers.
fn narrow_patterns(dt: DType) -> Vec<u8> {
    match dt {
        DType::F4E2M1 | DType::U4 => (0..16).collect(),
        DType::I4 => (-8i8..8).map(|v| v as u8).collect(),
        DType::U2 => (0..4).collect(),
        DType::I2 => (-2i8..2).map(|v| v as u8).collect(),
        _ => (0..=255).collect(),
    }
}

/// `out` as the CPU's `want`: narrow and integer outputs by their bytes, floats by value
/// (any NaN for a NaN: a NaN's payload in f16 is the device's choice).
fn same_as_cpu(out: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(out.dtype(), want.dtype(), "{what}");
    if out.dtype().is_float() && out.dtype().narrow_bits().is_none() {
        for (i, (a, b)) in out.to_f64_vec().iter().zip(want.to_f64_vec()).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan(),
                "{what}: element {i}: {a} where the CPU gives {b}"
            );
        }
    } else {
        for (i, (a, b)) in out.bytes().iter().zip(want.bytes()).enumerate() {
            assert_eq!(a, b, "{what}: byte {i}");
        }
    }
}

/// The narrow storage types on CUDA and WebGPU: Cast to them from floats (every value
/// the type holds, the midpoints between neighbours, where ties go to the even pattern,
/// one f32 step either side of them, overflow, infinities, NaN, −0, values below the
/// smallest subnormal), from integers and bool, from each of them to every dtype, and the
/// ops that only move elements; each to the CPU's output (whose conversions the
/// `tensor::narrow` unit tests and ONNX's node tests hold to ml_dtypes).
#[test]
fn narrow_types_cast_and_move_on_every_backend() {
    let gpus: Vec<_> = backends()
        .into_iter()
        .filter(|&b| b != graphrun::BackendKind::Cpu)
        .collect();
    let cpu = graphrun::BackendKind::Cpu;
    let cast = |to| Op::Cast { to };
    for nt in DType::ALL.into_iter().filter(|d| d.narrow_bits().is_some()) {
        let codes = narrow_patterns(nt);
        let all = Tensor::from_bytes(nt, &[codes.len()], &codes).unwrap();
        let mut fin: Vec<f64> = all
            .to_f64_vec()
            .into_iter()
            .filter(|v| v.is_finite())
            .collect();
        fin.sort_by(f64::total_cmp);
        fin.dedup();
        let step = |v: f32, d: i32| f32::from_bits((v.to_bits() as i32 + d) as u32);
        let mut probe: Vec<f32> = fin.iter().map(|&v| v as f32).collect();
        for w in fin.windows(2) {
            let m = ((w[0] + w[1]) / 2.0) as f32;
            if m != 0.0 {
                probe.extend([m, step(m, 1), step(m, -1)]);
            }
        }
        let max = fin.last().copied().unwrap() as f32;
        probe.extend([
            max * 1.03,
            -max * 1.03,
            max * 1.2,
            max * 4.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.0,
            1e-30,
            -1e-30,
            1e-42,
            3.75,
            -3.75,
            -7.5,
            9.99,
            1e10,
            -1e10,
            3e9,
            1e20,
            -1e20,
        ]);
        let xf = Tensor::from_vec(&[probe.len()], probe).unwrap();
        let ints: Vec<i64> = (-300..300).step_by(7).chain([i64::MAX, i64::MIN]).collect();
        let xi = i64s(&[ints.len()], &ints);
        let sources = [
            xf.clone(),
            xf.cast(DType::F16),
            xf.cast(DType::BF16),
            xf.cast(DType::F64),
            xi.clone(),
            xi.cast(DType::I32),
            xi.cast(DType::I8),
            xi.cast(DType::U8),
            xi.cast(DType::Bool),
        ];
        let mut runs: Vec<(Op, Vec<Arg>, String)> = sources
            .iter()
            .map(|x| {
                (
                    cast(nt),
                    vec![inp(x.clone())],
                    format!("{} -> {nt}", x.dtype()),
                )
            })
            .collect();
        for to in DType::ALL {
            runs.push((cast(to), vec![inp(all.clone())], format!("{nt} -> {to}")));
        }
        // The ops that move elements, on a [4, 8] block of the patterns.
        let block: Vec<u8> = (0..32).map(|i| codes[(i * 7 + 3) % codes.len()]).collect();
        let b = Tensor::from_bytes(nt, &[4, 8], &block).unwrap();
        let idx = i64s(&[3], &[2, 0, 3]);
        let cond = bools(&[4, 8], &(0..32).map(|i| i % 3 == 0).collect::<Vec<_>>());
        let b2 = Tensor::from_bytes(
            nt,
            &[4, 8],
            &block.iter().rev().copied().collect::<Vec<_>>(),
        )
        .unwrap();
        let ints_attr = |v: &[i64]| graphrun::graph::AttrValue::Ints(v.to_vec());
        let int_attr = graphrun::graph::AttrValue::Int;
        let moves = [
            (
                op("Transpose", &[("perm", ints_attr(&[1, 0]))]),
                vec![inp(b.clone())],
            ),
            (
                op("Concat", &[("axis", int_attr(1))]),
                vec![inp(b.clone()), inp(b2.clone())],
            ),
            (
                op("Gather", &[("axis", int_attr(0))]),
                vec![inp(b.clone()), inp(idx)],
            ),
            (op("Where", &[]), vec![inp(cond), inp(b.clone()), inp(b2)]),
            (
                op("Slice", &[]),
                vec![
                    inp(b.clone()),
                    cst(i64s(&[2], &[1, 2])),
                    cst(i64s(&[2], &[3, 7])),
                ],
            ),
            (
                op("Expand", &[]),
                vec![
                    inp(b.clone().reshaped(&[4, 1, 8]).unwrap()),
                    cst(i64s(&[3], &[4, 3, 8])),
                ],
            ),
        ];
        for (o, args) in moves {
            let what = format!("{} of {nt}", o.name());
            runs.push((o, args, what));
        }
        for (o, args, what) in runs {
            let want = run_raw(cpu, o.clone(), &args, 1)
                .unwrap_or_else(|e| panic!("{what} on the CPU: {e}"));
            for &backend in &gpus {
                match run_raw(backend, o.clone(), &args, 1) {
                    Ok(out) => same_as_cpu(&out[0], &want[0], &format!("{what} on {backend:?}")),
                    Err(e) => {
                        let refusable = args.iter().any(|a| match a {
                            Arg::In(t) => {
                                graphrun::backends::not_on(backend, t.dtype())
                                    && t.dtype().narrow_bits().is_none()
                            }
                            _ => false,
                        }) || matches!(o, Op::Cast { to } if graphrun::backends::not_on(backend, to) && to.narrow_bits().is_none());
                        assert!(refusable, "{what} on {backend:?}: {e}");
                    }
                }
            }
        }
    }
}
