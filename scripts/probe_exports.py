#!/usr/bin/env python3
"""Breadth probe: exports tiny random-weight models beyond tests/fixtures/zoo (more
torchvision and transformers architectures, and the zoo's own at other exporter/opset
pairs), runs `graphrun` on each and compares its outputs with ONNX Runtime's (relative
error <= 1e-4, 1e-2 with HALF=1), then checks that `--backward` runs. Nothing is written
to the repository: the exports go to /tmp/probe_exports/.

    cargo build --release
    VARIANTS=ts14,dy20 python3 scripts/probe_exports.py tv_resnet18,clip_text,whisper
    EAGER=1 VARIANTS=ts9,ts11 python3 scripts/probe_exports.py gpt2,bert

VARIANTS: tsN is the TorchScript exporter at opset N, dyN the dynamo exporter. EAGER=1
exports transformers models with eager attention (SDPA does not export below opset 14);
HALF=1 exports them in float16. Architectures: those of scripts/make_zoo.py and EXTRA
below. Needs torch, torchvision, transformers, onnx, onnxruntime and onnxscript.
"""

import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402

import make_zoo as Z  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXE = os.environ.get("GRAPHRUN", os.path.join(ROOT, "target", "release", "graphrun"))
OUT = "/tmp/probe_exports"
V = Z.VOCAB
_make_inputs = Z.make_inputs


def make_inputs(arch, spec, batch, seq, with_mask, gen):
    """The zoo's inputs, or an architecture's own (`make`)."""
    if "make" in spec:
        return spec["make"](batch, seq, gen)
    return _make_inputs(arch, spec, batch, seq, with_mask, gen)


Z.make_inputs = make_inputs


def tv(name, **kw):
    return lambda: getattr(torchvision.models, name)(weights=None, **kw)


def hf(cls, cfgcls, **cfg):
    def b():
        import transformers

        c = getattr(transformers, cfgcls)(**cfg)
        return getattr(transformers, cls)(c)

    return b


small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
dec = dict(vocab_size=V, max_position_embeddings=32, use_cache=False)


def ids(b, s, g):
    return torch.randint(3, V, (b, s), generator=g)


def seq2seq(b, s, g):
    return {
        "input_ids": ids(b, s, g),
        "attention_mask": Z.mask_of(b, s),
        "decoder_input_ids": ids(b, s, g),
    }


def whisper_in(b, s, g):
    return {
        "input_features": torch.randn(b, 16, 16, generator=g),
        "decoder_input_ids": ids(b, 7, g),
    }


