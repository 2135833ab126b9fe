#!/usr/bin/env python3
"""Builds tests/fixtures/zoo/: tiny exports of real `transformers` and `torchvision`
architectures (random, seeded weights) with ONNX Runtime's outputs and PyTorch's float64
gradients beside them.

Needs torch, torchvision, transformers, onnx, onnxruntime and onnxscript:
    nice -n 10 python3 scripts/make_zoo.py [OUT_DIR] [--only ARCH,ARCH]
(OUT_DIR defaults to tests/fixtures/zoo). CI never runs this: the test reads the files.

Every architecture is exported as a user would: the model object itself, named inputs,
dynamic batch (and sequence, for text) axes, with
    dynamo   torch.onnx.export(..., dynamo=True)   at opset 18 and at opset 23
    torchscript  torch.onnx.export(..., dynamo=False) at opset 17
and text models twice: with input_ids only, and with input_ids + attention_mask.
An exporter that fails is recorded in MANIFEST.tsv with its message, not skipped.

The references are computed at other shapes than the export's sample (batch 3, sequence 5
against 2 and 7), so a shape the exporter baked in shows up as a failure.

Layout:
    OUT_DIR/MANIFEST.tsv         one line per export: case, exported, ORT, detail
    OUT_DIR/<case>/              case = <arch>_<exporter>_op<N>[_mask]
        model.onnx               weights inline
        in_<name>.npy            the inputs
        ort_<i>.npy              ONNX Runtime's outputs (CPU EP, float32), graph order;
                                 where ORT fails, onnx.reference's as ref_<i>.npy
        seed.npy                 d(loss)/d(first output): loss = sum(first output * seed)
        MANIFEST                 kind<TAB>ONNX value<TAB>file lines, the test's contract:
                                 input, output (ORT), seed, grad (same layout as the
                                 value), grad_t (a 2-D value holding the transpose of the
                                 parameter whose gradient the file is), grad_sum (a tied
                                 parameter: the value is a comma-separated list of the
                                 initializers holding it, `T:` before a transposed one;
                                 the file is the sum of their gradients)
        params.json              each initializer's torch parameter, and the parameters
                                 left unchecked (and why)
    OUT_DIR/_torch/<arch>[_mask]/grads/<param or input>.npy
                                 PyTorch's float64 gradients, shared by the exports of
                                 the same model and inputs (the initializer names differ
                                 per exporter, the gradients do not)
"""
import contextlib
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from collections import Counter

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import torch

warnings.filterwarnings("ignore")

SEED = 0
EXPORTERS = [("dynamo", True, 18), ("dynamo", True, 23), ("torchscript", False, 17)]
# Export sample and reference shapes differ on purpose (see the module doc).
EXPORT_BATCH, EXPORT_SEQ = 2, 7
TEST_BATCH, TEST_SEQ = 3, 5
VOCAB = 100


# ---------------------------------------------------------------------------------------
# The architectures: tiny configs of the real classes.

def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    c = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_inner=64,
                   n_positions=32, use_cache=False,
                   bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(c)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    # Grouped-query attention: 4 query heads share 2 key/value heads.
    c = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=32, use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM(c)


def bert():
    from transformers import BertConfig, BertModel

    c = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                   type_vocab_size=2)
    return BertModel(c)


def distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    c = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                         max_position_embeddings=32)
    return DistilBertModel(c)


def t5_encoder():
    from transformers import T5Config, T5EncoderModel

    c = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return T5EncoderModel(c)


def vit():
    from transformers import ViTConfig, ViTModel

    c = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, image_size=16, patch_size=4, num_channels=3)
    return ViTModel(c)


WHISPER_POSITIONS = 8


def whisper_encoder():
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    c = WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2,
                      encoder_attention_heads=2, encoder_ffn_dim=64, decoder_layers=1,
                      decoder_attention_heads=2, decoder_ffn_dim=64,
                      max_source_positions=WHISPER_POSITIONS, max_target_positions=16)
    return WhisperEncoder(c)


