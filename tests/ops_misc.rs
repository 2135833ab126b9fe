//! Cast, Identity, Constant and the view ops (Reshape, Squeeze, Unsqueeze, Flatten)
//! against plain f64 references, on every backend and dtype.

mod common;
use common::*;
use graphrun::graph::AttrValue as V;
use graphrun::DType;

fn same(args: &[Option<graphrun::Tensor>], shape: &[usize]) -> Expected {
    let x = args[0].as_ref().unwrap();
    vec![(shape.to_vec(), x.to_f64_vec())]
}

#[test]
fn reshape_zero_and_minus_one() {
    let x = rand(&[2, 3, 4], 1, -2.0, 2.0);
    check(
        op("Reshape", &[]),
        &[inp(x.clone()), cst(i64s(&[3], &[0, -1, 2]))],
        &FLOATS,
        |a| same(a, &[2, 6, 2]),
    );
    check(
        op("Reshape", &[]),
        &[inp(x.clone()), cst(i64s(&[2], &[-1, 4]))],
        &FLOATS,
        |a| same(a, &[6, 4]),
    );
    check(
        op("Reshape", &[]),
        &[inp(x.clone()), cst(i64s(&[4], &[0, 0, 2, 2]))],
        &FLOATS,
        |a| same(a, &[2, 3, 2, 2]),
    );
    // allowzero=1: a 0 is a real zero-sized dim, only valid for an empty input.
    let empty = rand(&[0, 3], 2, 0.0, 1.0);
    check(
        op("Reshape", &[("allowzero", V::Int(1))]),
        &[inp(empty), cst(i64s(&[3], &[3, 0, 5]))],
        &[DType::F32],
        |a| same(a, &[3, 0, 5]),
    );
    // Integer data moves unchanged.
    let xi = i64s(&[2, 3], &[1, -2, 3, -4, 5, -6]);
    check(
        op("Reshape", &[]),
        &[inp(xi), cst(i64s(&[1], &[-1]))],
        &[DType::F32],
        |a| same(a, &[6]),
    );
    // Bad specs are errors naming the node.
    let e = run_op(
        graphrun::BackendKind::Cpu,
        op("Reshape", &[]),
        &[inp(x.clone()), cst(i64s(&[2], &[5, -1]))],
        1,
        DType::F32,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("Reshape") && e.to_string().contains("[5, -1]"),
        "{e}"
    );
    let e = run_op(
        graphrun::BackendKind::Cpu,
        op("Reshape", &[]),
        &[inp(x), cst(i64s(&[2], &[-1, -1]))],
        1,
        DType::F32,
    )
    .unwrap_err();
    assert!(e.to_string().contains("more than one -1"), "{e}");
}

#[test]
fn squeeze_unsqueeze_flatten() {
    let x = rand(&[1, 3, 1, 4], 3, -1.0, 1.0);
    check(op("Squeeze", &[]), &[inp(x.clone())], &FLOATS, |a| {
        same(a, &[3, 4])
    });
    check(
        op("Squeeze", &[]),
        &[inp(x.clone()), cst(i64s(&[1], &[-2]))],
        &FLOATS,
        |a| same(a, &[1, 3, 4]),
    );
    check(
        op("Squeeze", &[("axes", V::Ints(vec![0]))]),
        &[inp(x.clone())],
        &FLOATS,
        |a| same(a, &[3, 1, 4]),
    );
    let e = run_op(
        graphrun::BackendKind::Cpu,
        op("Squeeze", &[("axes", V::Ints(vec![1]))]),
        &[inp(x.clone())],
        1,
        DType::F32,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("cannot squeeze axis 1 of size 3"),
        "{e}"
    );
    let y = rand(&[3, 4], 4, -1.0, 1.0);
    check(
        op("Unsqueeze", &[]),
        &[inp(y.clone()), cst(i64s(&[2], &[0, -1]))],
        &FLOATS,
        |a| same(a, &[1, 3, 4, 1]),
    );
    check(
        op("Unsqueeze", &[("axes", V::Ints(vec![1]))]),
        &[inp(y.clone())],
        &FLOATS,
        |a| same(a, &[3, 1, 4]),
    );
    check(op("Flatten", &[]), &[inp(x.clone())], &FLOATS, |a| {
        same(a, &[1, 12])
    });
    check(
        op("Flatten", &[("axis", V::Int(0))]),
        &[inp(x.clone())],
        &FLOATS,
        |a| same(a, &[1, 12]),
    );
    check(
        op("Flatten", &[("axis", V::Int(-1))]),
        &[inp(x.clone())],
        &FLOATS,
        |a| same(a, &[3, 4]),
    );
    check(
        op("Flatten", &[("axis", V::Int(4))]),
        &[inp(x)],
        &FLOATS,
        |a| same(a, &[12, 1]),
    );
}

#[test]
fn identity_on_every_dtype() {
    let x = rand(&[3, 5], 5, -3.0, 3.0);
    check(op("Identity", &[]), &[inp(x)], &FLOATS, |a| {
        same(a, &[3, 5])
    });
    check(
        op("Identity", &[]),
        &[inp(i64s(&[4], &[9, -8, 7, 0]))],
        &[DType::F32],
        |a| same(a, &[4]),
    );
    check(
        op("Identity", &[]),
        &[inp(bools(&[3], &[true, false, true]))],
        &[DType::F32],
        |a| same(a, &[3]),
    );
}

