"""`radixlm serve --dp N`: N replicas (each a whole radixlm server with its own engine, on its own
loopback port), sglang-router in front of them (cache-aware by default), and the front proxy
(dp_front.py) on the user's host:port. Promise: the URL answers only once every replica is
healthy and registered with the router; a replica that dies is logged and routed around; SIGINT/
SIGTERM, the router's death or the last replica's stops all of them (replicas get SIGTERM and
drain as a single server does) and the command exits."""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger("radixlm.server")

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
# Options of `serve` that describe the whole deployment, not one replica.
DEPLOYMENT_OPTIONS = frozenset({"dp", "router_policy", "host", "port", "model", "help"})
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux), so no
    replica or router outlives the deployment."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def replica_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The command-line options of one replica: every option the user set, except those of
    the deployment (the replica's own host and port are added by the launcher)."""
    argv: list[str] = []
    for action in parser._actions:
        if action.dest in DEPLOYMENT_OPTIONS or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        elif isinstance(value, list):
            for item in value:  # append-style options repeat
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


@dataclass
class Deployment:
    """The child processes of one --dp deployment and their URLs."""

    replicas: list[subprocess.Popen[bytes]] = field(default_factory=list)
    replica_urls: list[str] = field(default_factory=list)
    router: subprocess.Popen[bytes] | None = None
    router_url: str = ""

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [*self.replicas, *([self.router] if self.router else [])]

    def dead(self) -> str | None:
        """A description of the first child that has exited, if any."""
        for name, proc in self._named():
            if proc.poll() is not None:
                return f"{name} (pid {proc.pid}) exited with status {proc.returncode}"
        return None

    def _named(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        named = [(f"replica {i} at {u}", p) for i, (u, p) in enumerate(zip(self.replica_urls, self.replicas))]
        return named + ([(f"router at {self.router_url}", self.router)] if self.router else [])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal every child (the front has stopped taking requests; replicas drain what runs
        as a single server does on that signal); SIGKILL what has not exited after a timeout."""
        for proc in self.processes():
            if proc.poll() is None:
                proc.send_signal(sig)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.processes():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop in %.0f s; killing it", proc.pid, STOP_TIMEOUT_S)
                proc.kill()
                proc.wait()


def start_replicas(dep: Deployment, n: int, argv: list[str]) -> None:
    for _ in range(n):
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "radixlm.launch_server",
            *argv,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        dep.replicas.append(spawn(cmd))
        dep.replica_urls.append(f"http://127.0.0.1:{port}")


def start_router(dep: Deployment, policy: str, log_level: str, api_key: str | None) -> None:
    port, metrics_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *dep.replica_urls,
        "--policy",
        policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        # A dead replica refuses connections at once, so retries sent to it are spent in
        # milliseconds: give more of them, and open its circuit after a few failures so the
        # policy picks another replica before the retries run out.
        "--retry-max-retries",
        "10",
        "--cb-failure-threshold",
        "3",
        "--health-check-interval-secs",
        "5",
        "--health-failure-threshold",
        "2",
        "--log-level",
        {"warning": "warn", "debug": "debug", "error": "error"}.get(log_level, "warn"),
    ]
    if api_key is not None:  # the router's own calls to the replicas (/server_info, ...) need it
        cmd += ["--api-key", api_key]
    dep.router = spawn(cmd)
    dep.router_url = f"http://127.0.0.1:{port}"


def wait_until(
    dep: Deployment, ready: Callable[[], bool], what: str, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Poll `ready()` until true; SystemExit if a child dies or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        gone = dep.dead()
        if gone:
            raise SystemExit(f"radixlm serve --dp: {gone} while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"radixlm serve --dp: {what} not ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _registered(router_url: str, n: int, api_key: str | None) -> bool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        workers = httpx.get(router_url + "/workers", headers=headers, timeout=2.0).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return False
    return sum(1 for w in workers if w.get("is_healthy")) >= n


def check_router_installed() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit(
            "radixlm serve --dp needs sglang-router (SGLang's cache-aware router): pip install sglang-router"
        )


def launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Deployment:
    """Start the replicas and the router and wait until the router has every replica."""
    check_router_installed()
    dep = Deployment()
    try:
        start_replicas(dep, args.dp, replica_argv(parser, args))
        for url in dep.replica_urls:
            wait_until(dep, functools.partial(_healthy, url), f"replica {url}")
        start_router(dep, args.router_policy, args.log_level, args.api_key)
        wait_until(dep, lambda: _registered(dep.router_url, args.dp, args.api_key), "the router")
    except BaseException:
        dep.stop()
        raise
    return dep


def serve_dp(parser: argparse.ArgumentParser, args: argparse.Namespace, sock: socket.socket) -> None:
    """Run the deployment behind the front on `sock` until SIGINT/SIGTERM or a child's death."""
    # uvicorn re-raises the signal it handled once it has stopped, and SIGTERM's default action
    # would end this process before its children are stopped: it raises here instead, from the
    # start (a SIGTERM while the replicas load stops them too).
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        _serve(parser, args, sock)
    except (KeyboardInterrupt, _Terminated):  # during startup; launch() stopped what it started
        logger.info("deployment stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace, sock: socket.socket) -> None:
    import uvicorn

    from .dp_front import create_front

    dep = launch(parser, args)
    app = create_front(dep.router_url, dep.replica_urls, args.api_key)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    threading.Thread(target=_watch, args=(dep, server), name="radixlm-dp-watch", daemon=True).start()
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    logger.info(
        "router (%s) at %s over replicas %s", args.router_policy, dep.router_url, ", ".join(dep.replica_urls)
    )
    print(f"radixlm serving {args.dp} replicas behind sglang-router on {url}", flush=True)
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        dep.stop()
    logger.info("deployment stopped")


class _Terminated(Exception):
    """SIGTERM, re-raised by uvicorn after its graceful shutdown."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


def _watch(dep: Deployment, server: Any) -> None:
    """A replica's death is logged and survived (the router retries its requests on the others
    and stops routing to it); the router's death, or the last replica's, stops the front."""
    reported: set[int] = set()
    while not server.should_exit:
        for i, proc in enumerate(dep.replicas):
            if proc.poll() is not None and i not in reported:
                reported.add(i)
                logger.error("replica %s exited with status %s", dep.replica_urls[i], proc.returncode)
        router_gone = dep.router is not None and dep.router.poll() is not None
        if router_gone or len(reported) == len(dep.replicas):
            server.should_exit = True
            return
        time.sleep(1.0)
