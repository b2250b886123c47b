"""Tiny random-weight models of the families researchers load, built from transformers configs (no weights, no hub).

Each entry sets what makes its family differ where the wrapper's masks and cache could go wrong: grouped-query
heads, a sliding window shorter than the tests' contexts (6 slots), alternating local / global layers, attention
soft-capping, absolute or learned positions, parallel attention, mixture-of-experts MLPs. The test matrix
(``tests/test_families.py``) and the table of docs/engine_and_models.md (``benchmarks/family_matrix.py``) run
``FAMILIES`` on every kernel and step kind, ``MORE_FAMILIES`` on every kernel but flex attention and the main step kinds,
and ``REFUSED_FAMILIES``, which the wrapper refuses in one line.

``tiny_family_model(family, kernel)`` -> a transformers model in float32 on the CPU with the attention ``kernel``
(``"eager"``, ``"sdpa"``, ``"flex_attention"``, ...), reproducible from ``seed``.
"""

from __future__ import annotations

import torch

__all__ = ["FAMILIES", "MORE_FAMILIES", "REFUSED_FAMILIES", "WINDOW", "tiny_family_config", "tiny_family_model", "perturbed_copy", "tiny_family_pair",
           "MTP_LAYOUTS", "tiny_mtp_checkpoint", "RECURRENT_FAMILIES", "tiny_recurrent_model", "SPARSE_FAMILIES",
           "tiny_sparse_model", "QWEN_MTP_CONFIGS",
           "tiny_qwen_mtp_checkpoint", "tiny_gemma4_pair", "tiny_dflash_pair", "word_tokenizer", "tiny_usd_pair"]

WINDOW = 6  # sliding window of the windowed families: shorter than the tests' prompts plus generations
_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=1)

