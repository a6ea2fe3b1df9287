"""Which attention implementation a program runs: one table keyed by ``(platform, cache kind)``,
the only place that choice is made, and what follows from it (the engine's attention spans, its
paged layout, the name the preflight reports).

* platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` (``platform_name`` folds ``"cuda"`` and ``"rocm"``
  into ``"gpu"``), the platform the program is compiled for (``target_platform``).
* cache kind (``CACHE_KINDS``): ``"none"`` (a whole sequence, no cache: training, scoring),
  ``"dense"`` (``qwen2.KVCache`` rows), ``"paged"`` (``qwen2.PagedKVCache``, keys and values in
  pages of their own), ``"paged_interleaved"`` (the pages in ``ragged_paged_attention``'s layout).

That is all a kernel needs to know: every implementation takes prefill chunks, decode tokens and
the engine's mixed ragged batch alike (queries at per-row slots). ``"*"`` as a platform matches
any. ``choose`` takes the exact platform's entry before ``"*"``'s. A kernel joins with one
``register`` line (the built-in entries are at the end of ``implementations``). The choice is
made once per call of the model, when its ``cache.LayerCache`` is built.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

CACHE_KINDS = ("none", "dense", "paged", "paged_interleaved")
ANY = "*"


def platform_name(name: str) -> str:
  """A device's or backend's platform as the table names it: ``"cuda"`` and ``"rocm"`` (what
  some plugins and topology descriptions report) are ``"gpu"``."""
  name = name.lower()
  return "gpu" if name in ("gpu", "cuda", "rocm") else name


def target_platform(mesh=None) -> str:
  """The platform a program runs on: that of ``mesh``'s devices, else of the mesh set by
  ``jax.set_mesh`` (abstract devices included), else the default backend. A deviceless compile
  for a TPU or GPU topology from a CPU process names its target here, not ``"cpu"``."""
  if mesh is not None:
    return platform_name(mesh.devices.flat[0].platform)
  device = jax.sharding.get_abstract_mesh().abstract_device
  return platform_name(jax.default_backend() if device is None else device.platform)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One attention implementation: ``fn(q, keys) -> out`` with ``q [n, T, K, G, hd]`` and ``keys``
  a ``keys.KeyView`` (what one device reads), out ``[n, T, K, G, hd]``.
  ``reads_whole_span``: its cost follows the attention span it is handed, not the furthest query
  (``Addressing.bounded`` changes nothing), so a caller that can (the engine) should hand it the
  shortest span that holds every row."""
  name: str
  fn: Callable[[Any, Any], Any]
  reads_whole_span: bool = False


_TABLE: dict[tuple[str, str], Implementation] = {}


def _key(platform: str, cache: str) -> tuple[str, str]:
  if cache not in CACHE_KINDS:
    raise ValueError(f"unknown cache kind {cache!r}; known: {CACHE_KINDS}")
  return (platform if platform == ANY else platform_name(platform), cache)


def register(platform: str, cache: str, impl: Implementation) -> None:
  """Makes ``impl`` the implementation for ``(platform, cache)`` (``platform`` may be ``"*"``);
  a later registration of the same key replaces the earlier one."""
  _TABLE[_key(platform, cache)] = impl


def unregister(platform: str, cache: str) -> None:
  """Removes the entry ``register`` made for exactly this key (a no-op where there is none)."""
  _TABLE.pop(_key(platform, cache), None)


def choose(platform: str, cache: str) -> Implementation:
  """The implementation registered for ``(platform, cache)``, the most specific entry."""
  platform, cache = _key(platform, cache)
  for key in ((platform, cache), (ANY, cache)):
    if key in _TABLE:
      return _TABLE[key]
  raise ValueError(f"no attention implementation for platform {platform!r}, cache {cache!r}; "
                   f"registered: {sorted(_TABLE)}")


def entries() -> dict[tuple[str, str], str]:
  """The table: each key and the name of its implementation."""
  return {key: impl.name for key, impl in sorted(_TABLE.items())}


def interleaved(pages_v) -> bool:
  """Whether a paged cache is in ``ragged_paged_attention``'s layout: keys and values interleaved
  over the head axis of one ``[L, P, page, 2K, hd]`` array (``pages_k``: head 2k the keys of KV
  head k, 2k + 1 its values), ``pages_v`` an empty ``[L, P, page, 0, hd]`` placeholder. Such
  pages may hold values rather than raw bits (``qwen2.PagedKVCache.init(interleaved=True)``)."""
  return pages_v.shape[-2] == 0


def cache_kind(cache) -> str:
  """The table's cache kind of a model cache (``qwen2.KVCache`` or ``PagedKVCache``, arrays or
  shapes): paged caches have a page ``table``."""
  if getattr(cache, "table", None) is None:
    return "dense"
  return "paged_interleaved" if interleaved(cache.v) else "paged"


def interleave_pages(mesh=None) -> bool:
  """Whether a paged cache for ``mesh`` should be kept interleaved (``qwen2.PagedKVCache.init(
  interleaved=)``): where the table reads that layout with an implementation of its own (TPU:
  ``ragged_paged_attention``); elsewhere split pages read the same way."""
  platform = target_platform(mesh)
  return choose(platform, "paged_interleaved") is not choose(platform, "paged")


def attention_spans(max_len: int, mesh=None, paged: bool = False) -> list[int]:
  """The attention spans (``qwen2.Options.attend_len``) an engine over rows of ``max_len`` slots
  on ``mesh`` compiles a program for. One, the whole row, where the implementation reads key
  blocks up to the call's furthest token only (one span serves every length); where it reads the
  whole span it is handed (cuDNN), three prefixes of the rows, so a step attends to the shortest
  one that holds every row and short episodes do not pay for the longest one the cache allows."""
  cache = ("paged_interleaved" if interleave_pages(mesh) else "paged") if paged else "dense"
  whole = choose(target_platform(mesh), cache).reads_whole_span
  return sorted({max(max_len >> k, 1) for k in range(3 if whole else 1)})


def describe(mesh, cache) -> str:
  """The implementation an engine's attention over ``cache`` (a model cache, as ``cache_kind``)
  runs on ``mesh``, by name; for an unpaged cache where a paged one would run another, how to
  get that one."""
  platform, kind = target_platform(mesh), cache_kind(cache)
  name = choose(platform, kind).name
  paged = choose(platform, "paged_interleaved" if interleave_pages(mesh) else "paged").name
  if kind == "dense" and paged != name:
    return f"{name} (unpaged cache; rollout.page_size for {paged})"
  return name
