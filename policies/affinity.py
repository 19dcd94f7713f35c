"""Affinity on the client's own keys: a conversation's next turn prefers the worker that
served its previous turn, even where the prefix index has forgotten it.

A client may name what its requests share: OpenAI's ``prompt_cache_key``, an
``X-Session-ID`` header or the ``user`` field (``RequestView.session_key``, read by
``gateway.request``). The index can lose track of where a key's last turn went (the
approximate tree's budget evicted it, the precise index's block budget or a missed event
dropped its pages, the prompt came as text where the index keys token ids). This table
remembers, per key, the worker that served the key's last request and enough of its prompt
to tell how much of the next one it shares; a cache-aware policy credits that worker with
the share it probably still holds where the index credits no worker with as much, then
decides by its own rule (``cache_aware``'s balance thresholds, ``cost``'s priced TTFT), so
load still wins where that worker is overloaded.

What the key's worker probably holds of a request, in the request's own units (token ids
where it has them, else characters):

* the prefix it shares with the key's last prompt, found by sampling: hashes of short
  chunks of the last prompt ending at 1/2, 3/4, 7/8 ... 63/64 of its length and at its end
  are compared with the request's chunks at the same places, and the last of an unbroken run
  of matches from the first is the shared prefix (within 1/64 of it). A key shared by
  unrelated prompts (a user's parallel conversations, one key for a whole application)
  shares no sampled chunk past their common head, and is credited that little. Where the
  whole last prompt recurs, the last turn's output counts too: the engine cached it after
  the prompt, and a chat's next turn repeats it;
* times what survives the worker's KV churn since that turn ended: an LRU cache of ``K``
  tokens keeps what was used within its last ``K`` tokens of new KV, part of which the
  running requests hold, so the credit is whole until ``K / 2`` tokens of new KV (prompt
  tokens not cached plus output, as the engines report them on completion) and falls to
  nothing at ``K``. Where no capacity is known (no ``max_total_num_tokens`` in the
  worker's server_info or load report), it falls with age over ``ttl_s`` instead.

A precise index fed by the engines' KV events hears of their evictions: its answer stands
unless it has itself let go of pages since the key's last turn (its block budget, a
cleared worker; ``forgetting``), since the estimate above would only second-guess the
engines' own word. The approximate tree, and the precise index's text fallback, hear of
none, and are credited whenever they know less.

A key is forgotten ``ttl_s`` after its last turn, the least recently used past
``max_entries``, and with its worker. Requests without a key cost one attribute read.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from index.block_index import BlockIndex
from index.fallback import PreciseOrApprox
from index.prefix import IndexMatch, PrefixIndex, Tiers
from index.tree_budget import DEFAULT_UNITS_PER_TOKEN, worker_capacity
from index.views import Outcome, RequestView, WorkerView, urls_of
from wire.options import on_off, opt

CHUNK = 16  # units hashed per sample: enough that unrelated prompts never agree by chance
SAMPLES = 6  # samples before the end: at 1/2, 3/4, ... (2^n - 1)/2^n of the prompt


def _clock() -> float:
    return time.monotonic()  # looked up at each call, so a test's clock replaces it


@dataclass
class AffinityOptions:
    """Affinity on the client's keys (``policies.affinity``), for every cache-aware policy."""

    affinity: bool = opt(True, "prefer a key's last worker (prompt_cache_key, X-Session-ID, user) where the index "
                         "knows less", parse=on_off)
    affinity_entries: int = opt(65_536, "keys remembered; the least recently used are forgotten")
    affinity_ttl_s: float = opt(3600.0, "a key's last worker is forgotten this long after its last turn")


def make_affinity(options: AffinityOptions) -> AffinityTable | None:
    """The table the options ask for, or None (affinity off)."""
    if not options.affinity:
        return None
    return AffinityTable(options.affinity_entries, options.affinity_ttl_s)


def forgetting(index: PrefixIndex, request: RequestView | None = None) -> int | None:
    """How often ``index`` has let go of pages the engines may still hold (``BlockIndex.forgotten``),
    where its answer for ``request`` is the engines' own word; None where that answer is a
    guess (the approximate tree, the text fallback). Without a request: the precise count,
    the mark a routed turn keeps."""
    if isinstance(index, PreciseOrApprox):
        return index.forgotten_for(request)
    if isinstance(index, BlockIndex) and (request is None or index.usable(request)):
        return index.forgotten
    return None