EXTRA = {
    "tv_resnet18": dict(
        build=tv("resnet18"), kind="float", input=("x", (3, 64, 64)), outputs={"out": "b"}
    ),
    "tv_squeezenet": dict(
        build=tv("squeezenet1_0"), kind="float", input=("x", (3, 64, 64)), outputs={"out": "b"}
    ),
    "tv_shufflenet": dict(
        build=tv("shufflenet_v2_x0_5"), kind="float", input=("x", (3, 64, 64)), outputs={"out": "b"}
    ),
    "tv_densenet": dict(
        build=tv("densenet121"), kind="float", input=("x", (3, 64, 64)), outputs={"out": "b"}
    ),
    "tv_googlenet": dict(
        build=tv("googlenet", aux_logits=False, init_weights=True),
        kind="float",
        input=("x", (3, 64, 64)),
        outputs={"out": "b"},
    ),
    "tv_mnasnet": dict(
        build=tv("mnasnet0_5"), kind="float", input=("x", (3, 64, 64)), outputs={"out": "b"}
    ),
    "tv_regnet": dict(
        build=tv("regnet_y_400mf"), kind="float", input=("x", (3, 64, 64)), outputs={"out": "b"}
    ),
    "tv_swin": dict(
        build=tv("swin_t"), kind="float", input=("x", (3, 64, 64)), outputs={"out": "b"}
    ),
    "tv_vit": dict(
        build=lambda: torchvision.models.VisionTransformer(32, 8, 2, 2, 32, 64, num_classes=10),
        kind="float",
        input=("x", (3, 32, 32)),
        outputs={"out": "b"},
    ),
    "tv_convnext": dict(
        build=tv("convnext_tiny"), kind="float", input=("x", (3, 32, 32)), outputs={"out": "b"}
    ),
    "tv_effv2": dict(
        build=tv("efficientnet_v2_s"), kind="float", input=("x", (3, 32, 32)), outputs={"out": "b"}
    ),
    "tv_fcn": dict(
        build=lambda: torchvision.models.segmentation.fcn_resnet50(
            weights=None, weights_backbone=None, num_classes=4
        ),
        kind="float",
        input=("x", (3, 32, 32)),
        outputs={"out": "b"},
    ),
    "tv_deeplab": dict(
        build=lambda: torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=4
        ),
        kind="float",
        input=("x", (3, 32, 32)),
        outputs={"out": "b"},
    ),
    "tv_r3d": dict(
        build=(lambda: torchvision.models.video.r3d_18(weights=None)),
        kind="float",
        input=("x", (3, 4, 32, 32)),
        outputs={"out": "b"},
    ),
    "clip_text": dict(
        build=hf(
            "CLIPTextModel", "CLIPTextConfig", vocab_size=V, max_position_embeddings=32, **small
        ),
        kind="text",
        outputs={"last_hidden_state": "bs", "pooler_output": "b"},
    ),
    "clip_vision": dict(
        build=hf("CLIPVisionModel", "CLIPVisionConfig", image_size=16, patch_size=4, **small),
        kind="float",
        input=("pixel_values", (3, 16, 16)),
        outputs={"last_hidden_state": "b", "pooler_output": "b"},
    ),
    "deit": dict(
        build=hf("DeiTModel", "DeiTConfig", image_size=16, patch_size=4, **small),
        kind="float",
        input=("pixel_values", (3, 16, 16)),
        outputs={"last_hidden_state": "b", "pooler_output": "b"},
    ),
    "beit": dict(
        build=hf(
            "BeitModel",
            "BeitConfig",
            image_size=16,
            patch_size=4,
            use_relative_position_bias=True,
            **small,
        ),
        kind="float",
        input=("pixel_values", (3, 16, 16)),
        outputs={"last_hidden_state": "b", "pooler_output": "b"},
    ),
    "dinov2": dict(
        build=hf("Dinov2Model", "Dinov2Config", image_size=16, patch_size=4, **small),
        kind="float",
        input=("pixel_values", (3, 16, 16)),
        outputs={"last_hidden_state": "b", "pooler_output": "b"},
    ),
    "segformer": dict(
        build=hf(
            "SegformerForSemanticSegmentation",
            "SegformerConfig",
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            num_attention_heads=[1, 2],
            decoder_hidden_size=32,
            num_labels=3,
            patch_sizes=[7, 3],
            strides=[4, 2],
        ),
        kind="float",
        input=("pixel_values", (3, 32, 32)),
        outputs={"logits": "b"},
    ),
    "mobilevit": dict(
        build=hf(
            "MobileViTModel",
            "MobileViTConfig",
            image_size=32,
            hidden_sizes=[16, 24, 32],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
        ),
        kind="float",
        input=("pixel_values", (3, 32, 32)),
        outputs={"last_hidden_state": "b", "pooler_output": "b"},
    ),
    "electra": dict(
        build=hf(
            "ElectraModel",
            "ElectraConfig",
            vocab_size=V,
            embedding_size=16,
            max_position_embeddings=32,
            **small,
        ),
        kind="text",
        outputs={"last_hidden_state": "bs"},
    ),
    "mobilebert": dict(
        build=hf(
            "MobileBertModel",
            "MobileBertConfig",
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            embedding_size=16,
            intra_bottleneck_size=16,
            max_position_embeddings=32,
        ),
        kind="text",
        outputs={"last_hidden_state": "bs", "pooler_output": "b"},
    ),
    "deberta": dict(
        build=hf(
            "DebertaV2Model", "DebertaV2Config", vocab_size=V, max_position_embeddings=32, **small
        ),
        kind="text",
        outputs={"last_hidden_state": "bs"},
    ),
    "falcon": dict(
        build=hf(
            "FalconForCausalLM",
            "FalconConfig",
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            use_cache=False,
        ),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "gpt_bigcode": dict(
        build=hf(
            "GPTBigCodeForCausalLM",
            "GPTBigCodeConfig",
            vocab_size=V,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            use_cache=False,
        ),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "gptj": dict(
        build=hf(
            "GPTJForCausalLM",
            "GPTJConfig",
            vocab_size=V,
            n_embd=32,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            n_positions=32,
            use_cache=False,
        ),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "codegen": dict(
        build=hf(
            "CodeGenForCausalLM",
            "CodeGenConfig",
            vocab_size=V,
            n_embd=32,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            n_positions=32,
            n_ctx=32,
            use_cache=False,
        ),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "stablelm": dict(
        build=hf("StableLmForCausalLM", "StableLmConfig", num_key_value_heads=2, **small, **dec),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "qwen3": dict(
        build=hf(
            "Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8, **small, **dec
        ),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "gemma2": dict(
        build=hf(
            "Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=8, **small, **dec
        ),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "mixtral": dict(
        build=hf(
            "MixtralForCausalLM",
            "MixtralConfig",
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            **small,
            **dec,
        ),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "phi": dict(
        build=hf("PhiForCausalLM", "PhiConfig", **small, **dec),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "olmo": dict(
        build=hf("OlmoForCausalLM", "OlmoConfig", **small, **dec),
        kind="text",
        outputs={"logits": "bs"},
    ),
    "t5": dict(
        build=hf(
            "T5ForConditionalGeneration",
            "T5Config",
            vocab_size=V,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            use_cache=False,
        ),
        kind="text",
        make=seq2seq,
        outputs={"logits": "bs"},
    ),
    "bart": dict(
        build=hf(
            "BartForConditionalGeneration",
            "BartConfig",
            vocab_size=V,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=32,
            use_cache=False,
        ),
        kind="text",
        make=seq2seq,
        outputs={"logits": "bs"},
    ),
    "whisper": dict(
        build=hf(
            "WhisperForConditionalGeneration",
            "WhisperConfig",
            vocab_size=V,
            num_mel_bins=16,
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=4,
            decoder_layers=2,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=8,
            max_target_positions=16,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        ),
        kind="x",
        make=whisper_in,
        outputs={"logits": "bs"},
    ),
    "hubert": dict(
        build=hf(
            "HubertModel",
            "HubertConfig",
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            **small,
        ),
        kind="float",
        input=("input_values", (400,)),
        outputs={"last_hidden_state": "b"},
    ),
}
Z.ARCHS.update(EXTRA)

VARIANTS = os.environ.get("VARIANTS", "ts14,dy20").split(",")


def parse(v):
    return (
        ("dynamo", True, int(v[2:])) if v.startswith("dy") else ("torchscript", False, int(v[2:]))
    )


def run(case_dir, model_path, inputs, backward=False):
    out = os.path.join(case_dir, "bwd" if backward else "out")
    args = [EXE, model_path, "--out-dir", out]
    for n, f in inputs:
        args += ["--input", f"{n}={f}"]
    if backward:
        args += ["--backward"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    return p.returncode, (p.stderr + p.stdout).strip(), out


def rel(a, b):
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    n = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (n if n > 0 else 1)


def main():
    archs = sys.argv[1].split(",") if len(sys.argv) > 1 else list(Z.ARCHS)
    root = OUT
    for arch in archs:
        spec = Z.ARCHS[arch]
        masks = [True] if spec["kind"] == "text" else [False]
        for with_mask in masks:
            torch.manual_seed(0)
            model = spec["build"]().eval()
            if os.environ.get("EAGER") and hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation("eager")
            Z.randomize(model, torch.Generator().manual_seed(1))
            g = torch.Generator().manual_seed(2)
            ex_in = Z.make_inputs(arch, spec, 2, 7, with_mask, g)
            te_in = Z.make_inputs(arch, spec, 3, 5, with_mask, g)
            if os.environ.get("HALF"):
                model = model.half()
                ex_in = {k: (v.half() if v.is_floating_point() else v) for k, v in ex_in.items()}
                te_in = {k: (v.half() if v.is_floating_point() else v) for k, v in te_in.items()}
            for v in VARIANTS:
                exporter, dynamo, opset = parse(v)
                case = f"{arch}_{v}" + ("_mask" if with_mask else "")
                d = os.path.join(root, case)
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                mp = os.path.join(d, "model.onnx")
                try:
                    with Z.quiet():
                        Z.export(model, spec, ex_in, mp, dynamo, opset)
                except Exception as e:
                    print(f"{case}: EXPORT FAIL {Z.summary(e)[:150]}", flush=True)
                    continue
                inputs = []
                feeds = {}
                for n, t in te_in.items():
                    f = os.path.join(d, f"in_{n}.npy")
                    a = t.numpy()
                    np.save(f, a)
                    inputs.append((n, f))
                    feeds[n] = a
                try:
                    sess = ort.InferenceSession(mp, providers=["CPUExecutionProvider"])
                    names = [o.name for o in sess.get_outputs()]
                    refs = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
                except Exception as e:
                    print(f"{case}: ORT FAIL {str(e)[:150]}", flush=True)
                    refs = None
                rc, msg, out = run(d, mp, inputs)
                if rc != 0:
                    print(f"{case}: GRAPHRUN FAIL {msg[:400]}", flush=True)
                    continue
                worst = 0
                if refs is not None:
                    for n, r in zip(names, refs):
                        p = os.path.join(out, f"{n}.npy")
                        if not os.path.exists(p):
                            print(f"{case}: no output {n}")
                            worst = 1
                            continue
                        worst = max(worst, rel(np.load(p), r))
                rc, msg, _ = run(d, mp, inputs, backward=True)
                print(
                    f"{case}: fwd err {worst:.1e}{'  MISMATCH' if worst > (1e-2 if os.environ.get('HALF') else 1e-4) else ''}; bwd {'ok' if rc == 0 else 'FAIL ' + msg[:300]}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
