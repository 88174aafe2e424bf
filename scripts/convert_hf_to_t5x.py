"""Converts a Hugging Face T5 directory (config.json + *.safetensors) to a T5X checkpoint.

  python scripts/convert_hf_to_t5x.py --hf_dir=/models/t5-v1_1-small \
      --output_dir=/ckpts/t5_1_1_small/checkpoint_0 [--dtype=bfloat16] [--step=0]

The output is T5X's legacy format (msgpack `checkpoint` + gzip zarr arrays), readable by T5X
and by `speclm.checkpoints.load_t5x_checkpoint`; `--output_dir` may be a gs:// path. The
matching speclm gin binding is printed at the end (v1.0 vs v1.1 comes from config.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speclm.checkpoints import hf_t5  # pylint: disable=wrong-import-position
from speclm.checkpoints import t5x  # pylint: disable=wrong-import-position


def convert(hf_dir: str, output_dir: str, *, dtype: str = 'float32', step: int = 0) -> str:
  """Reads `hf_dir`, writes the T5X checkpoint to `output_dir`, returns a config summary."""
  config, params = hf_t5.load_hf_t5(hf_dir, dtype=dtype)
  t5x.save_t5x_checkpoint(output_dir, params, step=step)
  return (f'T5 {config.version} (emb_dim={config.emb_dim}, num_heads={config.num_heads},'
          f' head_dim={config.head_dim}, layers={config.num_encoder_layers}+'
          f'{config.num_decoder_layers}, mlp_dim={config.mlp_dim},'
          f' mlp_activations={config.mlp_activations},'
          f' logits_via_embedding={config.logits_via_embedding}, vocab_size={config.vocab_size},'
          f' param dtype {config.param_dtype})')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--hf_dir', required=True, help='config.json + *.safetensors directory')
  parser.add_argument('--output_dir', required=True, help='checkpoint_<step> directory to write')
  parser.add_argument('--dtype', default='float32', help='parameter dtype written (float32,'
                      ' bfloat16)')
  parser.add_argument('--step', type=int, default=0, help='step recorded in the checkpoint')
  args = parser.parse_args(argv)
  try:
    summary = convert(args.hf_dir, args.output_dir, dtype=args.dtype, step=args.step)
  except (ValueError, OSError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(f'Wrote {args.output_dir}: {summary}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
