#!/usr/bin/env python
"""Regenerate think.npz: the OFFICIAL ByteDance-Seed/Bagel code's text decoding on the tiny checkpoint, CPU, float32.

Usage:
  python reference_think.py [--bagel BAGEL_SRC] [--assets DIR] [--out think.npz]
    BAGEL_SRC: an extracted checkout of github.com/ByteDance-Seed/Bagel; without it, the bare git dir named by
               $BAGEL_GIT_DIR is extracted (git archive HEAD) into a temporary folder.
    DIR:       the tiny checkpoint `make models` builds (models/bagel-tiny: ema.safetensors, ae.safetensors and the
               tokenizer files), which is the golden set's checkpoint bit for bit (checkpoint.sha256).

Runs `InterleaveInferencer.interleave_inference([prompt], ...)` greedily (do_sample=False) for the CASES below:
text answers (understanding_output=True), an answer after thinking (think=True, understanding_output=True) and an
image after thinking (think=True), with image CFG off and on (cfg_img_scale 2). The monkeypatches are golden.npz's
(README): a per-sequence SDPA stand-in for flash_attn, an einops stand-in, transformers-5 compatibility, and bfloat16
casts made float32 in qwen2_navit.
Recorders (no behaviour change) wrap Bagel.prepare_prompts (every prefilled text's ids), Bagel.generate_text (the
generated ids), Bagel._forward_flow (each step's input latents) and AutoEncoder.decode.
"""
import argparse, dataclasses, os, subprocess, sys, tempfile, types, typing

import numpy as np
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MIRROR = os.environ.get("BAGEL_GIT_DIR", "")

# Prompts chosen by `--search` (greedy answers, cap 40) over eight short prompts: only "a green sphere next to a
# yellow cone" ends on <|im_end|> (30 ids); "a red cube on a blue floor" repeats one token, so it stops at the cap.
CASES = {
    "answer_ends": dict(prompt="a green sphere next to a yellow cone", think=False, understanding_output=True,
                        max_think_token_n=40),
    "answer_capped": dict(prompt="a red cube on a blue floor", think=False, understanding_output=True,
                          max_think_token_n=12),
    "think_answer": dict(prompt="what is red?", think=True, understanding_output=True, max_think_token_n=16),
    "think_image": dict(prompt="a red cube on a blue floor", think=True, understanding_output=False,
                        max_think_token_n=10, image_shapes=(64, 64), cfg_text_scale=4.0, cfg_renorm_type="global",
                        seed=1),
    # The image-CFG context keeps the prompt without the thought (interleave_inference updates it with the system
    # prompt and the prompt only), so cfg_img_scale > 1 guides away from the image the prompt alone would give.
    "think_image_cfg_img": dict(prompt="a red cube on a blue floor", think=True, understanding_output=False,
                                max_think_token_n=10, image_shapes=(64, 64), cfg_text_scale=4.0, cfg_img_scale=2.0,
                                cfg_renorm_type="global", seed=1),
}
COMMON = dict(do_sample=False, num_timesteps=6, cfg_img_scale=1.0, cfg_interval=[0.4, 1.0], cfg_renorm_min=0.0,
              timestep_shift=3.0)

LLM_CONFIG = dict(  # fields of the official llm_config.json, shrunk (the tiny preset's)
    attention_dropout=0.0, bos_token_id=295, eos_token_id=297, hidden_act="silu", hidden_size=64,
    initializer_range=0.02, intermediate_size=128, max_position_embeddings=4096, max_window_layers=2,
    num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
    sliding_window=4096, tie_word_embeddings=False, torch_dtype="float32", use_cache=True, use_mrope=False,
    use_sliding_window=False, vocab_size=300)
LLM_OVERRIDES = dict(qk_norm=True, tie_word_embeddings=False, layer_module="Qwen2MoTDecoderLayer")  # the app's
VAE_PARAMS = dict(resolution=256, in_channels=3, downsample=8, ch=32, out_ch=3, ch_mult=[1, 1, 1, 1],
                  num_res_blocks=1, z_channels=16, scale_factor=0.3611, shift_factor=0.1159)
