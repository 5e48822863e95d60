"""Tiny random-weight `LTX2Pipeline` preset (built offline by `make models`).

The component configs follow diffusers' own LTX-2 fast tests (tests/pipelines/ltx2):
a three-level video VAE (/8 in space and time, so num_frames follows
LTX-2's 8k + 1 rule), an audio VAE with 8 mel
bins and a vocoder at 16 kHz, a 2-layer audio-video transformer, the text
connectors. The Gemma 3 text encoder (with a tiny SigLIP vision tower, which text
to video never runs) and its tokenizer are built here, as no hub is reachable.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine_lib.pipelines.tiny_parts import PROMPT_CORPUS, _bpe_trainer, _train_like, seeded

PRESETS = {"tiny": {"text_hidden": 32, "text_layers": 2}}


def gemma_tokenizer():
    """A GemmaTokenizer (byte-fallback BPE) trained offline on the shared corpus."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    model = _train_like(GemmaTokenizer(), PROMPT_CORPUS, _bpe_trainer(specials, vocab_size=400))
    return GemmaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                          extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                "image_token": "<image_soft_token>"}, model_max_length=1024)


def gemma3_text_encoder(seed: int, tokenizer, hidden: int, layers: int):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         sliding_window=32, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4,
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
    )
    return seeded(seed, lambda: Gemma3ForConditionalGeneration(config))


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `LTX2Pipeline` of one preset's config."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = gemma_tokenizer()
    hidden, layers = preset["text_hidden"], preset["text_layers"]
    text_encoder = gemma3_text_encoder(seed, tokenizer, hidden, layers)
    transformer = seeded(seed, lambda: LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=hidden, rope_double_precision=False, rope_type="split"))
    connectors = seeded(seed, lambda: LTX2TextConnectors(
        caption_channels=hidden, text_proj_in_factor=layers + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split"))

    def video_vae():
        vae = AutoencoderKLLTX2Video(  # three spatio-temporal levels: /8 in space and time (the real 8k + 1 rule)
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8),
            down_block_types=("LTX2VideoDownBlock3D",) * 3, decoder_block_out_channels=(8, 8, 8),
            layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False,) * 4, downsample_type=("spatiotemporal",) * 3,
            upsample_type=("spatiotemporal",) * 3, upsample_residual=(False, False, False), upsample_factor=(1, 1, 1),
            timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
        vae.use_framewise_encoding = False
        vae.use_framewise_decoding = False
        return vae

    audio_vae = seeded(seed, lambda: AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8))
    vocoder = seeded(seed, lambda: LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000))
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=seeded(seed, video_vae), audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
