"""The input plan a run keeps in tfdist_run.json: what places a resumed
stream besides the step, so that a resume on another plan says so."""


def input_plan(dataset, global_batch_size, seed, shuffle_buffer):
  """What places a resumed stream besides the step: where the examples
  trained so far are is step x global batch, in the seed's order."""
  return {"global_batch_size": global_batch_size, "seed": seed,
          "train_examples": dataset.num_train_examples,
          "train_files": dataset.num_train_files,
          "shuffle_buffer": shuffle_buffer}


def describe_plan_change(previous, plan, step):
  """A warning's text when a resume at `step` reads another plan than the
  run that saved: the epoch in progress may then repeat and skip
  examples. None when the plans agree (or one is unknown); a key the
  saved plan lacks (an older run's) is not a change."""
  if not previous or not plan:
    return None
  changed = [f"{k} {previous[k]} -> {v}" for k, v in plan.items()
             if k in previous and previous[k] != v]
  if not changed:
    return None
  batch = ""
  if "global_batch_size" in previous and (
      previous["global_batch_size"] != plan.get("global_batch_size")):
    batch = (f" The stream starts at step x the new batch, example "
             f"{step * plan['global_batch_size']}, where {step} steps of "
             f"{previous['global_batch_size']} trained on "
             f"{step * previous['global_batch_size']}.")
  return (f"The input plan changed on resume at step {step}: "
          f"{', '.join(changed)}.{batch} The epoch in progress is read "
          "from the new plan, so some of its examples may be trained twice "
          "and others not at all; the epochs after it are exact.")
