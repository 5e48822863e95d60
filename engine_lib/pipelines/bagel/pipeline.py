"""`BagelPipeline`: BAGEL text-to-image in the shape of a diffusers pipeline (`from_pretrained`, `__call__`).

The reference's `InterleaveInferencer.interleave_inference([prompt])` for text to
image, cut into the pieces the engine's step contract needs, each used both by
`__call__` (one request, the reference's loop) and by the adapter (many requests
per forward):

* `encode`: `<|im_start|>` + prompt tokens + `<|im_end|>` prefilled into the
  request's generation context; the text-CFG context is empty (the reference
  copies it before the prompt). The image-CFG context of text to image holds the
  same prompt as the generation context, so its velocity is the conditional one,
  except after a thought: it keeps the prompt without it (`Context.img`);
* `initial_noise`: `torch.randn(h * w, 64)` on a CPU generator seeded with the seed;
* `schedule`: `linspace(1, 0, k + 1)` shifted by `timestep_shift`; k Euler updates;
* `predict`: one forward over every request's conditional row and, where CFG is
  active at its timestep, its unconditional row (and its image-CFG row, if it has
  its own image-CFG context); then each request's own CFG and
  renorm (the reference's packed "global" renorm would mix requests; ours does not);
* `decode`: unpack 2x2 patches, the FLUX VAE, and the reference's uint8 rule
  (`(x * 0.5 + 0.5).clamp(0, 1) * 255` truncated);
* text (`interleave_inference(..., understanding_output=True)` and `think=True`):
  `start_text`, then `next_tokens` / `advance` decode from `<|im_start|>` after a
  context, one token per forward for many requests at once, greedy or sampled, until `<|im_end|>`
  or `max_new_tokens`; `text` is the reference's cut of the decoded ids; a thought
  goes into the image's context re-encoded (`append`). Think mode's system prompt
  is in both the generation and the text-CFG context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from engine_lib.pipelines.bagel.model import BagelModel, KVCache, QueryRows, grow, load_model
from engine_lib.pipelines.decoder_parts import TextDecode, sample_token, shifted_schedule
from engine_lib.pipelines.bagel.vae import decode as vae_decode, load_vae

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")  # bos, eos, start/end of image
RENORM_TYPES = ("global", "channel", "text_channel")

# The reference inferencer's system prompts of think mode, verbatim (its trailing spaces included).
VLM_THINK_SYSTEM_PROMPT = '''You should first think about the reasoning process in the mind and then provide the user with the answer. 
The reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning process here </think> answer here'''
GEN_THINK_SYSTEM_PROMPT = '''You should first think about the planning process in the mind and then generate the image. 
The planning process is enclosed within <think> </think> tags, i.e. <think> planning process here </think> image here'''


@dataclass
class Guidance:
    """One request's CFG settings (the reference's names)."""

    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 1.0
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_type: str = "global"
    cfg_renorm_min: float = 0.0

    def active(self, t: float) -> bool:
        """Whether CFG runs at timestep t (the reference: scales drop to 1 outside the interval)."""
        return self.cfg_text_scale > 1.0 and self.cfg_interval[0] < t <= self.cfg_interval[1]


@dataclass
class Context:
    """A request's prompt contexts: the generation context and the text-CFG one (empty, or think mode's system
    prompt: the reference copies it before the prompt). The image-CFG context is the generation context except
    after a thought, which the reference adds to the generation context only: then `img` keeps the context
    without it (only for cfg_img_scale > 1, the one use of its row)."""

    cond: KVCache
    uncond: KVCache
    grid: tuple[int, int]  # latent patches (h, w)
    img: Optional[KVCache] = None  # the image-CFG context where it differs from `cond`


class BagelPipeline:
    """BAGEL's model, VAE and tokenizer from an official checkpoint folder."""

    def __init__(self, model: BagelModel, vae, tokenizer, device: torch.device):
        self.model, self.vae, self.tokenizer, self.device = model, vae, tokenizer, torch.device(device)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ValueError(f"the tokenizer lacks BAGEL's special tokens {SPECIAL_TOKENS}")
        self.bos, self.eos, self.start_of_image, self.end_of_image = ids
        self.latent_channels = int(vae.config.latent_channels)
        self.patch = int(round((model.config.patch_latent_dim // self.latent_channels) ** 0.5))
        self.downsample = self.patch * 2 ** (len(vae.config.block_out_channels) - 1)  # pixels per latent patch

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "BagelPipeline":
        from transformers import AutoTokenizer

        folder = Path(path)
        tokenizer_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        device = torch.device(device)
        return cls(load_model(folder, device, dtype), load_vae(folder, device, dtype), tokenizer, device)

    def to(self, device) -> "BagelPipeline":
        self.device = torch.device(device)
        self.model.to(self.device)
        self.vae.to(self.device)
        return self

    def set_progress_bar_config(self, **kwargs) -> None:
        """diffusers' pipeline API; this pipeline draws no progress bar."""

    @property
    def max_size(self) -> int:
        """The largest height/width: the latent position table's side, in pixels."""
        return self.model.config.max_latent_size * self.downsample

    # -- the pieces -------------------------------------------------------------------------
    def token_ids(self, prompt: str) -> list[int]:
        return [self.bos, *self.tokenizer.encode(prompt, add_special_tokens=False), self.eos]

    @torch.no_grad()
    def encode(self, prompt: str, height: int, width: int, system_prompt: str = "") -> Context:
        """The prompt's contexts; a system prompt (think mode) goes before it in both."""
        uncond = self.model.empty_cache()
        if system_prompt:
            uncond = self.model.prefill(torch.tensor(self.token_ids(system_prompt), device=self.device))
        cond = self.append(uncond, prompt)
        return Context(cond, uncond, (height // self.downsample, width // self.downsample))

    def add_thought(self, context: Context, thought: str, cfg_img_scale: float) -> None:
        """A decoded thought into the generation context only (the reference's `update_context_text` of
        `gen_context`); the image-CFG context keeps the prompt without it when its row will run."""
        if cfg_img_scale > 1.0:
            context.img = context.cond
        context.cond = self.append(context.cond, thought)

    def append(self, cache: KVCache, text: str) -> KVCache:
        """`text`, wrapped in `<|im_start|>` ... `<|im_end|>`, appended to a context (a thought, after it is
        decoded, goes into the image's context this way: re-encoded from its text, as the reference does)."""
        new, _ = self.model.extend([cache], torch.tensor([self.token_ids(text)], device=self.device))
        return grow(cache, new[0])

    # -- text decoding ----------------------------------------------------------------------
    def start_text(self, cache: KVCache, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> TextDecode:
        """A decode from `<|im_start|>` after `cache`: greedy, or sampled at `temperature` > 0."""
        return TextDecode(cache, int(max_new_tokens), float(temperature), int(seed), [self.bos])

    @torch.no_grad()
    def next_tokens(self, decodes: Sequence[TextDecode]) -> tuple[list[int], torch.Tensor]:
        """One forward for many decodes, each row its last id against its own cache; changes nothing. Returns
        each one's next token (chosen from `lm_head`'s logits) and the keys and values of the id fed (`advance`
        takes both)."""
        last = torch.tensor([[d.ids[-1]] for d in decodes], device=self.device)
        new, hidden = self.model.extend([d.cache for d in decodes], last)
        logits = self.model.lm_head(hidden).float().cpu()
        return [sample_token(row, d) for d, row in zip(decodes, logits)], new

    def advance(self, decode: TextDecode, token: int, new: torch.Tensor) -> None:
        """`next_tokens`' result for one decode: its context grows; it ends on `<|im_end|>` (not kept) or once
        it holds `max_new_tokens` (the reference runs one more forward whose token it drops)."""
        decode.cache = grow(decode.cache, new)
        if token == self.eos:
            decode.done = True
            return
        decode.ids.append(token)
        decode.done = decode.new_tokens >= decode.max_new_tokens

    def text(self, ids: Sequence[int]) -> str:
        """The reference's text of decoded ids: after the first `<|im_start|>`, up to a later one."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False).split("<|im_end|>")[0].split(
            "<|im_start|>")[1]

    def generate_text(self, cache: KVCache, max_new_tokens: int, temperature: float = 0.0,
                      seed: int = 0) -> TextDecode:
        """One request's whole decode, token by token."""
        decode = self.start_text(cache, max_new_tokens, temperature, seed)
        while not decode.done:
            [token], new = self.next_tokens([decode])
            self.advance(decode, token, new[0])
        return decode

    def initial_noise(self, seed: int, context: Context) -> torch.Tensor:
        h, w = context.grid
        generator = torch.Generator().manual_seed(int(seed))  # the reference draws on the CPU default generator
        return torch.randn(h * w, self.model.config.patch_latent_dim, generator=generator).to(self.device)

    @staticmethod
    def schedule(num_inference_steps: int, timestep_shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps, dts) of k Euler updates: the reference's `num_timesteps = k + 1` without t = 0."""
        t = shifted_schedule(num_inference_steps, timestep_shift)
        return t[:-1], t[:-1] - t[1:]

    def query_rows(self, contexts: Sequence[Context], with_uncond: Sequence[bool]) -> QueryRows:
        """Every request's conditional row, then the unconditional rows of those running CFG, then the image-CFG
        rows of those of them with their own image-CFG context (`with_img`)."""
        rows = [(c.cond, c.grid) for c in contexts]
        rows += [(c.uncond, c.grid) for c, u in zip(contexts, with_uncond) if u]
        rows += [(c.img, c.grid) for c, i in zip(contexts, with_img(contexts, with_uncond)) if i]
        return QueryRows.build([cache for cache, _ in rows], [cache.length for cache, _ in rows],
                               [grid for _, grid in rows], self.model.config.max_latent_size,
                               (self.start_of_image, self.end_of_image), self.device)

    @torch.no_grad()
    def predict(self, rows: QueryRows, latents: torch.Tensor, timesteps: Sequence[torch.Tensor],
                guidance: Sequence[Guidance], with_uncond: Sequence[bool], counts: Sequence[int],
                groups: Optional[list] = None, with_img: Sequence[bool] = ()) -> list[torch.Tensor]:
        """Each request's guided velocity [N_r, 64]: one forward over `rows` (`query_rows`), `latents`
        [B, N_max, 64] right-padded, `counts` the N_r (`groups`: the first-block cache's, per row; `with_img`:
        the requests with an image-CFG row, `with_img` of their contexts)."""
        uncond = [i for i, u in enumerate(with_uncond) if u]
        img = [i for i, m in enumerate(with_img) if m]
        extra = uncond + img
        t = torch.stack([timesteps[i] for i in list(range(len(counts))) + extra]).to(self.device)
        # the extra rows by slices: a list index is a host-to-device copy that waits, on CUDA
        rows_in = torch.cat([latents] + [latents[i:i + 1] for i in extra]) if extra else latents
        raw = self.model.velocity(rows, rows_in, t, groups)
        row_of = {("uncond", i): len(counts) + k for k, i in enumerate(uncond)}
        row_of.update({("img", i): len(counts) + len(uncond) + k for k, i in enumerate(img)})
        out = []
        for i, n in enumerate(counts):
            v = raw[i, :n]
            if with_uncond[i]:
                v_img = raw[row_of["img", i], :n] if ("img", i) in row_of else None
                v = guide(v, raw[row_of["uncond", i], :n], guidance[i], v_img)
            out.append(v)
        return out

    @torch.no_grad()
    def decode(self, latents: Sequence[torch.Tensor], grid: tuple[int, int]) -> torch.Tensor:
        """Packed latents [N, 64] of one grid -> float images [B, H, W, 3] already on the reference's uint8 levels,
        on the device."""
        h, w, p, c = *grid, self.patch, self.latent_channels
        z = torch.stack(list(latents)).reshape(-1, h, w, p, p, c)
        z = torch.einsum("nhwpqc->nchpwq", z).reshape(-1, c, h * p, w * p)
        images = vae_decode(self.vae, z)
        images = torch.floor((images * 0.5 + 0.5).clamp(0, 1) * 255) / 255  # the reference's truncating cast
        return images.permute(0, 2, 3, 1)

    # -- the reference's loop, for one request ------------------------------------------------
    def __call__(self, prompt: str, height: int = 1024, width: int = 1024, num_inference_steps: int = 50,
                 generator: Optional[torch.Generator] = None, guidance_scale: float = 4.0, cfg_img_scale: float = 1.0,
                 cfg_interval: Sequence[float] = (0.4, 1.0), cfg_renorm_type: str = "global",
                 cfg_renorm_min: float = 0.0, timestep_shift: float = 3.0, output_type: str = "np",
                 think: bool = False, max_new_tokens: int = 999, temperature: float = 0.0):
        """An image (`images`); with `think`, first the plan (`text`) decoded after `GEN_THINK_SYSTEM_PROMPT`,
        then put into the image's context."""
        assert output_type == "np", "BagelPipeline returns numpy images"
        seed = generator.initial_seed() if generator is not None else torch.seed()
        guidance = Guidance(guidance_scale, cfg_img_scale, tuple(cfg_interval), cfg_renorm_type, cfg_renorm_min)
        context = self.encode(prompt, height, width, GEN_THINK_SYSTEM_PROMPT if think else "")
        thought = None
        if think:
            thought = self.text(self.generate_text(context.cond, max_new_tokens, temperature, seed).ids)
            self.add_thought(context, thought, cfg_img_scale)
        x = self.initial_noise(seed, context)
        timesteps, dts = self.schedule(num_inference_steps, timestep_shift)
        for t, dt in zip(timesteps, dts):
            with_uncond = [guidance.active(float(t))]
            rows = self.query_rows([context], with_uncond)
            [v] = self.predict(rows, x[None], [t], [guidance], with_uncond, [len(x)],
                               with_img=with_img([context], with_uncond))
            x = x - v * dt
        return SimpleNamespace(images=self.decode([x], context.grid).cpu().numpy(), text=thought)

    def answer(self, prompt: str, think: bool = False, max_new_tokens: int = 999, temperature: float = 0.0,
               seed: int = 0) -> str:
        """A text answer to `prompt` (with `think`: after `VLM_THINK_SYSTEM_PROMPT`, the reasoning included)."""
        context = self.encode(prompt, 0, 0, VLM_THINK_SYSTEM_PROMPT if think else "")
        return self.text(self.generate_text(context.cond, max_new_tokens, temperature, seed).ids)


def with_img(contexts: Sequence[Context], with_uncond: Sequence[bool]) -> list[bool]:
    """Which requests run an image-CFG row: those running CFG whose image-CFG context is not the generation one."""
    return [u and c.img is not None for c, u in zip(contexts, with_uncond)]


def guide(v_cond: torch.Tensor, v_uncond: torch.Tensor, g: Guidance, v_img: Optional[torch.Tensor] = None
          ) -> torch.Tensor:
    """The reference's CFG and renorm for one request ([N, 64] each). Text to image has no image
    context, so the image-CFG velocity is the conditional one, unless a thought left the image-CFG
    context without it (`v_img`, the velocity against that context)."""
    v_img = v_cond if v_img is None else v_img
    v_text = v_uncond + g.cfg_text_scale * (v_cond - v_uncond)
    if g.cfg_renorm_type == "text_channel":
        scale = (v_cond.norm(dim=-1, keepdim=True) / (v_text.norm(dim=-1, keepdim=True) + 1e-8))
        v_text = v_text * scale.clamp(min=g.cfg_renorm_min, max=1.0)
        return v_img + g.cfg_img_scale * (v_text - v_img) if g.cfg_img_scale > 1.0 else v_text
    v = v_img + g.cfg_img_scale * (v_text - v_img) if g.cfg_img_scale > 1.0 else v_text
    if g.cfg_renorm_type == "global":
        scale = v_cond.norm() / (v.norm() + 1e-8)
    else:  # channel
        scale = v_cond.norm(dim=-1, keepdim=True) / (v.norm(dim=-1, keepdim=True) + 1e-8)
    return v * scale.clamp(min=g.cfg_renorm_min, max=1.0)


def write_llm_config(folder: Path, llm_config: dict) -> None:
    (Path(folder) / "llm_config.json").write_text(json.dumps(llm_config, indent=2, sort_keys=True) + "\n")
