"""ES training: config validation, checkpointing, metrics, the trainer loop and the CPU demo.

``from jaxes.train import load_policy`` is the public way to read a run's policy; it is loaded on
first use so that importing a light submodule (config, metrics) does not pull in the model.
"""


def __getattr__(name):
  if name == "load_policy":
    from jaxes.train.policy import load_policy
    return load_policy
  raise AttributeError(f"module 'jaxes.train' has no attribute {name!r}")


__all__ = ["load_policy"]
