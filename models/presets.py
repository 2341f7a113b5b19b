"""Built-in model presets (pure data; validated by specs.spec_from_mapping on use).

Sources, per family:
- GPT-2: Radford et al. 2019 and HF `gpt2` config.json (12 layers, 768 hidden, 12 heads, 1024 ctx).
- GPT-3: Brown et al. 2020, Table 2.1. gpt3-13b's d_model is listed as 5140, which 40 heads do not
  divide; we use 5120 as Megatron-LM and most reproductions do.
- LLaMA 2: Touvron et al. 2023 and the released params.json/config.json files.
- LLaMA 3: Llama 3 Herd of Models (Dubey et al. 2024), Table 3, and the released config.json files.
- BERT-large: Devlin et al. 2019 (24 layers, 1024 hidden, 16 heads, 512 positions, 30522 WordPieces).
- ResNet-50: He et al. 2016; VGG-16: Simonyan & Zisserman 2015 (torchvision layouts).
- Mixtral 8x7B / 8x22B: Jiang et al. 2024 (arXiv 2401.04088) and HF mistralai/Mixtral-8x7B-v0.1,
  Mixtral-8x22B-v0.1 config.json (experts are `intermediate_size` wide; router_aux_loss_coef).
- Qwen2.5-7B: Qwen2.5 technical report (arXiv 2412.15115, Table 1) and HF Qwen/Qwen2.5-7B config.json (28
  layers, 3584 hidden, 28 heads, 4 K/V heads, 18944 FFN, 152,064 ids, biased q/k/v projections: 7.62 B parameters).
- Qwen3-30B-A3B / 235B-A22B: Qwen3 technical report (arXiv 2505.09388, Table 2) and HF Qwen/* config.json
  (head_dim 128, q/k RMSNorm, 128 experts of moe_intermediate_size, top-8, router_aux_loss_coef 0.001).
- DeepSeek-V3: arXiv 2412.19437 (Sec. 4.2: MLA ranks, 1 shared + 256 routed experts, top-8, first 3 layers
  dense, sigmoid routing with scaling 2.5, balance factor alpha = 0.0001, one MTP module) and HF
  deepseek-ai/DeepSeek-V3 config.json.
- Llama 4 Scout / Maverick: Meta's model card (17B active; 109B / 400B total, the vision encoder included) and
  HF meta-llama/Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E config.json text_config (48 layers, 5120 hidden,
  40 heads of 128, 8 K/V heads, 202,048 ids; 16 / 128 experts of 8192 plus one shared, top-1 sigmoid routing;
  Maverick's MoE layers every other one (interleave_moe_layer_step 2), its dense ones 16384 wide).
Sequence lengths are pre-training lengths (4096 for the MoE models: Qwen3's general stage, DeepSeek-V3's
4K pre-training, and the length NVIDIA's NeMo/Megatron Mixtral recipes train at), not the context windows
the HF configs list as max_position_embeddings.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Tiny models for CPU tests and the executor (a few layers, real shapes, run in milliseconds).
    "gpt-tiny": dict(family="gpt", num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=1024,
                     seq_length=128),
    "llama-tiny": dict(family="llama", num_layers=4, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                       ffn_hidden_size=352, vocab_size=1024, seq_length=128),
    # Tiny mixtures of experts: Mixtral-style (softmax top-2 of 4) and DeepSeek-style (MLA, sigmoid routing,
    # a shared expert, a dense first layer, fine-grained experts).
    "mixtral-tiny": dict(family="llama", num_layers=4, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=352, vocab_size=1024, seq_length=128, num_experts=4, experts_per_token=2),
    "deepseek-tiny": dict(family="llama", num_layers=3, hidden_size=128, num_attention_heads=4, q_lora_rank=64,
                          kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                          ffn_hidden_size=256, moe_ffn_hidden_size=64, num_experts=8, experts_per_token=2,
                          num_shared_experts=1, dense_layers=1, moe_score_function="sigmoid",
                          moe_routed_scaling_factor=2.5, mtp_layers=1, vocab_size=1024, seq_length=128),
    "gpt2": dict(family="gpt", num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                 seq_length=1024),
    "gpt3-1.3b": dict(family="gpt", num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50257,
                      seq_length=2048),
    "gpt3-2.7b": dict(family="gpt", num_layers=32, hidden_size=2560, num_attention_heads=32, vocab_size=50257,
                      seq_length=2048),
    "gpt3-6.7b": dict(family="gpt", num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=50257,
                      seq_length=2048),
    "gpt3-13b": dict(family="gpt", num_layers=40, hidden_size=5120, num_attention_heads=40, vocab_size=50257,
                     seq_length=2048),
    "gpt3-175b": dict(family="gpt", num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=50257,
                      seq_length=2048),
    "llama2-7b": dict(family="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                      ffn_hidden_size=11008, vocab_size=32000, seq_length=4096),
    "llama2-13b": dict(family="llama", num_layers=40, hidden_size=5120, num_attention_heads=40,
                       ffn_hidden_size=13824, vocab_size=32000, seq_length=4096),
    "llama2-70b": dict(family="llama", num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8,
                       ffn_hidden_size=28672, vocab_size=32000, seq_length=4096),
    "llama3-8b": dict(family="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                      ffn_hidden_size=14336, vocab_size=128256, seq_length=8192),
    "llama3-70b": dict(family="llama", num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8,
                       ffn_hidden_size=28672, vocab_size=128256, seq_length=8192),
    "llama3-405b": dict(family="llama", num_layers=126, hidden_size=16384, num_attention_heads=128,
                        num_kv_heads=8, ffn_hidden_size=53248, vocab_size=128256, seq_length=8192),
    "qwen2.5-7b": dict(family="llama", num_layers=28, hidden_size=3584, num_attention_heads=28, num_kv_heads=4,
                       ffn_hidden_size=18944, vocab_size=152064, seq_length=4096, qkv_bias=True),
    "mixtral-8x7b": dict(family="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                         ffn_hidden_size=14336, vocab_size=32000, seq_length=4096, num_experts=8,
                         experts_per_token=2, moe_aux_loss_coeff=0.02),
    "mixtral-8x22b": dict(family="llama", num_layers=56, hidden_size=6144, num_attention_heads=48, num_kv_heads=8,
                          ffn_hidden_size=16384, vocab_size=32000, seq_length=4096, num_experts=8,
                          experts_per_token=2, moe_aux_loss_coeff=0.001),
    "qwen3-30b-a3b": dict(family="llama", num_layers=48, hidden_size=2048, num_attention_heads=32, num_kv_heads=4,
                          head_dim=128, qk_norm=True, ffn_hidden_size=6144, moe_ffn_hidden_size=768,
                          num_experts=128, experts_per_token=8, vocab_size=151936, seq_length=4096,
                          moe_aux_loss_coeff=0.001),
    "qwen3-235b-a22b": dict(family="llama", num_layers=94, hidden_size=4096, num_attention_heads=64, num_kv_heads=4,
                            head_dim=128, qk_norm=True, ffn_hidden_size=12288, moe_ffn_hidden_size=1536,
                            num_experts=128, experts_per_token=8, vocab_size=151936, seq_length=4096,
                            moe_aux_loss_coeff=0.001),
    "deepseek-v3": dict(family="llama", num_layers=61, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        ffn_hidden_size=18432, moe_ffn_hidden_size=2048, num_experts=256, experts_per_token=8,
                        num_shared_experts=1, dense_layers=3, moe_score_function="sigmoid",
                        moe_routed_scaling_factor=2.5, moe_aux_loss_coeff=0.0001, mtp_layers=1, vocab_size=129280,
                        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_expert_bias=True,
                        seq_length=4096),
    "llama4-scout": dict(family="llama", num_layers=48, hidden_size=5120, num_attention_heads=40, num_kv_heads=8,
                         head_dim=128, ffn_hidden_size=16384, moe_ffn_hidden_size=8192, num_experts=16,
                         experts_per_token=1, num_shared_experts=1, moe_score_function="sigmoid", moe_norm_topk=False,
                         moe_aux_loss_coeff=0.001, vocab_size=202048, seq_length=8192),
    "llama4-maverick": dict(family="llama", num_layers=48, hidden_size=5120, num_attention_heads=40, num_kv_heads=8,
                            head_dim=128, ffn_hidden_size=16384, moe_ffn_hidden_size=8192, num_experts=128,
                            experts_per_token=1, num_shared_experts=1, moe_layer_step=2, moe_score_function="sigmoid",
                            moe_norm_topk=False, moe_aux_loss_coeff=0.001, vocab_size=202048, seq_length=8192),
    "bert-large": dict(family="bert", num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=30522,
                       seq_length=512),
    "resnet50": dict(family="resnet", depth=50, num_classes=1000, image_size=224),
    "vgg16": dict(family="vgg", depth=16, num_classes=1000, image_size=224),
    # An MLP whose classifier (2048 x 1M = 2.05 B parameters) dwarfs its trunk: the canonical case for
    # a data-parallel trunk with a class-sharded (model-parallel) classifier.
    "mlp-bigfc": dict(family="mlp", input_size=1024, hidden_sizes=[2048, 2048], num_classes=1_000_000),
}

# RoPE base, RMSNorm eps and RoPE scaling of the presets named after released models, from their HF config.json
# (rope_theta, rms_norm_eps, rope_scaling): the exports train those models with them (planner/exports, Megatron-LM
# --rotary-base/--norm-epsilon/--use-rope-scaling, torchtitan's flavor args). No planned figure depends on them
# (paraplan's own executor rotates with base 10000). The llama3-* presets take Llama 3.1's (the same shapes as
# Llama 3's: 3.1 adds the scaling; torchtitan's llama3 flavors are 3.1's); llama4-* are left to paraplan's.
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
PUBLISHED_NUMERICS: dict[str, dict[str, Any]] = {
    **{name: dict(rope_theta=10000.0, rms_norm_eps=1e-5, rope_scaling=None, source=f"meta-llama/Llama-2-{size}-hf")
       for name, size in (("llama2-7b", "7b"), ("llama2-13b", "13b"), ("llama2-70b", "70b"))},
    **{name: dict(rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling=LLAMA31_SCALING,
                  source=f"meta-llama/Llama-3.1-{size}")
       for name, size in (("llama3-8b", "8B"), ("llama3-70b", "70B"), ("llama3-405b", "405B"))},
    "mixtral-8x7b": dict(rope_theta=1e6, rms_norm_eps=1e-5, rope_scaling=None, source="mistralai/Mixtral-8x7B-v0.1"),
    "mixtral-8x22b": dict(rope_theta=1e6, rms_norm_eps=1e-5, rope_scaling=None,
                          source="mistralai/Mixtral-8x22B-v0.1"),
    "qwen2.5-7b": dict(rope_theta=1e6, rms_norm_eps=1e-6, rope_scaling=None, source="Qwen/Qwen2.5-7B"),
    "qwen3-30b-a3b": dict(rope_theta=1e6, rms_norm_eps=1e-6, rope_scaling=None, source="Qwen/Qwen3-30B-A3B"),
    "qwen3-235b-a22b": dict(rope_theta=1e6, rms_norm_eps=1e-6, rope_scaling=None, source="Qwen/Qwen3-235B-A22B"),
    "deepseek-v3": dict(rope_theta=10000.0, rms_norm_eps=1e-6,
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
                        source="deepseek-ai/DeepSeek-V3"),
}
