//! .onnx import: tensors in every encoding, opset-dependent forms, names, and bad files
//! (SPEC §9: one clear error, never a panic). Models are built here with the same prost
//! messages the importer decodes, so each test says exactly what its file holds.

#[path = "common/dirs.rs"]
mod dirs;
use dirs::*;

use graphrun::graph::Dim;
use graphrun::onnx::proto::{
    attr_type, AttributeProto, Dimension, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
    StringStringEntryProto, TensorProto, TensorShapeProto, TypeProto, TypeProtoOptional,
    TypeProtoSequence, TypeProtoTensor, ValueInfoProto,
};
use graphrun::{Model, Session, SessionOptions, Tensor};
use prost::Message;
use std::collections::HashMap;

use std::process::Command;

fn node(op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        op_type: op.into(),
        attribute: attrs,
        ..Default::default()
    }
}

fn ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::INTS,
        ints: v.to_vec(),
        ..Default::default()
    }
}
fn int(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::INT,
        i: v,
        ..Default::default()
    }
}
fn float(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::FLOAT,
        f: v,
        ..Default::default()
    }
}

/// A tensor-typed graph input; a dim is a size or a symbol.
fn input(name: &str, elem: i32, dims: &[Result<i64, &str>]) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TypeProtoTensor {
                elem_type: elem,
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| match d {
                            Ok(v) => Dimension {
                                dim_value: Some(*v),
                                dim_param: None,
                            },
                            Err(p) => Dimension {
                                dim_value: None,
                                dim_param: Some(p.to_string()),
                            },
                        })
                        .collect(),
                }),
            }),
            ..Default::default()
        }),
    }
}
fn output(name: &str) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: None,
    }
}

fn f32_raw(name: &str, dims: &[i64], v: &[f32]) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: 1,
        raw_data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ..Default::default()
    }
}

fn model(opset: i64, g: GraphProto) -> Vec<u8> {
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: opset,
        }],
        graph: Some(g),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Writes `bytes` as `<dir>/<name>` and loads it.
fn load(dir: &std::path::Path, name: &str, bytes: &[u8]) -> graphrun::Result<Model> {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    Model::load(&p)
}

fn run(m: &Model, feeds: &[(&str, Tensor)]) -> Vec<Tensor> {
    let feeds: HashMap<String, Tensor> = feeds
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let mut s = Session::new(m.graph.clone(), SessionOptions::unfused()).unwrap();
    s.run(&feeds).unwrap().into_iter().map(|(_, t)| t).collect()
}

