"""The host-side pool of a paged KV cache's pages, per data shard.

A paged cache (``Engine(page_size=, num_pages=)``) holds ``num_pages`` pages of ``page_size``
tokens, split evenly over the mesh's ``data`` shards with the slots: shard d's slots take pages
from shard d's pool only, and a page id is shard-local (``0 ... num_pages / D - 1``), as the
compacted rows' indices are (``attention.Rows``). ``take`` never hands out more pages than are
free (it takes all it was asked for or none), ``give`` takes back only pages that are out, so
``free + in use == pages per shard`` always holds.
"""
from __future__ import annotations


def pages_for(tokens: int, page_size: int) -> int:
  """Pages that hold ``tokens`` tokens."""
  return -(-int(tokens) // int(page_size))


class PagePool:
  def __init__(self, shards: int, pages_per_shard: int):
    if shards < 1 or pages_per_shard < 1:
      raise ValueError(f"a page pool needs shards >= 1 and pages_per_shard >= 1, got "
                       f"shards={shards}, pages_per_shard={pages_per_shard}")
    self.shards, self.pages_per_shard = int(shards), int(pages_per_shard)
    # Lowest ids last, so pop() hands them out first (a fresh pool fills pages 0, 1, ...).
    self._free = [list(range(pages_per_shard - 1, -1, -1)) for _ in range(shards)]
    self._out = [set() for _ in range(shards)]

  def free(self, shard: int) -> int:
    return len(self._free[shard])

  def in_use(self, shard: int | None = None) -> int:
    """Pages handed out, in ``shard`` or in all shards."""
    if shard is None:
      return sum(len(out) for out in self._out)
    return len(self._out[shard])

  def take(self, shard: int, n: int) -> list[int] | None:
    """``n`` free pages of ``shard``, or None (nothing taken) when fewer are free."""
    if n < 0:
      raise ValueError(f"cannot take {n} pages")
    free = self._free[shard]
    if n > len(free):
      return None
    pages = [free.pop() for _ in range(n)]
    self._out[shard].update(pages)
    return pages

  def give(self, shard: int, pages) -> None:
    """Return pages taken from ``shard``; a page that is not out is an error (a double free)."""
    pages = list(pages)
    out = self._out[shard]
    stray = [p for p in pages if p not in out] + [p for i, p in enumerate(pages) if p in pages[:i]]
    if stray:
      raise ValueError(f"pages {sorted(set(stray))} of shard {shard} were not taken (or returned twice)")
    out.difference_update(pages)
    self._free[shard].extend(sorted(pages, reverse=True))
