#!/usr/bin/env python3
"""Writes tests/fixtures/lm_train/: tiny GPT-2 and LLaMA (`transformers`, random seeded
weights with no two parameters alike, no dropout) exported with their logits as the only output, and PyTorch's own
fine-tuning of each from the same weights, for the test to follow step by step.

    python3 scripts/export_lm_training.py tests/fixtures/lm_train

<arch>.onnx          torch.onnx.export(dynamo=True), opset 18, dynamic batch and sequence
ids.npy, labels.npy  [steps, batch, seq] token batches from scripts/make_tokens.py's
                     generator (labels: the next token, -100 at the last position)
<arch>.losses.npy    PyTorch's loss at each step, in float64 from the exported float32
                     weights: mean cross-entropy of the logits against the labels
                     (ignoring -100), Adam lr 0.003
"""
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tokens import make  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, LR = 20, 4, 16, 100, 0.003


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    c = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_inner=64,
                   n_positions=32, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(c)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    c = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=32, use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM(c)


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids).logits


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    warnings.filterwarnings("ignore")
    rng = np.random.default_rng(0)
    ids, labels = make(rng, STEPS * BATCH, SEQ, VOCAB)
    ids = ids.reshape(STEPS, BATCH, SEQ)
    labels = labels.reshape(STEPS, BATCH, SEQ)
    np.save(os.path.join(out, "ids.npy"), ids)
    np.save(os.path.join(out, "labels.npy"), labels)
    for name, build in [("gpt2", gpt2), ("llama", llama)]:
        torch.manual_seed(0)
        m = Logits(build()).eval()
        # As a trained model's would, no two parameters hold the same values: the
        # exporter would share fresh ones and zeros (LayerNorm, biases) between layers,
        # which a fine-tune would then train as one parameter.
        with torch.no_grad():
            for p in m.parameters():
                if p.min() == p.max():
                    p.add_(0.02 * torch.randn_like(p))
        x = torch.from_numpy(ids[0][:2, :7].copy())
        b, s = torch.export.Dim("batch"), torch.export.Dim("seq")
        torch.onnx.export(m, (x,), dynamo=True, opset_version=18, input_names=["input_ids"],
                          output_names=["logits"],
                          dynamic_shapes={"input_ids": {0: b, 1: s}}).save(
            os.path.join(out, f"{name}.onnx"), external_data=False)
        # The exporter's per-node metadata (source locations) is most of the file.
        import onnx

        mp = onnx.load(os.path.join(out, f"{name}.onnx"))
        for n in mp.graph.node:
            del n.metadata_props[:]
        onnx.save(mp, os.path.join(out, f"{name}.onnx"))
        ref = m.double()
        opt = torch.optim.Adam(ref.parameters(), lr=LR)
        losses = []
        for k in range(STEPS):
            opt.zero_grad()
            logits = ref(torch.from_numpy(ids[k]))
            loss = F.cross_entropy(logits.reshape(-1, VOCAB),
                                   torch.from_numpy(labels[k]).reshape(-1), ignore_index=-100)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        np.save(os.path.join(out, f"{name}.losses.npy"), np.array(losses))
        print(name, "losses", [round(v, 4) for v in losses])


if __name__ == "__main__":
    main()
