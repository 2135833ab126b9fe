mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::{DType, Tensor};
#[test]
fn dbg() {
    let n = 70000usize;
    for (m, nn) in [(1usize, 1usize), (2, 3), (64, 64)] {
        let a = Tensor::from_f64(DType::F32, &[m, n], &vec![1.0; m * n]).unwrap();
        let b = Tensor::from_f64(DType::F32, &[n, nn], &vec![1.0; n * nn]).unwrap();
        let o = op("MatMul", &[]);
        for bk in backends() {
            let r = run_op(
                bk,
                o.clone(),
                &[inp(a.clone()), inp(b.clone())],
                1,
                DType::F32,
            )
            .unwrap();
            let v = r[0].to_f64_vec();
            eprintln!("MatMul {m}x{nn} {bk:?} {:?}", &v[..1]);
        }
    }
    let x = Tensor::from_f64(
        DType::F32,
        &[1, n],
        &(0..n).map(|i| (i % 7) as f64).collect::<Vec<_>>(),
    )
    .unwrap();
    let g = Tensor::from_f64(DType::F32, &[n], &vec![1.0; n]).unwrap();
    let o = op("LayerNormalization", &[("axis", AttrValue::Int(-1))]);
    for bk in backends() {
        let r = run_op(
            bk,
            o.clone(),
            &[inp(x.clone()), inp(g.clone()), inp(g.clone())],
            1,
            DType::F32,
        )
        .unwrap();
        let v = r[0].to_f64_vec();
        eprintln!("LN {bk:?} {:?} {:?}", &v[..2], &v[n - 2..]);
    }
    let o = op("ReduceSumSquare", &[]);
    for bk in backends() {
        let r = run_op(bk, o.clone(), &[inp(g.clone())], 1, DType::F32);
        eprintln!("RSS {bk:?} {:?}", r.map(|r| r[0].to_f64_vec()));
    }
}