BAGEL_CONFIG = dict(visual_gen=True, visual_und=False, latent_patch_size=2, max_latent_size=16,
                    connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=1.0)


def install_shims():
    import importlib.machinery
    fa = types.ModuleType("flash_attn"); fa.__version__ = "0.0-stub"
    fa.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                               causal=False, **kw):
        assert q.dtype == k.dtype == v.dtype == torch.float32, (q.dtype, k.dtype, v.dtype)
        out = torch.empty_like(q)
        hq, hk = q.shape[1], k.shape[1]
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            qi = q[qs:qe].transpose(0, 1)
            ki = k[ks:ke].transpose(0, 1).repeat_interleave(hq // hk, 0)
            vi = v[ks:ke].transpose(0, 1).repeat_interleave(hq // hk, 0)
            mask = None
            if causal:  # bottom-right aligned, as flash-attn >= 2.1 (one decoded token sees its whole cache)
                lq, lk = qe - qs, ke - ks
                mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask).transpose(0, 1)
        return out
    fa.flash_attn_varlen_func = flash_attn_varlen_func
    sys.modules["flash_attn"] = fa
    ei = types.ModuleType("einops")
    ei.__spec__ = importlib.machinery.ModuleSpec("einops", None)

    def rearrange(x, pattern, **kw):
        if pattern == "b c h w -> b 1 (h w) c":
            b, c, h, w = x.shape
            return x.reshape(b, c, h * w).transpose(1, 2).unsqueeze(1)
        if pattern == "b 1 (h w) c -> b c h w":
            b, _, n, c = x.shape
            return x.squeeze(1).transpose(1, 2).reshape(b, c, kw["h"], kw["w"])
        raise NotImplementedError(pattern)
    ei.rearrange = rearrange
    sys.modules["einops"] = ei
    try:
        import transformers.modeling_attn_mask_utils  # noqa: F401
    except Exception:
        m = types.ModuleType("transformers.modeling_attn_mask_utils")
        m._prepare_4d_attention_mask = lambda *a, **k: None
        sys.modules["transformers.modeling_attn_mask_utils"] = m
    import transformers.modeling_rope_utils as R

    def _default_rope(config, device=None, **kw):
        dim = config.hidden_size // config.num_attention_heads
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    R.ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope)


def build(src, assets):
    sys.path.insert(0, src)
    install_shims()
    import modeling.bagel.qwen2_navit as qn

    @dataclasses.dataclass
    class _Out:
        packed_query_sequence: typing.Any = None
        past_key_values: typing.Any = None
    qn.BaseNavitOutputWithPast = _Out

    class _TorchFP32(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)
    proxy = _TorchFP32("torch_fp32_proxy"); proxy.bfloat16 = torch.float32
    qn.torch = proxy
    from modeling.bagel import BagelConfig, Bagel, Qwen2Config, Qwen2ForCausalLM
    from modeling.autoencoder import AutoEncoder, AutoEncoderParams
    from safetensors.torch import load_file
    llm_config = Qwen2Config(pad_token_id=None, **LLM_CONFIG)
    for k, v in LLM_OVERRIDES.items():
        setattr(llm_config, k, v)
    vae_params = AutoEncoderParams(**VAE_PARAMS)
    config = BagelConfig(llm_config=llm_config, vit_config=None, vae_config=vae_params, **BAGEL_CONFIG)
    model = Bagel(Qwen2ForCausalLM(llm_config), None, config).float().eval()
    vae = AutoEncoder(vae_params).float().eval()
    for mod, f in ((model, "ema.safetensors"), (vae, "ae.safetensors")):
        mod.load_state_dict(load_file(os.path.join(assets, f)), strict=True)
    return model, vae


