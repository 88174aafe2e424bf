"""`python -m speclm.run`: the gin job's command line (`speclm.run.cli`)."""

from speclm.run import cli

if __name__ == '__main__':
  cli.run_main()
