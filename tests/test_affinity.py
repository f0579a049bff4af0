"""Data-parallel serving's pure parts, no Ray cluster: the prefix-affinity policy
(``server/affinity.py``) against its rules and a naive simulation, a replica's cores, the
in-process ASGI call a replica answers with (``server/asgi.py``), and serve's replica options
refused before anything loads."""

from __future__ import annotations

import asyncio
import json
import os
import time
import types

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from hypothesis import given
from hypothesis import strategies as st

from neuronfx.cli import main
from neuronfx.errors import InputError
from neuronfx.server.affinity import AffinityTable, prefix_key, prefix_text, ranked
from neuronfx.server.asgi import HttpCall, HttpHead, call_app


@pytest.fixture(autouse=True)
def ray_log_env(monkeypatch):
    """serve --data-parallel-size sets RAY_DEDUP_LOGS for Ray; restored after each test here."""
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")


def body(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_prefix_text_reads_each_endpoints_prompt():
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]}]}
    assert prefix_text("/v1/chat/completions", body(chat)) == "system: Be brief.\nuser: Hi"
    assert prefix_text("/v1/completions", body({"prompt": "Once upon"})) == "Once upon"
    assert prefix_text("/v1/completions", body({"prompt": ["first", "second"]})) == "first"
    assert prefix_text("/v1/completions", body({"prompt": [1, 2, 3]})) == "1,2,3"
    assert prefix_text("/v1/completions", body({"prompt": [[4, 5], [6]]})) == "4,5"
    assert prefix_text("/v1/responses", body({"instructions": "Sys", "input": "Q"})) == "Sys\nQ"
    assert prefix_text("/v1/responses", body({"input": [{"role": "user", "content": "Q"}]})) == "\nuser: Q"
    # Not a generation, or not a JSON object: no key (the replica answers its 400).
    assert prefix_text("/v1/models", b"") is None
    assert prefix_text("/v1/completions", b"{not json") is None
    assert prefix_text("/v1/completions", b"\xff\xfe") is None
    assert prefix_text("/v1/completions", body([1, 2])) is None
    assert prefix_text("/v1/chat/completions", body({"messages": "hi"})) is None
    assert prefix_text("/v1/completions", body({"prompt": 3})) is None


def test_prefix_key_reads_only_the_first_chars():
    shared = "s" * 300
    assert prefix_key(shared + "question one", 256) == prefix_key(shared + "another question", 256)
    assert prefix_key("short a", 256) != prefix_key("short b", 256)
    assert prefix_key("\ud800 lone surrogate", 7) == prefix_key("\ud800 lone other", 7)  # JSON may carry one
    with pytest.raises(ValueError, match="chars=0"):
        prefix_key("x", 0)


def test_ranked_keeps_the_owner_until_the_load_is_imbalanced():
    lens = {"a": 3, "b": 0, "c": 1}
    assert ranked("a", lens, imbalance=3) == [["a"], ["b", "c"]]
    assert ranked("a", lens, imbalance=2) == [["a", "b", "c"]]  # 3 more than b: least queue
    assert ranked(None, lens, imbalance=8) == [["a", "b", "c"]]
    assert ranked("gone", lens, imbalance=8) == [["a", "b", "c"]]  # its replica died
    # No recent figure for a replica (new, restarted, idle): Ray asks it before the others.
    fresh = {"a": 3, "b": None, "c": 1}
    assert ranked(None, fresh, imbalance=8) == [["b"], ["a", "c"]]
    assert ranked("a", fresh, imbalance=1) == [["b"], ["a", "c"]]  # 2 more than c
    assert ranked("b", fresh, imbalance=0) == [["b"], ["a", "c"]]
    assert ranked("c", {"c": None}, imbalance=0) == [["c"]]


def test_table_forgets_the_oldest_and_dead_replicas():
    table = AffinityTable(size=2)
    table.routed("k1", "a")
    table.routed("k2", "b")
    table.routed("k1", "a")  # k1 used again: k2 is now the oldest
    table.routed("k3", "a")
    assert (table.owner("k1"), table.owner("k2"), table.owner("k3")) == ("a", None, "a")
    table.forget(["a"])
    assert len(table) == 0
    with pytest.raises(ValueError, match="size=0"):
        AffinityTable(size=0)