def inferencer(src, assets, rec):
    model, vae = build(src, assets)
    import inferencer as inf_mod
    from modeling.bagel.bagel import Bagel
    from modeling.qwen2 import Qwen2Tokenizer
    from data.data_utils import add_special_tokens
    tokenizer, new_token_ids, _ = add_special_tokens(Qwen2Tokenizer.from_pretrained(assets))
    orig_pp, orig_gt, orig_ff = Bagel.prepare_prompts, Bagel.generate_text, Bagel._forward_flow

    def pp(self, *a, **k):
        gi, kv, ro = orig_pp(self, *a, **k)
        rec.setdefault("prefills", []).append(gi["packed_text_ids"].tolist())
        return gi, kv, ro

    def gt(self, *a, **k):
        out = orig_gt(self, *a, **k)
        rec.setdefault("generated", []).append(out[:, 0].tolist())
        return out

    def ff(self, *a, **k):
        rec.setdefault("x_in", []).append(k["x_t"].clone())
        return orig_ff(self, *a, **k)
    Bagel.prepare_prompts, Bagel.generate_text, Bagel._forward_flow = pp, gt, ff
    orig_dec = vae.decode

    def dec(z):
        rec["vae_in"] = z.clone()
        return orig_dec(z)
    vae.decode = dec
    return inf_mod, inf_mod.InterleaveInferencer(model=model, vae_model=vae, tokenizer=tokenizer, vae_transform=None,
                                                 vit_transform=None, new_token_ids=new_token_ids)


def run_cases(src, assets):
    rec = {}
    inf_mod, infer = inferencer(src, assets, rec)
    out = {"vlm_think_system_prompt": np.array(inf_mod.VLM_THINK_SYSTEM_PROMPT),
           "gen_think_system_prompt": np.array(inf_mod.GEN_THINK_SYSTEM_PROMPT)}
    for name, c in CASES.items():
        rec.clear()
        c = dict(COMMON, **c)
        seed = c.pop("seed", 0)
        prompt = c.pop("prompt")
        torch.manual_seed(seed)  # greedy decoding draws nothing; the image's noise is the first draw
        with torch.autocast("cpu", enabled=False):
            res = infer.interleave_inference([prompt], **c)
        [generated] = rec["generated"]
        p = name + "_"
        out[p + "prompt"] = np.array(prompt)
        out[p + "max_new_tokens"] = np.array(c["max_think_token_n"])
        out[p + "prefills"] = np.array([i for ids in rec["prefills"] for i in ids + [-1]])  # -1 ends each
        out[p + "generated_ids"] = np.array(generated)  # <|im_start|> first, <|im_end|> never (it stops the loop)
        out[p + "text"] = np.array(res[0])
        stop = "eos" if len(generated) < c["max_think_token_n"] else "cap"
        if not c["understanding_output"]:
            out[p + "latents_in"] = torch.stack(rec["x_in"]).numpy()
            out[p + "vae_latent"] = rec["vae_in"][0].numpy()
            out[p + "image_u8"] = np.array(res[1])
        print(name, stop, len(generated), repr(res[0]), flush=True)
    return out


def search(src, assets, prompts, cap):
    """Greedy answers of `prompts`: how the CASES were picked."""
    rec = {}
    _, infer = inferencer(src, assets, rec)
    for prompt in prompts:
        rec.clear()
        with torch.autocast("cpu", enabled=False):
            infer.interleave_inference([prompt], understanding_output=True, max_think_token_n=cap)
        print(len(rec["generated"][0]), rec["generated"][0][-3:], repr(prompt))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bagel", default=None)
    ap.add_argument("--assets", default=os.path.join(REPO, "models", "bagel-tiny"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "think.npz"))
    ap.add_argument("--search", nargs="*", help="print the greedy answers' lengths of these prompts instead")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    src = a.bagel
    if src is None:
        src = tempfile.mkdtemp(prefix="bagel_src_")
        subprocess.run("git --git-dir=%s archive HEAD | tar -x -C %s" % (MIRROR, src), shell=True, check=True)
    if a.search is not None:
        return search(src, a.assets, a.search, 40)
    out = run_cases(src, a.assets)
    out["bagel_commit"] = np.array(subprocess.run(["git", "--git-dir", MIRROR or os.path.join(src, ".git"), "rev-parse",
                                                   "HEAD"], capture_output=True, text=True).stdout.strip())
    np.savez_compressed(a.out, **out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
