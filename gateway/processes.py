"""``kvgate serve --processes N``: N gateway processes, each with its own event loop, on one port.

One event loop saturates one core; a group of processes serves more. The supervisor here
serves no request: it starts the members, replaces one that dies, rolls a reload through
them on SIGHUP and drains them all on SIGTERM/SIGINT (docs/processes.md).

Members are started as ``python -m gateway.processes CONFIG.json``, not through
``multiprocessing``: each is a fresh interpreter (no state forked from the supervisor, no
uvloop in a forked child), plainly visible in ``ps``, whose exit status is the gateway's own
(2 for a configuration error, as a lone gateway gives), and the inherited socket and ready
pipe are plain ``pass_fds``. The configuration the supervisor resolved (flags, YAML, the
workers ``kvgate up`` started) travels as a JSON file in the group's private run directory;
a reload writes a new one, so a member that is replaced later starts from the newest.

Listening (``gateway.listeners``): by default the supervisor binds one ``SO_REUSEPORT``
socket per slot, which the member of that slot inherits and a reload hands on to its
replacement, so the kernel spreads connections evenly and no queued connection is lost
when a member retires.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from gateway import group, log_setup
from gateway.nats_server import EmbeddedNats
from gateway.config import GatewayConfig
from gateway.listeners import Listeners

log = logging.getLogger("kvgate.processes")

READY_TIMEOUT_SECS = 120.0  # start-up includes the first health check of every worker and loading the tokenizer
BACKOFF_FIRST_SECS = 0.5  # before replacing a member that died; doubles per death in a row ...
BACKOFF_MAX_SECS = 30.0  # ... up to this
STABLE_SECS = 30.0  # a member that lived this long before dying starts the doubling again
EXIT_MARGIN_SECS = 10.0  # past a member's grace period before the supervisor kills it


class StartFailed(Exception):
    def __init__(self, index: int, code: int) -> None:
        super().__init__(f"process {index} failed to start (exit status {code})")
        self.code = code


@dataclass(eq=False)
class Member:
    index: int
    proc: asyncio.subprocess.Process
    started: float = field(default_factory=time.monotonic)
    retiring: bool = False


class Supervisor:
    """Owns the members of one group; ``run`` returns the exit status of the group."""

    def __init__(self, cfg: GatewayConfig, reload: Callable[[], GatewayConfig], listen: str = "reuseport") -> None:
        self.listeners = Listeners(listen, cfg.host, cfg.port, cfg.processes)
        self.cfg = cfg
        self.reload_config = reload
        self.size = cfg.processes
        self.slots: list[Member | None] = [None] * self.size
        self.members: set[Member] = set()  # every live process, retiring ones included
        self.deaths = [0] * self.size  # deaths in a row per slot, for the backoff
        self.stopping = asyncio.Event()
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvgate-group-"))
        self.metrics_dir = self.run_dir / "metrics"
        self.metrics_dir.mkdir()
        self.generation = 0
        self.config_path = self._write_config(cfg)
        self._tasks: set[asyncio.Task] = set()
        self._reload_wanted = asyncio.Event()
        self.nats: EmbeddedNats | None = None  # the group's state bus, when no --state-url names one

    # --- the group's life -----------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload_wanted.set)
        try:
            # Resources every member shares are started here, before the first member, and
            # stopped after the last one has exited.
            self.nats = start_group_services(self.cfg)
            if self.nats is not None:
                self.cfg = replace(self.cfg, state_url=self.nats.url)
                self.config_path = self._write_config(self.cfg)
            self.listeners.open()
            code = await self._serve()
        except GroupServiceFailed as exc:
            log.error("%s", exc)
            code = 1
        except OSError as exc:  # the port: taken, or an address this host does not have
            log.error("cannot listen on %s:%d: %s", self.cfg.host, self.cfg.port, exc)
            code = 1
        finally:
            await self._stop_all()
            stop_group_services(self.nats)
            self.listeners.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return code

    async def _serve(self) -> int:
        """Start every member; serve until SIGTERM/SIGINT. A member that fails to start stops the group
        with its exit status (a configuration error would fail every replacement alike)."""
        starting = {asyncio.ensure_future(self._start(i)) for i in range(self.size)}
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            while starting and not self.stopping.is_set():
                done, starting = await asyncio.wait(starting | {stop}, return_when=asyncio.FIRST_COMPLETED)
                starting.discard(stop)
                for task in done - {stop}:
                    if task.exception() is None:
                        self._adopt(task.result())
                failed = [t.exception() for t in done - {stop} if t.exception() is not None]
                if failed:
                    log.error("%s: stopping the group", failed[0])
                    return failed[0].code if isinstance(failed[0], StartFailed) else 1
            if self.stopping.is_set():
                return 0
            log.info("kvgate group of %d processes serving on http://%s:%d (listening: %s)", self.size,
                     self.cfg.host, self.listeners.port, self.listeners.mode)
            self._spawn(self._reloads())
            await stop
            return 0
        finally:
            stop.cancel()
            for task in starting:
                task.cancel()
            await asyncio.gather(*starting, return_exceptions=True)

    async def _stop_all(self) -> None:
        """SIGTERM to every member (each drains as a lone gateway does), wait for them all."""
        self.stopping.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        members = list(self.members)
        for m in members:
            signal_member(m, signal.SIGTERM)
        await asyncio.gather(*(self._exit(m, self.cfg.shutdown_grace_secs + EXIT_MARGIN_SECS) for m in members))

    async def _exit(self, member: Member, within: float) -> None:
        """Wait for a member told to stop; kill it after ``within`` seconds. Its slot's socket
        closes as soon as it is gone, so that while the others drain, new connections reach
        one of them (a 503 with ``Connection: close``) instead of waiting in a queue nobody reads."""
        try:
            code = await asyncio.wait_for(member.proc.wait(), max(0.1, within))
        except asyncio.TimeoutError:
            log.error("process %d (pid %d) still running after the grace period: killing it",
                      member.index, member.proc.pid)
            signal_member(member, signal.SIGKILL)
            code = await member.proc.wait()
        log.info("process %d (pid %d) exited (%d)", member.index, member.proc.pid, code)
        self._gone(member)
        if self.slots[member.index] is member:
            self.listeners.release(member.index)

    # --- members --------------------------------------------------------------------------
    async def _start(self, index: int) -> Member:
        """A new member in slot ``index``, once it is listening; ``StartFailed`` if it exits first."""
        read_fd, write_fd = os.pipe()
        env = {**os.environ, group.INDEX_ENV: str(index), group.SIZE_ENV: str(self.size),
               group.READY_FD_ENV: str(write_fd), group.METRICS_DIR_ENV: str(self.metrics_dir)}
        fds = [write_fd]
        try:
            sock = self.listeners.for_slot(index)
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            log.error("process %d: cannot listen on %s:%d: %s", index, self.cfg.host, self.cfg.port, exc)
            raise StartFailed(index, 1) from None
        if sock is not None:
            env[group.LISTEN_FD_ENV] = str(sock.fileno())
            fds.append(sock.fileno())
        try:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.processes",
                                                        str(self.config_path), env=env, pass_fds=fds)
        finally:
            os.close(write_fd)
        member = Member(index, proc)
        try:
            ready = await asyncio.wait_for(_read_once(read_fd), READY_TIMEOUT_SECS)
        except asyncio.TimeoutError:
            log.error("process %d (pid %d) not listening after %gs", index, proc.pid, READY_TIMEOUT_SECS)
            ready = False
        except asyncio.CancelledError:
            signal_member(member, signal.SIGKILL)
            await proc.wait()
            self._gone(member)
            raise
        finally:
            os.close(read_fd)
        if not ready:
            if proc.returncode is None:
                signal_member(member, signal.SIGKILL)
            code = await proc.wait()
            self._gone(member)
            raise StartFailed(index, code if code > 0 else 1)
        log.info("process %d (pid %d) listening", index, proc.pid)
        return member

    def _adopt(self, member: Member) -> None:
        """``member`` serves its slot from now on; its exit is watched."""
        self.slots[member.index] = member
        self.members.add(member)
        self._spawn(self._watch(member))

    async def _watch(self, member: Member) -> None:
        code = await member.proc.wait()
        self._gone(member)
        if member.retiring or self.stopping.is_set():
            log.info("process %d (pid %d) exited (%d)", member.index, member.proc.pid, code)
            return
        if time.monotonic() - member.started >= STABLE_SECS:
            self.deaths[member.index] = 0
        log.error("process %d (pid %d) died (exit status %d)", member.index, member.proc.pid, code)
        self.slots[member.index] = None
        self.listeners.release(member.index)
        await self._replace(member.index)

    async def _replace(self, index: int) -> None:
        """Start a member in slot ``index`` after a backoff that doubles with each death in a row.
        Ends when one starts; the group stopping cancels it."""
        while True:
            self.deaths[index] += 1
            delay = min(BACKOFF_MAX_SECS, BACKOFF_FIRST_SECS * 2 ** (self.deaths[index] - 1))
            log.warning("replacing process %d in %.1fs (death %d in a row)", index, delay, self.deaths[index])
            await asyncio.sleep(delay)
            try:
                self._adopt(await self._start(index))
                return
            except StartFailed as exc:
                log.error("%s", exc)
                self.listeners.release(index)

    def _gone(self, member: Member) -> None:
        if member in self.members:
            self.members.discard(member)
            from prometheus_client import multiprocess

            # its live gauges leave the group's figures; its counters stay in the sums
            multiprocess.mark_process_dead(member.proc.pid, str(self.metrics_dir))

    # --- rolling reload -------------------------------------------------------------------
    async def _reloads(self) -> None:
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted.clear()  # a SIGHUP during this reload asks for one more after it
            await self._reload()

    async def _reload(self) -> None:
        """A new member for each slot in turn: once it listens, the old one retires (stops
        accepting, finishes what it has). A new configuration that does not start leaves the group as it was."""
        try:
            cfg = self.reload_config()
        except (Exception, SystemExit) as exc:
            log.error("reload: configuration not loaded, the group goes on unchanged: %s", exc)
            return
        fixed = {"host": self.cfg.host, "port": self.cfg.port, "processes": self.size}
        if self.nats is not None:  # the embedded bus stays: its members keep their peers
            fixed["state_url"] = self.nats.url
        if any(getattr(cfg, k) != v for k, v in fixed.items()):
            log.warning("reload: host, port and processes change only with a restart; kept %s", fixed)
        self.cfg = replace(cfg, **fixed)
        previous, self.config_path = self.config_path, self._write_config(self.cfg)
        log.info("reload: replacing %d processes one at a time", self.size)
        for index in range(self.size):
            old = self.slots[index]
            if old is None:  # being replaced after a death: the replacement reads the new configuration
                continue
            try:
                new = await self._start(index)
            except StartFailed as exc:
                log.error("reload stopped: %s; the old processes go on", exc)
                self.config_path.unlink(missing_ok=True)
                self.config_path = previous
                return
            self._adopt(new)
            old.retiring = True
            signal_member(old, group.RETIRE_SIGNAL)
        previous.unlink(missing_ok=True)
        log.info("reload: done")

    # --- helpers --------------------------------------------------------------------------
    def _write_config(self, cfg: GatewayConfig) -> Path:
        self.generation += 1
        path = self.run_dir / f"config-{self.generation}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it holds the API keys
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(cfg))
        return path

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class GroupServiceFailed(RuntimeError):
    """A resource the group shares did not start."""


def start_group_services(cfg: GatewayConfig) -> EmbeddedNats | None:
    """What the members of a group share, started before the first member: the state bus
    their routing state travels on (``gateway.peers``), an embedded nats-server on loopback
    unless ``--state-url`` names one."""
    if cfg.state_url:
        return None
    try:
        nats = EmbeddedNats()
    except (OSError, RuntimeError) as exc:  # the binary missing, or the server not starting
        raise GroupServiceFailed(f"cannot start the group's state bus ({exc}); give --state-url") from None
    log.info("state bus for the group: embedded nats-server at %s", nats.url)
    return nats


def stop_group_services(nats: EmbeddedNats | None) -> None:
    """Stop what ``start_group_services`` started, after the last member has exited."""
    if nats is not None:
        nats.stop()


def signal_member(member: Member, sig: int) -> None:
    """``os.kill``, not ``Process.send_signal``: the latter polls, which reaps an exited member
    before asyncio's child watcher does, and the watcher then reports exit status 255."""
    if member.proc.returncode is None:
        try:
            os.kill(member.proc.pid, sig)
        except ProcessLookupError:
            pass


async def _read_once(fd: int) -> bool:
    """Whether the member wrote its ready byte (False: the pipe closed without it)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bool] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(os.read(fd, 1) == b"1")

    loop.add_reader(fd, readable)
    try:
        return await done
    finally:
        loop.remove_reader(fd)


def supervise(cfg: GatewayConfig, reload: Callable[[], GatewayConfig], listen: str = "reuseport") -> int:
    return asyncio.run(Supervisor(cfg, reload, listen).run())


def member_main(config_path: str) -> int:
    """One member of a group: the configuration the supervisor wrote, served as ``kvgate serve`` would."""
    from gateway.cli import _install_uvloop, serve_async
    from wire.options import OptionError

    cfg = msgspec.json.decode(Path(config_path).read_bytes(), type=GatewayConfig)
    log_setup.configure(cfg.log_level, f"%(asctime)s %(levelname)s %(name)s[{group.process_index()}]: %(message)s",
                        cfg.log_dir)
    _install_uvloop()
    try:
        asyncio.run(serve_async(cfg))
    except OptionError as exc:
        print(f"kvgate: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(member_main(sys.argv[1]))