#[test]
fn initializers_in_every_encoding() {
    let d = tmpdir("enc");
    std::fs::write(
        d.join("weights.bin"),
        [0u8; 8]
            .iter()
            .copied()
            .chain([5.0f32, 6.0].iter().flat_map(|x| x.to_le_bytes()))
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    let typed_f32 = TensorProto {
        name: "a".into(),
        dims: vec![2],
        data_type: 1,
        float_data: vec![1.0, 2.0],
        ..Default::default()
    };
    let typed_f64 = TensorProto {
        name: "b".into(),
        dims: vec![2],
        data_type: 11,
        double_data: vec![0.5, 0.25],
        ..Default::default()
    };
    let typed_i64 = TensorProto {
        name: "c".into(),
        dims: vec![2],
        data_type: 7,
        int64_data: vec![-3, 4],
        ..Default::default()
    };
    // f16 travels as bit patterns in int32_data: 0x3C00 is 1.0, 0xC000 is -2.0.
    let typed_f16 = TensorProto {
        name: "h".into(),
        dims: vec![2],
        data_type: 10,
        int32_data: vec![0x3C00, 0xC000],
        ..Default::default()
    };
    let external = TensorProto {
        name: "e".into(),
        dims: vec![2],
        data_type: 1,
        data_location: 1,
        external_data: vec![
            StringStringEntryProto {
                key: "location".into(),
                value: "weights.bin".into(),
            },
            StringStringEntryProto {
                key: "offset".into(),
                value: "8".into(),
            },
            StringStringEntryProto {
                key: "length".into(),
                value: "8".into(),
            },
        ],
        ..Default::default()
    };
    let g = GraphProto {
        initializer: vec![
            typed_f32,
            typed_f64,
            typed_i64,
            typed_f16,
            external,
            f32_raw("r", &[], &[7.0]),
        ],
        output: ["a", "b", "c", "h", "e", "r"].map(output).to_vec(),
        node: vec![],
        ..Default::default()
    };
    let m = load(&d, "enc.onnx", &model(17, g)).unwrap();
    let got = |n: &str| m.graph.initializer(n).unwrap().tensor.to_f64_vec();
    assert_eq!(got("a"), [1.0, 2.0]);
    assert_eq!(got("b"), [0.5, 0.25]);
    assert_eq!(got("c"), [-3.0, 4.0]);
    assert_eq!(got("h"), [1.0, -2.0]);
    assert_eq!(got("e"), [5.0, 6.0]);
    assert_eq!(got("r"), [7.0]);
    // Floating weights are trainable; a one-element constant is not.
    assert!(m.graph.initializer("a").unwrap().trainable);
    assert!(!m.graph.initializer("r").unwrap().trainable);
    assert!(!m.graph.initializer("c").unwrap().trainable);
}

/// BatchNormalization's running mean and variance are not trained; its scale and bias are.
#[test]
fn batch_norm_statistics_are_not_trainable() {
    let d = tmpdir("bn_stats");
    let c4 = |name: &str, v: f32| f32_raw(name, &[4], &[v, v + 0.5, v + 1.0, v + 1.5]);
    let g = GraphProto {
        input: vec![input("x", 1, &[Ok(2), Ok(4), Ok(3)])],
        initializer: vec![
            c4("scale", 1.0),
            c4("bias", 0.1),
            c4("mean", 0.2),
            c4("var", 1.0),
        ],
        output: vec![output("y")],
        node: vec![node(
            "BatchNormalization",
            &["x", "scale", "bias", "mean", "var"],
            &["y"],
            vec![],
        )],
        ..Default::default()
    };
    let m = load(&d, "bn.onnx", &model(15, g)).unwrap();
    let trainable = |n: &str| m.graph.initializer(n).unwrap().trainable;
    assert!(trainable("scale") && trainable("bias"));
    assert!(!trainable("mean") && !trainable("var"));
}

#[test]
fn graph_inputs_dims_names_and_initializer_inputs() {
    let d = tmpdir("inputs");
    let g = GraphProto {
        node: vec![
            node("MatMul", &["x", "w"], &["y0"], vec![]),
            node("Relu", &["y0"], &["y"], vec![]),
        ],
        // `w` is both an input and an initializer: from IR version 4 on, its default.
        input: vec![
            input("x", 1, &[Err("batch size"), Ok(2)]),
            input("w", 1, &[Ok(2), Ok(3)]),
        ],
        initializer: vec![f32_raw("w", &[2, 3], &[1., 0., -1., 0., 1., 1.])],
        output: vec![output("y")],
        ..Default::default()
    };
    let m = load(&d, "in.onnx", &model(17, g.clone())).unwrap();
    assert_eq!(m.graph.inputs.len(), 2);
    assert!(m.graph.initializers.is_empty());
    assert_eq!(
        m.graph.inputs[0].shape,
        [Dim::Sym("batch_size".into()), Dim::Fixed(2)]
    );
    assert_eq!(
        m.graph.inputs[1].default.as_ref().unwrap().to_f64_vec(),
        [1., 0., -1., 0., 1., 1.]
    );
    // The caller may override the default.
    let x = Tensor::from_vec(&[1, 2], vec![2.0f32, 3.0]).unwrap();
    let w2 = Tensor::from_vec(&[2, 3], vec![1.0f32, 1., 1., 1., 1., 1.]).unwrap();
    assert_eq!(
        run(&m, &[("x", x.clone()), ("w", w2)])[0].to_f64_vec(),
        [5.0, 5.0, 5.0]
    );
    // A default that does not fit the input's type is an error.
    let mut bad = g.clone();
    bad.initializer = vec![f32_raw("w", &[3, 2], &[0.; 6])];
    let e = load_err(&d, "baddef.onnx", &model(17, bad));
    assert!(
        e.contains("graph input 'w'") && e.contains("does not fit"),
        "{e}"
    );
    // Written as YAML and read back, the input keeps its default.
    let yaml = d.join("in.yaml");
    m.save(&yaml).unwrap();
    let back = Model::load(&yaml).unwrap();
    assert_eq!(back.graph.inputs[1].default, m.graph.inputs[1].default);
    assert_eq!(run(&back, &[("x", x)])[0].to_f64_vec(), [2.0, 3.0, 1.0]);
    // Before IR version 4 every initializer was listed as an input: a constant.
    let mut old = ModelProto::decode(model(17, g).as_slice()).unwrap();
    old.ir_version = 3;
    let m3 = load(&d, "ir3.onnx", &old.encode_to_vec()).unwrap();
    assert_eq!(m3.graph.inputs.len(), 1);
    assert!(m3.graph.initializer("w").is_some());
    // Unnamed nodes get stable names.
    let names: Vec<&str> = m.graph.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["MatMul_0", "Relu_1"]);
    assert_eq!(m.graph.name, "in");
    let x = Tensor::from_vec(&[1, 2], vec![2.0f32, 3.0]).unwrap();
    assert_eq!(run(&m, &[("x", x)])[0].to_f64_vec(), [2.0, 3.0, 1.0]);
}