def mobilenet_v2():
    import torchvision

    # The real class at a quarter width, with the first four of its seven stages (the
    # later ones repeat the same block), so the export stays ~100 KB.
    setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 2, 2], [6, 64, 1, 2]]
    return torchvision.models.MobileNetV2(num_classes=10, width_mult=0.25,
                                          inverted_residual_setting=setting)


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    # A sliding window of 3 tokens, shorter than the reference's sequence of 5, so the
    # window decides which keys each query sees.
    c = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32, sliding_window=3, use_cache=False,
                      tie_word_embeddings=False)
    return MistralForCausalLM(c)


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Qwen2's projections of q, k and v carry biases (LLaMA's do not).
    c = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=32, use_cache=False, tie_word_embeddings=False)
    return Qwen2ForCausalLM(c)


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    # One projection for q, k and v and one for gate and up, split in the graph.
    c = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=32, use_cache=False, tie_word_embeddings=False,
                   pad_token_id=0)
    return Phi3ForCausalLM(c)


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    # RMSNorm scaled by (1 + w), a GELU-gated MLP, embeddings scaled by sqrt(d).
    c = GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=8, max_position_embeddings=32, use_cache=False)
    return GemmaForCausalLM(c)


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    # Rotary embedding on a quarter of each head, attention and MLP in parallel.
    c = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.25,
                      max_position_embeddings=32, use_cache=False,
                      tie_word_embeddings=False)
    return GPTNeoXForCausalLM(c)


def opt():
    from transformers import OPTConfig, OPTForCausalLM

    # Learned positions offset by 2, ReLU MLP.
    c = OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                  num_attention_heads=2, word_embed_proj_dim=32, max_position_embeddings=32,
                  use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return OPTForCausalLM(c)


def bloom():
    from transformers import BloomConfig, BloomForCausalLM

    # ALiBi position biases instead of position embeddings.
    c = BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, use_cache=False,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return BloomForCausalLM(c)


def roberta():
    from transformers import RobertaConfig, RobertaModel

    # Positions counted from the ids (a cumulative sum past the padding token).
    c = RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=40,
                      type_vocab_size=1, pad_token_id=1)
    return RobertaModel(c)


def albert():
    from transformers import AlbertConfig, AlbertModel

    # Factorised embeddings (16 -> 32) and one layer's weights shared by both layers.
    c = AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
    return AlbertModel(c)


def resnet():
    from transformers import ResNetConfig, ResNetModel

    # Bottleneck blocks with BatchNorm and a max-pooled stem, two narrow stages.
    c = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1],
                     layer_type="bottleneck")
    return ResNetModel(c)


def convnext():
    from transformers import ConvNextConfig, ConvNextModel

    # Depthwise 7x7 convolutions, channels-last LayerNorm, GELU, layer scale.
    c = ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                       patch_size=2, image_size=16)
    return ConvNextModel(c)


def swin():
    from transformers import SwinConfig, SwinModel

    # Shifted windows (a roll), relative position bias, patch merging.
    c = SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 1],
                   num_heads=[2, 2], window_size=4, mlp_ratio=2.0)
    return SwinModel(c)


def mobilenet_v3():
    import torchvision

    # The small model at a quarter width: hard-swish, squeeze-and-excitation with
    # hard-sigmoid, 5×5 depthwise convolutions on maps down to 1×1.
    return torchvision.models.mobilenet_v3_small(num_classes=10, width_mult=0.25)


def lraspp():
    import torchvision

    from torchvision.models.segmentation import lraspp

    # The LR-ASPP segmentation head (a bilinear Resize back to the input size) on a
    # quarter-width MobileNetV3-Small, assembled as torchvision's
    # lraspp_mobilenet_v3_large is.
    backbone = torchvision.models.mobilenet_v3_small(width_mult=0.25, dilated=True)
    m = lraspp._lraspp_mobilenetv3(backbone, num_classes=3)
    low = m.classifier.low_classifier.in_channels
    high = m.classifier.cbr[0].in_channels
    m.classifier = lraspp.LRASPPHead(low, high, num_classes=3, inter_channels=16)
    return m