# Gemma's embeddings are scaled by sqrt(hidden) and tied to the output layer: a random tied model repeats its last
# token, so the Gemma entries (and XGLM, BioGPT below) untie or unscale them. family -> (transformers config class name, what this family's entry exercises, settings over _SIZES)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "Llama 2/3: RoPE, grouped-query heads", {}),
    "qwen2": ("Qwen2Config", "Qwen2 / Qwen2.5: q/k/v biases", {}),
    "qwen2-window": ("Qwen2Config", "Qwen2 with use_sliding_window: global then windowed layers",
                     dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3: q/k norms", dict(head_dim=8)),
    "mistral": ("MistralConfig", "Mistral: every layer windowed", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", "Mixtral: experts, windowed",
                dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),
    "gemma": ("GemmaConfig", "Gemma: scaled embeddings, GeGLU", dict(head_dim=8, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", "Gemma-2: soft-capping, alternating windowed / global layers",
               dict(head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma-3: local / global layers (5:1; here 1:1), two RoPE bases",
               dict(head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi-3: fused qkv, windowed", dict(sliding_window=WINDOW)),
    "phi": ("PhiConfig", "Phi-2: parallel attention, partial rotary", {}),
    "gpt2": ("GPT2Config", "GPT-2: learned absolute positions",
             dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)),
    "gpt-neox": ("GPTNeoXConfig", "GPT-NeoX / Pythia: parallel residual, partial rotary", {}),
    "opt": ("OPTConfig", "OPT: learned positions with an offset",
            dict(ffn_dim=64, word_embed_proj_dim=32, num_hidden_layers=2, max_position_embeddings=256)),
    "falcon": ("FalconConfig", "Falcon: multi-query, parallel attention", dict(new_decoder_architecture=False)),
    "starcoder2": ("Starcoder2Config", "StarCoder2: windowed, biases", dict(sliding_window=WINDOW)),
}

_ALTERNATING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
# More families, on every kernel but flex attention and the engine's main step kinds (experiments.families.more_cases)
MORE_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "deepseek-v3": ("DeepseekV3Config", "DeepSeek-V2/V3, Kimi-K2: latent attention (keys and values of other widths), "
                    "experts", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                                    qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                    first_k_dense_replace=1, n_group=1, topk_group=1, moe_intermediate_size=16)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3 MoE: q/k norms, experts",
                  dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "gpt-oss": ("GptOssConfig", "gpt-oss: attention sinks, alternating windowed / global layers, experts",
                dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, **_ALTERNATING)),
    "cohere2": ("Cohere2Config", "Command R7B: alternating windowed / global layers, parallel block", _ALTERNATING),
    "exaone4": ("Exaone4Config", "EXAONE 4: alternating windowed / global layers, q/k norms",
                dict(sliding_window_pattern=2, **_ALTERNATING)),
    "ministral": ("MinistralConfig", "Ministral: alternating windowed / global layers", dict(head_dim=8, **_ALTERNATING)),
    "smollm3": ("SmolLM3Config", "SmolLM3: layers without RoPE", dict(no_rope_layers=[1, 0])),
    "llama4": ("Llama4TextConfig", "Llama 4: chunked attention, layers without RoPE scale queries by position, experts",
               dict(head_dim=8, attention_chunk_size=4, no_rope_layers=[1, 0], floor_scale=2, attn_scale=1.0,
                    intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2)),
    "gemma3n": ("Gemma3nTextConfig", "Gemma 3n: the last layers reuse earlier layers' K and V, AltUp, per-layer inputs",
                dict(num_hidden_layers=4, num_kv_shared_layers=2, head_dim=8, sliding_window=WINDOW, laurel_rank=8,
                     layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
                     activation_sparsity_pattern=[0.0] * 4, tie_word_embeddings=False)),
    "gemma4": ("Gemma4TextConfig", "Gemma 4: the last layers reuse earlier layers' K and V, windowed / global layers",
               dict(num_hidden_layers=4, num_kv_shared_layers=2, head_dim=8, global_head_dim=8, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
                    vocab_size_per_layer_input=0, tie_word_embeddings=False)),
    "olmo2": ("Olmo2Config", "OLMo 2: norms after attention and MLP, q/k norms", {}),
    "granite": ("GraniteConfig", "Granite: scaled embeddings, residuals and logits", {}),
    "cohere": ("CohereConfig", "Command R: parallel block, scaled tied logits", {}),
    "glm4": ("Glm4Config", "GLM-4: partial rotary, extra norms", dict(head_dim=8)),
    "stablelm": ("StableLmConfig", "StableLM: partial rotary, layer norms", {}),
    "gpt-j": ("GPTJConfig", "GPT-J: parallel block, interleaved rotary",
              dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256)),
    "codegen": ("CodeGenConfig", "CodeGen: fused qkv in blocks, rotary",
                dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256, n_ctx=256)),
    "gpt-bigcode": ("GPTBigCodeConfig", "StarCoder 1 / SantaCoder: multi-query, learned positions",
                    dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)),
    "xglm": ("XGLMConfig", "XGLM: sinusoidal positions", dict(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                                                                tie_word_embeddings=False)),
    "biogpt": ("BioGptConfig", "BioGPT: learned positions", dict(scale_embedding=False)),
    "gpt-neo": ("GPTNeoConfig", "GPT-Neo: alternating global / local layers, windowed in their own buffer",
                dict(hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                     window_size=WINDOW, max_position_embeddings=256)),
    "bloom": ("BloomConfig", "BLOOM: ALiBi, built from the padding mask", dict(n_embed=32, n_layer=2, n_head=4)),
    "falcon-rw": ("FalconConfig", "Falcon-RW: ALiBi, built from the padding mask", dict(new_decoder_architecture=False,
                                                                                alibi=True)),
    "mpt": ("MptConfig", "MPT: ALiBi over cache slots, added in its attention",
            dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256)),
}
# Families CausalLM refuses in one line (models.attention): they keep no cache
REFUSED_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gpt-1": ("OpenAIGPTConfig", "GPT-1: no KV cache", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)),
}