@given(st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 6), min_size=3, max_size=3)), min_size=1, max_size=60),
       st.integers(0, 4))
def test_routing_simulation_keeps_prefixes_together_while_balanced(requests, imbalance):
    """A naive router (the least loaded replica for a new prefix, the prefix's replica while
    within ``imbalance`` of the least loaded) against ranked + AffinityTable, request by request."""
    table, owners = AffinityTable(), {}
    for prefix, loads in requests:
        lens = dict(zip("abc", loads, strict=True))
        ranks = ranked(table.owner(str(prefix)), lens, imbalance)
        assert sorted(r for rank in ranks for r in rank) == ["a", "b", "c"]
        chosen = min(ranks[0], key=lambda r: lens[r])  # Ray: the shortest queue of the first rank
        owner = owners.get(prefix)
        expected = owner if owner is not None and lens[owner] - min(lens.values()) <= imbalance else \
            min(lens, key=lambda r: lens[r])
        assert lens[chosen] == lens[expected] and (owner is None or chosen == expected or lens[owner] - min(lens.values()) > imbalance)
        table.routed(str(prefix), chosen)
        owners[prefix] = chosen


def test_replica_cores_split_a_node():
    from neuronfx.server.replicas import replica_cores

    assert replica_cores([3, 0, 1, 2], local_rank=0, threads=2) == [0, 1]
    assert replica_cores([3, 0, 1, 2], local_rank=1, threads=2) == [2, 3]
    assert replica_cores([0, 1], local_rank=2, threads=1) == [0]  # more replicas than cores: they share
    assert replica_cores([0], local_rank=0, threads=4) == [0]
    with pytest.raises(ValueError, match="threads=0"):
        replica_cores([0, 1], local_rank=0, threads=0)


def tiny_app() -> FastAPI:
    app = FastAPI()
    seen: list[str] = []

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode(), "query": request.url.query}, headers={"x-a": "1"})

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                seen.append("closed")
        return StreamingResponse(events(), media_type="text/event-stream")

    app.state.seen = seen
    return app


def test_call_app_gives_whole_answers_in_one_piece_and_streams_chunks():
    app = tiny_app()

    async def run() -> tuple[list, list]:
        whole = [item async for item in call_app(app, HttpCall(method="POST", path="/echo", query=b"x=1", body=b"hello"))]
        chunks = []
        gen = call_app(app, HttpCall(method="GET", path="/stream"))
        async for item in gen:
            chunks.append(item)
            if len(chunks) == 4:
                break
        await gen.aclose()  # the caller went away: the app sees http.disconnect and ends its stream
        return whole, chunks

    whole, chunks = asyncio.run(run())
    assert len(whole) == 1 and isinstance(whole[0], HttpHead) and not whole[0].streamed
    assert whole[0].status == 200 and json.loads(whole[0].body) == {"body": "hello", "query": "x=1"}
    assert (b"x-a", b"1") in whole[0].headers
    head, *rest = chunks
    assert isinstance(head, HttpHead) and head.streamed and head.body == b""
    assert b"".join(rest).startswith(b"data: 0\n\n")
    assert app.state.seen == ["closed"]


def test_call_app_answers_unknown_paths_as_the_app_does():
    async def run() -> list:
        return [item async for item in call_app(tiny_app(), HttpCall(method="GET", path="/nowhere"))]

    (head,) = asyncio.run(run())
    assert head.status == 404


