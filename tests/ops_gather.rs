//! GatherElements and GatherND, forward and gradient, on every backend and dtype, against
//! references written here from ONNX's definitions (negative indices, batch dims).

mod common;
use common::*;
use graphrun::graph::Op;
use graphrun::rng::Rng;
use graphrun::{DType, Tensor};

/// Seeded indices in [-d, d) (negative ones count from the end).
fn idx(shape: &[usize], d: usize, seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v: Vec<i64> = (0..shape.iter().product())
        .map(|_| r.int_in(-(d as i64), d as i64))
        .collect();
    i64s(shape, &v)
}

fn norm(i: f64, d: usize) -> usize {
    (if i < 0.0 { i + d as f64 } else { i }) as usize
}

/// For every output element, the flat data offset it reads.
fn elements_offsets(data: &[usize], ids: &Tensor, axis: usize) -> Vec<usize> {
    let st = strides(data);
    let iv = ids.to_f64_vec();
    indices(ids.shape())
        .iter()
        .enumerate()
        .map(|(k, p)| {
            (0..data.len())
                .map(|d| if d == axis { norm(iv[k], data[d]) } else { p[d] } * st[d])
                .sum()
        })
        .collect()
}

fn nd_offsets(data: &[usize], ids: &Tensor, b: usize) -> Vec<usize> {
    let st = strides(data);
    let (q, iv) = (ids.shape().len(), ids.to_f64_vec());
    let k = ids.shape()[q - 1];
    let slice: usize = data[b + k..].iter().product();
    let per_batch: usize = ids.shape()[b..q - 1].iter().product();
    let batch_size: usize = data[b..].iter().product();
    let mut out = vec![];
    for row in 0..iv.len() / k.max(1) {
        let mut off = (row / per_batch.max(1)) * batch_size;
        for j in 0..k {
            off += norm(iv[row * k + j], data[b + j]) * st[b + j];
        }
        out.extend((0..slice).map(|e| off + e));
    }
    out
}

/// (op, data shape, indices, output shape, offsets) of a case.
type Case = (Op, Vec<usize>, Tensor, Vec<usize>, Vec<usize>);

/// Every case.
fn cases() -> Vec<Case> {
    let mut v = vec![];
    for (axis, ishape) in [
        (1usize, vec![3, 2, 5]),
        (2, vec![2, 4, 3]),
        (0, vec![5, 4, 5]),
    ] {
        let data = vec![3, 4, 5];
        let ids = idx(&ishape, data[axis], 10 + axis as u64);
        let off = elements_offsets(&data, &ids, axis);
        let op = Op::GatherElements {
            axis: axis as i64 - if axis == 2 { 3 } else { 0 },
        };
        v.push((op, data, ids, ishape, off));
    }
    for (b, data, ishape, out) in [
        (0, vec![2, 3, 4], vec![5, 2], vec![5, 4]),
        (0, vec![2, 3, 4], vec![3, 1], vec![3, 3, 4]),
        (0, vec![2, 3, 4], vec![2, 2, 3], vec![2, 2]),
        (1, vec![2, 3, 4], vec![2, 5, 1], vec![2, 5, 4]),
        (1, vec![2, 3, 4], vec![2, 2], vec![2]),
    ] {
        let k = *ishape.last().unwrap();
        let mut ids_v = vec![];
        let mut r = Rng::new(20 + ishape.len() as u64 + b as u64);
        for i in 0..ishape.iter().product::<usize>() {
            let d = data[b + i % k];
            ids_v.push(r.int_in(-(d as i64), d as i64));
        }
        let ids = i64s(&ishape, &ids_v);
        let off = nd_offsets(&data, &ids, b);
        v.push((Op::GatherND { batch_dims: b }, data, ids, out, off));
    }
    v
}

#[test]
fn gathers_on_every_backend() {
    for (k, (op, data, ids, out, off)) in cases().into_iter().enumerate() {
        let x = randn(&data, 100 + k as u64);
        let want = |a: &[Option<Tensor>]| {
            let xv = a[0].as_ref().unwrap().to_f64_vec();
            vec![(out.clone(), off.iter().map(|&o| xv[o]).collect())]
        };
        check_exact(op.clone(), &[inp(x), inp(ids.clone())], &FLOATS, want);
        let xi = rand_ints(&data, 200 + k as u64, -50, 50);
        check_exact(op, &[inp(xi), inp(ids)], &[DType::F32], want);
    }
}

#[test]
fn gather_gradients_on_every_backend() {
    for (k, (op, data, ids, out, off)) in cases().into_iter().enumerate() {
        let dy = randn(&out, 300 + k as u64);
        let grad = op.grad_op().unwrap();
        let shape: Vec<i64> = data.iter().map(|&d| d as i64).collect();
        let args = [inp(dy), inp(ids), cst(i64s(&[shape.len()], &shape))];
        check(grad, &args, &FLOATS, |a| {
            let g = a[0].as_ref().unwrap().to_f64_vec();
            let mut acc = vec![0.0; data.iter().product()];
            for (i, &o) in off.iter().enumerate() {
                acc[o] += g[i];
            }
            vec![(data.clone(), acc)]
        });
    }
}

#[test]
fn out_of_range_indices_name_the_node() {
    for backend in backends() {
        let x = randn(&[2, 3], 1);
        let bad = i64s(&[2, 3], &[0, 1, 2, 0, 1, 2]);
        let e = run_op(
            backend,
            Op::GatherElements { axis: 0 },
            &[inp(x), inp(bad)],
            1,
            DType::F32,
        )
        .expect_err("index 2 on an axis of 2");
        assert!(
            e.to_string()
                .contains("index 2 is out of range for axis 0 of size 2"),
            "{e}"
        );
    }
}
