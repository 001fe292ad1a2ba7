"""A digits classifier with no kink: tanh, not ReLU. Runs that must end
with one device's weights use it, since under ReLU a rounding difference
(replicas summing in another order, another CPU's vector units) can flip
a unit's sign and grow from there: 3 replicas of the zoo's MLP moved 38
times the tolerance from one device over 250 steps."""

import keras


def mlp_tanh():
  return keras.Sequential([
      keras.Input((8, 8, 1)),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation="tanh"),
      keras.layers.Dense(10, dtype="float32"),
  ], name="mlp_tanh")
