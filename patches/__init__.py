"""The fixes, one module per patch. Installed as ``overlay.patches`` (see setup.py).

A patch module defines ``PATCH = overlay.patch.Patch(...)``; list it here to ship it. Order is
the order of the status table.
"""

PATCH_MODULES: tuple[str, ...] = (
    "device_move",
    "static_cache_tp_heads",
    "kv_cache_dtype",
    "attention_guard",
    "executorch_cache_dtype",
    "kept_static_cache",
    "chunked_prefill",
    "dynamic_cache_reset",
    "static_cache_zero_kv_shared_layers",
    "chunked_attention_left_padding",
    "xpu_sdpa_mask_skip",
    "position_ids_advance",
    "decoder_text_config_layers",
    "encoder_decoder_cache_depth",
    "generation_config_set_keys",
    "generation_config_precedence",
    "stop_strings_bytes",
    "repetition_penalty_padding",
    "prefix_constrained_return_sequences",
    "beam_search_logits_width",
    "beam_search_recurrent_cache",
    "static_cache_kv_head_sizes",
    "encoder_repetition_penalty_rows",
    "prompt_lookup_no_eos",
    "beam_sample_sorted_candidates",
    "quantized_cache_config_copy",
    "encoder_decoder_dynamic_cache",
    "quantized_cache_beam_reorder",
    "cpmant_cached_generate",
    "offload_execution_device",
)