#[test]
fn opset_forms_softmax_clip_slice_reduce_split() {
    let d = tmpdir("opsets");
    let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
    let xt = Tensor::from_vec(&[2, 3, 4], x.clone()).unwrap();
    // Opset 11 Softmax at axis 1 normalises over the flattened [3, 4] block.
    let g = GraphProto {
        node: vec![node("Softmax", &["x"], &["y"], vec![int("axis", 1)])],
        input: vec![input("x", 1, &[Ok(2), Ok(3), Ok(4)])],
        output: vec![output("y")],
        ..Default::default()
    };
    let m = load(&d, "softmax11.onnx", &model(11, g.clone())).unwrap();
    let y = run(&m, &[("x", xt.clone())])[0].to_f64_vec();
    for b in 0..2 {
        let row = &x[b * 12..(b + 1) * 12];
        let z: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
        for k in 0..12 {
            let want = (row[k] as f64).exp() / z;
            assert!((y[b * 12 + k] - want).abs() < 1e-6, "{b} {k}");
        }
    }
    // Opset 13 Softmax at axis 1 is along axis 1 alone.
    let m = load(&d, "softmax13.onnx", &model(13, g)).unwrap();
    let y = run(&m, &[("x", xt.clone())])[0].to_f64_vec();
    let s: f64 = (0..3).map(|j| y[j * 4]).sum();
    assert!((s - 1.0).abs() < 1e-6);

    // Opset 10 Clip takes min/max attributes; opset 9 Slice takes starts/ends/axes.
    let g = GraphProto {
        node: vec![
            node(
                "Clip",
                &["x"],
                &["c"],
                vec![float("min", -0.5), float("max", 0.25)],
            ),
            node(
                "Slice",
                &["c"],
                &["y"],
                vec![ints("starts", &[1]), ints("ends", &[3]), ints("axes", &[2])],
            ),
        ],
        input: vec![input("x", 1, &[Ok(2), Ok(3), Ok(4)])],
        output: vec![output("y")],
        ..Default::default()
    };
    let m = load(&d, "clip9.onnx", &model(9, g)).unwrap();
    let y = run(&m, &[("x", xt.clone())])[0].clone();
    assert_eq!(y.shape(), [2, 3, 2]);
    let want: Vec<f64> = (0..24)
        .filter(|i| (1..3).contains(&(i % 4)))
        .map(|i| (x[i] as f64).clamp(-0.5, 0.25))
        .collect();
    let got = y.to_f64_vec();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-7);
    }

    // Opset 11 ReduceSum (axes attribute) and Split (split attribute).
    let g = GraphProto {
        node: vec![
            node(
                "ReduceSum",
                &["x"],
                &["s"],
                vec![ints("axes", &[1]), int("keepdims", 0)],
            ),
            node(
                "Split",
                &["s"],
                &["a", "b"],
                vec![int("axis", 1), ints("split", &[1, 3])],
            ),
        ],
        input: vec![input("x", 1, &[Ok(2), Ok(3), Ok(4)])],
        output: vec![output("a"), output("b")],
        ..Default::default()
    };
    let m = load(&d, "reduce11.onnx", &model(11, g)).unwrap();
    let out = run(&m, &[("x", xt)]);
    assert_eq!(out[0].shape(), [2, 1]);
    assert_eq!(out[1].shape(), [2, 3]);
    let s0: f64 = (0..3).map(|j| x[j * 4] as f64).sum();
    assert!((out[0].to_f64_vec()[0] - s0).abs() < 1e-6);
}