@lru_cache(maxsize=4096)
def ends(units: int) -> tuple[int, ...]:
    """Where a prompt of ``units`` is sampled: chunk ends at (2^n - 1)/2^n of it, then at its
    end, ascending, none shorter than a chunk (a short prompt: its end alone). Kept per
    length: a key's turn is sampled where it was recorded, and conversations repeat lengths."""
    out = sorted({units - (units >> n) for n in range(1, SAMPLES + 1)} | {units})
    return tuple(e for e in out if e >= CHUNK) or (units,)


def _sample(prompt: Sequence[int] | str, end: int) -> int:
    """32 bits of the chunk's hash: a chance agreement (2^-32 a sample) costs one hint."""
    chunk = prompt[max(end - CHUNK, 0):end]
    return hash(chunk if type(chunk) is str else tuple(chunk)) & 0xFFFFFFFF


class Turn:
    """A key's last request: where it went and what of its prompt is sampled."""

    __slots__ = ("rid", "url", "when", "tokens", "units", "samples", "held", "churn", "forgotten")

    def __init__(self, rid: str, url: str, when: float, tokens: bool, units: int, samples: array,
                 churn: float, forgotten: int | None) -> None:
        self.rid, self.url, self.when = rid, url, when
        self.tokens = tokens  # units are token ids, else characters
        self.units = units  # the prompt's length
        self.samples = samples  # ``_sample`` of the chunks ending at ``ends(units)`` (array("I"): ~90
        # bytes where a tuple of ints took ~340)
        self.held = float(units)  # what the worker holds after it: the prompt, then its output too
        self.churn = churn  # the worker's KV churn counter when the turn last touched its KV
        self.forgotten = forgotten  # the precise index's ``forgotten`` when it was routed (None: none)


def _prompt(request: RequestView) -> tuple[Sequence[int] | str | None, bool]:
    """The request's prompt in the units it is sampled in, and whether they are token ids."""
    if request.token_ids is not None:
        return request.token_ids, True
    return request.text, False


def _key(request: RequestView) -> str | None:
    """The table's key: the client's, apart per cache salt (salted KV is not shared)."""
    key = request.session_key
    if not key or request.cache_salt is None:
        return key
    return f"{key}\0{request.cache_salt}"