def tiny_family_config(family: str, **overrides):
    """The tiny config of ``family`` (a key of ``FAMILIES``, ``MORE_FAMILIES`` or ``REFUSED_FAMILIES``), ``overrides``
    on top."""
    import transformers

    known = {**FAMILIES, **MORE_FAMILIES, **REFUSED_FAMILIES}
    if family not in known:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(known)}")
    class_name, _, settings = known[family]
    return getattr(transformers, class_name)(**{**_SIZES, **settings, **overrides})


def tiny_family_model(family: str, kernel: str = "eager", *, seed: int = 0, init_std: float = 0.5):
    """A float32 random-weight transformers model of ``family`` with attention ``kernel``; ``init_std`` sets the
    weights' scale (0.5: peaked, context-dependent next-token laws)."""
    from transformers import AutoModelForCausalLM

    config = tiny_family_config(family, initializer_range=init_std)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=kernel, dtype=torch.float32)
    return model.eval()


def perturbed_copy(model, noise: float = 0.1, seed: int = 1):
    """A copy of ``model`` with seeded noise of ``noise`` times each weight's std: a draft the target often accepts."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.numel() > 1:
                parameter.add_(noise * torch.randn(parameter.shape, generator=generator) * parameter.std())
    return draft


def tiny_family_pair(family: str = "llama", kernel: str = "eager", *, seed: int = 0, noise: float = 0.1):
    """``(target, draft)`` behind ``CausalLM`` on the CPU: the family's tiny model and its :func:`perturbed_copy`; a
    picklable recipe as ``functools.partial(tiny_family_pair, ...)`` (``experiments.executor``)."""
    from specresearch.models.causal_lm import CausalLM

    model = tiny_family_model(family, kernel, seed=seed)
    return CausalLM(model, device="cpu"), CausalLM(perturbed_copy(model, noise), device="cpu")


_MTP_HIDDEN = 32
_MTP_SIZES = dict(_SIZES, hidden_size=_MTP_HIDDEN, initializer_range=0.5)
_EXPERTS = dict(moe_intermediate_size=16, num_experts_per_tok=2)
# Tiny checkpoints with MTP layers in their published layouts (drafts.mtp; tests/test_mtp.py, benchmarks/audit_mtp.py):
# layout -> (config class, settings, the model's layers L: the MTP layer is the checkpoint's layer L, where indexed)
MTP_LAYOUTS: dict[str, tuple[str | None, dict, int]] = {
    "deepseek-v3": (None, {}, 61),
    "glm4-moe": ("Glm4MoeConfig", dict(head_dim=8, n_routed_experts=4, n_group=1, topk_group=1,
                                       first_k_dense_replace=1, **_EXPERTS), 46),
    "ernie4.5-moe": ("Ernie4_5_MoeConfig", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                                 moe_layer_start_index=0), 2),
    "mellum": ("MellumConfig", dict(head_dim=8, num_experts=4, sliding_window=4, **_EXPERTS), 2),
}


def _mtp_config(layout: str, layers: int):
    import transformers

    name, settings, _ = MTP_LAYOUTS[layout]
    if name is None:
        return tiny_family_config("deepseek-v3", num_hidden_layers=layers, initializer_range=0.5)
    if layout == "mellum":  # windowed and global layers, as Mellum ships (the rotary embedding serves both kinds)
        settings = {**settings, "layer_types": (["sliding_attention", "full_attention"] * layers)[:layers]}
    return getattr(transformers, name)(**{**_MTP_SIZES, **settings, "num_hidden_layers": layers})


def tiny_mtp_checkpoint(directory, layout: str, *, seed: int = 0) -> None:
    """Write to ``directory`` a random-weight checkpoint in ``layout`` (a key of ``MTP_LAYOUTS``) with one MTP layer
    (``drafts.mtp``): a model of L + 1 layers saved by transformers, its last layer's tensors moved under the layout's
    MTP names beside random ``enorm``, ``hnorm``, ``eh_proj`` and post-norm tensors, the config set to L layers and
    one MTP layer. L is what transformers' class expects of the published model where it names the layer by index
    (DeepSeek-V3's 61, GLM-4.5's 46). Reproducible from ``seed``."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    directory, L = Path(directory), MTP_LAYOUTS[layout][2]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_mtp_config(layout, L + 1), dtype=torch.float32)
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    block = {k[len(f"model.layers.{L}."):]: tensors.pop(k) for k in list(tensors) if k.startswith(f"model.layers.{L}.")}
    g = torch.Generator().manual_seed(seed + 1)
    norm = lambda: 1 + 0.2 * torch.randn(_MTP_HIDDEN, generator=g)  # noqa: E731
    proj = 0.3 * torch.randn(_MTP_HIDDEN, 2 * _MTP_HIDDEN, generator=g)
    if layout in ("deepseek-v3", "glm4-moe"):
        prefix = f"model.layers.{L}."
        extras = {"enorm.weight": norm(), "hnorm.weight": norm(), "eh_proj.weight": proj,
                  "shared_head.norm.weight": norm(), "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                  "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}
        tensors.update({prefix + k: v for k, v in {**block, **extras}.items()})
    elif layout == "ernie4.5-moe":  # its post-norm is the model's final norm
        tensors.update({f"mtp_block.0.{k}": v for k, v in block.items()})
        tensors.update({"mtp_emb_norm.0.weight": norm(), "mtp_hidden_norm.0.weight": norm(),
                        "mtp_linear_proj.0.weight": proj})
    else:
        tensors.update({f"mtp.layers.0.{k}": v for k, v in block.items()})
        tensors.update({"mtp.pre_fc_norm_embedding.weight": norm(), "mtp.pre_fc_norm_hidden.weight": norm(),
                        "mtp.fc.weight": proj, "mtp.norm.weight": norm()})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    for key in ("layer_types", "mlp_layer_types"):
        if key in config:
            config[key] = config[key][:L]
    (directory / "config.json").write_text(json.dumps(config))


