"""Worker masks of the precise index's pages, and the bit tricks that read them in C.

A page's mask is one int with three bits per worker slot: bit ``3*slot`` while the worker
holds the block on GPU, ``3*slot+1`` on GPU or host, ``3*slot+2`` in any tier including the
pool. ANDed along a prompt's path, the positions where bits drop give every worker's prefix
per tier. The hot loops of ``BlockIndex.match`` live here; they are tuned (shared int
objects, ``list.count`` over slices, bisection) and should only be changed with a benchmark.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate, repeat, takewhile
from operator import and_, or_

from index.page_trie import Path, Run


TIER_OF_MEDIUM = {"GPU": 0, "CPU_PINNED": 1, "CPU": 1, "DISK": 2, "EXTERNAL": 2}
# Raw tier bits of one slot (1 GPU, 2 host, 4 pool) -> its "at most this slow" bits.
_CUMULATIVE = [0, 7, 6, 7, 4, 7, 6, 7]


def medium_tier(medium: str | None) -> int:
    """0 GPU, 1 host, 2 pool or disk; SGLang's spelling first, then any case."""
    if not medium:
        return 0
    tier = TIER_OF_MEDIUM.get(medium)
    return TIER_OF_MEDIUM.get(medium.upper(), 0) if tier is None else tier


_BITS: dict[int, tuple[int, ...]] = {}


def _bit_indexes(mask: int) -> tuple[int, ...]:
    """The set bits of ``mask``, lowest first. Kept for the last few thousand masks: a
    fleet's masks repeat (a conversation's pages share one, and matches AND the same
    candidates with it), and finding the bits again in Python took ~1 us of every match."""
    bits = _BITS.get(mask)
    if bits is None:
        found, rest = [], mask
        while rest:
            low = rest & -rest
            found.append(low.bit_length() - 1)
            rest ^= low
        if len(_BITS) >= 4096:
            _BITS.clear()
        bits = _BITS[mask] = tuple(found)
    return bits


def _set_mask(run: Run, i: int, mask: int) -> None:
    """Store a page's mask, sharing the int object of an equal neighbour: a run of one mask
    is then one object repeated, which ``list.count`` checks by identity (big ints compared
    by value cost ~20 ns each, ~5 us for a 250-page run on every match)."""
    masks = run.masks
    if i and masks[i - 1] == mask:
        mask = masks[i - 1]
    elif i + 1 < len(masks) and masks[i + 1] == mask:
        mask = masks[i + 1]
    masks[i] = mask
    if i < run.flat:
        run.flat = i


def _name(run: Run, i: int, h: int) -> None:
    """One more block hash names page ``i`` (usually the only one)."""
    names = run.names[i]
    if names is None:
        run.names[i] = h
    elif type(names) is list:
        names.append(h)
    else:
        run.names[i] = [names, h]


def _combine(values: list[int], a: int, b: int, op, bits: int) -> None:
    """``values[a:b] = op(value, bits)`` for each, in C; values that were all equal end as
    one shared object (see ``_set_mask``)."""
    if a >= b:
        return
    if values[a:b].count(values[a]) == b - a:
        values[a:b] = repeat(op(values[a], bits), b - a)
    else:
        values[a:b] = map(op, values[a:b], repeat(bits))


def _head(values: list[int], n: int) -> list[int]:
    return values if n == len(values) else values[:n]


def _drops(acc: list[int], base: int, pages: dict[int, int]) -> None:
    """``acc`` is a running AND (``acc[0]`` before the first page): for every bit it loses,
    record how many pages kept it (plus ``base``), bisecting for the few changes."""
    stack = [(0, len(acc) - 1)]
    while stack:
        lo, hi = stack.pop()
        if acc[lo] == acc[hi]:
            continue
        if hi - lo == 1:
            if base + lo:  # bits no page kept are misses: not recorded
                for b in _bit_indexes(acc[lo] & ~acc[hi]):
                    pages[b] = base + lo
            continue
        mid = (lo + hi) // 2
        stack.append((lo, mid))
        stack.append((mid, hi))


def _held_pages(masks: Iterable[int], wanted: int) -> dict[int, int]:
    """Bit index -> number of leading pages whose mask has that bit, page by page. The
    running AND stops at the first page no candidate holds."""
    acc = list(takewhile(bool, accumulate(masks, and_, initial=wanted)))
    pages: dict[int, int] = {}
    if len(acc) > 1:
        _drops(acc, 0, pages)
        for b in _bit_indexes(acc[-1]):
            pages[b] = len(acc) - 1
    return pages


def _path_masks(run: Run, n: int) -> list[int]:
    """The first ``n`` pages' masks with their speculative bits."""
    masks = _head(run.masks, n)
    return masks if run.spec is None else list(map(or_, masks, run.spec))


def _leading(values: list[int], known: int, n: int) -> int:
    """Where the stretch of ``values[:n]`` equal to ``values[0]`` ends, given that the first
    ``known`` are: the usual run carries one mask, so one count over the rest tells."""
    if known >= n:
        return n
    rest = values if not known and n == len(values) else values[known:n]
    return n if rest.count(values[0]) == n - known else _stretch(values, 0, n, max(known, 1))


