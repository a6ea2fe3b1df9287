"""A grid's surface: every combination of a few config keys' values, each cell a named variant.

``--surface="delay_fraction=0.1,0.5 delay_updates=4,8"`` is 4 cells, each the *base* variant
(Async-1 by default: the paper's delays sit on top of natural asynchrony) with the cell's values
as overrides. Any config key may be an axis: a dotted key (``controller.delay_fraction``,
``es.sigma``) as written, or a bare leaf name that exactly one section of the config has
(``delay_fraction`` -> ``controller.delay_fraction``). A cell's name is its values,
``delay_fraction=0.1+delay_updates=8`` (bare leaf names), so its run directories
(``<cell>-s<seed>``) are found again by a rerun (resume) or ``--aggregate-only`` given the same
spec. ``;`` joins products into one surface, for a subset that is not a product:
``"delay_fraction=0.1 delay_updates=4,16; delay_fraction=1.0 delay_updates=4"`` is 3 cells.
"""
from __future__ import annotations

import dataclasses
import itertools

from jaxes.experiments.variants import GridError, Variant

SEPARATOR = "+"   # between a cell name's axes (',' separates variants, '-s' the seed)


@dataclasses.dataclass(frozen=True)
class Axis:
  key: str              # the dotted config key
  values: tuple[str, ...]   # as written: passed on as --config.KEY=VALUE

  @property
  def label(self) -> str:
    return self.key.rsplit(".", 1)[-1]


def parse(spec: str) -> list[tuple[str, tuple[str, ...]]]:
  """``"a=1,2 b.c=x,y"`` -> ``[("a", ("1", "2")), ("b.c", ("x", "y"))]``; one line on bad input."""
  axes = []
  for part in spec.split():
    key, eq, values = part.partition("=")
    items = tuple(v.strip() for v in values.split(",") if v.strip())
    if not eq or not key or not items:
      raise GridError(f"--surface: {part!r}: write each axis as KEY=V1,V2,...")
    if len(set(items)) != len(items):
      raise GridError(f"--surface: {key}: values repeat ({values})")
    if any(SEPARATOR in v or "/" in v for v in items):
      raise GridError(f"--surface: {key}: a value may not contain {SEPARATOR!r} or '/'")
    if key in (k for k, _ in axes):
      raise GridError(f"--surface: {key} is named twice")
    axes.append((key, items))
  if not axes:
    raise GridError("--surface: empty; e.g. --surface='delay_fraction=0.1,0.5 delay_updates=4,8'")
  return axes


def resolve_key(key: str, config) -> str:
  """The dotted key of ``key`` in ``config`` (a ConfigDict): as written when dotted, else the
  one section holding a leaf of that name."""
  if "." in key:
    node = config
    for part in key.split("."):
      if not hasattr(node, "keys") or part not in node:
        raise GridError(f"--surface: {key}: unknown key")
      node = node[part]
    return key
  if key in config and not hasattr(config[key], "keys"):
    return key
  found = [f"{s}.{key}" for s in config if hasattr(config[s], "keys") and key in config[s]]
  if len(found) != 1:
    raise GridError(f"--surface: {key}: " + ("unknown key" if not found else
                    f"ambiguous ({', '.join(found)}); write the dotted key"))
  return found[0]


def axes_of(spec: str, config) -> list[Axis]:
  return [Axis(resolve_key(k, config), v) for k, v in parse(spec)]


def cells_of(spec: str, config) -> list[dict[str, str]]:
  """Every cell of ``spec``: the products between its ``;`` in order, each cell once."""
  out = []
  for block in spec.split(";"):   # "" is one empty block: axes_of says so
    for cell in cells(axes_of(block, config)):
      if cell in out:
        raise GridError(f"--surface: the cell {cell_name(cell)} is named twice")
      out.append(cell)
  return out


def cell_name(values: dict[str, str]) -> str:
  return SEPARATOR.join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in values.items())


def cells(axes: list[Axis]) -> list[dict[str, str]]:
  """Every combination, the first axis slowest: {dotted key: value as written}."""
  return [dict(zip((a.key for a in axes), combo)) for combo in itertools.product(*(a.values for a in axes))]


def variants(cells_: list[dict[str, str]], base: Variant) -> list[Variant]:
  """One variant per cell: ``base``'s config and overrides, then the cell's values."""
  if not base.available:
    raise GridError(f"--surface_base={base.name}: {base.unavailable}")
  return [dataclasses.replace(base, name=cell_name(c), overrides={**base.overrides, **c}) for c in cells_]


def cell_values(name: str) -> dict[str, str]:
  """A cell name back to {leaf label: value}; {} for a name that is not a cell's."""
  out = {}
  for part in name.split(SEPARATOR):
    label, eq, value = part.partition("=")
    if not eq:
      return {}
    out[label] = value
  return out
