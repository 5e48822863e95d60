"""What the tiny presets share: offline-trained tokenizers and tiny text encoders and VAEs.

Each pipeline's `tiny.py` (engine_lib/pipelines/<name>/tiny.py) builds the real
diffusers pipeline class from these parts with tiny configs and seeded random
weights. Tokenizers are trained offline (the `tokenizers` library) on a fixed
corpus so that the same seed gives the same files byte for byte, in any process.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Mapping, Sequence

import torch

# The text every tokenizer is trained on: Qwen-Image's system prompt (so its chat
# template prefix is 34 tokens, as with the real tokenizer) and typical prompts.
QWEN_SYSTEM_TEXT = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:\nuser\nassistant\n"
)
PROMPT_CORPUS = (
    "a photo of a cat sitting on a red chair in the sun",
    "an astronaut riding a horse on the moon, high quality, detailed",
    "dance monkey, a painting of a city at night with bright lights",
    "a bowl of fruit on a wooden table, soft light, blue background",
    "bad quality, blurry, low resolution, ugly, text, watermark",
    "a small dog running in the green grass next to a river",
    "portrait of a woman with long hair, studio lighting, 4k",
    "a red car parked in front of a white house under a cloudy sky",
)



# ---------------------------------------------------------------------------
# Offline tokenizers


def _train_like(empty_tokenizer, corpus: Sequence[str], trainer) -> Dict[str, Any]:
    """Train a model with `empty_tokenizer`'s own normalizer and pre-tokenizer.

    Returns the trained model as JSON (vocab, merges), ready to pass back to the
    transformers tokenizer class. BPE training is deterministic (count ties break
    by pair id, the byte alphabet is sorted) except for ids the trainer adds for
    end-of-word suffixes; Unigram needs `_canonical_unigram_vocab`.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(empty_tokenizer.backend_tokenizer.to_str())
    tok.train_from_iterator(list(corpus), trainer)
    return json.loads(tok.to_str())["model"]


def _canonical_unigram_vocab(model: Mapping[str, Any], special_tokens: Sequence[str]) -> list:
    """Make a trained Unigram vocab independent of the process that trained it.

    The trainer re-adds pruned single characters in hash-set order with slightly
    decreasing scores, and its float sums differ in the last digits. So: single
    characters scored below every longer piece (fallbacks) get one equal score,
    every score is rounded, and ties are sorted by piece.
    """
    pieces = [(piece, score) for piece, score in model["vocab"] if piece not in special_tokens]
    floor = min(score for piece, score in pieces if len(piece) > 1)
    pieces = [(p, floor - 1.0 if len(p) == 1 and s < floor - 1e-6 else s) for p, s in pieces]
    pieces = sorted(((p, round(s, 6)) for p, s in pieces), key=lambda item: (-item[1], item[0]))
    return [(piece, 0.0) for piece in special_tokens] + pieces


def _bpe_trainer(special_tokens: Sequence[str], vocab_size: int, **kwargs):
    from tokenizers import pre_tokenizers, trainers

    return trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        **kwargs,
    )


def qwen2_tokenizer():
    """A Qwen2Tokenizer (Qwen's split regex, byte-level BPE) trained offline.

    Qwen-Image's chat template prefix tokenizes to 34 tokens with it, as with the
    real tokenizer, because every word of the system prompt is one token.
    """
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    corpus = [QWEN_SYSTEM_TEXT] * 4 + list(PROMPT_CORPUS)
    model = _train_like(Qwen2Tokenizer(), corpus, _bpe_trainer(specials + vision, vocab_size=512))
    return Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        errors="replace",
        model_max_length=32768,
        additional_special_tokens=specials[1:] + vision,
    )


def clip_tokenizer():
    """A CLIPTokenizer (lower-cased byte-level BPE, `</w>` word ends), model_max_length 77."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    # The trainer would add each `x</w>` it meets in hash-map order (ids differing per
    # process, and so merge tie-breaks); listing them up front fixes their ids.
    word_ends = [c + "</w>" for c in sorted(pre_tokenizers.ByteLevel.alphabet())]
    specials = ["<|startoftext|>", "<|endoftext|>"]
    trainer = _bpe_trainer(specials + word_ends, 800, end_of_word_suffix="</w>")
    model = _train_like(CLIPTokenizer(), PROMPT_CORPUS, trainer)
    return CLIPTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], model_max_length=77)


def t5_tokenizer():
    """A T5Tokenizer (Unigram over Metaspace) with T5's ids: pad 0, eos 1, unk 2."""
    from tokenizers import trainers
    from transformers import T5Tokenizer

    specials = ["<pad>", "</s>", "<unk>"]
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=specials, unk_token="<unk>", show_progress=False)
    model = _train_like(T5Tokenizer(extra_ids=0), PROMPT_CORPUS, trainer)
    return T5Tokenizer(vocab=_canonical_unigram_vocab(model, specials), extra_ids=0, model_max_length=512)


# ---------------------------------------------------------------------------
# Shared tiny components


def seeded(seed: int, make: Callable[[], Any]) -> Any:
    """Seed torch, then build: each component's weights depend on the seed only."""
    torch.manual_seed(seed)
    return make().eval()


# Flux and SD3 share this AutoencoderKL: 3 levels, so vae_scale_factor 4.
SD_VAE = dict(block_out_channels=[4, 8, 8], latent_channels=4, layers_per_block=1, norm_num_groups=4)


def tiny_sd_vae(seed: int, config: Mapping[str, Any], scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    levels = len(config["block_out_channels"])
    return seeded(
        seed,
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * levels,
            up_block_types=("UpDecoderBlock2D",) * levels,
            block_out_channels=tuple(config["block_out_channels"]),
            layers_per_block=config["layers_per_block"],
            latent_channels=config["latent_channels"],
            norm_num_groups=config["norm_num_groups"],
            sample_size=32,
            scaling_factor=scaling_factor,
            shift_factor=shift_factor,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
    )


def tiny_clip(seed: int, tokenizer, hidden_size: int, with_projection: bool):
    """CLIPTextModel(WithProjection) whose eos_token_id is the tokenizer's (pooling looks for it)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=hidden_size,
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return seeded(seed, lambda: cls(config))


def tiny_t5(seed: int, tokenizer, d_model: int, umt5: bool = False):
    """A T5 encoder (UMT5's, with per-layer relative attention, for the pipelines that name that class)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config = (UMT5Config if umt5 else T5Config)(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return seeded(seed, lambda: (UMT5EncoderModel if umt5 else T5EncoderModel)(config))


# Qwen3's chat template, cut to what the pipelines send (one user turn, a generation prompt) and kept
# byte-identical to it there: `enable_thinking=False` opens the answer with an empty think block.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def qwen3_tokenizer():
    """The Qwen2Tokenizer of `qwen2_tokenizer` with Qwen3's think tokens and chat template (Z-Image, FLUX.2 klein
    apply the template with `enable_thinking`)."""
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    corpus = list(PROMPT_CORPUS) + ["user\nassistant\n"] * 4
    model = _train_like(Qwen2Tokenizer(), corpus, _bpe_trainer(specials, vocab_size=384))
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], errors="replace",
                               model_max_length=32768, additional_special_tokens=specials[1:])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3(seed: int, tokenizer, hidden_size: int, num_hidden_layers: int, causal_lm: bool):
    """A Qwen3 language model (the text encoder of Z-Image and FLUX.2 klein): grouped-query attention with
    half as many key/value heads, as the releases have."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden_size // 2,
        max_position_embeddings=2048,
        rope_theta=1e6,
        tie_word_embeddings=causal_lm,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    return seeded(seed, lambda: (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config))
