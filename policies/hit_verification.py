"""Check the index's predictions against what the engine says it actually reused.

A cache-aware policy is only as good as its guess of ``cached_tokens``. When the guess is
systematically wrong (the gateway's chat template or tokenizer differs from the engine's,
the hash scheme changed, the engines run with a much smaller cache than the index assumes)
routing for "cache hits" that never happen only concentrates load. So every completed
request's prediction is compared with ``Outcome.cached_tokens``; when the share of predicted
hits that did not materialise stays above ``degrade_above`` over a window, the policy
falls back to load-aware routing until it drops below ``recover_below`` (hysteresis, so it
does not flap).

The defaults (0.85 / 0.6) are set for mismatches, which lose nearly every predicted hit.
Engines under memory pressure also evict some predicted prefixes between routing and
prefill (on the Mooncake trace with 4 simulated workers, 30-70% of predicted tokens, even
with the precise index); that is not a reason to stop routing for the hits that remain. Predictions keep being made and checked while degraded, which is what
lets it recover.

The opposite error is quieter: when the gateway's token ids differ from the engine's (a
tokenizer or chat template that is not the model's), the precise index never matches what
the engines report, and the engines reuse prefixes the index never predicted. Routing then
only loses hits, so nothing degrades, but the share of the engines' cached tokens that were
not predicted (stat ``hit_unpredicted_ratio``) is logged as a warning when it stays above
``warn_unpredicted_above``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass

from index.views import Outcome
from wire.options import opt

log = logging.getLogger("kvgate.policies.hit_verification")


@dataclass
class VerifierOptions:
    """Hit verification, for every cache-aware policy."""

    drift_window: int = opt(128, "completed requests the drift is measured over")
    drift_min_samples: int = opt(32, "samples before the verifier may degrade routing")
    drift_degrade_above: float = opt(0.85, "degrade to load-aware routing above this drift")
    drift_recover_below: float = opt(0.6, "recover below this drift")


def make_verifier(name: str, options: VerifierOptions) -> HitVerifier:
    return HitVerifier(window=options.drift_window, min_samples=options.drift_min_samples,
                       degrade_above=options.drift_degrade_above, recover_below=options.drift_recover_below,
                       name=name)


class HitVerifier:
    def __init__(self, window: int = 128, min_samples: int = 32, degrade_above: float = 0.85,
                 recover_below: float = 0.6, max_pending: int = 100_000, name: str = "policy",
                 warn_unpredicted_above: float = 0.5) -> None:
        self.window = int(window)
        self.min_samples = int(min_samples)
        self.degrade_above = float(degrade_above)
        self.recover_below = float(recover_below)
        self.max_pending = int(max_pending)
        self.name = name
        self._pending: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.window)
        self._over = 0  # running sums over the window
        self._pred = 0
        self._under = 0
        self._actual = 0
        self.warn_unpredicted_above = float(warn_unpredicted_above)
        self._warned_unpredicted = False
        self.predicted_total = 0
        self.actual_total = 0
        self.samples = 0
        self.degraded = False
        self.degradations = 0

    def expect(self, request_id: str, fraction: float, tokens: int) -> None:
        """Remember the prediction made at routing: the cached share of the prompt (scaled by
        the engine's own prompt_tokens later, so text-length estimates do not count as
        drift) and the token estimate used when the engine does not report prompt_tokens."""
        self._pending[request_id] = (fraction, tokens)
        if len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def complete(self, request_id: str, outcome: Outcome) -> None:
        got = self._pending.pop(request_id, None)
        if got is None or not outcome.ok or outcome.cached_tokens is None:
            return
        fraction, tokens = got
        predicted = round(fraction * outcome.prompt_tokens) if outcome.prompt_tokens else tokens
        self.observe(predicted, outcome.cached_tokens)

    def observe(self, predicted: int, actual: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            p, a = self._recent[0]
            self._pred -= p
            self._over -= max(p - a, 0)
            self._actual -= a
            self._under -= max(a - p, 0)
        self._recent.append((predicted, actual))
        self._pred += predicted
        self._over += max(predicted - actual, 0)
        self._actual += actual
        self._under += max(actual - predicted, 0)
        self.predicted_total += predicted
        self.actual_total += actual
        self.samples += 1
        self._update()

    @property
    def drift(self) -> float:
        """Share of predicted cached tokens (over the window) the engine did not reuse."""
        return self._over / self._pred if self._pred else 0.0

    @property
    def unpredicted(self) -> float:
        """Share of the engine's cached tokens (over the window) the index did not predict."""
        return self._under / self._actual if self._actual else 0.0

    def _update(self) -> None:
        if len(self._recent) < self.min_samples:
            return
        missed = self.unpredicted
        if not self._warned_unpredicted and missed > self.warn_unpredicted_above:
            self._warned_unpredicted = True
            log.warning(
                "%s: the engines reused %d cached tokens over the last %d requests, %.0f%% of them beyond what "
                "the index predicted. If the gateway tokenizes for a precise index, its tokenizer or chat template "
                "likely differs from the engines' (see --tokenizer, --chat-template).", self.name, self._actual,
                len(self._recent), 100 * missed)
        elif self._warned_unpredicted and missed < self.warn_unpredicted_above / 2:
            self._warned_unpredicted = False
        drift = self.drift
        if not self.degraded and drift > self.degrade_above:
            self.degraded = True
            self.degradations += 1
            log.warning(
                "%s: %.0f%% of the predicted cache hits over the last %d requests did not happen "
                "(engine cached %d of %d predicted tokens); routing by load until predictions "
                "recover. Likely a chat-template/tokenizer/hash mismatch or engine caches smaller "
                "than the index assumes.", self.name, 100 * drift, len(self._recent),
                sum(a for _, a in self._recent), self._pred)
        elif self.degraded and drift < self.recover_below:
            self.degraded = False
            log.warning("%s: cache predictions agree with the engine again (drift %.0f%%); "
                        "cache-aware routing resumed", self.name, 100 * drift)

    def stats(self) -> Mapping[str, float]:
        return {
            "hit_predicted_tokens_total": float(self.predicted_total),
            "hit_actual_tokens_total": float(self.actual_total),
            "hit_verified_requests_total": float(self.samples),
            "hit_drift_ratio": self.drift,
            "hit_unpredicted_ratio": self.unpredicted,
            "hit_degraded": float(self.degraded),
            "hit_degradations_total": float(self.degradations),
        }
