"""Inputs for decoding jobs: datasets (files, seqio tasks, built-in prompts) and vocabularies.

  inputs            examples from JSONL/TSV/text files, encoding, length buckets, batches
                    (exported here)
  vocab             the `Vocabulary` interface: bytes, SentencePiece, any encode/decode pair
                    (exported here)
  builtin_prompts   the demo's prompts and the SmolLM2 draft's training and held-out prompts
  grounded_prompts  training requests grounded in passages (standard-library docstrings)
  seqio_tasks       the paper's WMT EnDe and CNN/DailyMail as seqio tasks
  conversations     Spec-Bench/MT-bench question files, one example per turn
  sharegpt          ShareGPT V3 for training drafts (the `train` extra)
  torch_replies     a Llama's own replies in PyTorch bfloat16 (training data for drafts)
  draft_shards      the draft scripts' training shards: source, held out, the card's data line

`speclm.data.seqio_tasks` (the optional `seqio` extra) is not imported here; import it to
register the paper's WMT EnDe and CNN/DailyMail tasks. Nor are `sharegpt` and `torch_replies`
(PyTorch), which only the training scripts need.
"""

from speclm.data.inputs import Batch
from speclm.data.inputs import DataError
from speclm.data.inputs import EncodedExample
from speclm.data.inputs import Example
from speclm.data.inputs import bucket_width
from speclm.data.inputs import default_buckets
from speclm.data.inputs import encode_examples
from speclm.data.inputs import make_batches
from speclm.data.inputs import read_examples
from speclm.data.inputs import synthetic_dataset
from speclm.data.vocab import ByteVocabulary
from speclm.data.vocab import FunctionVocabulary
from speclm.data.vocab import SentencePieceVocabulary
from speclm.data.vocab import Vocabulary

__all__ = [
    'Batch', 'ByteVocabulary', 'DataError', 'EncodedExample', 'Example', 'FunctionVocabulary',
    'SentencePieceVocabulary', 'Vocabulary', 'bucket_width', 'default_buckets',
    'encode_examples', 'make_batches', 'read_examples', 'synthetic_dataset',
]
