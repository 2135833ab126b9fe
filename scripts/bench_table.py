#!/usr/bin/env python3
"""Merges `graphrun bench --json` files with torch_reference.py JSON files (same device
call) into one side-by-side markdown table: graphrun's median ms next to PyTorch's
(cudagraph mode, and eager where it was run), their ratio, the achieved TFLOP/s by the
reference's analytic FLOP count (the same count for both sides) and its fraction of the
matrix ceiling of the dtype.

  python3 scripts/bench_table.py OUT.md graphrun/*.json torch_*.json
"""
import json, sys

CEIL = {"bf16": 779.0, "tf32": 404.0, "f32": 51.3}  # TFLOP/s, H100, ../shared/bench
ORDER = ["mlp_small", "mlp_large", "gpt_block", "attention"]


def load(paths):
    g, t, meta = {}, {}, {}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        if "meta" in d:
            meta = d["meta"]
        for r in d.get("results", []):
            pas = "train" if r.get("pass") in ("train", "fwd+bwd") else r.get("pass")
            key = (r["workload"], r["dtype"], pas)
            if r.get("mode") == "graphrun":
                g[key] = r
            elif r.get("status") == "ok":
                t.setdefault(key, {})[r["mode"]] = r
    return g, t, meta


def main():
    out, paths = sys.argv[1], sys.argv[2:]
    g, t, meta = load(paths)
    keys = sorted(set(g) | set(t), key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else 9, ["f32", "tf32", "bf16"].index(k[1]) if k[1] in CEIL else 9, k[2]))
    lines = [
        "| workload | dtype | pass | graphrun ms | PyTorch cudagraph ms | PyTorch eager ms | graphrun / best PyTorch | graphrun TFLOP/s | of ceiling | graphrun peak MiB | PyTorch peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in keys:
        gr, tr = g.get(k), t.get(k, {})
        flop = next((r.get("flop") for r in tr.values() if r.get("flop")), None)
        cg, eg = tr.get("cudagraph"), tr.get("eager")
        best = min([r["ms"] for r in (cg, eg) if r], default=None)
        gms = gr["ms"] if gr and gr.get("status") == "ok" else None
        f = lambda v: f"{v:.3f}" if v is not None else "-"
        ratio = f"{gms / best:.2f}" if gms and best else "-"
        tf = flop / (gms * 1e-3) / 1e12 if gms and flop else None
        frac = f"{100 * tf / CEIL[k[1]]:.1f}%" if tf and k[1] in CEIL else "-"
        tpeak = next((r.get("peak_mib") for r in (cg, eg) if r and r.get("peak_mib") is not None), None)
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {f(gms)} | {f(cg['ms'] if cg else None)} | {f(eg['ms'] if eg else None)} | {ratio} | "
            f"{tf:.2f} | {frac} | {gr['peak_mib']:.0f} | {tpeak:.0f} |".replace("None", "-")
            if tf is not None and gr and tpeak is not None
            else f"| {k[0]} | {k[1]} | {k[2]} | {f(gms)} | {f(cg['ms'] if cg else None)} | {f(eg['ms'] if eg else None)} | {ratio} | - | - | {gr['peak_mib'] if gr else '-'} | {tpeak if tpeak is not None else '-'} |"
        )
    head = f"device: {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}\n\n"
    with open(out, "w") as fo:
        fo.write(head + "\n".join(lines) + "\n")
    print(head + "\n".join(lines))


if __name__ == "__main__":
    main()