def _stretch(values: list[int], a: int, n: int, lo: int = 0) -> int:
    """Where the stretch of ``values[a:n]`` equal to ``values[a]`` ends, given that it goes
    at least to ``lo``, found with ``count`` over slices in C, growing then halved: the cost
    follows the stretch's length, not the run's. Pages stored or evicted together share one
    mask object (``_set_mask``), which ``count`` checks by identity."""
    v = values[a]
    lo, step, hi = max(lo, a + 1), 16, n
    while lo < n:
        hi = min(lo + step, n)
        if values[lo:hi].count(v) != hi - lo:
            break
        lo, step = hi, step * 4
    else:
        return n
    while hi - lo > 1:  # values[a:lo] equal v; one of values[lo:hi] does not
        mid = (lo + hi) >> 1
        if values[lo:mid].count(v) == mid - lo:
            lo = mid
        else:
            hi = mid
    return lo


def _held_on_path(path: Path, wanted: int) -> tuple[dict[int, int], int]:
    """``_held_pages`` over a trie path, one AND per stretch of pages that share one mask (a
    conversation's pages are stored and evicted together, so a run is one stretch or a few),
    and the floor: the leading pages every candidate holds on GPU, where the first bit drops.
    Bits that drop there are left out of ``pages`` (their count is the floor), so a prefix
    every worker holds (a system prompt on the whole fleet) costs one number instead of an
    entry per worker and tier (~190 bits at 64 workers, ~40 us of a match in Python).

    How far a run's first stretch goes is kept on the run (``flat``, ``spec_flat``) from one
    match to the next, so a long run is counted once, not on every match. A run cut into
    short stretches (holes, one-page speculative entries) is read page by page instead, in
    C: past 4 stretches averaging under 32 pages, a stretch costs more in Python than its
    pages do. At page size 1 a 4,000-page run with speculative bits on its tail was read
    page by page before, ~340 us."""
    pages: dict[int, int] = {}
    if not wanted:
        return pages, 0
    acc, pos, floor = wanted, 0, -1  # (-1: no bit has dropped yet)
    for run, n in path:
        masks, spec = run.masks, run.spec
        mask_end = _leading(masks, run.flat, n)
        if mask_end > run.flat:
            run.flat = mask_end
        spec_end = n
        if spec is not None:
            spec_end = _leading(spec, run.spec_flat, n)
            if spec_end > run.spec_flat:
                run.spec_flat = spec_end
        a = stretches = 0
        while a < n:
            if stretches > 4 and a < 32 * stretches:  # short stretches: the rest page by page
                rest = masks[a:n] if spec is None else list(map(or_, masks[a:n], spec[a:n]))
                acc, floor = _fold_pages(rest, acc, pos + a, floor, pages)
                break
            if mask_end <= a:
                mask_end = _stretch(masks, a, n)
            mask = masks[a]
            if spec is None:
                end = mask_end
            else:
                if spec_end <= a:
                    spec_end = _stretch(spec, a, n)
                mask |= spec[a]
                end = mask_end if mask_end < spec_end else spec_end
            new = acc & mask
            if new != acc:
                if floor < 0:
                    floor = pos + a
                else:  # (past the floor, so past the first page)
                    for b in _bit_indexes(acc & ~new):
                        pages[b] = pos + a
                acc = new
                if not acc:
                    break
            a, stretches = end, stretches + 1
        if not acc:
            return pages, floor
        pos += n
    if floor < 0:  # every candidate holds the whole path
        return pages, pos
    for b in _bit_indexes(acc):
        pages[b] = pos
    return pages, floor


def _fold_pages(masks: list[int], acc: int, at: int, floor: int, pages: dict[int, int]) -> tuple[int, int]:
    """The running AND through ``masks`` (pages ``at`` on), page by page in C, recording
    the bits that drop as ``_held_on_path`` does; returns (the AND, 0 where it ran out, and
    the floor)."""
    running = list(takewhile(bool, accumulate(masks, and_, initial=acc)))
    if floor >= 0:
        _drops(running, at, pages)
    elif running[-1] != acc:  # the first drop is here: after the leading equal ANDs
        f = running.count(acc) - 1
        floor = at + f
        _drops(running[f + 1:], floor + 1, pages)
    if len(running) > len(masks):
        return running[-1], floor
    stop = at + len(running) - 1  # some page held by no candidate: the rest stop here
    if floor < 0:
        floor = stop
    elif stop:  # (bits no page kept are misses: not recorded)
        for b in _bit_indexes(running[-1]):
            pages[b] = stop
    return 0, floor


def _pooled_on_path(path: Path) -> int:
    """Leading pages of the path that the shared pool holds."""
    pooled = 0
    for run, n in path:
        flags = run.pooled
        if flags is None:
            break
        gap = flags.find(0, 0, n)
        if gap >= 0:
            return pooled + gap
        pooled += n
    return pooled