_RECURRENT_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
_INKLING = dict(**_RECURRENT_SMALL, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, d_rel=4,
                num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"], sliding_window_size=WINDOW, rel_extent=8,
                log_scaling_n_floor=2, log_scaling_alpha=0.5, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# transformers model_type -> config settings of a tiny model with recurrent layers (models.recurrent; tests/test_recurrent.py)
RECURRENT_FAMILIES = {
    "qwen3_5_text": dict(**_RECURRENT_SMALL, **_LINEAR),
    "qwen3_next": dict(**_RECURRENT_SMALL, **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16),
    "mamba": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4),
    "falcon_mamba": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4),
    "mamba2": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, state_size=8, n_groups=1,
                   expand=2, conv_kernel=4),
    "jamba": dict(**_RECURRENT_SMALL, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4),
    "bamba": dict(**_RECURRENT_SMALL, **_MAMBA, num_hidden_layers=4, attn_layer_indices=[1, 3]),
    "falcon_h1": dict(**_RECURRENT_SMALL, **_MAMBA, num_hidden_layers=2, mamba_d_ssm=64),
    "granitemoehybrid": dict(**_RECURRENT_SMALL, **_MAMBA, num_hidden_layers=4, layer_types=["mamba", "attention"] * 2,
                             num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=16),
    "nemotron_h": dict(**_RECURRENT_SMALL, num_hidden_layers=4, layers_block_type=["mamba", "attention", "mamba", "mlp"],
                       mamba_num_heads=8, mamba_head_dim=8, n_groups=1, ssm_state_size=8, conv_kernel=4, expand=2),
    "olmo_hybrid": dict(**_RECURRENT_SMALL, num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "kimi_linear": dict(**{**_RECURRENT_SMALL, "num_key_value_heads": 4}, num_hidden_layers=4, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, layer_types=["linear_attention", "full_attention"] * 2,
                        linear_head_dim=8, linear_num_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
                        qk_nope_head_dim=8, v_head_dim=8, mlp_layer_types=["dense"] * 4),  # latent attention: no GQA
    "lara_mini": dict(**_RECURRENT_SMALL, **{**_LINEAR, "layer_types": ["linear_attention", "sliding_attention",
                                                                           "linear_attention", "full_attention"]},
                      sliding_window=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16, tie_word_embeddings=False),  # windows beside recurrent layers
    "lfm2": dict(**_RECURRENT_SMALL, num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2),
    # Zamba2: Mamba-2 layers and hybrid layers (a shared attention block beside a Mamba-2 mixer); its time step is
    # bounded below by time_step_min, in its cached steps by the wrapper (models.recurrent.clamp_time_steps)
    "zamba2": dict(**_RECURRENT_SMALL, num_hidden_layers=4, layers_block_type=["mamba", "hybrid"] * 2, mamba_headdim=8,
                   mamba_ngroups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, hybrid_layer_ids=[1, 3],
                   num_mem_blocks=1, attention_hidden_size=64, attention_head_dim=16),
    # Zamba (a shared attention block every few Mamba layers) and Zaya: their layers record their state once a call
    # (models.recurrent.ONE_TOKEN_CALLS)
    "zamba": dict(**{**_RECURRENT_SMALL, "num_key_value_heads": 4}, num_hidden_layers=4, attention_head_dim=16,
                  n_mamba_heads=2, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=4, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2),
    "zaya": dict(**_RECURRENT_SMALL, num_hidden_layers=2, sliding_window=WINDOW, num_experts=4, num_experts_per_tok=1,
                 moe_intermediate_size=16, router_hidden_size=16, tie_word_embeddings=False, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2),
    # MiniMax: lightning attention (a decayed K^T V state, recorded once a call, in a cache class of its own) first,
    # as in MiniMax-Text-01, beside full layers; blocks of 4 in a prompt's scan
    "minimax": dict(**_RECURRENT_SMALL, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                    block_size=4, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2),
    # RecurrentGemma (Griffin): two recurrent blocks (a causal convolution, the RG-LRU) to a windowed attention layer,
    # the recurrence wider than the model; its blocks' states moved into the cache by the wrapper (models.griffin)
    "recurrent_gemma": dict(**_RECURRENT_SMALL, num_hidden_layers=4, lru_width=48, sliding_window=WINDOW,
                            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Inkling: short convolutions in every layer, a relative bias (zero past rel_extent) and log-scaled full layers;
    # Inkling 2: attention residuals across blocks; its loop variant runs its middle layer twice
    "inkling_text": dict(**_INKLING, mlp_layer_types=["sparse"] * 2, n_shared_experts=1),
    "inkling2_text": dict(**_INKLING, n_layers_per_attn_res_block=1, unpadded_vocab_size=64),
    "inkling2_loop_text": dict(**{**_INKLING, "num_hidden_layers": 3,
                                  "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"]},
                               n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2,
                               loop_num_passes=2, loop_gate_rank=4, unpadded_vocab_size=64),
}
# model_type -> config settings of a tiny Qwen3.5 (dense) / Qwen3-Next (experts) with one MTP layer (drafts.qwen_mtp)
QWEN_MTP_CONFIGS = {kind: dict(RECURRENT_FAMILIES[kind], mtp_num_hidden_layers=1) for kind in ("qwen3_5_text", "qwen3_next")}