#[test]
fn cast_between_dtypes() {
    let x = f64s(&[6], &[-2.7, -0.5, 0.0, 0.49, 1.5, 123.456]);
    for (to, want) in [
        ("i64", vec![-2.0, 0.0, 0.0, 0.0, 1.0, 123.0]), // truncation toward zero
        ("i32", vec![-2.0, 0.0, 0.0, 0.0, 1.0, 123.0]),
        ("bool", vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
    ] {
        let w = want.clone();
        check(
            op("Cast", &[("to", V::Str(to.into()))]),
            &[inp(x.clone())],
            &[DType::F64, DType::F32],
            move |_| vec![(vec![6], w.clone())],
        );
    }
    // Float to float rounds to the target: the reference rounds through the target dtype.
    let y = rand(&[50], 6, -100.0, 100.0);
    for to in [DType::F16, DType::BF16, DType::F32] {
        check(
            op("Cast", &[("to", V::Str(to.name().into()))]),
            &[inp(y.clone())],
            &[DType::F64],
            move |a| {
                let v = a[0].as_ref().unwrap().cast(to).to_f64_vec();
                vec![(vec![50], v)]
            },
        );
    }
    // ONNX integer codes are accepted for `to`.
    check(
        op("Cast", &[("to", V::Int(1))]),
        &[inp(i64s(&[3], &[-5, 0, 70000]))],
        &[DType::F32],
        |_| vec![(vec![3], vec![-5.0, 0.0, 70000.0])],
    );
    check(
        op("Cast", &[("to", V::Int(7))]),
        &[inp(bools(&[2], &[true, false]))],
        &[DType::F32],
        |_| vec![(vec![2], vec![1.0, 0.0])],
    );
}

#[test]
fn constant_values() {
    let t = rand(&[2, 3], 7, -1.0, 1.0).cast(DType::F32);
    let want = t.to_f64_vec();
    check(
        op("Constant", &[("value", V::Tensor(t))]),
        &[],
        &[DType::F32],
        move |_| vec![(vec![2, 3], want.clone())],
    );
    check(
        op("Constant", &[("value_ints", V::Ints(vec![3, -1, 4]))]),
        &[],
        &[DType::F32],
        |_| vec![(vec![3], vec![3.0, -1.0, 4.0])],
    );
    check(
        op("Constant", &[("value_float", V::Float(0.25))]),
        &[],
        &[DType::F32],
        |_| vec![(vec![], vec![0.25])],
    );
    check(
        op("Constant", &[("value_floats", V::Floats(vec![1.5, -2.0]))]),
        &[],
        &[DType::F32],
        |_| vec![(vec![2], vec![1.5, -2.0])],
    );
    check(
        op("Constant", &[("value_int", V::Int(-9))]),
        &[],
        &[DType::F32],
        |_| vec![(vec![], vec![-9.0])],
    );
}

/// BitCast reads the bytes as the other type: f32 ↔ i32 against `to_bits`, f16 → i16, bool
/// → u8, f64 → i64 on the backends that hold 8-byte values; a mismatched width, a 4-bit
/// type and a cast to bool are refused at inference, naming both types.
#[test]
fn bitcast_reinterprets_bytes() {
    let xs = [-2.75f32, 0.0, -0.0, 1.0e-40, f32::INFINITY, 3.5e20];
    let x = graphrun::Tensor::from_vec(&[2, 3], xs.to_vec()).unwrap();
    let bits: Vec<i32> = xs.iter().map(|v| v.to_bits() as i32).collect();
    let as_i32 = graphrun::Tensor::from_vec(&[2, 3], bits.clone()).unwrap();
    let h = graphrun::Tensor::from_vec(&[2], vec![1.5f32, -0.25])
        .unwrap()
        .cast(DType::F16);
    let h_bits: Vec<f64> = [0x3E00u16, 0xB400]
        .iter()
        .map(|&b| b as i16 as f64)
        .collect();
    let d = graphrun::Tensor::from_vec(&[1], vec![-1.0f64]).unwrap();
    let cases: Vec<(graphrun::Tensor, &str, Vec<f64>)> = vec![
        (x.clone(), "i32", bits.iter().map(|&b| b as f64).collect()),
        (as_i32, "f32", xs.iter().map(|&v| v as f64).collect()),
        (h, "i16", h_bits),
        (bools(&[3], &[true, false, true]), "u8", vec![1.0, 0.0, 1.0]),
        (d, "i64", vec![(-1.0f64).to_bits() as i64 as f64]),
    ];
    for backend in backends() {
        for (x, to, want) in &cases {
            let wide = x.dtype().size() == 8;
            if wide && backend == graphrun::BackendKind::Wgpu {
                continue;
            }
            let got = run_raw(
                backend,
                op("BitCast", &[("to", V::Str(to.to_string()))]),
                &[inp(x.clone())],
                1,
            )
            .unwrap_or_else(|e| panic!("{backend:?} {} to {to}: {e}", x.dtype()));
            assert_eq!(got[0].dtype().name(), *to, "{backend:?}");
            assert_eq!(got[0].shape(), x.shape(), "{backend:?}");
            let g = got[0].to_f64_vec();
            assert!(
                g.iter()
                    .zip(want)
                    .all(|(a, b)| a == b || a.is_nan() && b.is_nan()),
                "{backend:?} {} to {to}: {g:?}, want {want:?}",
                x.dtype()
            );
        }
    }
    for (x, to, says) in [
        (x.clone(), "i64", "same width: f32 is 32 bits, i64 64"),
        (i64s(&[2], &[1, 2]).cast(DType::I4), "u8", "4- and 2-bit"),
        (x.cast(DType::U8), "bool", "not a boolean"),
    ] {
        let e = run_raw(
            graphrun::BackendKind::Cpu,
            op("BitCast", &[("to", V::Str(to.into()))]),
            &[inp(x)],
            1,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(says) && e.contains("BitCast"), "{e}");
    }
}
