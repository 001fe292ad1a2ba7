"""Keras's call state that a layer's call depends on, kept and entered
again: sharded_params runs a layer a second time in the backward, after
the model's call has returned. Keras keeps the call context (the
`training` an outer layer's call set, which inner layers inherit) and
the autocast scope (mixed precision) in private state; this module is
the one place that reads it (tests/test_private_apis.py pins it)."""

import contextlib

from keras.src import backend
from keras.src.backend.common import global_state

_CALL_CONTEXT = "current_call_ctx"


class KerasCallState:
  def __init__(self, call_context, autocast):
    self.call_context, self.autocast = call_context, autocast


def capture():
  """The call context and autocast scope in force now."""
  return KerasCallState(global_state.get_global_attribute(_CALL_CONTEXT),
                        backend.get_autocast_scope())


@contextlib.contextmanager
def entered(state):
  """`state` in force again (and what was in force after)."""
  previous = global_state.get_global_attribute(_CALL_CONTEXT)
  global_state.set_global_attribute(_CALL_CONTEXT, state.call_context)
  try:
    with (backend.AutocastScope(state.autocast.dtype) if state.autocast
          else contextlib.nullcontext()):
      yield
  finally:
    global_state.set_global_attribute(_CALL_CONTEXT, previous)


def no_autocast():
  """Variables read at their own dtype."""
  return backend.AutocastScope(None)


def stateless(mapping):
  """A keras.StatelessScope over `mapping` that keeps the losses added
  in it (so that they can be refused, not lost)."""
  import keras  # pylint: disable=g-import-not-at-top
  return keras.StatelessScope(state_mapping=mapping, collect_losses=True)
