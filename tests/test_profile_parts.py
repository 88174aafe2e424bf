"""speclm.analysis.profile_parts: a trace's operations grouped by the HLO op names."""

from speclm.analysis import profile_parts

_LOOP = 'jit(_speculative_loop)'


def _line(instruction: str, op_name: str | None, root: bool = False) -> str:
  """One instruction of an optimized HLO dump, with its op name in the metadata (or none)."""
  metadata = '' if op_name is None else f', metadata={{op_name="{_LOOP}/{op_name}"}}'
  return f'  {"ROOT " if root else ""}%{instruction} = f32[4]{{0}} fusion(%a){metadata}\n'


_HLO = ('HloModule jit__speculative_loop\n'
        + _line('fusion.1', 'while/body/LlamaModule/layers_3/mlp/up/dot_general')
        + _line('fusion.2', 'while/body/LlamaModule/layers_17/mlp/gate/dot_general')
        + _line('ffi_call.3', 'while/body/LlamaModule.logits/lm_head/lm_head._product')
        + _line('exp.4', 'LlamaModule/layers_0/attention/while/body/closed_call/exp')
        + _line('fusion.5', 'while/body/EagleModule/layers_0/attention/while/body/closed_call/exp')
        + _line('reduce.6', 'while/body/reduce_max', root=True)
        + _line('wrapped_reduce-window.7', None))


def _event(op, dur, module='jit__speculative_loop', ph='X'):
  return {'ph': ph, 'dur': dur, 'name': op, 'args': {'hlo_module': module, 'hlo_op': op}}


def test_parts_of_the_loop_body_from_the_op_names(tmp_path):
  (tmp_path / 'module_0042.jit__speculative_loop.cpu_after_optimizations.txt').write_text(_HLO)
  (tmp_path / 'module_0042.jit__speculative_loop.before_optimizations.txt').write_text(
      _HLO.replace('layers_3', 'layers_9'))  # not read: only the optimized program runs
  names = profile_parts.op_names(str(tmp_path))
  assert names[('jit__speculative_loop', 'fusion.1')].endswith('layers_3/mlp/up/dot_general')
  assert ('jit__speculative_loop', 'wrapped_reduce-window.7') not in names
  events = [_event('fusion.1', 10.0), _event('fusion.2', 5.0), _event('ffi_call.3', 7.0),
            _event('exp.4', 100.0),  # the prefill's tiled attention: outside the body
            _event('fusion.5', 2.0), _event('reduce.6', 1.0), _event('reduce.6', 1.5),
            _event('wrapped_reduce-window.7', 0.5),
            _event('fusion.1', 50.0, module='jit_other'),  # another program
            _event('fusion.1', 50.0, ph='i')]  # not a complete event
  total, count = profile_parts.part_times(events, names, depth=3)
  assert dict(total) == {'LlamaModule/layers_*/mlp': 15.0,
                         'LlamaModule.logits/lm_head/lm_head._product': 7.0,
                         'EagleModule/layers_*/attention': 2.0, '(loop) reduce_max': 2.5,
                         profile_parts.UNNAMED: 0.5}
  assert count['LlamaModule/layers_*/mlp'] == 2 and count['(loop) reduce_max'] == 2
  shallow, _ = profile_parts.part_times(events, names, depth=1)
  assert shallow['LlamaModule'] == 15.0 and shallow['EagleModule'] == 2.0


def test_an_operation_counts_its_own_time_not_that_of_the_operations_inside_it(tmp_path):
  """A `while` inside the loop body (a draft's γ steps) has an event spanning its body's
  events: it counts only the time none of them covers, so nothing is counted twice."""
  hlo = ('HloModule jit__speculative_loop\n'
         + _line('while.8', 'while/body/while')
         + _line('fusion.9', 'while/body/EagleModule/layers_0/mlp/dot_general')
         + _line('fusion.1', 'while/body/LlamaModule/layers_3/mlp/up/dot_general'))
  (tmp_path / 'module_0001.jit__speculative_loop.cpu_after_optimizations.txt').write_text(hlo)
  names = profile_parts.op_names(str(tmp_path))

  def timed(op, ts, dur, tid=1):
    return dict(_event(op, dur), ts=ts, tid=tid, pid=7)

  events = [timed('while.8', 100.0, 50.0),
            timed('fusion.9', 105.0, 20.0), timed('fusion.9', 130.0, 15.0),  # its body's steps
            timed('fusion.1', 110.0, 30.0, tid=2),  # another thread at the same time
            timed('fusion.1', 160.0, 10.0)]  # after the while, on its thread
  total, _ = profile_parts.part_times(events, names, depth=2)
  assert dict(total) == {'(loop) while': 15.0, 'EagleModule/layers_*': 35.0,
                         'LlamaModule/layers_*': 40.0}


def test_part_of_an_op_name():
  body = 'jit(_autoregressive_loop)/while/body/'
  assert profile_parts.part_of(body + 'LlamaModule/layers_29/attention/ffi_call', 2) == (
      'LlamaModule/layers_*')
  assert profile_parts.part_of(body + 'jit(_where)/select_n', 3) == '(loop) select_n'
  assert profile_parts.part_of('jit(_autoregressive_loop)/while/body', 3) is None
  assert profile_parts.part_of(body.rstrip('/'), 3) is None
  assert profile_parts.part_of(body + 'while/body/closed_call', 3) == '(loop) while'
  assert profile_parts.part_of('jit(_autoregressive_loop)/LlamaModule/layers_0/mlp', 3) is None
