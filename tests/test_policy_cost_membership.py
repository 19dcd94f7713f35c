"""Worker lists with a membership token (``index.views.Workers``): the caches that follow a
worker list by its urls answer the same whether they are handed tokens or plain lists, and
the gateway's registry gives a list of the same workers in the same order the same token."""

from __future__ import annotations

import json

from gateway.config import GatewayConfig, WorkerSpec
from gateway.workers import Worker, WorkerRegistry
from index.views import SameUrls, WorkerView, Workers, new_membership, urls_of
from policies.base import EngineLoad
from policies.fleet_backlog import FleetBacklog, Pricing
from tests import test_policy_cost_golden as golden


def _views(*ports: int) -> list[WorkerView]:
    return [WorkerView(f"http://127.0.0.1:{p}") for p in ports]


def test_a_token_seen_last_is_the_same_urls_and_any_other_is_compared():
    views = _views(1, 2, 3)
    token = new_membership()
    same = SameUrls()
    assert same.changed(Workers(views, token)) and same.urls == [v.url for v in views]
    replaced = Workers([views[0], views[1].with_in_flight(4), views[2]], token)
    assert not same.changed(replaced)  # known by its token
    assert not same.changed(Workers(replaced, new_membership()))  # a new token: the urls are compared
    assert same.changed(Workers(replaced[::-1], new_membership()))  # another order
    assert same.changed(replaced[:2])  # a slice is a plain list, compared by its urls
    assert not same.changed(list(replaced[:2]))
    assert same.changed(Workers(views, token))  # the token of other urls than the last: compared
    assert urls_of(Workers(views[:1], new_membership())) == [views[0].url]
    assert urls_of(replaced) == [v.url for v in views]


def test_a_token_comes_from_new_membership():
    try:
        Workers(_views(1), 0)
    except ValueError:
        pass
    else:
        raise AssertionError("a token of 0 was accepted")
    assert type(Workers(_views(1), new_membership())[:]) is list


def test_backlog_rows_found_by_token_read_the_views_they_were_given():
    """A fleet found by its token takes the views it is handed: a replaced report there is
    read (the rows are those of the current views)."""
    rows = FleetBacklog(Pricing(1 / 5_000, 0.0002, "max", True), {}, lambda: 100.0)
    token = new_membership()
    views = [WorkerView(f"http://127.0.0.1:{p}", load=EngineLoad(waiting=0, max_tokens=1000)) for p in (1, 2)]
    fleet = rows.fleet(Workers(views, token), 1.0)
    assert fleet.wait == [0.0, 0.0]
    views[1] = views[1].reported(load=EngineLoad(waiting=5, max_tokens=1000))
    other = rows.fleet(Workers(views[::-1], new_membership()), 2.0)  # another list between
    assert other is not fleet and other.wait == [0.1, 0.0]
    again = rows.fleet(Workers(views, token), 3.0)
    assert again is fleet and fleet.wait == [0.0, 0.1] and rows._fleets[0] is fleet


def test_the_registry_gives_the_same_workers_the_same_token():
    registry = WorkerRegistry(GatewayConfig(), None)  # type: ignore[arg-type]  (no probes here)
    a, b, c = (Worker(WorkerSpec(f"http://127.0.0.1:{p}"), registry.cfg) for p in (1, 2, 3))
    first = registry.views([a, b, c])
    assert type(first) is Workers and first == [a.view, b.view, c.view]
    a.started()  # the view replaced, the worker the same
    again = registry.views([a, b, c])
    assert again.membership == first.membership and again[0] is a.view
    assert registry.views([a, c]).membership != first.membership
    assert registry.views([c, b, a]).membership != first.membership
    back = Worker(WorkerSpec(a.url), registry.cfg)  # removed and added again: another object
    assert registry.views([back, b, c]).membership != first.membership


def test_golden_decisions_with_worker_lists_as_the_registry_hands_them(monkeypatch):
    """The golden fixture's decisions again, each given its workers as ``Workers`` with a
    token per url order, as the gateway's registry gives them: the same decisions, floats
    included."""
    tokens: dict[tuple[str, ...], int] = {}

    def given(views):
        return Workers(views, tokens.setdefault(tuple(v.url for v in views), new_membership()))

    plain_decide = golden.Script.decide

    def decide(self, request):
        plain = self.workers, self.decodes
        self.workers = given(self.workers)
        self.decodes = None if self.decodes is None else given(self.decodes)
        try:
            return plain_decide(self, request)
        finally:
            self.workers, self.decodes = plain

    monkeypatch.setattr(golden.Script, "decide", decide)
    got = json.loads(json.dumps(golden.scenarios(monkeypatch)))
    want = json.loads(golden.FIXTURE.read_text())
    assert got == want