# model_type -> config settings of a tiny model with DeepSeek Sparse Attention (models.attention.INDEXED_FAMILIES;
# tests/test_sparse_attention.py): latent attention (no grouped keys), its indexer keeping 4 keys a query out of up to 15
SPARSE_FAMILIES = {
    kind: dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
               qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
               n_group=1, topk_group=1, index_n_heads=8, index_head_dim=8, index_topk=4, max_position_embeddings=256,
               bos_token_id=0, eos_token_id=1, pad_token_id=1)
    for kind in ("deepseek_v32", "glm_moe_dsa")}


def tiny_sparse_model(model_type: str, kernel: str = "eager", *, seed: int = 0, **overrides):
    """A float32 random-weight model of ``model_type`` (a key of ``SPARSE_FAMILIES``) with attention ``kernel``, its
    matrices and embeddings (the padding token's too: a zero embedding scores every key 0 in the indexer, a tie its
    top-k breaks as the call's shape happens to) drawn N(0, 0.5^2), reproducible from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SPARSE_FAMILIES[model_type], **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _draw_matrices(AutoModelForCausalLM.from_config(config, attn_implementation=kernel,
                                                                dtype=torch.float32).eval())
    return model


def tiny_recurrent_model(model_type: str, options: dict | None = None, *, seed: int = 0):
    """A transformers model of ``model_type`` from ``options`` (default ``RECURRENT_FAMILIES[model_type]``), float32 on
    the CPU, its matrices drawn N(0, 0.5^2) (reproducible from ``seed``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **(RECURRENT_FAMILIES[model_type] if options is None else options))
    return _draw_matrices(AutoModelForCausalLM.from_config(config).eval())


