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
