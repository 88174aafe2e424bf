"""The trained drafts shipped for SmolLM2-135M-Instruct.

`load` gives the embedded default's M_q, a token-only draft (below). `load_eagle` gives an
EAGLE-3 draft (`speclm.models.eagle`, one layer that reads SmolLM2's hidden states after layers
2, 15 and 27) in `speclm/assets/smollm2_eagle/`, made by `scripts/train_sharegpt_draft.py` (its
MODEL_CARD.md describes the run).

A small Llama (a few layers of SmolLM2's width) whose head covers only the S most frequent
tokens of SmolLM2's replies (q̃ = 0 elsewhere, see `subset_vocab`). It reuses the target's
token embeddings for those S tokens, read from the target at load time, so the shipped file
holds only what was trained: the transformer layers, the final norm, the embedding of the
"other" input id, and the subset's token ids. `scripts/train_smollm2_draft.py` makes it;
`speclm/assets/smollm2_draft/MODEL_CARD.md` describes the run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from speclm import protocol
from speclm import trees
from speclm.checkpoints import validate
from speclm.models import eagle
from speclm.models import llama
from speclm.models import subset_vocab

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'assets')
DRAFT_DIR = os.path.join(_ASSETS, 'smollm2_draft')
WEIGHTS_FILE = 'draft.safetensors'
# The EAGLE-style draft (`speclm.models.eagle`, made by scripts/train_smollm2_eagle.py).
EAGLE_DIR = os.path.join(_ASSETS, 'smollm2_eagle')
EAGLE_FILE = 'eagle.safetensors'


def draft_config(target_config: llama.LlamaConfig, num_layers: int, subset_size: int,
                 dtype: str = 'float32') -> llama.LlamaConfig:
  """The draft's inner Llama: the target's width and heads, fewer layers, S+1 ids, tied head,
  and the target's context length."""
  return llama.LlamaConfig(
      vocab_size=subset_size + 1, num_layers=num_layers, embed_dim=target_config.embed_dim,
      num_heads=target_config.num_heads, num_kv_heads=target_config.num_kv_heads,
      head_dim=target_config.head_dim, mlp_dim=target_config.mlp_dim,
      rope_theta=target_config.rope_theta, rope_scaling=target_config.rope_scaling,
      norm_eps=target_config.norm_eps, tie_embeddings=True,
      max_position_embeddings=target_config.max_position_embeddings, param_dtype=dtype,
      dtype=dtype)


def subset_embedding(target: protocol.Model, subset_ids, other_embedding) -> jax.Array:
  """`[S+1, D]`: the target's embedding rows for the subset, then the "other" row."""
  table = llama.embedding_table(target)
  rows = jnp.take(table, jnp.asarray(subset_ids), axis=0)
  return jnp.concatenate([rows, jnp.asarray(other_embedding, table.dtype)[None]], axis=0)


def assemble(target: protocol.Model, trained: dict[str, Any], subset_ids,
             num_layers: int, dtype: str = 'float32',
             cpu_kernels: bool = False) -> protocol.Model:
  """A full-vocabulary draft `Model` from its trained parameters and the target's embeddings.

  `trained` holds `layers_{i}`, `final_norm` and `other_embedding` (`[D]`). `cpu_kernels`:
  see `llama.pack_for_cpu` (inference only; the layers' panels are bfloat16 as stored, the
  head's rounded to bfloat16).
  """
  config = draft_config(target.definition.config, num_layers, len(subset_ids), dtype)
  inner_params = {k: v for k, v in trained.items() if k != 'other_embedding'}
  inner_params['embedder'] = {
      'embedding': subset_embedding(target, subset_ids, trained['other_embedding'])}
  inner_params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, config.param_dtype),
                                        inner_params)
  inner = protocol.Model(llama.Llama(config), inner_params)
  inner.definition.validate_params(inner.params)
  # The head's panels are rounded to bfloat16 (its rows are the target's Q8_0 embeddings, not
  # bfloat16 values): a draft may be any model, and this halves its largest matrix.
  inner = (llama.pack_for_cpu(inner, bfloat16_head=True) if cpu_kernels
           else llama.untie_head(inner))
  return subset_vocab.wrap(inner, subset_ids, target.vocab_size)


def save(path: str, trained: dict[str, Any], subset_ids, metadata: dict[str, Any]) -> None:
  """Writes the trained parameters (bfloat16) and subset ids as one safetensors file."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  flat = {}
  for key_path, value in jax.tree_util.tree_flatten_with_path(trained)[0]:
    name = '.'.join(str(getattr(k, 'key', k)) for k in key_path)
    # bfloat16 halves the file; stored as raw uint16 since NumPy has no bfloat16 of its own.
    flat[name] = np.asarray(jnp.asarray(value, jnp.bfloat16)).view(np.uint16)
  flat['subset_ids'] = np.asarray(subset_ids, np.int32)
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  save_file(flat, path, metadata={'speclm': json.dumps(metadata, sort_keys=True)})


def read(path: str | None = None) -> tuple[dict[str, Any], np.ndarray, dict[str, Any]]:
  """(trained params as float32, subset ids, metadata) from a draft file."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  path = path or os.path.join(DRAFT_DIR, WEIGHTS_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No SmolLM2 draft at {path}; train one with'
                            ' `python scripts/train_smollm2_draft.py`.')
  with safe_open(path, framework='numpy') as f:
    metadata = json.loads((f.metadata() or {}).get('speclm', '{}'))
    subset_ids = f.get_tensor('subset_ids')
    flat = {name: f.get_tensor(name).view(jnp.bfloat16).astype(np.float32)
            for name in f.keys() if name != 'subset_ids'}
  trained = trees.unflatten(flat, sep='.')
  validate.check_finite(trained, path, error=ValueError)
  return trained, subset_ids, metadata


def load(target: protocol.Model, path: str | None = None,
         dtype: str = 'float32', cpu_kernels: bool = False) -> protocol.Model:
  """The shipped (or a given) draft for `target` = SmolLM2-135M, as a `protocol.Model`."""
  trained, subset_ids, metadata = read(path)
  return assemble(target, trained, subset_ids, _num_layers(trained, metadata), dtype,
                  cpu_kernels)


def load_eagle(target: protocol.Model, path: str | None = None,
               cpu_kernels: bool = False) -> protocol.Model:
  """The shipped (or a given) EAGLE-style draft for `target` = SmolLM2-135M (an EAGLE-3 one
  if its metadata names the `feature_layers` it reads)."""
  trained, head_ids, metadata = read(path or os.path.join(EAGLE_DIR, EAGLE_FILE))
  return eagle.make(target, trained, head_ids, _num_layers(trained, metadata), cpu_kernels,
                    feature_layers=metadata.get('feature_layers'))


def _num_layers(trained: dict[str, Any], metadata: dict[str, Any]) -> int:
  """The layers a draft file holds, checked against what its metadata says."""
  num_layers = sum(1 for k in trained if k.startswith('layers_'))
  if metadata.get('num_layers', num_layers) != num_layers:
    raise ValueError(f'The draft file says {metadata["num_layers"]} layers but holds'
                     f' {num_layers}.')
  return num_layers
