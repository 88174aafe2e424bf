"""seqio tasks for the paper's Table 2 datasets (the optional `seqio` extra).

`register_paper_tasks()` adds two tasks to seqio's registry, equivalent to T5's:

  wmt_t2t_ende_v003   TFDS `wmt_t2t_translate/de-en`, input "translate English to German: " + en,
                      target de; metric BLEU.
  cnn_dailymail_v002  TFDS `cnn_dailymail`, input "summarize: " + article, target highlights;
                      metric ROUGE.

A task that is already registered under a name (e.g. by importing T5's own `t5.data`) is left
as it is. `seqio_dataset(task_name=…)` is a dataset provider (gin's `@seqio_dataset`): it reads a
split of any registered task and yields `Example`s of the task's *text* inputs and targets,
which the job then encodes with its own vocabulary (for T5, the same SentencePiece model).

seqio, TensorFlow and TFDS are imported only when these functions run, so the module can be
named in gin files on machines without them.
"""

from __future__ import annotations

from typing import Any, Callable


from speclm.data import inputs as inputs_lib

ENDE_TASK = 'wmt_t2t_ende_v003'
CNNDM_TASK = 'cnn_dailymail_v002'
ENDE_PREFIX = 'translate English to German: '
CNNDM_PREFIX = 'summarize: '
ENDE_TFDS_NAME = 'wmt_t2t_translate/de-en:1.0.0'
CNNDM_TFDS_NAME = 'cnn_dailymail:3.4.0'
# T5's default vocabulary: 32000 SentencePiece pieces plus 100 sentinel ids.
T5_VOCABULARY_PATH = 'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'
T5_EXTRA_IDS = 100


def _import_seqio():
  try:
    import seqio  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(
        'seqio tasks need the optional seqio extra (seqio, TensorFlow, TFDS): pip install'
        ' "speclm[seqio]". Without it, give the job a local file with'
        ' run_job.dataset = @file_dataset() instead.') from None
  return seqio


def translate(dataset, *, source_language: str = 'en', target_language: str = 'de',
              prefix: str = ENDE_PREFIX):
  """{en, de} -> {inputs: prefix + en, targets: de}, as T5's translation preprocessing."""

  def fn(example):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return {'inputs': tf.strings.join([prefix, example[source_language]]),
            'targets': example[target_language]}

  return dataset.map(fn, num_parallel_calls=-1)


def summarize(dataset, *, article_key: str = 'article', summary_key: str = 'highlights',
              prefix: str = CNNDM_PREFIX):
  """{article, highlights} -> {inputs: prefix + article, targets: highlights}."""

  def fn(example):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return {'inputs': tf.strings.join([prefix, example[article_key]]),
            'targets': example[summary_key]}

  return dataset.map(fn, num_parallel_calls=-1)


def _output_features(vocabulary):
  seqio = _import_seqio()
  if vocabulary is None:
    vocabulary = seqio.SentencePieceVocabulary(T5_VOCABULARY_PATH, extra_ids=T5_EXTRA_IDS)
  return {'inputs': seqio.Feature(vocabulary=vocabulary, add_eos=True),
          'targets': seqio.Feature(vocabulary=vocabulary, add_eos=True)}


def _add_task(name: str, source, text_preprocessor: Callable[..., Any], vocabulary,
              metric: str):
  seqio = _import_seqio()
  del metric  # the job computes BLEU/ROUGE itself from the text; kept for readability
  return seqio.TaskRegistry.add(
      name, source=source,
      preprocessors=[text_preprocessor, seqio.preprocessors.tokenize,
                     seqio.CacheDatasetPlaceholder(), seqio.preprocessors.append_eos_after_trim],
      output_features=_output_features(vocabulary))


def add_translation_task(name: str, source, vocabulary=None):
  """Registers an EnDe task over any seqio source with `en` and `de` string features."""
  return _add_task(name, source, translate, vocabulary, 'bleu')


def add_summarization_task(name: str, source, vocabulary=None):
  """Registers a summarization task over a source with `article` and `highlights` features."""
  return _add_task(name, source, summarize, vocabulary, 'rouge')


def register_paper_tasks(vocabulary=None) -> tuple[str, str]:
  """Registers wmt_t2t_ende_v003 and cnn_dailymail_v002 unless already present."""
  seqio = _import_seqio()
  registered = set(seqio.TaskRegistry.names())
  if ENDE_TASK not in registered:
    add_translation_task(ENDE_TASK, seqio.TfdsDataSource(tfds_name=ENDE_TFDS_NAME), vocabulary)
  if CNNDM_TASK not in registered:
    add_summarization_task(CNNDM_TASK, seqio.TfdsDataSource(tfds_name=CNNDM_TFDS_NAME),
                           vocabulary)
  return ENDE_TASK, CNNDM_TASK


def _text(value) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def seqio_dataset(task_name: str, split: str = 'validation',
                  max_examples: int | None = None,
                  tfds_data_dir: str | None = None) -> list[inputs_lib.Example]:
  """Dataset provider: a split of a registered seqio task as `Example`s (text, in order).

  The paper's two tasks are registered on first use. Inputs keep the task's prefix; references
  are the task's target text. `tfds_data_dir` (local or gs://) is where prepared TFDS data
  lives, when not in TFDS's default directory.
  """
  seqio = _import_seqio()
  if tfds_data_dir:
    seqio.set_tfds_data_dir_override(tfds_data_dir)
  register_paper_tasks()
  try:
    task = seqio.get_mixture_or_task(task_name)
  except ValueError:
    known = ', '.join(sorted(seqio.TaskRegistry.names())[:20])
    raise inputs_lib.DataError(
        f'No seqio task named {task_name!r}. Registered tasks include: {known}.') from None
  dataset = task.get_dataset(sequence_length=None, split=split, shuffle=False, num_epochs=1,
                             use_cached=False)
  examples = []
  for index, features in enumerate(dataset.as_numpy_iterator()):
    if max_examples is not None and index >= max_examples:
      break
    examples.append(inputs_lib.Example(
        index=index, id=f'{task_name}:{split}:{index}',
        input=_text(features['inputs_pretokenized']),
        reference=_text(features['targets_pretokenized'])
        if 'targets_pretokenized' in features else None))
  return examples

