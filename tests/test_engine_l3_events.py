"""engine_patches.l3_events against SGLang's real HiCache controller, storage and publisher.

What runs for real: SGLang's ``HiCacheController._page_backup`` / ``_storage_hit_query``
(on a controller built without its GPU pools), SGLang's ``HiCacheFile`` L3 backend on a
temp dir, SGLang's page-hash chain, SGLang's ``ZmqEventPublisher`` from its own factory,
and a ZMQ SUB socket decoding with kvgate's wire module. What stands in: the host KV pool
(it needs a GPU device pool), replaced by a zero tensor per page handed to the backend.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import zmq

from engine_patches import l3_events
from tests.sglang_cpu import child_pythonpath, require
from tests.support import ROOT, child_env
from wire.hashing import page_hashes
from wire.kv_events import BlockRemoved, BlockStored, decode_batch, unpack_seq

PAGE = 2


def test_refuses_releases_outside_the_tested_range(caplog):
    caplog.set_level(logging.WARNING, "kvgate.engine_patches")
    for version in ((0, 5, 5), (0, 6, 0)):
        assert l3_events.install(version=version) is False
    assert "outside the tested range 0.5.7..0.5.23" in caplog.text


@pytest.fixture(scope="module")
def sgl():
    cc = require("sglang.srt.managers.cache_controller")
    kv = require("sglang.srt.disaggregation.kv_events")
    storage = require("sglang.srt.mem_cache.hicache_storage")
    torch = require("torch")
    assert l3_events.install() is True
    return cc, kv, storage, torch


@pytest.fixture(scope="module")
def subscriber(sgl):
    _, kv, _, _ = sgl
    # ZMQ picks the port at bind time ("*"), so no other process can take it first.
    config = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "bind": True, "topic": "kv"}
    publisher = kv.EventPublisherFactory.create(json.dumps(config), 0)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.describe_local_source(PAGE)["endpoint"])
    # The subscription joins a moment after connect: empty batches until one arrives, then drained.
    for _ in range(50):
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[]))
        if sub.poll(200):
            break
    else:
        raise AssertionError("the SUB socket never received the publisher's batches")
    while sub.poll(300):
        assert decode_batch(sub.recv_multipart()[2]).events == []
    yield sub
    sub.close(linger=0)
    publisher.shutdown()


def receive(sub: zmq.Socket, timeout_ms: int = 5000) -> list:
    assert sub.poll(timeout_ms), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv" and unpack_seq(seq) >= 0
    return decode_batch(payload).events


@pytest.fixture()
def controller(sgl, tmp_path):
    cc, _, storage, torch = sgl
    config = storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="test-model")
    backend = storage.HiCacheFile(config, file_path=str(tmp_path))
    ctl = object.__new__(cc.HiCacheController)  # the real class, minus its GPU pools
    ctl.page_size = PAGE
    ctl.storage_backend = backend
    ctl.page_set_func = lambda keys, host_indices, extra_info=None: backend.batch_set(
        keys, [torch.zeros(4) for _ in keys])
    return ctl


def backup(sgl, ctl, tokens: list[int]) -> list[str]:
    cc, _, _, torch = sgl
    keys = require("sglang.srt.mem_cache.utils").get_hash_str(tokens, None, page_size=PAGE)
    op = cc.StorageOperation(torch.arange(len(tokens)), tokens, hash_value=keys)
    ctl._page_backup(op)
    assert op.completed_tokens == len(tokens)
    return keys


def test_patch_wraps_the_real_methods_once(sgl):
    cc, kv, _, _ = sgl
    assert l3_events.install() is True  # idempotent
    for name in ("_page_backup", "_storage_hit_query"):
        wrapped = getattr(cc.HiCacheController, name)
        assert hasattr(wrapped, "__kvgate_orig__")
        assert not hasattr(wrapped.__kvgate_orig__, "__kvgate_orig__")
    assert hasattr(kv.EventPublisherFactory.create, "__kvgate_orig__")


def test_backup_to_storage_publishes_external_block_stored(sgl, controller, subscriber):
    tokens = [1, 2, 3, 4, 5, 6]
    keys = backup(sgl, controller, tokens)
    (event,) = receive(subscriber)
    assert isinstance(event, BlockStored) and event.medium == "EXTERNAL"
    # The same hashes the GPU tier's events carry, so the gateway's index joins them.
    assert event.block_hashes == page_hashes(tokens, PAGE)
    assert event.block_hashes[:2] == [3817746824117602890, -4216701448867210342]
    assert event.block_hashes == [require("sglang.srt.mem_cache.utils").hash_str_to_int64(k) for k in keys]
    assert event.parent_block_hash is None and event.token_ids == tokens and event.block_size == PAGE


def test_prefetch_query_retracts_evicted_pages_and_credits_foreign_ones(sgl, controller, subscriber, tmp_path):
    cc, _, _, torch = sgl
    tokens = [11, 12, 13, 14, 15, 16]
    keys = backup(sgl, controller, tokens)
    receive(subscriber)
    # The master evicts the middle page: the later one can no longer serve a prefix either.
    (evicted,) = [f for f in os.listdir(tmp_path) if f.startswith(keys[1])]
    os.remove(tmp_path / evicted)
    hits, _ = controller._storage_hit_query(cc.PrefetchOperation("r1", tokens + [17]))
    assert hits == keys[:1]
    (removed,) = receive(subscriber)
    assert isinstance(removed, BlockRemoved) and removed.medium == "EXTERNAL"
    assert removed.block_hashes == page_hashes(tokens, PAGE)[1:]

    # Pages another engine wrote to the shared pool: this engine learns of them on a hit.
    foreign = [21, 22, 23, 24]
    foreign_keys = require("sglang.srt.mem_cache.utils").get_hash_str(foreign, None, page_size=PAGE)
    controller.storage_backend.batch_set(foreign_keys, [torch.zeros(4) for _ in foreign_keys])
    hits, _ = controller._storage_hit_query(cc.PrefetchOperation("r2", foreign))
    assert hits == foreign_keys
    (stored,) = receive(subscriber)
    assert isinstance(stored, BlockStored) and stored.medium == "EXTERNAL"
    assert stored.block_hashes == page_hashes(foreign, PAGE) and stored.token_ids == foreign
    # Asking again announces nothing new: no batch at all.
    controller._storage_hit_query(cc.PrefetchOperation("r3", foreign))
    assert not subscriber.poll(300)


def test_pip_installed_kvgate_is_loaded_by_sglangs_plugin_loader(tmp_path):
    """SGLang 0.5.2x calls load_plugins() in every server process: an installed kvgate
    must patch there without the run_server wrapper."""
    require("sglang.srt.plugins")
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(ROOT)],
        capture_output=True, text=True, timeout=180)
    assert build.returncode == 0, build.stderr[-3000:]
    probe = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
             "import engine_patches; "
             "from sglang.srt.managers.cache_controller import HiCacheController as H; "
             "print('installed-from', engine_patches.__file__); "
             "print('patched', hasattr(H._page_backup, '__kvgate_orig__'))")
    env = child_env(PYTHONPATH=child_pythonpath(site).replace(str(ROOT) + os.pathsep, ""))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"installed-from {site}" in out.stdout and "patched True" in out.stdout


def test_spawned_sglang_children_reimport_the_wrapper_and_are_patched():
    """SGLang starts schedulers with multiprocessing's spawn; a child re-imports the parent's
    ``-m`` module as ``__mp_main__`` (multiprocessing.spawn._fixup_main_from_name). Doing
    exactly that must patch the child and must not start a second server."""
    require("sglang.srt.managers.cache_controller")
    probe = ("import multiprocessing.spawn as spawn, sys; "
             "spawn._fixup_main_from_name('engine_patches.run_server'); "
             "from sglang.srt.managers.cache_controller import HiCacheController as H; "
             "print('main', sys.modules['__main__'].__name__); "
             "print('patched', hasattr(H._page_backup, '__kvgate_orig__'))")
    env = child_env(PYTHONPATH=child_pythonpath(ROOT))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=180, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "main __mp_main__" in out.stdout and "patched True" in out.stdout
