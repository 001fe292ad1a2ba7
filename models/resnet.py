"""CIFAR-style ResNets (He et al. 2016, section 4.2): depth = 6n + 2."""

import keras


def _conv_bn(x, filters, strides, name, relu=True):
  x = keras.layers.Conv2D(filters, 3, strides=strides, padding="same",
                          use_bias=False, name=f"{name}_conv")(x)
  x = keras.layers.BatchNormalization(name=f"{name}_bn")(x)
  return keras.layers.ReLU(name=f"{name}_relu")(x) if relu else x


def _block(x, filters, strides, name):
  shortcut = x
  y = _conv_bn(x, filters, strides, f"{name}_a")
  y = _conv_bn(y, filters, 1, f"{name}_b", relu=False)
  if strides != 1 or x.shape[-1] != filters:
    shortcut = keras.layers.Conv2D(filters, 1, strides=strides,
                                   use_bias=False, name=f"{name}_proj")(x)
  return keras.layers.ReLU(name=f"{name}_out")(
      keras.layers.Add(name=f"{name}_add")([shortcut, y]))


def _resnet(depth, *, input_shape, num_classes):
  blocks_per_stage = (depth - 2) // 6
  inputs = keras.Input(input_shape, name="images")
  x = _conv_bn(inputs, 16, 1, "stem")
  for stage, filters in enumerate((16, 32, 64)):
    for block in range(blocks_per_stage):
      strides = 2 if stage > 0 and block == 0 else 1
      x = _block(x, filters, strides, f"stage{stage}_block{block}")
  x = keras.layers.GlobalAveragePooling2D()(x)
  logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
  return keras.Model(inputs, logits, name=f"resnet{depth}")


def resnet20(*, input_shape, num_classes):
  return _resnet(20, input_shape=input_shape, num_classes=num_classes)


def resnet56(*, input_shape, num_classes):
  return _resnet(56, input_shape=input_shape, num_classes=num_classes)
