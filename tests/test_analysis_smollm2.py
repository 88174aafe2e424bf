"""α on a real model pair: SmolLM2-135M-Instruct and its shipped trained draft.

At temperature 0 greedy speculative decoding writes the target's own greedy text, so
Corollary 3.6's β computed teacher-forced along that text is β at exactly the prefixes the
loop drafted from. Replaying Algorithm 1's rounds on it must reproduce the loop's statistics
(see `test_analysis_measure.test_loop_alpha_matches_corollary_3_6_on_the_same_greedy_text`
for the argument); here with real weights, a real tokenizer and chat prompts.
"""

import numpy as np
import pytest

import speclm
from speclm.analysis import measure
from speclm.data import builtin_prompts
from speclm.models import smollm2
from speclm.models import smollm2_draft

pytestmark = pytest.mark.skipif(not smollm2.is_available(),
                                reason=f'SmolLM2 is not installed: {smollm2.SETUP_COMMAND}')

GAMMA = 4
MAX_NEW = 24


def test_loop_alpha_matches_corollary_3_6_on_smollm2():
  target = smollm2.load_model()
  draft = smollm2_draft.load(target)
  tok = smollm2.load_tokenizer()
  prompts, lengths = tok.batch([tok.encode_chat(p) for p in builtin_prompts.demo_prompts()[:2]])
  spec = speclm.speculative_decode(target, draft, prompts, lengths, gamma=GAMMA,
                                   max_new_tokens=MAX_NEW)
  reference = measure.generate_reference(target, prompts, lengths,
                                         tokens_per_row=MAX_NEW + GAMMA,
                                         sampling=speclm.GREEDY, batch_size=2)
  np.testing.assert_array_equal(np.asarray(spec.tokens), reference.tokens[:, :MAX_NEW])
  beta, mask = measure.beta_along(target, draft, reference, sampling=speclm.GREEDY,
                                  batch_size=2)
  assert mask.all() and set(np.unique(beta)) <= {0.0, 1.0}
  replay = measure.greedy_round_replay(beta, MAX_NEW, GAMMA)
  stats = spec.stats
  assert replay.beta_count == int(stats.beta_count)
  assert replay.beta_sum == pytest.approx(float(stats.beta_sum), abs=1e-4)
  assert replay.accepted_histogram.tolist() == np.asarray(stats.accepted_histogram).tolist()
  assert replay.alpha == pytest.approx(measure.alpha_from_stats(stats), abs=1e-6)
  assert 0.0 < replay.alpha < 1.0
