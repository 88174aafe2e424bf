"""Gin errors found from public information (bindings, registered configurables, signatures).

speclm.run.gin_cli reads gin's state through one function (`_gin_state`); unknown names,
unbound `gin.REQUIRED` parameters and providers called without a required parameter are
worked out from the bindings the user wrote and the configurables' signatures, never from
gin's error text. These tests pin the messages each case gives.
"""

import gin
import pytest

from speclm import run
from speclm.run import gin_cli
from speclm.run import providers


@pytest.fixture(autouse=True)
def fresh_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _parse_error(*bindings, gin_files=('test_tiny.gin',)) -> str:
  with pytest.raises(run.JobError) as info:
    run.parse_gin(list(gin_files), ["OUTPUT_DIR = '/unused'", *bindings])
  return info.value.message


def test_unknown_parameter_of_a_class_is_named_with_its_binding():
  assert _parse_error('T5Config.emb_dimm = 8') == (
      "Unknown gin binding: T5Config has no parameter 'emb_dimm' (In bindings string line 2"
      ' T5Config.emb_dimm = 8). Check the spelling in the gin file or --gin flag.')


def test_unknown_configurable_in_a_file_names_the_file_and_line(tmp_path):
  path = tmp_path / 'typo.gin'
  path.write_text("include 'test_tiny.gin'\n\nsynthetic_datset.num_examples = 3\n")
  message = _parse_error(gin_files=(str(path),))
  assert message.startswith(
      "Unknown gin binding: nothing is registered under the name 'synthetic_datset' (In file"
      f' "{path}", line 3 synthetic_datset.num_examples = 3). Did you mean synthetic_dataset')
  assert message.endswith('? Check the spelling in the gin file or --gin flag.')


def test_an_unknown_reference_keeps_gins_own_message():
  message = _parse_error('DATASET = @no_such_provider')
  assert message.startswith("Could not parse the gin configuration: No configurable matching"
                            " reference '@no_such_provider'.")


def test_unbound_required_parameters_are_named_from_the_signature():
  run.parse_gin(['test_tiny.gin'], ["OUTPUT_DIR = '/unused'",
                                    'GAMMA = @gamma_for_temperature()',
                                    'gamma_for_temperature.at_0 = 3'])
  assert gin_cli.unbound_parameters([], 'gamma_for_temperature') == ['temperature', 'at_1']
  with pytest.raises(RuntimeError) as info:
    gin.get_configurable('gamma_for_temperature')()
  assert gin_cli.required_call_error(info.value) == (
      'Required settings not provided: gamma_for_temperature.temperature,'
      ' gamma_for_temperature.at_1. Set them in a gin file (e.g.'
      ' gamma_for_temperature.temperature = …) or on the command line:'
      ' --gin.gamma_for_temperature.temperature=… --gin.gamma_for_temperature.at_1=…'
      ' (strings in quotes: --gin.gamma_for_temperature.temperature="\'value\'").')
  assert gin_cli.required_call_error(RuntimeError('XLA ran out of memory')) is None


@pytest.mark.parametrize('dataset', ['@file_dataset', '@eval/file_dataset'])
def test_a_provider_without_its_required_parameter_says_which(dataset):
  run.parse_gin(['test_tiny.gin'], ["OUTPUT_DIR = '/unused'", f'DATASET = {dataset}',
                                    "eval/file_dataset.format = 'jsonl'"])
  reference = gin_cli.resolve_macros(gin.query_parameter('run_job.dataset'))
  assert reference.scopes == (['eval'] if 'eval' in dataset else [])
  provider = reference.scoped_configurable_fn
  assert gin_cli.reference_to(provider) is reference
  with pytest.raises(run.JobError) as info:
    providers.provide(provider, 'Reading the dataset')
  assert info.value.message == (
      'Reading the dataset: file_dataset.path is not set. Set it in a gin file'
      ' (file_dataset.path = …) or on the command line (--gin.file_dataset.path=…).')


def test_a_type_error_of_a_provider_that_gin_did_not_give_is_one_line_with_its_cause():
  # Not a missing setting (gin did not make the call): the bug is reported as one line naming
  # the step and the exception, and the TypeError itself is kept for --verbose.
  def broken():
    raise TypeError('a bug inside the provider')
  with pytest.raises(run.JobError) as error:
    providers.provide(broken, 'Reading the dataset')
  assert error.value.message.startswith(
      'Reading the dataset failed: TypeError: a bug inside the provider')
  assert isinstance(error.value.__cause__, TypeError)


def test_all_bindings_lists_what_was_parsed():
  run.parse_gin(['test_tiny.gin'], ["OUTPUT_DIR = '/tmp/x'"])
  bindings = gin_cli.all_bindings()
  assert bindings[('OUTPUT_DIR', 'gin.macro')] == {'value': '/tmp/x'}
  assert any(selector.endswith('run_job') and 'dataset' in params
             for (scope, selector), params in bindings.items() if not scope)
