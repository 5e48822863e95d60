#!/usr/bin/env python
"""Regenerate think.npz: the OFFICIAL Tencent-Hunyuan/HunyuanImage-3.0 think / recaption path
(`generate_image(..., bot_task="think" | "recaption")`) on the tiny checkpoint, CPU, float32, greedy.

Usage:
  python reference_think.py [--hy SRC] [--assets DIR] [--out think.npz]
    SRC: a folder holding the reference package hunyuan_image_3/; without it, it is extracted
         (`git archive HEAD hunyuan_image_3`) from the bare git dir $HY3_GIT_DIR.
    DIR: the tiny checkpoint `make models` builds (models/hunyuan_image3-tiny), the golden set's bit for bit
         (checkpoint.sha256).
Needs `einops` importable (pip install --target SITE einops; PYTHONPATH=SITE).

What the reference does: `prepare_model_inputs(mode="gen_text")` builds the "instruct" template
(`User: <prompt>\n\nAssistant: <think>` or `... <recaption>`), `_generate` decodes greedily with
transformers' `generate` until `</recaption>`, `</answer>` or `<|endoftext|>` (kept, except a final
`<|endoftext|>`) or `max_new_tokens`; `get_cot_text` decodes the whole sequence and keeps what follows
"Assistant: "; the image's sequence holds that text re-encoded (`get_cot_sections`), then `<answer>`, the
image and `</answer>`; its unconditional row replaces the prompt and the thought (not the `<think>` /
`<recaption>` markers) by `<cfg>`.

Settings (generation_config, P5): golden.npz's, but sequence_template="instruct" (the "pretrain" template has no
"Assistant: " for `get_cot_text` to split on: it raises IndexError) and use_system_prompt="None" (the random tiny
model never ends its text with the "dynamic" system prompts: 24 prompts tried, all ran to the cap). Cases were
chosen by a search over short prompts (cap 60) for ones that end on an end token.

Monkeypatches: reference_run.py's (P1-P10), plus for transformers 5's `generate` (gen_text mode):
  P11 `generate` renames the `past_key_values` kwarg to `cache`, which the reference's
      prepare_inputs_for_generation does not take: a wrapper takes `cache` and passes it on as past_key_values;
  P12 the reference's `_update_model_kwargs_for_generation` returns a new dict without `use_cache`, which
      transformers 5's `_sample` reads: it is carried over (and the cache renamed back, as P10).
Recorders (no behaviour change) wrap `_generate` (each phase's input ids and output) and the scheduler's step.
"""
import argparse, os, subprocess, sys, tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_run as rr  # noqa: E402

GEN_CONFIG = dict(rr.GEN_CONFIG, sequence_template="instruct", use_system_prompt="None", drop_think=False,
                  do_sample=False)
CASES = {
    # ends on </answer> after 38 tokens (the text has no </think>: one section, all <cfg> in the uncond row)
    "think_ends": dict(prompt="draw cat big the", bot_task="think", max_new_tokens=60, image_size="64x64",
                       guidance_scale=5.0, seed=1),
    # ends on </recaption> after 3 tokens (<recaption>...</recaption>: its markers stay in the uncond row)
    "recaption_ends": dict(prompt="cat cube old", bot_task="recaption", max_new_tokens=20, image_size="48x80",
                           guidance_scale=3.5, seed=2),
    # repeats itself up to the cap
    "think_capped": dict(prompt="the red house !", bot_task="think", max_new_tokens=12, image_size="64x64",
                         guidance_scale=5.0, seed=3),
}


def build(src, assets):
    model, hy, pl = rr.build(src, assets)
    for k, v in GEN_CONFIG.items():
        setattr(model.generation_config, k, v)
    orig_prepare = model.prepare_inputs_for_generation

    # P11 (generate checks its kwargs against this signature, so it names them)
    def prepare(input_ids, cache=None, past_key_values=None, attention_mask=None, inputs_embeds=None,
                tokenizer_output=None, batch_gen_image_info=None, generator=None, **kwargs):
        return orig_prepare(input_ids, past_key_values=past_key_values if past_key_values is not None else cache,
                            attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                            tokenizer_output=tokenizer_output, batch_gen_image_info=batch_gen_image_info,
                            generator=generator, **kwargs)
    model.prepare_inputs_for_generation = prepare
    orig_update = type(model)._update_model_kwargs_for_generation

    def update(outputs, model_kwargs, *a, **k):  # P12 (and P10)
        new = orig_update(model, outputs, model_kwargs, *a, **k)
        if "past_key_values" not in new and new.get("cache") is not None:
            new["past_key_values"] = new.pop("cache")
        new.setdefault("use_cache", model_kwargs.get("use_cache"))
        assert new["past_key_values"] is model_kwargs.get("past_key_values", model_kwargs.get("cache"))
        return new
    model._update_model_kwargs_for_generation = update
    return model


def run_cases(src, assets):
    model = build(src, assets)
    rec = {}
    orig_generate = model._generate

    def generate(**k):
        out = orig_generate(**k)
        rec.setdefault(k["mode"], []).append((k["input_ids"].clone(), out))
        return out
    model._generate = generate
    sched = model.pipeline.scheduler
    orig_step = sched.step

    def step(pred, t, latents, *a, **k):
        o = orig_step(pred, t, latents, *a, **k)
        rec.setdefault("latents", []).append(o[0].clone())
        return o
    sched.step = step
    tok = model._tkwrapper.tokenizer
    out = {}
    for name, c in CASES.items():
        rec.clear()
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            img = model.generate_image(prompt=c["prompt"], seed=c["seed"], image_size=c["image_size"],
                                       bot_task=c["bot_task"], max_new_tokens=c["max_new_tokens"],
                                       diff_guidance_scale=c["guidance_scale"],
                                       diff_infer_steps=GEN_CONFIG["diff_infer_steps"])
        [(text_ids, text_out)], [(image_ids, _)] = rec["gen_text"], rec["gen_image"]
        p = name + "_"
        out[p + "text_input_ids"] = text_ids[0].numpy()       # the text phase's context
        out[p + "new_ids"] = text_out[0, text_ids.shape[1]:].numpy()  # generated, end token included
        out[p + "cot_text"] = np.array(model.get_cot_text(text_out[0]))
        out[p + "image_input_ids"] = image_ids.numpy()        # [2, L]: cond; uncond
        out[p + "latents_after_step"] = torch.stack(rec["latents"]).squeeze(1).numpy()
        out[p + "image_u8"] = np.array(img)
        print(name, "text", tuple(text_ids.shape), "new", len(out[p + "new_ids"]), repr(tok.decode(out[p + "new_ids"])),
              "image seq", tuple(image_ids.shape), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hy", default=None)
    ap.add_argument("--assets", default="models/hunyuan_image3-tiny")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "think.npz"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    src = a.hy
    if src is None:
        src = tempfile.mkdtemp(prefix="hy3_src_")
        subprocess.run("git --git-dir=%s archive HEAD hunyuan_image_3 | tar -x -C %s" % (rr.HY3_GIT_DIR, src),
                       shell=True, check=True)
    out = run_cases(src, a.assets)
    out["hy3_commit"] = np.array(subprocess.run(["git", "--git-dir", rr.HY3_GIT_DIR, "rev-parse", "HEAD"],
                                                capture_output=True, text=True).stdout.strip())
    np.savez_compressed(a.out, **out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