def efficientnet():
    import torchvision
    from torchvision.models.efficientnet import MBConvConfig

    # EfficientNet's MBConv with squeeze-and-excitation and SiLU, two short stages.
    setting = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(4, 3, 2, 8, 16, 2)]
    return torchvision.models.EfficientNet(setting, dropout=0.0, num_classes=10,
                                           last_channel=32)


def wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    # A convolutional feature encoder over raw audio (GroupNorm), a grouped positional
    # convolution, then a transformer encoder.
    c = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                       conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                       num_conv_pos_embedding_groups=4, feat_extract_norm="group",
                       do_stable_layer_norm=False, mask_time_prob=0.0)
    return Wav2Vec2Model(c)


class LstmLm(torch.nn.Module):
    """A recurrent language model as a user writes one: an embedding, a two-layer
    bidirectional LSTM, a linear head (attention_mask accepted and unused)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.lstm = torch.nn.LSTM(16, 12, num_layers=2, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(24, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.lstm(self.embed(input_ids))[0])


class GruEncoder(torch.nn.Module):
    """A recurrent feature encoder: a GRU over frames of features (time-major inside, as
    speech models run it), its last state through a linear layer beside the sequence."""

    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(10, 12, num_layers=1)
        self.rnn = torch.nn.RNN(12, 8, nonlinearity="relu")
        self.proj = torch.nn.Linear(8, 6)

    def forward(self, features):
        y, h = self.gru(features.transpose(0, 1))
        z, _ = self.rnn(torch.tanh(y))
        return self.proj(z).transpose(0, 1), h[0]


def lstm_lm():
    return LstmLm()


def gru_encoder():
    return GruEncoder()


# The text architectures after the first ones keep three of their six exports (the zoo
# stays small; `keep` picks the exports of a few others by the same suffixes): the dynamo exporter's at opset 18 with a mask and at opset 23 without, and
# the TorchScript exporter's with a mask (and its failure without one, which costs nothing).
FEW = ["_dynamo_op18_mask", "_dynamo_op23", "_torchscript_op17_mask", "_torchscript_op17"]


# name, builder, kind ("text" has input_ids [+ attention_mask]), output axes per output
# name (the ones a user marks dynamic), float input (name, shape after the batch dim).
ARCHS = {
    "gpt2": dict(build=gpt2, kind="text", outputs={"logits": "bs"}),
    "llama": dict(build=llama, kind="text", outputs={"logits": "bs"}),
    "bert": dict(build=bert, kind="text",
                 outputs={"last_hidden_state": "bs", "pooler_output": "b"}),
    "distilbert": dict(build=distilbert, kind="text", outputs={"last_hidden_state": "bs"}),
    "t5_encoder": dict(build=t5_encoder, kind="text", outputs={"last_hidden_state": "bs"}),
    "vit": dict(build=vit, kind="float", input=("pixel_values", (3, 16, 16)),
                outputs={"last_hidden_state": "b", "pooler_output": "b"}),
    "whisper_encoder": dict(build=whisper_encoder, kind="float",
                            input=("input_features", (16, 2 * WHISPER_POSITIONS)),
                            outputs={"last_hidden_state": "b"}),
    "mobilenet_v2": dict(build=mobilenet_v2, kind="float", input=("x", (3, 32, 32)),
                         outputs={"output": "b"}),
    "mistral": dict(build=mistral, kind="text", outputs={"logits": "bs"}),
    "qwen2": dict(build=qwen2, kind="text", outputs={"logits": "bs"}, few=True),
    "phi3": dict(build=phi3, kind="text", outputs={"logits": "bs"}, few=True),
    "gemma": dict(build=gemma, kind="text", outputs={"logits": "bs"}, few=True),
    "gpt_neox": dict(build=gpt_neox, kind="text", outputs={"logits": "bs"}, few=True),
    "opt": dict(build=opt, kind="text", outputs={"logits": "bs"}, few=True),
    "bloom": dict(build=bloom, kind="text", outputs={"logits": "bs"}, few=True),
    "roberta": dict(build=roberta, kind="text", few=True,
                    outputs={"last_hidden_state": "bs", "pooler_output": "b"}),
    "albert": dict(build=albert, kind="text", few=True,
                   outputs={"last_hidden_state": "bs", "pooler_output": "b"}),
    "resnet": dict(build=resnet, kind="float", input=("pixel_values", (3, 32, 32)),
                   outputs={"last_hidden_state": "b", "pooler_output": "b"}),
    "convnext": dict(build=convnext, kind="float", input=("pixel_values", (3, 16, 16)),
                     outputs={"last_hidden_state": "b", "pooler_output": "b"}),
    "swin": dict(build=swin, kind="float", input=("pixel_values", (3, 16, 16)),
                 outputs={"last_hidden_state": "b", "pooler_output": "b"}),
    "mobilenet_v3": dict(build=mobilenet_v3, kind="float", input=("x", (3, 32, 32)),
                         outputs={"output": "b"}, keep=["_op18", "_op17"]),
    "lraspp": dict(build=lraspp, kind="float", input=("input", (3, 64, 64)),
                   outputs={"out": "b"}, keep=["_torchscript_op17"]),
    "efficientnet": dict(build=efficientnet, kind="float", input=("x", (3, 32, 32)),
                         outputs={"output": "b"}),
    "wav2vec2": dict(build=wav2vec2, kind="float", input=("input_values", (400,)),
                     outputs={"last_hidden_state": "b", "extract_features": "b"}),
    "lstm_lm": dict(build=lstm_lm, kind="text", outputs={"logits": "bs"}, few=True),
    "gru_encoder": dict(build=gru_encoder, kind="float", input=("features", (7, 10)),
                        outputs={"frames": "b", "state": "b"}),
}


def randomize(model, gen):
    """Seeded weights with spread: every parameter distinct (exporters merge initializers
    of equal value, and LayerNorm's ones/zeros would all be equal) and of a scale that
    keeps activations O(1), so relative errors mean something."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = max(1, math.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            elif name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
            elif name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)


