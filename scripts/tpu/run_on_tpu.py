r"""Runs a speclm gin job on a fresh Cloud TPU VM and brings the results back.

Steps (each one gcloud command; --dry-run prints them all and runs none):
  1. create the TPU VM
  2. copy this checkout to it (tracked and untracked files, not .git or ignored outputs)
  3. install speclm with JAX for TPU (and the extras you ask for)
  4. run the job: `python -m speclm.run --gin_file=… --gin.…` (OUTPUT_DIR is set for you), or
     any command given with --command
  5. copy the output directory back
  6. delete the VM (also when a step fails; --keep_vm keeps it)

  python scripts/tpu/run_on_tpu.py --name=speclm-ende --zone=us-central2-b \
      --accelerator_type=v4-8 --gin_file=ende_small.gin \
      --gin.TARGET_CHECKPOINT="'gs://bucket/t5_1_1_xxl_ende/checkpoint_1000000'" \
      --gin.DRAFT_CHECKPOINT="'gs://bucket/t5_1_1_small_ende/checkpoint_1000000'" \
      --local_output_dir=results/ende_small --dry-run

Needs the Google Cloud SDK (`gcloud`) logged in to a project with TPU quota.

Single-host slices (v4-8, v5p-8, v5litepod-8, v6e-8, v3-8, …) copy, install and run on worker 0.
A slice of several hosts (v4-32, v5litepod-16, …; see `num_hosts`) must run the JAX program on
every host at once, so steps 2-4 use --worker=all and the gin job gets
--gin.partitioning.initialize_distributed.enabled=True, or --gin.MULTI_HOST=True with
runs/sharded.gin (jax.distributed.initialize() on every host; each decodes its share, process
0 merges them and writes the report); step 5 copies from worker 0. A --command runs on every
worker as given: it must enable multi-host itself. The merge reads every host's part from
OUTPUT_DIR, so on several hosts that directory must be one the hosts share (docs/tpu.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from typing import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REMOTE_DIR = 'speclm'
REMOTE_OUTPUT = 'speclm_output'
ARCHIVE = 'speclm_checkout.tar.gz'


# TPU generation -> (what the number in '<generation>-<N>' counts, how many of those one host
# holds). Cloud TPU's system architecture pages: v2 and v3 have 2 TensorCores per chip and 4
# chips per host; v4 and v5p have 2 TensorCores per chip and 4 chips per host; v5e
# (v5litepod) and v6e name chips: up to 8 on one host, and 4 per host in a multi-host slice.
_GENERATIONS = {'v2': ('TensorCores', 8), 'v3': ('TensorCores', 8), 'v4': ('TensorCores', 8),
                'v5p': ('TensorCores', 8), 'v5litepod': ('chips', 4), 'v6e': ('chips', 4)}
# The largest slice of one host where a host holds more than in multi-host slices.
_SINGLE_HOST_MAX = {'v5litepod': 8, 'v6e': 8}
# The gin binding that turns on jax.distributed.initialize() at the job's start: the
# configurable's own parameter, which works with any gin files; with configs/runs/sharded.gin,
# its MULTI_HOST macro, which sets that parameter (speclm.run refuses a macro no file uses).
MULTI_HOST_BINDING = '--gin.partitioning.initialize_distributed.enabled=True'
SHARDED_MULTI_HOST_BINDING = '--gin.MULTI_HOST=True'


def num_hosts(accelerator_type: str) -> int:
  """How many hosts (TPU VM workers) a Cloud TPU slice `<generation>-<N>` has.

  The rule, from Cloud TPU's system architecture documentation:
    * v2-N, v3-N: N TensorCores, 2 per chip, 4 chips (8 TensorCores) per host: N / 8 hosts
      (v3-8: 1, v3-32: 4).
    * v4-N, v5p-N: N TensorCores, 2 per chip, 4 chips (8 TensorCores) per host: N / 8 hosts
      (v4-8: 1, v4-16: 2, v4-32: 4).
    * v5litepod-N (v5e), v6e-N: N chips; N <= 8 fit one host (1, 4 or 8 chips), larger
      slices have 4 chips per host: N / 4 hosts (v5litepod-16: 4, v6e-256: 64).

  Raises ValueError for a generation not listed above or a size that is not a slice size.
  """
  match = re.fullmatch(r'(v[0-9][a-z]*)-([0-9]+)', accelerator_type.strip().lower())
  known = ', '.join(f'{g}-N' for g in _GENERATIONS)
  if not match or match.group(1) not in _GENERATIONS:
    raise ValueError(f'Unknown TPU accelerator type {accelerator_type!r}: known generations are'
                     f' {known} (e.g. v4-8, v4-32, v5p-8, v5litepod-8, v6e-16).')
  generation, size = match.group(1), int(match.group(2))
  counted, per_host = _GENERATIONS[generation]
  if 0 < size <= _SINGLE_HOST_MAX.get(generation, 0):
    return 1
  if size < per_host or size % per_host:
    raise ValueError(f'{accelerator_type!r} is not a {generation} slice size: N counts'
                     f' {counted}, {per_host} per host, so N must be a multiple of {per_host}.')
  return size // per_host


def multi_host_binding(gin_files: Sequence[str]) -> str:
  """The flag that makes `speclm.run` with these gin files start jax.distributed."""
  if any(os.path.basename(f) == 'sharded.gin' for f in gin_files):
    return SHARDED_MULTI_HOST_BINDING
  return MULTI_HOST_BINDING


def checkout_files(repo: str = REPO) -> list[str]:
  """Tracked and untracked, not ignored, files of the checkout (relative paths)."""
  out = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'],
                       cwd=repo, check=True, capture_output=True, text=True).stdout
  return [path for path in out.splitlines() if path and os.path.isfile(os.path.join(repo, path))]


def make_archive(path: str, repo: str = REPO) -> None:
  with tarfile.open(path, 'w:gz') as tar:
    for name in checkout_files(repo):
      tar.add(os.path.join(repo, name), arcname=name)


def double_quote(arg: str) -> str:
  """`arg` for a POSIX shell, in double quotes when needed (readable with gin's '…' strings)."""
  if arg and all(c.isalnum() or c in '@%+=:,./-_' for c in arg):
    return arg
  escaped = ''.join('\\' + c if c in '"$`\\' else c for c in arg)
  return f'"{escaped}"'


def display(command: Sequence[str]) -> str:
  return ' '.join(double_quote(arg) for arg in command)


def plan(args: argparse.Namespace, gin_args: Sequence[str], archive: str) -> dict[str, list]:
  """The gcloud commands of each step, as argument lists."""
  tpu = ['gcloud', 'compute', 'tpus', 'tpu-vm']
  where = [f'--zone={args.zone}'] + ([f'--project={args.project}'] if args.project else [])
  create = tpu + ['create', args.name, *where, f'--accelerator-type={args.accelerator_type}',
                  f'--version={args.version}'] + (['--spot'] if args.spot else [])
  extras = f'[{args.extras}]' if args.extras else ''
  install = ' && '.join([
      f'mkdir -p {REMOTE_DIR}', f'tar -xzf {ARCHIVE} -C {REMOTE_DIR}',
      'python3 -m pip install --upgrade pip',
      'python3 -m pip install "jax[tpu]"',
      f'python3 -m pip install -e "./{REMOTE_DIR}{extras}"'])
  multi_host = num_hosts(args.accelerator_type) > 1
  if args.command:
    job = args.command
  else:
    # The job runs in ~/speclm, so ../speclm_output is ~/speclm_output. The multi-host binding
    # comes before the user's, so an explicit one of the same name wins.
    job = display(['python3', '-m', 'speclm.run',
                   *[f'--gin_file={f}' for f in args.gin_file],
                   *([multi_host_binding(args.gin_file)] if multi_host else []), *gin_args,
                   f"--gin.OUTPUT_DIR='../{REMOTE_OUTPUT}'"])
  run = f'cd {REMOTE_DIR} && {job}'
  # Every host of a multi-host slice gets the code and runs the program (jax.distributed waits
  # for all of them); process 0, on worker 0, merges the results.
  workers = '--worker=all' if multi_host else '--worker=0'
  ssh = lambda command: tpu + ['ssh', args.name, *where, workers, f'--command={command}']
  return {
      'create': [create],
      'copy code': [tpu + ['scp', archive, f'{args.name}:~/{ARCHIVE}', *where, workers]],
      'install': [ssh(install)],
      'run job': [ssh(run)],
      'copy results': [tpu + ['scp', '--recurse', f'{args.name}:~/{REMOTE_OUTPUT}',
                              args.local_output_dir, *where, '--worker=0']],
      'delete': [tpu + ['delete', args.name, *where, '--quiet']],
  }


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog='--gin.NAME=VALUE arguments are passed to the job.')
  parser.add_argument('--name', required=True, help='TPU VM name')
  parser.add_argument('--zone', required=True, help='e.g. us-central2-b (v4), us-west4-a (v5e)')
  parser.add_argument('--project', default=None, help='GCP project (default: gcloud config)')
  parser.add_argument('--accelerator_type', default='v4-8')
  parser.add_argument('--version', default='tpu-ubuntu2204-base', help='TPU VM software image')
  parser.add_argument('--spot', action='store_true', help='a preemptible (spot) VM')
  parser.add_argument('--gin_file', action='append', default=[], help='repeatable')
  parser.add_argument('--command', default=None,
                      help='run this shell command in the checkout instead of a gin job, e.g.'
                      ' "python3 scripts/reproduce_table2.py --output_dir=$HOME/speclm_output'
                      ' --checkpoint_pattern=…"')
  parser.add_argument('--extras', default='seqio', help="pip extras, e.g. 'seqio' or ''")
  parser.add_argument('--local_output_dir', default='tpu_results')
  parser.add_argument('--keep_vm', action='store_true', help='do not delete the VM at the end')
  parser.add_argument('--dry-run', '--dry_run', dest='dry_run', action='store_true',
                      help='print every gcloud command and run none')
  args, rest = parser.parse_known_args(argv)
  unknown = [a for a in rest if not a.startswith('--gin.')]
  if unknown:
    parser.error(f'unrecognized arguments: {" ".join(unknown)}')
  if not args.gin_file and not args.command:
    parser.error('give --gin_file (a gin job) or --command.')
  try:
    hosts = num_hosts(args.accelerator_type)
  except ValueError as e:
    parser.error(str(e))
  if hosts > 1:
    print(f'# {args.accelerator_type} has {hosts} hosts: copying, installing and running on'
          ' every worker (--worker=all), results from worker 0'
          + ('; --command runs as given, so it must enable multi-host itself (e.g.'
             f' {MULTI_HOST_BINDING} for speclm.run)' if args.command else
             f' ({multi_host_binding(args.gin_file)})') + '.', file=sys.stderr)

  with tempfile.TemporaryDirectory() as tmp:
    archive = os.path.join(tmp, ARCHIVE)
    steps = plan(args, rest, archive)
    if args.dry_run:
      print(f'# would archive {len(checkout_files())} files of {REPO} into {ARCHIVE}')
      for step, commands in steps.items():
        for command in commands:
          print(f'# {step}\n{display(command)}')
      return 0
    make_archive(archive)
    created = False
    try:
      for step, commands in steps.items():
        if step == 'delete':
          continue
        for command in commands:
          print(f'[{step}] {display(command)}', flush=True)
          subprocess.run(command, check=True)
        created = created or step == 'create'
      return 0
    except subprocess.CalledProcessError as e:
      print(f'run_on_tpu: step failed with exit code {e.returncode}.', file=sys.stderr)
      return 1
    finally:
      if created and not args.keep_vm:
        for command in steps['delete']:
          print(f'[delete] {display(command)}', flush=True)
          subprocess.run(command, check=False)
      elif created:
        print(f'Keeping the VM {args.name}; delete it with:\n  {display(steps["delete"][0])}')


if __name__ == '__main__':
  sys.exit(main())