def _draw_matrices(model, std: float = 0.5):
    """``model`` with every matrix (embeddings included) drawn N(0, std^2) from torch's generator; norms kept."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, std)
    return model


def tiny_qwen_mtp_checkpoint(directory, model_type: str, *, seed: int = 0) -> dict:
    """Write to ``directory`` a random-weight Qwen3.5 / Qwen3-Next checkpoint (``QWEN_MTP_CONFIGS``) with one MTP layer
    as their checkpoints carry it (``drafts.qwen_mtp``: ``mtp.fc``, its norms and ``mtp.layers.0.*``, experts one per
    tensor); returns the ``mtp.*`` tensors. Reproducible from ``seed``."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    model = tiny_recurrent_model(model_type, QWEN_MTP_CONFIGS[model_type], seed=seed)
    model.save_pretrained(directory)
    g = torch.Generator().manual_seed(seed + 1)
    draw = lambda *shape: 0.3 * torch.randn(shape, generator=g)  # noqa: E731
    H, extras = model.config.hidden_size, {}
    for name, value in model.model.layers[3].state_dict().items():  # a full-attention layer's shapes
        if name == "mlp.experts.gate_up_proj":  # saved one per expert, gate and up apart
            for e in range(value.shape[0]):
                for part in ("gate", "up"):
                    extras[f"mtp.layers.0.mlp.experts.{e}.{part}_proj.weight"] = draw(value.shape[1] // 2, H)
        elif name == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                extras[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = draw(*value.shape[1:])
        else:
            extras[f"mtp.layers.0.{name}"] = draw(*value.shape)
    extras |= {"mtp.fc.weight": draw(H, 2 * H), "mtp.norm.weight": draw(H), "mtp.pre_fc_norm_embedding.weight": draw(H),
               "mtp.pre_fc_norm_hidden.weight": draw(H)}
    save_file(load_file(directory / "model.safetensors") | extras, directory / "model.safetensors", metadata={"format": "pt"})
    return extras


def tiny_gemma4_pair(*, seed: int = 0, init_std: float = 0.3, num_assistant_tokens: int = 2):
    """``(target, assistant)``: a random-weight Gemma 4 text model (two layers, windowed then global, its embeddings
    untied: a random tied one repeats its last token) and a Gemma 4
    assistant for it (``Gemma4AssistantForCausalLM``, drafting from the target's shared KV states: transformers'
    ``SinglePositionMultiTokenCandidateGenerator``), float32 on the CPU, reproducible from ``seed``; the assistant's
    generation config drafts ``num_assistant_tokens`` a step. ``init_std`` 0.3: next-token laws neither flat nor one
    token's (the audit's runs need both several cells and a visible second token)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    sizes = dict(_SIZES, head_dim=8, global_head_dim=8, num_hidden_layers=2, sliding_window=WINDOW,
                 layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                 vocab_size_per_layer_input=0, initializer_range=init_std, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = Gemma4ForCausalLM(Gemma4TextConfig(**sizes)).eval()
        assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
            text_config=Gemma4TextConfig(**sizes), backbone_hidden_size=sizes["hidden_size"], num_centroids=8,
            centroid_intermediate_top_k=4)).eval()
    assistant.generation_config.num_assistant_tokens = num_assistant_tokens
    return target, assistant


def tiny_dflash_pair(*, seed: int = 0, block_size: int = 3):
    """``(target, assistant)``: the tiny Llama of :func:`tiny_family_model` and a DFlash block drafter for it
    (transformers' ``MuseGlimmerAssistantModel``: one layer over the target's hidden states after its layers 0 and 1,
    ``block_size - 1`` tokens drafted a step, the last token id its mask), float32 on the CPU, reproducible from
    ``seed``."""
    from transformers import MuseGlimmerAssistantConfig
    from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import MuseGlimmerAssistantModel

    target = tiny_family_model("llama", "sdpa", seed=seed)
    config = MuseGlimmerAssistantConfig(
        hidden_size=_SIZES["hidden_size"], intermediate_size=_SIZES["intermediate_size"], num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=64,
        block_size=block_size, mask_token_id=_SIZES["vocab_size"] - 1, target_layer_ids=[0, 1],
        vocab_size=_SIZES["vocab_size"], bos_token_id=0, eos_token_id=1, pad_token_id=1, initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        assistant = MuseGlimmerAssistantModel(config).eval()
    return target, assistant


def word_tokenizer(words):
    """A transformers tokenizer over whole words (``tokenizers``' WordLevel, split at whitespace): ids 0 ``[UNK]`` and
    1 ``[EOS]`` (also the padding), then ``words`` in order; decoding joins words with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["[UNK]", "[EOS]", *words])}
    if len(vocab) != len(words) + 2:
        raise ValueError("words must be distinct and other than [UNK] and [EOS]")
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]", pad_token="[EOS]")