def mask_of(batch, seq):
    """Right padding: the first row full, the others shorter."""
    m = torch.ones(batch, seq, dtype=torch.long)
    for r in range(1, batch):
        m[r, seq - r:] = 0
    return m


def make_inputs(arch, spec, batch, seq, with_mask, gen):
    """Named inputs (an ordered dict: forward's keyword arguments)."""
    if spec["kind"] == "text":
        # Ids 0-2 are the configs' pad/bos/eos tokens: torch's nn.Embedding(padding_idx)
        # gives the pad row no gradient, which the exported Gather cannot express.
        d = {"input_ids": torch.randint(3, VOCAB, (batch, seq), generator=gen)}
        if with_mask:
            d["attention_mask"] = mask_of(batch, seq)
        return d
    name, shape = spec["input"]
    return {name: torch.randn((batch,) + shape, generator=gen)}


def outputs_of(res):
    """The model's outputs as a flat list of tensors in the exporters' order."""
    if isinstance(res, torch.Tensor):
        return [res]
    if isinstance(res, dict):  # torchvision's segmentation models: {"out": ...}
        res = tuple(res.values())
    if hasattr(res, "to_tuple"):
        res = res.to_tuple()
    return [t for t in res if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------------------------------
# Exporting.

def export(model, spec, inputs, path, dynamo, opset):
    names = list(inputs)
    out_names = list(spec["outputs"])
    text = spec["kind"] == "text"
    in_axes = {n: ({0: "batch", 1: "sequence"} if text else {0: "batch"}) for n in names}
    axes_of = {"bs": {0: "batch", 1: "sequence"}, "b": {0: "batch"}}
    if dynamo:
        torch.onnx.export(model, (), path, kwargs=inputs, input_names=names,
                          output_names=out_names, dynamic_shapes=in_axes, dynamo=True,
                          opset_version=opset)
    else:
        dyn = dict(in_axes)
        dyn.update({o: axes_of[a] for o, a in spec["outputs"].items()})
        # The TorchScript exporter binds every parameter of forward() (transformers'
        # `logits_to_keep=0` would become a graph input): export a wrapper whose forward
        # takes exactly the named inputs, as users of this exporter do.
        # The exporter puts the wrapper back in the mode it was in, and a new module is in
        # train(): made eval() first, so that the model is left in eval() for later exports
        # (a dynamo export in train() writes dropout as RandomUniformLike).
        torch.onnx.export(Positional(model, names).eval(), tuple(inputs.values()), path,
                          input_names=names, output_names=out_names, dynamic_axes=dyn,
                          dynamo=False, opset_version=opset)
    # One self-contained file: weights inline, no model.onnx.data beside it.
    m = onnx.load(path)
    strip_metadata(m.graph)
    for f in os.listdir(os.path.dirname(path)):
        if f != "model.onnx":
            os.remove(os.path.join(os.path.dirname(path), f))
    onnx.save_model(m, path, save_as_external_data=False)
    return m


def strip_metadata(g):
    """Drops what only tools read: the dynamo exporter writes ~2 KB of stack trace and
    module path per node (metadata_props), which would make the zoo four times larger.
    Nothing that defines the computation is touched."""
    for n in g.node:
        del n.metadata_props[:]
        n.doc_string = ""
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                strip_metadata(a.g)
            for sub in a.graphs:
                strip_metadata(sub)
    for v in list(g.value_info) + list(g.input) + list(g.output) + list(g.initializer):
        del v.metadata_props[:]
        v.doc_string = ""
    del g.metadata_props[:]


class Positional(torch.nn.Module):
    """model(**dict(zip(names, args))) with the outputs as a tuple. The model is held as
    `model`, so torch names its parameters `model.<name>`."""

    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        return tuple(outputs_of(self.model(**dict(zip(self.names, args)))))


@contextlib.contextmanager
def quiet():
    """The exporters print progress and, on failure, whole TorchScript graphs (from C++
    too): send fds 1 and 2 to a scratch file while they run."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def summary(e):
    """The line of an exception that says what went wrong (the exporters wrap the cause
    in a long banner)."""
    text = str(e)
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if "## Exception summary" in text:
        after = text.split("## Exception summary", 1)[1]
        cause = [l.strip() for l in after.splitlines() if l.strip()]
        if cause:
            return f"{type(e).__name__}: {cause[0]}"[:400]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


# ---------------------------------------------------------------------------------------
# References.

def torch_reference(model, inputs, gen_seed):
    """float64 outputs, the seed of the first output, and gradients of
    sum(first output * seed) w.r.t. the float inputs and every parameter."""
    m64 = copy.deepcopy(model).double()
    # Frozen parameters (Whisper's sinusoidal positions) are initializers like any other
    # in the export, and graphrun differentiates them: compare their true gradient.
    for p in m64.parameters():
        p.requires_grad_(True)
    a64 = {k: (v.double().requires_grad_() if v.is_floating_point() else v)
           for k, v in inputs.items()}
    outs = outputs_of(m64(**a64))
    g = torch.Generator().manual_seed(gen_seed)
    seed = torch.randn(outs[0].shape, generator=g).float()
    (outs[0] * seed.double()).sum().backward()
    grads = {k: v.grad.numpy() for k, v in a64.items() if v.is_floating_point()}
    pgrads = {n: p.grad.numpy() for n, p in m64.named_parameters() if p.grad is not None}
    return [o.detach().numpy() for o in outs], seed.numpy(), grads, pgrads


def map_initializers(m, model):
    """Which torch parameter each ONNX initializer holds: by name (aliases of tied weights
    included), else by exact value, else by exact transposed value (the TorchScript
    exporter folds a Linear's weight.T into a new initializer). Returns
    {init: (param, transposed)} for the unambiguous ones, the tied parameters and a dict
    of notes on the initializers left unchecked."""
    alias = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        alias[n] = p
        alias[f"model.{n}"] = p  # as named in the export of the `Positional` wrapper
    canon = {}
    for n, p in model.named_parameters():
        canon[id(p)] = n
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    hit = {}
    notes = {}
    for init in m.graph.initializer:
        a = onnx.numpy_helper.to_array(init)
        if init.name in alias:
            p = canon[id(alias[init.name])]
            if a.shape == params[p].shape and np.array_equal(a, params[p]):
                hit[init.name] = (p, False)
            else:
                # The dynamo exporter folds BatchNorm into the Conv before it and keeps
                # the Conv weight's name for the folded value.
                notes[init.name] = f"named after {p} but holds another value (folded)"
            continue
        if a.dtype != np.float32 or a.size < 2:
            continue
        found = []
        for n, pv in params.items():
            if a.shape == pv.shape and np.array_equal(a, pv):
                found.append((n, False))
            elif pv.ndim == 2 and a.shape == pv.T.shape and np.array_equal(a, pv.T):
                found.append((n, True))
        if len(found) == 1:
            hit[init.name] = found[0]
        elif len(found) > 1:
            notes[init.name] = f"equal to several parameters: {[f[0] for f in found]}"
    # A parameter held by several initializers (a tied embedding and its transposed copy)
    # gets the sum of their gradients in torch: checked as that sum.
    users = Counter(p for p, _ in hit.values())
    tied = {}
    for init, (p, t) in sorted(hit.items()):
        if users[p] > 1:
            tied.setdefault(p, []).append((init, t))
    for init in notes:
        hit.pop(init, None)
    for p, held in tied.items():
        for init, _ in held:
            hit.pop(init)
    return hit, tied, notes


# ---------------------------------------------------------------------------------------

def main():
    args = sys.argv[1:]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = set(args[i + 1].split(","))
        del args[i:i + 2]
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "zoo")
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    manifest_path = os.path.join(root, "MANIFEST.tsv")
    rows = {}
    if os.path.exists(manifest_path) and only:
        for line in open(manifest_path).read().splitlines()[1:]:
            rows[line.split("\t")[0]] = line
    torch.set_num_threads(1)
    for arch, spec in ARCHS.items():
        if only and arch not in only:
            continue
        masks = [False, True] if spec["kind"] == "text" else [False]
        for with_mask in masks:
            torch.manual_seed(SEED)
            model = spec["build"]().eval()
            randomize(model, torch.Generator().manual_seed(SEED + 1))
            g = torch.Generator().manual_seed(SEED + 2)
            ex_in = make_inputs(arch, spec, EXPORT_BATCH, EXPORT_SEQ, with_mask, g)
            te_in = make_inputs(arch, spec, TEST_BATCH, TEST_SEQ, with_mask, g)
            ref = f"{arch}_mask" if with_mask else arch
            outs64, seed, in_grads, p_grads = torch_reference(model, te_in, SEED + 3)
            tdir = os.path.join(root, "_torch", ref, "grads")
            shutil.rmtree(os.path.dirname(tdir), ignore_errors=True)
            os.makedirs(tdir)
            for n, gr in list(in_grads.items()) + list(p_grads.items()):
                np.save(os.path.join(tdir, f"{n}.npy"), gr)
            for exporter, dynamo, opset in EXPORTERS:
                case = f"{arch}_{exporter}_op{opset}" + ("_mask" if with_mask else "")
                keep = FEW if spec.get("few") else spec.get("keep")
                if keep and not any(case.endswith(s) for s in keep):
                    continue
                d = os.path.join(root, case)
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                print(f"{case} ...", flush=True)
                try:
                    with quiet():
                        m = export(model, spec, ex_in, os.path.join(d, "model.onnx"), dynamo, opset)
                except Exception as e:  # the exporter's own failure is the measurement
                    shutil.rmtree(d)
                    msg = summary(e)
                    print(f"  export failed: {msg}")
                    rows[case] = "\t".join([case, "no", "-", msg.replace("\t", " ")])
                    continue
                rows[case] = finish_case(case, d, m, model, te_in, outs64, seed, in_grads, ref)
                print("  " + rows[case].split("\t", 2)[2])
    with open(manifest_path, "w") as f:
        f.write("case\texported\tort\tdetail\n")
        for case in sorted(rows):
            f.write(rows[case] + "\n")


def finish_case(case, d, m, model, te_in, outs64, seed, in_grads, ref):
    ops = Counter(n.op_type for n in m.graph.node)
    graph_inputs = [i.name for i in m.graph.input]
    feeds = {}
    lines = []
    for n in graph_inputs:
        if n not in te_in:
            return "\t".join([case, "yes", "no", f"graph input {n} is none of {list(te_in)}"])
        feeds[n] = te_in[n].numpy()
        np.save(os.path.join(d, f"in_{n}.npy"), feeds[n])
        lines.append(("input", n, f"in_{n}.npy"))
    ort_ok = "yes"
    try:
        s = ort.InferenceSession(os.path.join(d, "model.onnx"), providers=["CPUExecutionProvider"])
        with quiet():
            got = s.run(None, feeds)
        prefix = "ort"
    except Exception as e:
        # ONNX Runtime's error is the measurement; onnx.reference (the semantics contract)
        # still gives outputs to compare with, stored as ref_<i>.npy so they are never
        # mistaken for ORT's.
        ort_ok = "no: " + str(e).splitlines()[0][:300].replace("\t", " ")
        try:
            from onnx.reference import ReferenceEvaluator

            got = ReferenceEvaluator(m).run(None, feeds)
            prefix = "ref"
        except Exception as e2:
            return "\t".join([case, "yes", ort_ok,
                              "onnx.reference fails too: " + str(e2).splitlines()[0][:200]])
    errs = []
    for i, (vo, o) in enumerate(zip(m.graph.output, got)):
        np.save(os.path.join(d, f"{prefix}_{i}.npy"), o)
        lines.append(("output", vo.name, f"{prefix}_{i}.npy"))
        if i < len(outs64):
            r = outs64[i]
            errs.append(float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
                        if o.shape == r.shape else float("inf"))
    first = m.graph.output[0].name
    np.save(os.path.join(d, "seed.npy"), seed)
    lines.append(("seed", first, "seed.npy"))
    gdir = f"../_torch/{ref}/grads"
    for n in in_grads:
        lines.append(("grad", n, f"{gdir}/{n}.npy"))
    hit, tied, notes = map_initializers(m, model)
    inits = {}
    for init, (p, transposed) in sorted(hit.items()):
        lines.append(("grad_t" if transposed else "grad", init, f"{gdir}/{p}.npy"))
        inits[init] = {"param": p, "transposed": transposed}
    for p, held in sorted(tied.items()):
        names = ",".join(("T:" if t else "") + i for i, t in held)
        lines.append(("grad_sum", names, f"{gdir}/{p}.npy"))
        for i, t in held:
            inits[i] = {"param": p, "transposed": t, "tied": True}
    held = {p for p, _ in hit.values()} | set(tied)
    unmapped = sorted(n for n, p in model.named_parameters() if n not in held)
    with open(os.path.join(d, "params.json"), "w") as f:
        json.dump({"initializers": inits, "ambiguous": notes,
                   "parameters_without_initializer": unmapped,
                   "note": "gradients are PyTorch's float64 ones of sum(first output * seed)"
                           f" in ../_torch/{ref}/grads/<param>.npy; a transposed initializer"
                           " holds param.T (its gradient is the file's transpose); the"
                           " gradient of a tied parameter is the sum over its initializers"},
                  f, indent=1, sort_keys=True)
        f.write("\n")
    with open(os.path.join(d, "MANIFEST"), "w") as f:
        f.writelines(f"{k}\t{v}\t{p}\n" for k, v, p in lines)
    opsets = ",".join(f"{o.domain or 'ai.onnx'}:{o.version}" for o in m.opset_import)
    detail = (f"{len(m.graph.node)} nodes, {len(ops)} op types; opsets {opsets}; "
              f"{'ORT' if prefix == 'ort' else 'onnx.reference'} vs torch f64 {max(errs):.1e}; "
              f"{len(hit)} initializers mapped, "
              f"{len(unmapped)} parameters not")
    return "\t".join([case, "yes", ort_ok, detail])


if __name__ == "__main__":
    main()