@pytest.mark.parametrize("argv, message", [
    (["--replica-threads", "1"], "--replica-threads applies to data-parallel serving: give --data-parallel-size too."),
    (["--data-parallel-size", "0"], "--data-parallel-size=0 must be >= 1"),
    (["--data-parallel-size", "2", "--min-replicas", "3"], "need 1 <= min <= size <= max"),
    (["--data-parallel-size", str(len(os.sched_getaffinity(0)) + 1)], "is above this machine's"),
    (["--data-parallel-size", "1", "--replica-threads", str(len(os.sched_getaffinity(0)) + 1)], "lower them, or join a larger"),
    (["--data-parallel-size", "1", "--prefix-affinity-chars", "0"], "--prefix-affinity-chars=0 must be >= 1"),
    (["--data-parallel-size", "1", "--replica-threads", "0"], "--replica-threads=0 must be >= 1"),
    (["--data-parallel-size", "1", "--tp-degree", "2"], "--tp-degree=2: serve runs in one process"),
])
def test_replica_options_refused_before_loading(argv, message, capsys):
    assert main(["serve", "/no/such/model", "--backend", "eager", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_data_parallel_without_ray_says_how_to_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("ray") else real(name, *a))
    assert main(["serve", "--backend", "eager", "--data-parallel-size", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'neuronfx[ray]'" in err and len(err.splitlines()) == 1, err


def test_replica_application_from_serve_options(tmp_path):
    """serve's options -> the replicas' deployment options (no cluster): CPUs per replica,
    admission bound, drain, the affinity router; a fixed count, or autoscaling bounds."""
    from ray.serve import Application

    from neuronfx.cli.serve import replica_application, replica_setup
    from neuronfx.config.inference import InferenceConfig
    from neuronfx.server.replicas import AffinityRouter, replica_options

    app = replica_application(["--backend", "eager", "--data-parallel-size", "4", "--replica-threads", "1"])
    assert isinstance(app, Application)  # 4 replicas on a cluster of the caller's: this machine's cores do not count
    with pytest.raises(InputError, match="give --replica-threads"):
        replica_application(["--backend", "eager"])
    inference = InferenceConfig(batch_size=4, backend="eager")
    args = main_args(["--data-parallel-size", "2", "--min-replicas", "1", "--max-replicas", "2", "--max-waiting", "10",
                      "--shutdown-timeout", "3", "--prefix-affinity-chars", "100"])
    spec, scaling, chars = replica_setup(args, None, inference, "m", None)
    assert (spec.threads, chars) == (len(os.sched_getaffinity(0)) // 2, 100)
    options = replica_options(spec, scaling)
    assert options["ray_actor_options"] == {"num_cpus": spec.threads} and options["max_ongoing_requests"] == 4 + 10
    assert options["graceful_shutdown_timeout_s"] == 3 and options["max_constructor_retry_count"] == 1
    assert options["request_router_config"].request_router_kwargs == {"imbalance": 4}
    assert options["request_router_config"].get_request_router_class() is AffinityRouter
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 2, "target_ongoing_requests": 4}
    fixed = replica_options(*replica_setup(main_args(["--data-parallel-size", "2"]), None, inference, "m", None)[:2])
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed


def main_args(argv: list[str]):
    import argparse

    from neuronfx.cli.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_driver_compiles_with_the_replicas_thread_count(monkeypatch):
    """The compile cache keys on the thread count (compiled code guards on it): the driver's one
    compile runs with the replicas' threads, or every replica would compile again."""
    import torch

    import neuronfx.cli.serve as serve_cli
    from neuronfx.server import replica_driver

    seen = {}

    def compile_once(*args, **kwargs):
        seen["threads"] = torch.get_num_threads()
        return types.SimpleNamespace(summary=lambda: "stand-in")

    monkeypatch.setattr(serve_cli, "load_runtime", compile_once)
    monkeypatch.setattr(replica_driver, "serve_replicas", lambda spec, scaling, **k: seen.setdefault("spec", spec) and 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the driver's own count differs from the replicas'
    try:
        assert main(["serve", "--data-parallel-size", "1", "--replica-threads", "1", "--port", "0"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen["threads"] == seen["spec"].threads == 1 and seen["spec"].inference.backend == "inductor"


def test_cluster_must_fit_the_replicas_node_by_node(monkeypatch):
    """Ray places a replica on one node: 2 nodes of 3 CPUs hold two replicas of 2 threads, not
    three (6 CPUs in all would say they fit); a dead node's CPUs do not count."""
    import ray

    from neuronfx.server.replica_driver import check_cluster_cpus
    from neuronfx.server.replicas import Scaling

    nodes = [{"Alive": True, "Resources": {"CPU": 3.0}}, {"Alive": True, "Resources": {"CPU": 3.0}},
             {"Alive": False, "Resources": {"CPU": 8.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    check_cluster_cpus(Scaling(replicas=2, min_replicas=2, max_replicas=2, target_ongoing=8), threads=2)
    with pytest.raises(InputError, match=r"3 replicas x 2 threads do not fit the Ray cluster: its nodes have \[3, 3\] CPUs, room for 2"):
        check_cluster_cpus(Scaling(replicas=3, min_replicas=3, max_replicas=3, target_ongoing=8), threads=2)


def test_serve_replicas_starts_a_local_cluster_fresh_and_leaves_it(monkeypatch, capsys):
    """The driver's Ray calls (Ray itself stood in for: tests/test_replicas.py runs the real one):
    a local cluster is a new one (never a running ``ray start``'s) and is shut down with Serve on
    a failed start; on a cluster of the user's, a Serve that ran before keeps its other
    applications (only this one is deleted); a stop while the replicas are built ends the start."""
    import threading

    import ray
    from ray import serve
    from ray.serve.schema import ApplicationStatusOverview, ServeStatus

    from neuronfx.config.inference import InferenceConfig
    from neuronfx.server.replica_driver import serve_replicas
    from neuronfx.server.replicas import APP_NAME, ReplicaSpec, Scaling

    calls: list[tuple] = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(("init", kw.get("address"), kw.get("num_cpus"))))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("ray.shutdown",)))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}])
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append(("serve.start",)))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append(("serve.shutdown",)))
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(("serve.delete", name)))
    monkeypatch.setattr(serve, "status", lambda: ServeStatus())  # no Serve running before: Serve's empty status

    def failing_run(app, **kw):
        raise RuntimeError("Deploying application neuronfx failed: replica x: ReplicaBuildError: replica x could not build")

    monkeypatch.setattr(serve, "run", failing_run)
    spec = ReplicaSpec(build=lambda: None, inference=InferenceConfig(batch_size=4, backend="eager"), model_name="m", threads=1)
    scaling = Scaling(replicas=2, min_replicas=2, max_replicas=2, target_ongoing=4)
    args = {"host": "127.0.0.1", "port": 0, "cores": 2, "stop": threading.Event()}
    assert serve_replicas(spec, scaling, ray_address=None, **args) == 2
    assert calls == [("init", "local", 2), ("serve.start",), ("serve.shutdown",), ("ray.shutdown",)]
    assert capsys.readouterr().err.strip() == "neuronfx: error: replica x could not build"
    calls.clear()
    assert serve_replicas(spec, scaling, ray_address="10.0.0.1:6379", **args) == 2  # Serve not running there before: shut down
    assert calls == [("init", "10.0.0.1:6379", None), ("serve.start",), ("serve.shutdown",), ("ray.shutdown",)]
    calls.clear()
    running = ServeStatus(applications={"theirs": ApplicationStatusOverview(status="RUNNING", message="", last_deployed_time_s=0,
                                                                          deployments={})})
    monkeypatch.setattr(serve, "status", lambda: running)  # Serve already serves other applications there: only ours goes
    assert serve_replicas(spec, scaling, ray_address="10.0.0.1:6379", **args) == 2
    assert calls == [("init", "10.0.0.1:6379", None), ("serve.start",), ("serve.delete", APP_NAME), ("ray.shutdown",)]
    monkeypatch.setattr(serve, "status", lambda: ServeStatus())
    calls.clear()
    stop = threading.Event()
    monkeypatch.setattr(serve, "run", lambda app, **kw: time.sleep(30))  # replicas that take long to build
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    assert serve_replicas(spec, scaling, ray_address=None, **(args | {"stop": stop})) == 0
    assert time.monotonic() - t0 < 5 and calls[-2:] == [("serve.shutdown",), ("ray.shutdown",)]
