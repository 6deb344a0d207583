"""Tiny model configs for the real-engine suite: no hub, dummy weights, seconds per request on 2 CPU cores.

Each entry: the Hugging Face config.json the test writes into a fresh directory,
and the extra LLM(...) arguments. `num_gpu_blocks_override` is small so that the
scenarios force evictions.
"""

from __future__ import annotations

from typing import Any

VOCAB = 1024
_COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}

MODELS: dict[str, dict[str, Any]] = {
    # plain attention: one full-attention group
    "llama": {
        "config": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                   "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 64},
        "llm": {"block_size": 32, "num_gpu_blocks_override": 24, "max_model_len": 512, "max_num_seqs": 4},
    },
    # sliding-window groups + one full-attention group
    "gemma3": {
        "config": {**_COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                   "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 80,
                   "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                   "hidden_activation": "gelu_pytorch_tanh"},
        "llm": {"block_size": 32, "num_gpu_blocks_override": 64, "max_model_len": 512, "max_num_seqs": 4},
    },
    # three gated-delta-net (mamba kind) groups + one full-attention group
    "qwen3_next": {
        "config": {**_COMMON, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                   "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 64,
                   "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                   "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 1,
                   "linear_num_value_heads": 1, "linear_conv_kernel_dim": 4, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "full_attention_interval": 4},
        "llm": {"block_size": 32, "num_gpu_blocks_override": 64, "max_model_len": 2048, "max_num_seqs": 4},
    },
    # Mamba2 + attention (granite-4.0-h)
    "granite_h": {
        "config": {**_COMMON, "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
                   "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "layer_types": ["mamba", "mamba", "mamba", "attention"],
                   "mamba_n_heads": 4, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_n_groups": 1,
                   "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 64, "num_local_experts": 4,
                   "num_experts_per_tok": 2, "shared_intermediate_size": 128, "position_embedding_type": "nope"},
        # vLLM raises the block size to the Mamba2 page (64); the CPU Mamba2 kernel
        # needs prefill chunks of one block
        "llm": {"block_size": 32, "num_gpu_blocks_override": 64, "max_model_len": 2048, "max_num_seqs": 4,
                "max_num_batched_tokens": 64},
    },
}
