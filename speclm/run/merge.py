"""Several processes, one job: each decodes its share into `process_<p>/`, and process 0
merges every share into the job's predictions.jsonl and metrics.json."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from speclm import outputs as outputs_lib
from speclm.analysis import job_metrics
from speclm.run.errors import JobError


def process_dir(process_index: int) -> str:
  """The sub-directory of `output_dir` that process `process_index` writes."""
  return f'process_{process_index:03d}'


def merge_processes(output_dir: str, process_index: int, process_count: int,
                     metrics: dict[str, Any], **report_kwargs) -> dict[str, Any]:
  """Process 0 gathers every process's predictions and writes the merged report.

  The records travel over JAX's own collectives (`process_allgather`), not a shared file
  system: on a TPU slice each host writes its part to its own disk (`process_<p>/`), and only
  process 0's `output_dir` gets the merged predictions.jsonl and metrics.json.
  """
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  own = os.path.join(output_dir, process_dir(process_index), outputs_lib.PREDICTIONS)
  with open(own, 'rb') as f:
    data = np.frombuffer(f.read(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64)))
  padded = np.zeros((int(sizes.max()),), np.uint8)
  padded[:data.size] = data
  parts = np.asarray(multihost_utils.process_allgather(padded))  # [processes, bytes]
  if process_index == 0:
    records, seen = [], set()
    for p in range(process_count):
      text = parts[p, :int(sizes.reshape(-1)[p])].tobytes()
      for line in text.splitlines():
        if not line.strip():
          continue
        record = json.loads(line)
        if record['index'] in seen:
          raise JobError(f'Example {record["index"]} was decoded by two processes; the'
                         f' process directories under {output_dir} belong to different jobs.')
        seen.add(record['index'])
        records.append(record)
    records.sort(key=lambda r: r['index'])
    outputs_lib.write_atomic(os.path.join(output_dir, outputs_lib.PREDICTIONS),
                             ''.join(json.dumps(r, ensure_ascii=False, allow_nan=True) + '\n'
                                     for r in records))
    merged = job_metrics.compute_metrics(records, cost=metrics.get('cost_measurement'),
                                         **report_kwargs)
    merged['job'] = dict(metrics['job'], output_dir=output_dir, process_index=0,
                         merged_from=[process_dir(p) for p in range(process_count)])
    outputs_lib.write_json_atomic(os.path.join(output_dir, outputs_lib.METRICS), merged)
    metrics = merged
  multihost_utils.sync_global_devices('speclm.run: the report is written')
  return metrics
