"""Which attention implementation a program runs: one table keyed by ``(platform, cache kind,
phase)``, the only place that choice is made.

* platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` (``platform_name`` folds ``"cuda"`` and ``"rocm"``
  into ``"gpu"``), the platform the program is compiled for (``attention.target_platform``).
* cache kind (``CACHE_KINDS``): ``"none"`` (a whole sequence, no cache: training, scoring),
  ``"dense"`` (``qwen2.KVCache`` rows), ``"paged"`` (``qwen2.PagedKVCache``, keys and values in
  pages of their own), ``"paged_interleaved"`` (the pages in ``ragged_paged_attention``'s layout).
* phase (``PHASES``): ``"prefill"`` (several tokens per row, or a whole sequence), ``"decode"``
  (one token per row), ``"mixed"`` (the engine's ragged flat batch of prefill and decode tokens).

``"*"`` in an entry matches any value. ``choose`` takes the most specific entry: an exact
platform before ``"*"``, then an exact cache kind, then an exact phase. A kernel joins with one
``register`` line (the built-in entries are at the end of ``jaxes.models.attention``).

This module imports nothing but the standard library, so host-side code (``jaxes.measure``) can
name platforms without importing JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

CACHE_KINDS = ("none", "dense", "paged", "paged_interleaved")
PHASES = ("prefill", "decode", "mixed")
ANY = "*"


def platform_name(name: str) -> str:
  """A device's or backend's platform as the table names it: ``"cuda"`` and ``"rocm"`` (what
  some plugins and topology descriptions report) are ``"gpu"``."""
  name = name.lower()
  return "gpu" if name in ("gpu", "cuda", "rocm") else name


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One attention implementation: ``fn(q, keys) -> out`` with ``q [n, T, K, G, hd]`` and ``keys``
  an ``attention.KeyView`` (what one device reads), out ``[n, T, K, G, hd]``.
  ``reads_whole_span``: its cost follows the attention span it is handed, not the furthest query
  (``attention.KeyView.bounded`` changes nothing), so a caller that can (the engine) should hand
  it the shortest span that holds every row."""
  name: str
  fn: Callable[[Any, Any], Any]
  reads_whole_span: bool = False


_TABLE: dict[tuple[str, str, str], Implementation] = {}


def register(platform: str, cache: str, phase: str, impl: Implementation) -> None:
  """Makes ``impl`` the implementation for ``(platform, cache, phase)`` (each may be ``"*"``);
  a later registration of the same key replaces the earlier one."""
  if cache not in CACHE_KINDS + (ANY,):
    raise ValueError(f"unknown cache kind {cache!r}; known: {CACHE_KINDS}")
  if phase not in PHASES + (ANY,):
    raise ValueError(f"unknown attention phase {phase!r}; known: {PHASES}")
  _TABLE[(platform if platform == ANY else platform_name(platform), cache, phase)] = impl


def unregister(platform: str, cache: str, phase: str) -> None:
  """Removes the entry ``register`` made for exactly this key (a no-op where there is none)."""
  _TABLE.pop((platform if platform == ANY else platform_name(platform), cache, phase), None)


def choose(platform: str, cache: str, phase: str) -> Implementation:
  """The implementation registered for ``(platform, cache, phase)``, the most specific entry."""
  platform = platform_name(platform)
  for key in ((platform, cache, phase), (platform, cache, ANY), (ANY, cache, phase),
              (ANY, cache, ANY)):
    if key in _TABLE:
      return _TABLE[key]
  raise ValueError(f"no attention implementation for platform {platform!r}, cache {cache!r}, "
                   f"phase {phase!r}; registered: {sorted(_TABLE)}")


def entries() -> dict[tuple[str, str, str], str]:
  """The table: each key and the name of its implementation."""
  return {key: impl.name for key, impl in sorted(_TABLE.items())}
