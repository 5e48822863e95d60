"""Text sampling (engine_lib/pipelines/decoder_parts.py `sample_token`, BAGEL's and HunyuanImage-3.0's thoughts):
the draws of one request at successive token indices are a categorical sample of softmax(logits / temperature),
not one draw repeated. Seeded, so the statistic below is a fixed number, never a flaky one."""

from __future__ import annotations

import numpy as np
import torch

from engine_lib.pipelines.decoder_parts import TextDecode, sample_token

LOGITS = torch.tensor([1.3, 0.6, 0.1, -0.3, -1.1])
DRAWS = 3000
# The 0.999 quantile of chi-square with 4 degrees of freedom (5 tokens): a true sample exceeds it once in 1000
# seeds; the seed here is fixed, so the test is deterministic.
CHI2_BOUND = 18.47


def chi2(counts: np.ndarray, probs: torch.Tensor) -> float:
    expected = probs.double().numpy() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_at_successive_tokens_follow_the_tempered_softmax():
    """One request at temperature 0.7 draws 3000 tokens (its ids growing as decoding's do) over fixed logits: the
    counts fit softmax(logits / 0.7) within the chi-square bound and miss softmax(logits) (temperature 1) by over
    5 times it; consecutive draws differ as often as independent ones would (within 0.05)."""
    decode = TextDecode(cache=None, max_new_tokens=DRAWS, temperature=0.7, seed=11, ids=[0])
    for _ in range(DRAWS):
        decode.ids.append(sample_token(LOGITS, decode))
    drawn = np.array(decode.ids[1:])
    counts = np.bincount(drawn, minlength=len(LOGITS))
    probs = torch.softmax(LOGITS / 0.7, dim=-1)
    fit, untempered = chi2(counts, probs), chi2(counts, torch.softmax(LOGITS, dim=-1))
    print(f"counts {counts.tolist()}, expected {(probs * DRAWS).round().tolist()}: chi2 {fit:.2f}, "
          f"at temperature 1: {untempered:.1f}")
    assert fit < CHI2_BOUND < 5 * CHI2_BOUND < untempered
    changes = float(np.mean(drawn[1:] != drawn[:-1]))
    assert abs(changes - (1 - float((probs ** 2).sum()))) < 0.05
    again = TextDecode(cache=None, max_new_tokens=DRAWS, temperature=0.7, seed=11, ids=decode.ids[:50])
    assert sample_token(LOGITS, again) == decode.ids[50]  # token 49 drawn again: the same token
