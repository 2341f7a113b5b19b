"""``paraplan hardware``: the GPU, link and cluster specs in tables (or one JSON object)."""

from __future__ import annotations

import dataclasses

from paraplan.hardware_specs import load_cluster, load_gpu, load_link, names

from .output import print_json, stdout, table


def run(args) -> int:
    gpus = [load_gpu(n) for n in names("gpu")]
    links = [load_link(n) for n in names("link")]
    clusters = [load_cluster(n) for n in names("cluster")]
    if args.json:
        print_json({
            "gpus": [dataclasses.asdict(g) for g in gpus],
            "links": [dataclasses.asdict(x) for x in links],
            "clusters": [{**dataclasses.asdict(c), "gpu": c.gpu.name, "num_gpus": c.num_gpus} for c in clusters],
        })
        return 0
    fmt = lambda v: "-" if v is None else f"{v:g}"
    stdout.print(table("GPUs (dense peak TFLOP/s)", ["name", "memory GiB", "HBM GB/s", "fp32", "tf32", "bf16", "fp16",
                                                     "fp8"],
                       [[g.name, fmt(g.memory_GiB), fmt(g.hbm_GBps), *[fmt(g.peak_tflops[d]) for d in
                                                                        ("fp32", "tf32", "bf16", "fp16", "fp8")]]
                        for g in gpus]))
    stdout.print(table("Links (per direction)", ["name", "kind", "GB/s", "latency us"],
                       [[x.name, x.kind, fmt(x.bandwidth_GBps), fmt(x.latency_us)] for x in links], 2))
    stdout.print(table("Clusters", ["name", "gpu", "nodes x gpus", "intra-node GB/s", "inter-node GB/s (node)",
                                    "$/GPU-hour"],
                       [[c.name, c.gpu.name, f"{c.nodes} x {c.gpus_per_node}", fmt(c.intra_node.bandwidth_GBps),
                         fmt(c.inter_node.bandwidth_GBps) if c.networked else "-", fmt(c.cost_per_gpu_hour_usd)]
                        for c in clusters], 2))
    return 0
