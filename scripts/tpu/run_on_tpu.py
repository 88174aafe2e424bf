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

Needs the Google Cloud SDK (`gcloud`) logged in to a project with TPU quota. The job runs on
worker 0 of a single-host slice (v4-8, v5litepod-8, …).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from typing import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REMOTE_DIR = 'speclm'
REMOTE_OUTPUT = 'speclm_output'
ARCHIVE = 'speclm_checkout.tar.gz'


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
  if args.command:
    job = args.command
  else:
    # The job runs in ~/speclm, so ../speclm_output is ~/speclm_output.
    job = display(['python3', '-m', 'speclm.run',
                   *[f'--gin_file={f}' for f in args.gin_file], *gin_args,
                   f"--gin.OUTPUT_DIR='../{REMOTE_OUTPUT}'"])
  run = f'cd {REMOTE_DIR} && {job}'
  ssh = lambda command: tpu + ['ssh', args.name, *where, '--worker=0', f'--command={command}']
  return {
      'create': [create],
      'copy code': [tpu + ['scp', archive, f'{args.name}:~/{ARCHIVE}', *where, '--worker=0']],
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