def tiny_usd_pair(*, seed: int = 0, assistant_only: int = 12, init_std: float = 0.3):
    """``(target, assistant, target_tokenizer, assistant_tokenizer)`` for speculative decoding across vocabularies
    (transformers' ``UniversalSpeculativeDecodingGenerator``): two tiny random-weight Llamas over word tokenizers
    (:func:`word_tokenizer`). The target's 64 tokens: ``[UNK]``, ``[EOS]``, ``w0`` .. ``w61``. The assistant lacks
    ``w0`` .. ``w7`` and has ``assistant_only`` words of its own (``a0`` ..), so its vocabulary is a subset of the
    target's where ``assistant_only`` is 0 (transformers takes two models of one vocabulary size for one tokenizer:
    ``assistant_only`` 8 is refused); float32 on the CPU, reproducible from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target_words = [f"w{i}" for i in range(_SIZES["vocab_size"] - 2)]
    assistant_words = target_words[8:] + [f"a{i}" for i in range(assistant_only)]
    tokenizers = word_tokenizer(target_words), word_tokenizer(assistant_words)
    models = []
    for i, tokenizer in enumerate(tokenizers):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            config = LlamaConfig(**dict(_SIZES, vocab_size=len(tokenizer), bos_token_id=None,
                                        initializer_range=init_std, tie_word_embeddings=False))
            models.append(LlamaForCausalLM(config).eval())
    return (*models, *tokenizers)