#[test]
fn constant_nodes_and_tensor_attributes() {
    let d = tmpdir("const");
    let value = AttributeProto {
        name: "value".into(),
        r#type: attr_type::TENSOR,
        t: Some(f32_raw("", &[3], &[1.0, 2.0, 3.0])),
        ..Default::default()
    };
    let g = GraphProto {
        node: vec![
            node("Constant", &[], &["k"], vec![value]),
            node("Add", &["x", "k"], &["y"], vec![]),
        ],
        input: vec![input("x", 1, &[Ok(3)])],
        output: vec![output("y")],
        ..Default::default()
    };
    let m = load(&d, "const.onnx", &model(17, g)).unwrap();
    let x = Tensor::from_vec(&[3], vec![10.0f32, 20.0, 30.0]).unwrap();
    assert_eq!(run(&m, &[("x", x)])[0].to_f64_vec(), [11.0, 22.0, 33.0]);
}

/// The error of loading `bytes` as an .onnx file; loading must fail, never panic.
fn load_err(dir: &std::path::Path, name: &str, bytes: &[u8]) -> String {
    match load(dir, name, bytes) {
        Ok(_) => panic!("{name} loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_unsupported_op_in_one_error() {
    let d = tmpdir("unsupported");
    let mut conv2 = node("ImageDecoder", &["p", "w"], &["q"], vec![]);
    conv2.name = "conv_b".into();
    let mut fused = node("FusedGemm", &["q", "w"], &["r"], vec![]);
    fused.domain = "com.microsoft".into();
    let g = GraphProto {
        node: vec![
            node("ImageDecoder", &["x", "w"], &["c"], vec![]),
            node("StringSplit", &["c"], &["p"], vec![]),
            conv2,
            fused,
            node("Relu", &["r"], &["y"], vec![]),
        ],
        input: vec![input("x", 1, &[Ok(1), Ok(1), Ok(4), Ok(4)])],
        initializer: vec![f32_raw("w", &[1, 1, 1, 1], &[1.0])],
        output: vec![output("y")],
        ..Default::default()
    };
    let e = load_err(&d, "conv.onnx", &model(17, g));
    assert!(e.contains("conv.onnx"), "{e}");
    assert!(
        e.contains("does not support 3 ops of this model (4 nodes)")
            && e.contains("ImageDecoder (2 nodes: '#0', 'conv_b')")
            && e.contains("StringSplit (1 node: '#1')")
            && e.contains("com.microsoft::FusedGemm"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "one error: {e}");
}

#[test]
fn opsets_graphrun_cannot_honor_are_refused() {
    let d = tmpdir("opset");
    let g = GraphProto {
        node: vec![node("Relu", &["x"], &["y"], vec![])],
        input: vec![input("x", 1, &[Ok(2)])],
        output: vec![output("y")],
        ..Default::default()
    };
    let e = load_err(&d, "new.onnx", &model(28, g.clone()));
    assert!(e.contains("opset 28") && e.contains("1 to 27"), "{e}");
    // Under opsets 1 to 6, only the ops whose definition is opset 7's: Relu dropped
    // `consumed_inputs` at 6, so opset 5's Relu is refused and opset 6's runs.
    let e = load_err(&d, "old.onnx", &model(5, g.clone()));
    assert!(
        e.contains("node '#0' (Relu)")
            && e.contains("after opset 5")
            && e.contains("version_converter"),
        "{e}"
    );
    load(&d, "opset6.onnx", &model(6, g.clone())).expect("opset 6's Relu is opset 7's");
    let mut no_default = ModelProto::decode(model(17, g.clone()).as_slice()).unwrap();
    no_default.opset_import[0].domain = "com.example".into();
    let e = load_err(&d, "nodefault.onnx", &no_default.encode_to_vec());
    assert!(e.contains("no ai.onnx opset"), "{e}");
    // An op newer than the imported opset is not valid ONNX.
    let g = GraphProto {
        node: vec![node("Gelu", &["x"], &["y"], vec![])],
        input: vec![input("x", 1, &[Ok(2)])],
        output: vec![output("y")],
        ..Default::default()
    };
    let e = load_err(&d, "gelu17.onnx", &model(17, g));
    assert!(e.contains("Gelu exists from opset 20 on"), "{e}");
    // ONNX's Attention needs K and V: graphrun's packed form (both omitted) is not ONNX.
    let g = GraphProto {
        node: vec![node(
            "Attention",
            &["x", "", ""],
            &["y"],
            vec![int("q_num_heads", 2), int("kv_num_heads", 2)],
        )],
        input: vec![input("x", 1, &[Ok(1), Ok(3), Ok(48)])],
        output: vec![output("y")],
        ..Default::default()
    };
    let e = load_err(&d, "packed.onnx", &model(23, g));
    assert!(e.contains("inputs K and V are required"), "{e}");
}

#[test]
fn bad_files_are_one_clear_error() {
    let d = tmpdir("bad");
    let e = load_err(
        &d,
        "garbage.onnx",
        b"this is not a protobuf \xff\xff\xff\xff",
    );
    assert!(
        e.contains("garbage.onnx") && e.contains("not a valid ONNX model"),
        "{e}"
    );
    let e = load_err(&d, "empty.onnx", b"");
    assert!(
        e.contains("no ai.onnx opset") || e.contains("no graph"),
        "{e}"
    );
    assert!(Model::load(d.join("nonexistent.onnx"))
        .unwrap_err()
        .to_string()
        .contains("nonexistent.onnx"));

    let init = |t: TensorProto| GraphProto {
        initializer: vec![t],
        output: vec![output("w")],
        ..Default::default()
    };
    // Dims whose product overflows: refused before anything is allocated.
    let huge = TensorProto {
        name: "w".into(),
        dims: vec![1 << 40, 1 << 40],
        data_type: 1,
        ..Default::default()
    };
    let e = load_err(&d, "huge.onnx", &model(17, init(huge)));
    assert!(
        e.contains("initializer 'w'") && e.contains("overflow"),
        "{e}"
    );
    let short = TensorProto {
        raw_data: vec![0; 4],
        ..f32_raw("w", &[1 << 30], &[])
    };
    let e = load_err(&d, "short.onnx", &model(17, init(short)));
    assert!(e.contains("initializer 'w'") && e.contains("bytes"), "{e}");
    let neg = f32_raw("w", &[-1], &[]);
    let e = load_err(&d, "neg.onnx", &model(17, init(neg)));
    assert!(e.contains("negative dim"), "{e}");
    let strings = TensorProto {
        name: "w".into(),
        dims: vec![1],
        data_type: 8,
        string_data: vec![b"a".to_vec()],
        ..Default::default()
    };
    let e = load_err(&d, "str.onnx", &model(17, init(strings)));
    assert!(
        e.contains("STRING") && e.contains("does not support"),
        "{e}"
    );
    let nodata = TensorProto {
        name: "w".into(),
        dims: vec![3],
        data_type: 1,
        ..Default::default()
    };
    let e = load_err(&d, "nodata.onnx", &model(17, init(nodata)));
    assert!(e.contains("no data"), "{e}");
    // External data must stay inside the model's folder, and be long enough.
    let ext = |loc: &str| TensorProto {
        name: "w".into(),
        dims: vec![4],
        data_type: 1,
        data_location: 1,
        external_data: vec![StringStringEntryProto {
            key: "location".into(),
            value: loc.into(),
        }],
        ..Default::default()
    };
    let e = load_err(&d, "escape.onnx", &model(17, init(ext("../secret.bin"))));
    assert!(e.contains("outside the model's folder"), "{e}");
    std::fs::write(d.join("short.bin"), [0u8; 6]).unwrap();
    let e = load_err(&d, "shortext.onnx", &model(17, init(ext("short.bin"))));
    assert!(e.contains("holds 6 bytes"), "{e}");
    // A graph input dim that is negative, or so large that sizes overflow at run time.
    let g = |dims: &[Result<i64, &str>]| GraphProto {
        node: vec![node("Relu", &["x"], &["y"], vec![])],
        input: vec![input("x", 1, dims)],
        output: vec![output("y")],
        ..Default::default()
    };
    let e = load_err(&d, "negdim.onnx", &model(17, g(&[Ok(-2)])));
    assert!(
        e.contains("graph input 'x'") && e.contains("negative"),
        "{e}"
    );
    let e = load_err(
        &d,
        "bigdim.onnx",
        &model(17, g(&[Ok(1 << 40), Ok(1 << 40)])),
    );
    assert!(
        e.contains("graph input 'x'") && e.contains("too large"),
        "{e}"
    );
}

#[test]
fn truncated_and_corrupted_files_never_panic() {
    let d = tmpdir("trunc");
    let good =
        std::fs::read("tests/fixtures/onnx/gpt_block_explicit_torchscript/model.onnx").unwrap();
    let path = d.join("t.onnx");
    let mut failures = 0;
    for cut in (0..good.len()).step_by(97) {
        std::fs::write(&path, &good[..cut]).unwrap();
        failures += Model::load(&path).is_err() as usize;
    }
    assert!(failures > 0);
    // Flipped bytes: whatever decodes must either load or fail, not panic.
    let mut x: u64 = 12345;
    for _ in 0..300 {
        let mut bad = good.clone();
        for _ in 0..4 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let i = (x >> 33) as usize % bad.len();
            bad[i] ^= (x >> 13) as u8 | 1;
        }
        std::fs::write(&path, &bad).unwrap();
        if let Ok(m) = Model::load(&path) {
            let _ = m.random_inputs(0, &Default::default());
        }
    }
}

fn graphrun(args: &[&str]) -> (bool, i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_graphrun"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn every_command_takes_onnx_and_convert_writes_yaml() {
    let d = tmpdir("cli");
    let onnx = "tests/fixtures/onnx/gpt_block_explicit_dynamo/model.onnx";
    let x = "x=tests/fixtures/onnx/gpt_block_explicit_dynamo/in_0.npy";
    let (ok, _, out, err) = graphrun(&[
        onnx,
        "--input",
        x,
        "--out-dir",
        d.join("a").to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("y: f32 [2, 8, 16]"), "{out}");
    let (ok, _, out, err) = graphrun(&["inspect", onnx]);
    assert!(ok, "{err}");
    assert!(out.contains("Attention 1"), "{out}");
    let (ok, _, out, err) = graphrun(&["bench", onnx, "--iters", "2", "--warmup", "1"]);
    assert!(ok && out.contains("median"), "{out}{err}");
    let (ok, _, _, err) = graphrun(&[onnx, "--backward", "--verify-fusion", "-q"]);
    assert!(ok, "{err}");

    let yaml = d.join("block.yaml");
    let (ok, _, out, err) = graphrun(&["convert", onnx, "-o", yaml.to_str().unwrap()]);
    assert!(ok && out.contains("wrote"), "{out}{err}");
    // It says that the large initializers went into a file beside the YAML.
    let side = d.join("block.safetensors");
    assert!(side.exists(), "{out}");
    assert!(
        out.contains(&format!("wrote {} (", side.display())),
        "{out}"
    );
    let (ok, _, _, err) = graphrun(&[
        yaml.to_str().unwrap(),
        "--input",
        x,
        "--out-dir",
        d.join("b").to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read(d.join("a/y.npy")).unwrap(),
        std::fs::read(d.join("b/y.npy")).unwrap(),
        "the converted YAML model computes the same bits"
    );
    // Converting again from the YAML gives the same file (its side file named after it).
    let again = d.join("again.yaml");
    let (ok, _, _, err) = graphrun(&[
        "convert",
        yaml.to_str().unwrap(),
        "-o",
        again.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read_to_string(&yaml).unwrap(),
        std::fs::read_to_string(&again)
            .unwrap()
            .replace("again.safetensors", "block.safetensors")
    );
    // An .onnx file has no training: section; --loss names the scalar to minimise.
    let ce = "tests/fixtures/onnx/embed_ce_dynamo/model.onnx";
    let (ok, code, _, err) = graphrun(&["train", ce, "--steps", "2", "-q"]);
    assert!(!ok && code == 2 && err.contains("--loss OUTPUT"), "{err}");
    let (ok, _, out, err) = graphrun(&[
        "train", ce, "--loss", "loss", "--steps", "20", "--lr", "0.05", "-q",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("loss"), "{out}");
    // A bad model is exit code 2 and one line.
    std::fs::write(d.join("bad.onnx"), b"\x08\x07garbage").unwrap();
    let (ok, code, _, err) = graphrun(&[d.join("bad.onnx").to_str().unwrap()]);
    assert!(!ok && code == 2 && err.lines().count() == 1, "{code} {err}");
}

/// ONNX lets nodes share a name; such a file imports (the repeats renamed) and runs.
#[test]
fn nodes_sharing_a_name_import_and_run() {
    let d = tmpdir("same_names");
    let mut a = node("Relu", &["x"], &["h"], vec![]);
    let mut b = node("Neg", &["h"], &["y"], vec![]);
    a.name = "act".into();
    b.name = "act".into();
    let mut c = node("Abs", &["y"], &["z"], vec![]);
    c.name = "act_1".into();
    let g = GraphProto {
        node: vec![a, b, c],
        input: vec![input("x", 1, &[Ok(4)])],
        output: vec![output("y"), output("z")],
        ..Default::default()
    };
    let m = load(&d, "same.onnx", &model(17, g)).unwrap();
    let mut names: Vec<&str> = m.graph.nodes.iter().map(|n| n.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["act", "act_1", "act_2"]);
    let x = Tensor::from_vec(&[4], vec![-1.5f32, 2.0, -0.25, 3.0]).unwrap();
    let out = run(&m, &[("x", x)]);
    assert_eq!(out[0].to_f64_vec(), [0.0, -2.0, 0.0, -3.0]);
    assert_eq!(out[1].to_f64_vec(), [0.0, 2.0, 0.0, 3.0]);
}

/// `v` with its tensor type wrapped in a sequence type, or in an optional one.
fn wrapped(mut v: ValueInfoProto, sequence: bool) -> ValueInfoProto {
    let elem_type = Some(Box::new(v.r#type.take().unwrap()));
    let mut t = TypeProto::default();
    if sequence {
        t.sequence_type = Some(TypeProtoSequence { elem_type }.encode_to_vec());
    } else {
        t.optional_type = Some(TypeProtoOptional { elem_type }.encode_to_vec());
    }
    v.r#type = Some(t);
    v
}

/// Optionals of tensors: a graph input of an optional type is its tensor, `Optional`
/// with an input is that input and without one an empty optional, which an op reading it
/// sees as its input left out; OptionalHasElement says which, OptionalGetElement unwraps.
#[test]
fn optionals_of_tensors_are_their_tensors() {
    let d = tmpdir("optional");
    let x = wrapped(input("x", 1, &[Ok(2), Ok(3)]), false);
    let g = GraphProto {
        node: vec![
            node("OptionalHasElement", &["x"], &["has_x"], vec![]),
            node("OptionalGetElement", &["x"], &["x1"], vec![]),
            node("Optional", &[], &["none"], vec![]),
            node("OptionalHasElement", &["none"], &["has_none"], vec![]),
            node("OptionalHasElement", &[], &["has_nothing"], vec![]),
            node("Optional", &["hi"], &["hi_opt"], vec![]),
            // Clip's min left out through the empty optional: only the max bounds x.
            node("Clip", &["x1", "none", "hi_opt"], &["y"], vec![]),
        ],
        initializer: vec![f32_raw("hi", &[], &[0.25])],
        input: vec![x],
        output: vec![
            output("has_x"),
            output("has_none"),
            output("has_nothing"),
            output("y"),
        ],
        ..Default::default()
    };
    let m = load(&d, "opt.onnx", &model(18, g.clone())).unwrap();
    let xs = [-3.0f32, -0.5, 0.0, 0.1, 0.7, 2.0];
    let out = run(
        &m,
        &[("x", Tensor::from_vec(&[2, 3], xs.to_vec()).unwrap())],
    );
    assert_eq!(out[0].to_f64_vec(), [1.0], "has_x");
    assert_eq!(out[1].to_f64_vec(), [0.0], "has_none");
    assert_eq!(out[2].to_f64_vec(), [0.0], "has_nothing");
    let want: Vec<f64> = xs.iter().map(|&v| v.min(0.25) as f64).collect();
    assert_eq!(out[3].to_f64_vec(), want);
    // Unwrapping an empty optional is an error that names the node.
    let mut bad = g;
    bad.node
        .push(node("OptionalGetElement", &["none"], &["z"], vec![]));
    bad.output.push(output("z"));
    let e = load_err(&d, "bad.onnx", &model(18, bad));
    assert!(
        e.contains("(OptionalGetElement)") && e.contains("'none' is an empty optional"),
        "{e}"
    );
}

/// Sequences are written out when the model is loaded: a sequence input is its elements,
/// fed as `s[0]`, `s[1]`, ...; the sequence ops rearrange the list or become Split,
/// Concat, Squeeze and Unsqueeze, SequenceMap its body once per element; a sequence
/// output is its elements.
#[test]
fn sequences_are_lists_of_tensors() {
    let d = tmpdir("sequence");
    let s_in = wrapped(input("s", 1, &[]), true);
    let i64_scalar = |name: &str, v: i64| TensorProto {
        name: name.into(),
        data_type: 7,
        int64_data: vec![v],
        ..Default::default()
    };
    let g = GraphProto {
        node: vec![
            // x [2, 3] split into its rows, each [3] (keepdims 0).
            node(
                "SplitToSequence",
                &["x"],
                &["rows"],
                vec![int("keepdims", 0)],
            ),
            // s = [a, b]; insert row 1 at the front: [r1, a, b]; erase the last: [r1, a].
            node("SequenceAt", &["rows", "one"], &["r1"], vec![]),
            node("SequenceInsert", &["s", "r1", "zero"], &["s2"], vec![]),
            node("SequenceErase", &["s2"], &["s3"], vec![]),
            node("SequenceLength", &["s3"], &["len"], vec![]),
            // Stacked along a new axis 0: [[r1], [a]] -> [2, 3].
            node(
                "ConcatFromSequence",
                &["s3"],
                &["stacked"],
                vec![int("axis", 0), int("new_axis", 1)],
            ),
            node("SequenceConstruct", &["stacked", "x"], &["pair"], vec![]),
            node("Identity", &["pair"], &["out_seq"], vec![]),
            // Each element of s3 plus the tensor r1, and each element's shape.
            {
                let mut m = node("SequenceMap", &["s3", "r1"], &["sums", "shapes"], vec![]);
                m.attribute.push(AttributeProto {
                    name: "body".into(),
                    r#type: attr_type::GRAPH,
                    g: Some(Box::new(GraphProto {
                        node: vec![
                            node("Add", &["e", "t"], &["sum"], vec![]),
                            node("Shape", &["e"], &["shape"], vec![]),
                        ],
                        input: vec![input("e", 1, &[Ok(3)]), input("t", 1, &[Ok(3)])],
                        output: vec![output("sum"), output("shape")],
                        ..Default::default()
                    })),
                    ..Default::default()
                });
                m
            },
            node(
                "ConcatFromSequence",
                &["sums"],
                &["sums_cat"],
                vec![int("axis", 0)],
            ),
        ],
        initializer: vec![i64_scalar("one", 1), i64_scalar("zero", 0)],
        input: vec![s_in, input("x", 1, &[Ok(2), Ok(3)])],
        output: vec![
            output("len"),
            output("stacked"),
            output("out_seq"),
            output("sums_cat"),
            output("shapes"),
        ],
        ..Default::default()
    };
    let bytes = model(18, g);
    // Without the elements' shapes the input cannot be written out; the error says how.
    let e = load_err(&d, "seq.onnx", &bytes);
    assert!(
        e.contains("graph input 's' is a sequence") && e.contains("'s[0]'"),
        "{e}"
    );
    let p = d.join("seq.onnx");
    let mut opts = graphrun::onnx::ImportOptions::default();
    for k in ["s[0]", "s[1]"] {
        opts.input_shapes.insert(k.into(), vec![3]);
    }
    let m = Model::load_with(&p, &opts).unwrap();
    let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let a = [7.0f32, 8.0, 9.0];
    let b = [10.0f32, 11.0, 12.0];
    let out = run(
        &m,
        &[
            ("x", Tensor::from_vec(&[2, 3], x.to_vec()).unwrap()),
            ("s[0]", Tensor::from_vec(&[3], a.to_vec()).unwrap()),
            ("s[1]", Tensor::from_vec(&[3], b.to_vec()).unwrap()),
        ],
    );
    let names: Vec<&str> = m.graph.outputs.iter().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "len",
            "stacked",
            "out_seq[0]",
            "out_seq[1]",
            "sums_cat",
            "shapes[0]",
            "shapes[1]"
        ]
    );
    // s3 = [r1, a], r1 = [4, 5, 6]: sums [8, 10, 12, 11, 13, 15], shapes [3] twice.
    assert_eq!(out[4].to_f64_vec(), [8.0, 10.0, 12.0, 11.0, 13.0, 15.0]);
    assert_eq!(out[5].to_f64_vec(), [3.0]);
    assert_eq!(out[6].to_f64_vec(), [3.0]);
    assert_eq!(out[0].to_f64_vec(), [2.0]);
    assert_eq!(out[1].shape(), [2, 3]);
    assert_eq!(out[1].to_f64_vec(), [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    assert_eq!(out[2].to_f64_vec(), out[1].to_f64_vec());
    assert_eq!(
        out[3].to_f64_vec(),
        x.iter().map(|&v| v as f64).collect::<Vec<_>>()
    ); // A file declaring a huge axis cannot make the import allocate per element.
    let huge = GraphProto {
        node: vec![
            node("SplitToSequence", &["w"], &["parts"], vec![int("axis", 1)]),
            node(
                "ConcatFromSequence",
                &["parts"],
                &["y"],
                vec![int("axis", 1)],
            ),
        ],
        input: vec![input("w", 1, &[Ok(1), Ok(1 << 40)])],
        output: vec![output("y")],
        ..Default::default()
    };
    let e = load_err(&d, "huge.onnx", &model(18, huge));
    assert!(
        e.contains("(SplitToSequence)") && e.contains("parts would be more than"),
        "{e}"
    );
}
