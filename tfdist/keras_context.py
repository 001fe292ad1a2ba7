"""Keras's call state that a layer's call depends on, kept and entered
again: sharded_params runs a layer a second time in the backward, after
the model's call has returned. Keras keeps the call context (the
`training` an outer layer's call set, which inner layers inherit) and
the autocast scope (mixed precision) in private state, and a
StatelessScope's assignments in an undocumented attribute; this module
is the one place that reads them (tests/test_private_apis.py pins
them)."""

import contextlib
import copy

from keras.src import backend
from keras.src.backend.common import global_state

_CALL_CONTEXT = "current_call_ctx"


class KerasCallState:
  def __init__(self, call_context, autocast):
    self.call_context, self.autocast = call_context, autocast


def capture():
  """The call context and autocast scope in force now. The context is
  copied: Keras sets `training` on the one object as later layers are
  called with their own."""
  context = global_state.get_global_attribute(_CALL_CONTEXT)
  return KerasCallState(copy.copy(context), backend.get_autocast_scope())


@contextlib.contextmanager
def entered(state):
  """`state` in force again (and what was in force after), without an
  autocast scope when the state had none."""
  previous = global_state.get_global_attribute(_CALL_CONTEXT)
  global_state.set_global_attribute(_CALL_CONTEXT,
                                    copy.copy(state.call_context))
  try:
    with backend.AutocastScope(state.autocast.dtype if state.autocast
                               else None):
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


def assigned_count(scope):
  """How many variables `scope` maps or has assignments for (Keras keeps
  both in `state_mapping`, one entry per variable)."""
  return len(scope.state_mapping)
