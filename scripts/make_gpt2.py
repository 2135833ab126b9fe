#!/usr/bin/env python3
"""Writes models/gpt2_124m.yaml: GPT-2 small as the bench reference's `gpt2_124m` defines
it (vocab 50257, context 1024, 12 pre-LayerNorm blocks of d 768 with 12 heads of 64, MLP
3072 with GELU(tanh), the LM head tied to the token embedding), trained with next-token
softmax cross-entropy and AdamW (lr 3e-4, weight decay 0.01, PyTorch's defaults).

    python3 scripts/make_gpt2.py [--layers N] [OUT.yaml]

Each block is written in primitive ops as exporters write it (one QKV projection split in
three, head split/merge Reshape/Transpose, MatMul/Div/causal-Where/Softmax/MatMul
attention, GELU(tanh) expanded), so the benchmark measures what the passes make of it.
Weights are seeded random (normal, std 0.02; LayerNorm ones/zeros), generated when the
model loads: the file holds no weights.
"""
import sys

V, CTX, D, H, FF = 50257, 1024, 768, 12, 3072


def main():
    args = sys.argv[1:]
    layers = 12
    if "--layers" in args:
        i = args.index("--layers")
        layers = int(args[i + 1])
        del args[i:i + 2]
    out = args[0] if args else "models/gpt2_124m.yaml"
    seed = iter(range(100, 100000))
    normal = lambda: f"{{dist: normal, std: 0.02, seed: {next(seed)}}}"
    I = []  # initializers
    N = []  # nodes
    init = lambda name, shape, how: I.append(
        f"  - {{name: {name}, dtype: f32, shape: {shape}, init: {how}}}")
    const = lambda name, dtype, shape, values: I.append(
        f"  - {{name: {name}, dtype: {dtype}, shape: {shape}, values: {values}, trainable: false}}")
    node = lambda s: N.append(f"  - {s}")

    init("wte", f"[{V}, {D}]", normal())
    init("wpe", f"[{CTX}, {D}]", normal())
    const("zero1", "i64", "[1]", "[0]")
    const("qkv_split", "i64", "[3]", f"[{D}, {D}, {D}]")
    const("heads_shape", "i64", "[4]", f"[0, 0, {H}, {D // H}]")
    const("merged_shape", "i64", "[3]", f"[0, 0, {D}]")
    const("flat_logits", "i64", "[2]", f"[-1, {V}]")
    const("flat_labels", "i64", "[1]", "[-1]")
    const("sqrt_d", "f32", "[]", f"[{(D // H) ** 0.5}]")
    const("one", "f32", "[]", "[1.0]")
    const("neg_big", "f32", "[]", "[-3.4028234663852886e38]")
    const("half", "f32", "[]", "[0.5]")
    const("three", "f32", "[]", "[3.0]")
    const("gelu_c", "f32", "[]", "[0.044715]")
    const("sqrt_2_over_pi", "f32", "[]", "[0.7978845608028654]")

    # Embeddings: tokens gathered, positions 0..seq-1 sliced off the table.
    node("{op: Gather, inputs: [wte, ids], outputs: [tok], attrs: {axis: 0}, name: wte_gather}")
    node("{op: Shape, inputs: [ids], outputs: [seq_len], attrs: {start: 1, end: 2}}")
    node("{op: Slice, inputs: [wpe, zero1, seq_len, zero1], outputs: [pos]}")
    node("{op: Add, inputs: [tok, pos], outputs: [x0], name: embed}")
    x = "x0"
    for l in range(layers):
        p = f"h{l}_"
        for ln in ("ln1", "ln2"):
            init(p + ln + "_scale", f"[{D}]", "ones")
            init(p + ln + "_bias", f"[{D}]", "zeros")
        for w, shape in (("qkv", (D, 3 * D)), ("proj", (D, D)), ("fc1", (D, FF)), ("fc2", (FF, D))):
            init(p + "w_" + w, f"[{shape[0]}, {shape[1]}]", normal())
            init(p + "b_" + w, f"[{shape[1]}]", "zeros")
        n = lambda s: node(s.replace("@", p))
        n(f"{{op: LayerNormalization, inputs: [{x}, @ln1_scale, @ln1_bias], outputs: [@ln1], attrs: {{axis: -1, epsilon: 1.0e-5}}, name: @ln1}}")
        n("{op: MatMul, inputs: [@ln1, @w_qkv], outputs: [@qkv0], name: @qkv}")
        n("{op: Add, inputs: [@qkv0, @b_qkv], outputs: [@qkv1]}")
        n("{op: Split, inputs: [@qkv1, qkv_split], outputs: [@q0, @k0, @v0], attrs: {axis: -1}}")
        n("{op: Reshape, inputs: [@q0, heads_shape], outputs: [@q1]}")
        n("{op: Transpose, inputs: [@q1], outputs: [@q], attrs: {perm: [0, 2, 1, 3]}}")
        n("{op: Reshape, inputs: [@k0, heads_shape], outputs: [@k1]}")
        n("{op: Transpose, inputs: [@k1], outputs: [@kt], attrs: {perm: [0, 2, 3, 1]}}")
        n("{op: Reshape, inputs: [@v0, heads_shape], outputs: [@v1]}")
        n("{op: Transpose, inputs: [@v1], outputs: [@v], attrs: {perm: [0, 2, 1, 3]}}")
        n("{op: MatMul, inputs: [@q, @kt], outputs: [@scores], name: @qk}")
        n("{op: Div, inputs: [@scores, sqrt_d], outputs: [@scaled]}")
        n("{op: Shape, inputs: [@scaled], outputs: [@ss], attrs: {start: 2}}")
        n("{op: Expand, inputs: [one, @ss], outputs: [@ones]}")
        n("{op: Trilu, inputs: [@ones], outputs: [@tril], attrs: {upper: 0}}")
        n("{op: Cast, inputs: [@tril], outputs: [@keep], attrs: {to: bool}}")
        n("{op: Where, inputs: [@keep, @scaled, neg_big], outputs: [@masked]}")
        n("{op: Softmax, inputs: [@masked], outputs: [@p], attrs: {axis: -1}}")
        n("{op: MatMul, inputs: [@p, @v], outputs: [@ctx], name: @pv}")
        n("{op: Transpose, inputs: [@ctx], outputs: [@ctx_t], attrs: {perm: [0, 2, 1, 3]}}")
        n("{op: Reshape, inputs: [@ctx_t, merged_shape], outputs: [@ctx_m]}")
        n("{op: MatMul, inputs: [@ctx_m, @w_proj], outputs: [@proj0], name: @proj}")
        n("{op: Add, inputs: [@proj0, @b_proj], outputs: [@proj1]}")
        n(f"{{op: Add, inputs: [{x}, @proj1], outputs: [@h], name: @residual1}}")
        n("{op: LayerNormalization, inputs: [@h, @ln2_scale, @ln2_bias], outputs: [@ln2], attrs: {axis: -1, epsilon: 1.0e-5}, name: @ln2}")
        n("{op: MatMul, inputs: [@ln2, @w_fc1], outputs: [@f0], name: @fc1}")
        n("{op: Add, inputs: [@f0, @b_fc1], outputs: [@f]}")
        n("{op: Pow, inputs: [@f, three], outputs: [@f3]}")
        n("{op: Mul, inputs: [@f3, gelu_c], outputs: [@f3c]}")
        n("{op: Add, inputs: [@f, @f3c], outputs: [@inner]}")
        n("{op: Mul, inputs: [@inner, sqrt_2_over_pi], outputs: [@inner_s]}")
        n("{op: Tanh, inputs: [@inner_s], outputs: [@t]}")
        n("{op: Add, inputs: [@t, one], outputs: [@t1]}")
        n("{op: Mul, inputs: [@f, half], outputs: [@f_half]}")
        n("{op: Mul, inputs: [@f_half, @t1], outputs: [@g]}")
        n("{op: MatMul, inputs: [@g, @w_fc2], outputs: [@m0], name: @fc2}")
        n("{op: Add, inputs: [@m0, @b_fc2], outputs: [@m]}")
        n("{op: Add, inputs: [@h, @m], outputs: [@y], name: @residual2}")
        x = p + "y"
    init("lnf_scale", f"[{D}]", "ones")
    init("lnf_bias", f"[{D}]", "zeros")
    node(f"{{op: LayerNormalization, inputs: [{x}, lnf_scale, lnf_bias], outputs: [xf], attrs: {{axis: -1, epsilon: 1.0e-5}}, name: lnf}}")
    # The LM head is the token embedding, transposed (tied, as GPT-2's is).
    node("{op: Transpose, inputs: [wte], outputs: [wte_t], attrs: {perm: [1, 0]}}")
    node("{op: MatMul, inputs: [xf, wte_t], outputs: [logits], name: lm_head}")
    node("{op: Reshape, inputs: [logits, flat_logits], outputs: [logits2]}")
    node("{op: Reshape, inputs: [labels, flat_labels], outputs: [labels1]}")
    node("{op: SoftmaxCrossEntropyLoss, inputs: [logits2, labels1], outputs: [loss], name: cross_entropy}")

    head = [
        f"# GPT-2 small (124M) as scripts/make_gpt2.py writes it (this file is its output:",
        f"#   python3 scripts/make_gpt2.py{'' if layers == 12 else f' --layers {layers}'} {out}",
        "# ). Vocab 50257, context 1024, 12 pre-LayerNorm blocks (d 768, 12 heads of 64, causal,",
        "# MLP 3072 with GELU(tanh)), LM head tied to the token embedding; next-token softmax",
        "# cross-entropy (labels are the ids shifted by one) and AdamW. Blocks are written in",
        "# primitive ops as exporters write them. Small shapes: --dim batch=2 --dim seq=64.",
        "graphrun: 1",
        "name: gpt2_124m",
        "dims: {batch: 8, seq: 1024}",
        "inputs:",
        "  - {name: ids, dtype: i64, shape: [batch, seq], range: [0, 50257]}",
        "  - {name: labels, dtype: i64, shape: [batch, seq], range: [0, 50257]}",
        "outputs: [loss]",
        "initializers:",
    ]
    tail = ["training:", "  loss: loss",
            "  optimizer: {adamw: {lr: 3.0e-4, weight_decay: 0.01}}", ""]
    with open(out, "w") as f:
        f.write("\n".join(head + I + ["nodes:"] + N + tail))


if __name__ == "__main__":
    main()
