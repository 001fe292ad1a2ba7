"""The frozen, validated run configuration, derived from tfdist.options.

Config has one keyword-only field per option, with the option's default.
No TensorFlow import here.
"""

import dataclasses
import re
import types

from tfdist import metric_direction
from tfdist import options as options_lib
from tfdist.errors import ConfigError


_CACHE_CHOICES = ("auto", "memory", "off")


def _is_cache_choice(value):
  """auto, memory, off, or a path prefix: a / in it, so that a typo such
  as `none` does not become a cache file in the current directory."""
  return value in _CACHE_CHOICES or (
      "/" in value and not value.endswith("/"))


def class_weights(text):
  """{class: weight} of --class_weight ("CLASS:WEIGHT,..."); {} if empty."""
  weights = {}
  for item in filter(None, text.replace(" ", "").split(",")):
    label, _, weight = item.partition(":")
    try:
      label, weight = int(label), float(weight)
    except ValueError:
      label = None
    if label is None or label < 0 or label > 1_000_000 or label in weights \
        or not 0 <= weight < float("inf"):
      raise ConfigError(
          f"--class_weight must be CLASS:WEIGHT pairs, each class once, an "
          f"integer from 0 to 1000000, each weight finite and >= 0. "
          f"Received: class_weight={text!r}")
    weights[label] = weight
  return weights


def _validate(config):
  if not config.model_dir:
    raise ConfigError("--model_dir is required.")
  for option in options_lib.OPTIONS:
    value = getattr(config, option.name)
    if option.kind == "ints" and value is not None:
      object.__setattr__(config, option.name, tuple(value))
    message = option.check(value)
    if message:
      raise ConfigError(message)
  if not _is_cache_choice(config.cache):
    raise ConfigError("--cache takes auto, memory, off or a path prefix "
                      "(with a / in it, such as /tmp/cache or ./cache). "
                      f"Received: cache={config.cache!r}")
  if config.profile_steps is not None:
    if len(config.profile_steps) != 2 or not (
        config.profile_steps[0] < config.profile_steps[1]):
      raise ConfigError(
          "profile_steps must be START,END with 0 <= START < END. Received: "
          f"profile_steps={','.join(map(str, config.profile_steps))}")
  if config.checkpoint and config.mode != "eval":
    raise ConfigError(f"--checkpoint is read by --mode=eval only. Received: "
                      f"checkpoint={config.checkpoint!r} with "
                      f"mode={config.mode}")
  if config.init_checkpoint_skip:
    if not config.init_checkpoint:
      raise ConfigError("--init_checkpoint_skip needs --init_checkpoint. "
                        f"Received: init_checkpoint_skip="
                        f"{config.init_checkpoint_skip!r} with no "
                        "init_checkpoint")
    try:
      re.compile(config.init_checkpoint_skip)
    except re.error as e:
      raise ConfigError(f"--init_checkpoint_skip is not a regular "
                        f"expression ({e}). Received: init_checkpoint_skip="
                        f"{config.init_checkpoint_skip!r}") from None
  class_weights(config.class_weight)
  if not config.ema_decay < 1:
    raise ConfigError(f"--ema_decay must be below 1 (0: off). Received: "
                      f"ema_decay={config.ema_decay:g}")
  if config.early_stopping_patience and not config.best_metric:
    raise ConfigError(f"--early_stopping_patience needs --best_metric (the "
                      f"metric it watches). Received: early_stopping_"
                      f"patience={config.early_stopping_patience} with no "
                      "best_metric")
  if config.best_metric:
    metric_direction.resolve_mode(config.best_metric, config.best_mode)
  if (config.allreduce_compression == "powersgd"
      and config.mixed_precision == "mixed_float16"):
    raise ConfigError("--allreduce_compression=powersgd keeps error buffers "
                      "of the gradients, and one loss-scale overflow would "
                      "put Inf into them for good; use mixed_bfloat16 or no "
                      "mixed precision. Received: allreduce_compression="
                      "powersgd with mixed_precision=mixed_float16")
  _check_sharding(config)
  if config.clip_norm and config.mixed_precision == "mixed_float16":
    raise ConfigError("--clip_norm would clip loss-scaled float16 "
                      "gradients; use mixed_bfloat16 or no clipping. "
                      f"Received: clip_norm={config.clip_norm:g} with "
                      "mixed_precision=mixed_float16")


def shard_stage(config):
  """What is sharded: none, optimizer, gradients or params
  (--shard_optimizer is --shard=optimizer)."""
  return "optimizer" if config.shard_optimizer else config.shard


def shard_flag(config):
  """The flag as the user gave it, for messages."""
  return ("--shard_optimizer" if config.shard_optimizer
          else f"--shard={config.shard}")


def _check_sharding(config):
  stage = shard_stage(config)
  if not config.reshard_after_forward and stage != "params":
    raise ConfigError("--noreshard_after_forward keeps gathered weights, "
                      "which only --shard=params gathers. Received: "
                      f"reshard_after_forward=False with shard={stage}")
  if stage == "none":
    return
  if config.shard_optimizer and config.shard not in ("none", "optimizer"):
    raise ConfigError("--shard_optimizer is --shard=optimizer; give one of "
                      "them. Received: shard_optimizer=True with "
                      f"shard={config.shard}")
  refused = {"ema_decay": config.ema_decay,
             "mixed_precision": config.mixed_precision == "mixed_float16"
             and "mixed_float16",
             "allreduce_compression": config.allreduce_compression
             != "none" and config.allreduce_compression,
             "allreduce_dtype": config.allreduce_dtype != "float32"
             and config.allreduce_dtype,
             "jit_compile": config.jit_compile,
             "model_parallel": config.model_parallel != "none"
             and config.model_parallel}
  also = ""
  if stage == "params":
    # Each is a path the unit-by-unit gather does not take yet.
    refused.update({
        "mixed_precision": config.mixed_precision != "none"
        and config.mixed_precision,
        "grad_accum_steps": config.grad_accum_steps > 1
        and config.grad_accum_steps,
        "sync_batchnorm": config.sync_batchnorm,
        "init_checkpoint": config.init_checkpoint})
    also = (", and with --shard=params not with mixed precision, "
            "--grad_accum_steps, --sync_batchnorm or --init_checkpoint")
  given = {k: v for k, v in refused.items() if v}
  if given:
    raise ConfigError(
        f"{shard_flag(config)} updates flat float32 shards of the weights "
        "and sends them itself; it does not work with --ema_decay, "
        "mixed_float16's loss scaling, a compressed or cast all-reduce, "
        f"--jit_compile or --model_parallel yet{also}. Received: "
        + ", ".join(f"{k}={v}" for k, v in given.items()))


def _to_dict(self):
  return dataclasses.asdict(self)


def _section(self, name):
  """The options of one section, as a read-only namespace."""
  if name not in options_lib.SECTIONS:
    raise ValueError(f"Unrecognized section: {name!r}")
  return types.MappingProxyType({
      o.name: getattr(self, o.name) for o in options_lib.OPTIONS
      if o.section == name})


Config = dataclasses.make_dataclass(
    "Config",
    [(o.name, object, dataclasses.field(default=o.default))
     for o in options_lib.OPTIONS],
    frozen=True, kw_only=True,
    namespace={"__post_init__": _validate, "to_dict": _to_dict,
               "section": _section,
               "__doc__": "Everything a run needs; see tfdist.options.",
               "__module__": __name__})