class AffinityTable:
    """Key -> the key's last ``Turn``, least recently used first; and each worker's KV churn."""

    def __init__(self, max_entries: int = 65_536, ttl_s: float = 3600.0) -> None:
        self.max_entries = max(1, int(max_entries))
        self.ttl_s = float(ttl_s)
        self._turns: OrderedDict[str, Turn] = OrderedDict()
        self._churn: dict[str, float] = {}  # url -> tokens of new KV written there, ever
        self.seen = False  # a request with a key arrived (stats are reported from then on)
        self.credited = 0  # decisions that credited a key's worker
        self.kept = 0  # keyed requests routed to the key's last worker
        self.moved = 0  # keyed requests routed elsewhere

    def __len__(self) -> int:
        return len(self._turns)

    # -- learning ----------------------------------------------------------------------
    def routed(self, request: RequestView, worker: WorkerView, forgotten: int | None = None) -> None:
        """``request`` went to ``worker`` (here or by a peer): its key's last turn is this one.
        ``forgotten``: the policy's precise index's count (``forgetting``). A PD decode leg
        says nothing of where the prefill's prefix is cached."""
        key = _key(request)
        if key is None or worker.role == "decode":
            return
        self.seen = True
        prompt, tokens = _prompt(request)
        if prompt is None:
            return
        url = worker.url
        last = self._turns.get(key)
        if last is not None and last.rid != request.request_id:
            if last.url == url:
                self.kept += 1
            else:
                self.moved += 1
        units = len(prompt)
        samples = array("I", [_sample(prompt, e) for e in ends(units)])
        self._turns[key] = Turn(request.request_id, url, _clock(), tokens, units, samples,
                                self._churn.get(url, 0.0), forgotten)
        self._turns.move_to_end(key)
        while len(self._turns) > self.max_entries:
            self._turns.popitem(last=False)

    def completed(self, request: RequestView, worker: WorkerView, outcome: Outcome) -> None:
        """Every request's completion counts in its worker's churn; a key's last turn that
        succeeded now holds its output too, from now; one that failed is forgotten."""
        url = worker.url
        if outcome.prompt_tokens is not None:
            new = outcome.prompt_tokens - (outcome.cached_tokens or 0) + (outcome.completion_tokens or 0)
        else:
            new = request.prompt_tokens_estimate
        churn = self._churn[url] = self._churn.get(url, 0.0) + max(new, 0)
        key = _key(request)
        turn = self._turns.get(key) if key is not None else None
        if turn is None or turn.rid != request.request_id or turn.url != url:
            return
        if not outcome.ok:
            del self._turns[key]  # type: ignore[arg-type]
            return
        output = float(outcome.completion_tokens or 0)
        if not turn.tokens:  # characters: the output at the prompt's characters per token
            per = turn.units / outcome.prompt_tokens if outcome.prompt_tokens else DEFAULT_UNITS_PER_TOKEN
            output *= per
        turn.held = turn.units + output
        turn.when, turn.churn = _clock(), churn

    def worker_removed(self, url: str) -> None:
        """A worker that comes back under the same url starts cold: its keys are forgotten."""
        self._churn.pop(url, None)
        for key in [k for k, t in self._turns.items() if t.url == url]:
            del self._turns[key]

    # -- crediting ---------------------------------------------------------------------
    def held(self, request: RequestView, worker: WorkerView, turn: Turn) -> float:
        """How many of ``request``'s units ``worker`` (the turn's) probably holds."""
        prompt, tokens = _prompt(request)
        if prompt is None or tokens != turn.tokens:
            return 0.0
        units = len(prompt)
        shared = 0
        for end, sample in zip(ends(turn.units), turn.samples):
            if end > units or _sample(prompt, end) != sample:
                break
            shared = end
        if not shared:
            return 0.0
        held = turn.held if shared == turn.units else float(shared)
        capacity = worker_capacity(worker)
        if capacity:
            left = 2.0 * (1.0 - (self._churn.get(turn.url, 0.0) - turn.churn) / capacity)
        else:
            left = 1.0 - (_clock() - turn.when) / self.ttl_s if self.ttl_s > 0 else 1.0
        return min(held, float(units)) * min(max(left, 0.0), 1.0)

    def credit(self, request: RequestView, workers: Sequence[WorkerView], match: IndexMatch,
               forgotten: int | None = None) -> IndexMatch:
        """``match``, or a copy where the key's last worker is credited with what it probably
        holds, when that is more than the index credits any worker with (``match`` itself is
        never changed). ``forgotten``: ``forgetting`` for this match; while it is what it was
        when the key's last turn was routed, the engines' word stands."""
        key = _key(request)
        turn = self._turns.get(key) if key is not None else None
        if turn is None or turn.rid == request.request_id:  # none, or this request's own (a retry)
            return match
        if forgotten is not None and forgotten == turn.forgotten:
            return match
        if self.ttl_s > 0 and _clock() - turn.when > self.ttl_s:
            del self._turns[key]  # type: ignore[arg-type]
            return match
        try:
            at = urls_of(workers).index(turn.url)
        except ValueError:  # its worker is not a candidate
            return match
        held = self.held(request, workers[at], turn)
        if held <= 0.0:
            return match
        prompt, tokens = _prompt(request)
        query_len, unit = match.query_len, match.unit
        if not query_len:  # the index could not key it: the request's own units
            query_len, unit = len(prompt), ("tokens" if tokens else "chars")  # type: ignore[arg-type]
        credit = round(held * query_len / len(prompt))  # type: ignore[arg-type]
        best = max(match.everyone.total, max((t.total for t in match.hits.values()), default=0))
        if credit <= best:
            return match
        hits = dict(match.hits)
        known = match.get(turn.url)
        hits[turn.url] = Tiers(known.gpu + credit - known.total, known.host, known.pool)
        self.credited += 1
        return IndexMatch(query_len, unit, hits, match.everyone)

    def stats(self) -> Mapping[str, float]:
        """Nothing until a request carried a key: a fleet whose clients send none sees the
        policy's stats as they were."""
        if not self.seen:
            return {}
        return {"affinity_keys": float(len(self._turns)), "affinity_credited_total": float(self.credited),
                "affinity_kept_total": float(self.kept), "affinity_moved_total": float(self.moved)}
