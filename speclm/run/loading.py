"""Loading a gin job's parts without running it: `load_job` hands the target, the draft and the
encoded prompts of a job's TARGET, DRAFT, VOCABULARY, DATASET and MAX_INPUT_LENGTH macros to
other tools (`python -m speclm.analysis --gin_file=…`, the benchmark scripts)."""

from __future__ import annotations

from typing import Any, Sequence

import gin
import numpy as np

from speclm import protocol
from speclm.data import inputs as inputs_lib
from speclm.run import gin_cli
from speclm.run import providers
from speclm.run.errors import JobError


@gin.configurable
def job_parts(target: Any = gin.REQUIRED, draft: Any = None, vocabulary: Any = None,
              dataset: Any = None, max_input_length: int = 512):
  """The providers a gin job names; `load_job` binds them to the job's macros."""
  return target, draft, vocabulary, dataset, max_input_length


_JOB_PARTS_BINDINGS = (
    'OUTPUT_DIR = None',  # a tool that only loads the job's parts writes no outputs
    'job_parts.target = %TARGET', 'job_parts.draft = %DRAFT',
    'job_parts.vocabulary = %VOCABULARY', 'job_parts.dataset = %DATASET',
    'job_parts.max_input_length = %MAX_INPUT_LENGTH')


def load_job(gin_files: Sequence[str], gin_bindings: Sequence[str] = (),
             gin_search_paths: Sequence[str] = ()) -> dict[str, Any]:
  """The target, draft and encoded prompts of a gin job (its TARGET, DRAFT, VOCABULARY,
  DATASET and MAX_INPUT_LENGTH macros), without running it.

  Returns a dict with 'target', 'draft' (`protocol.Model`s), 'prompts' `[N, P]`,
  'prompt_lengths' `[N]` (right-padded token ids) and 'eos_id'.
  """
  gin_cli.parse_gin(gin_files, list(gin_bindings) + list(_JOB_PARTS_BINDINGS), gin_search_paths)
  # pylint: disable-next=no-value-for-parameter
  target, draft, vocabulary, dataset, max_input_length = job_parts()
  vocabulary = providers.as_vocabulary(providers.provide(vocabulary, 'Loading the vocabulary'))
  examples = list(providers.provide(dataset, 'Reading the dataset'))
  if not examples:
    raise JobError('The dataset is empty: no prompts to measure on.')
  try:
    encoded = [e for e in inputs_lib.encode_examples(examples, vocabulary,
                                                     max_input_length=max_input_length)
               if e.skipped is None]
  except inputs_lib.DataError as e:
    raise JobError(str(e)) from None
  width = max(e.length for e in encoded)
  prompts = np.full((len(encoded), width), vocabulary.pad_id, np.int32)
  for row, item in enumerate(encoded):
    prompts[row, :item.length] = item.ids
  return {
      'target': providers.provide(target, 'Loading the target model', protocol.Model),
      'draft': None if draft is None else providers.provide(draft, 'Loading the draft model',
                                                   protocol.Model),
      'prompts': prompts,
      'prompt_lengths': np.array([e.length for e in encoded], np.int32),
      'eos_id': vocabulary.eos_id,
  }
