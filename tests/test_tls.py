"""TLS between every process of the cluster: a job trains over it, the step path's own connections
included, and a client without a certificate, a plain `tcp://` connection and a certificate of another
authority are all refused. Real processes: a LocalElasticCluster started with `security=True`."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import distributed
import pytest
import torch
from distributed.security import Security

from prefect_elastic import train
from prefect_elastic.cluster import tls_security
from prefect_elastic.errors import JobConfigError
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.wire import Entry, Frame, ShardLink, ShardServer

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job
from .prefect_harness import PrefectServer
from .test_flow import FlowRun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[LocalElasticCluster]:
    with LocalElasticCluster(static_workers=2, elastic_workers=2, security=True) as cluster:
        yield cluster


def test_a_job_trains_over_tls_bitwise_equal_to_the_plain_run(
    tls_cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    assert tls_cluster.scheduler_address.startswith("tls://")
    job = make_job(digits_url, "reassign", job_id="over-tls", epochs=1)
    result = train(job, cluster=tls_cluster)  # the cluster's Security is the controller's
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    # The step path's connections use TLS too: in a task (where compute loops and the shards' actor
    # methods run), every worker of the cluster finds its TLS context for them.
    with tls_cluster.client() as client:
        workers = [*tls_cluster.elastic_addresses(), *tls_cluster.static_addresses()]
        probes = [client.submit(_channel_tls_in_use, workers=[w], pure=False) for w in workers]
        assert client.gather(probes) == [True] * len(workers)


def _channel_tls_in_use() -> bool:
    from prefect_elastic.wire import worker_tls

    return worker_tls("connect") is not None and worker_tls("listen") is not None


def test_a_client_without_a_certificate_is_refused(tls_cluster: LocalElasticCluster) -> None:
    """A TLS client that trusts the cluster's authority but shows no certificate of its own: the scheduler
    ends the handshake. (Dask's own Client does not even try without one.)"""
    security = tls_cluster.security
    assert security is not None
    host, port = tls_cluster.scheduler_address.removeprefix("tls://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=security.tls_ca_file)
    context.check_hostname = False  # (the authority's one certificate names no host)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        try:
            with context.wrap_socket(raw) as conn:
                conn.sendall(b"\x00" * 8)
                answer = conn.recv(1)  # TLS 1.3: the server's refusal arrives after the client's finish
        except (ssl.SSLError, ConnectionError) as refused:
            answer = repr(refused).encode()
    # Refused: an alert, a reset, or the connection closed mid-handshake (SSLEOFError, seen once in CI);
    # a server that took the connection would answer nothing and the read would time out.
    assert answer == b"" or any(w in answer.lower() for w in (b"alert", b"reset", b"eof")), answer


def test_a_plain_tcp_connection_is_refused(tls_cluster: LocalElasticCluster) -> None:
    plain = tls_cluster.scheduler_address.replace("tls://", "tcp://")
    with pytest.raises((OSError, TimeoutError)):
        distributed.Client(plain, timeout=5, set_as_default=False)


def test_a_certificate_of_another_authority_is_refused(tls_cluster: LocalElasticCluster) -> None:
    stranger = Security.temporary()  # a self-signed authority of its own
    with pytest.raises((OSError, TimeoutError)):
        distributed.Client(tls_cluster.scheduler_address, timeout=5, security=stranger, set_as_default=False)


def test_the_step_path_refuses_plain_and_foreign_connections() -> None:
    """A shard's listener with the cluster's TLS context answers a loop with a certificate of the same
    authority, and serves nothing to a plain connection or to a certificate of another authority."""
    ours, theirs = Security.temporary(), Security.temporary()

    async def answer(frame: Frame) -> Frame:
        return Frame({"ok": True}, [(Entry("state", -1, "echo"), t) for _, t in frame.tensors])

    async def scenario() -> tuple[bool, str, str]:
        server = ShardServer(answer)
        address = await server.start("127.0.0.1", tls=ours.get_listen_args("worker")["ssl_context"])
        # No Unix socket beside it: any process of the machine could connect to one, unchecked.
        assert address.local == ""
        loop = asyncio.get_running_loop()

        def as_a_loop(security: Security | None) -> str:
            context = None if security is None else security.get_connection_args("worker")["ssl_context"]
            link = ShardLink(address, timeout=5, tls=context)
            try:
                import torch

                got = link.request(Frame({"op": "ping"}, [(Entry("grad", 0, "w"), torch.arange(4.0))]))
                return "answered" if got.tensors[0][1].tolist() == [0.0, 1.0, 2.0, 3.0] else "wrong"
            except (OSError, ssl.SSLError, ConnectionError) as exc:
                return f"refused: {type(exc).__name__}"
            finally:
                link.close()

        ok = await loop.run_in_executor(None, as_a_loop, ours)
        plain = await loop.run_in_executor(None, as_a_loop, None)
        foreign = await loop.run_in_executor(None, as_a_loop, theirs)
        await server.aclose()
        return ok == "answered", plain, foreign

    ok, plain, foreign = asyncio.run(scenario())
    assert ok, "a loop with the cluster's certificate is answered"
    assert plain.startswith("refused"), plain
    assert foreign.startswith("refused"), foreign


def test_a_plain_socket_to_a_tls_listener_gets_no_frame() -> None:
    """What a plain client sees: the handshake fails and the connection is closed, no answer is sent."""
    ours = Security.temporary()

    async def answer(frame: Frame) -> Frame:
        raise AssertionError("a plain connection must never reach the handler")

    async def scenario() -> bytes:
        server = ShardServer(answer)
        address = await server.start("127.0.0.1", tls=ours.get_listen_args("worker")["ssl_context"])
        # No Unix socket beside it: any process of the machine could connect to one, unchecked.
        assert address.local == ""
        loop = asyncio.get_running_loop()

        def plain_client() -> bytes:
            with socket.create_connection((address.host, address.port), timeout=5) as sock:
                sock.sendall(b"\x00\x00\x00\x02{}")
                try:
                    return sock.recv(1024)
                except ConnectionResetError:
                    return b""

        got = await loop.run_in_executor(None, plain_client)
        await server.aclose()
        return got

    got = asyncio.run(scenario())
    assert b"ok" not in got, got


def test_the_tls_flow_parameter_names_bad_files_and_keys(tmp_path: Path) -> None:
    assert tls_security(None) is None, "no parameter: Dask's own TLS config applies"
    with pytest.raises(JobConfigError, match=r"unknown keys \['ca'\]"):
        tls_security({"ca": "x"})
    with pytest.raises(JobConfigError, match="cert missing"):
        tls_security({"ca_file": "x"})
    with pytest.raises(JobConfigError, match=r"tls.ca_file='/nowhere/ca.pem': no such file"):
        tls_security({"ca_file": "/nowhere/ca.pem", "cert": "/nowhere/cert.pem"})


@pytest.mark.heavy  # two flow runs against the Prefect server: in .ci/run's second stage, for time
def test_a_flow_run_by_address_reaches_a_tls_cluster_with_the_tls_parameter(
    prefect_server: PrefectServer, tls_cluster: LocalElasticCluster, digits_url: str, tmp_path: Path
) -> None:
    """A deployment reaches a running cluster by its address; with TLS, the `tls` parameter names this
    client's files. Without it the flow run fails (the scheduler wants a certificate)."""
    security = tls_cluster.security
    assert security is not None
    tls = {"ca_file": security.tls_ca_file, "cert": security.tls_client_cert, "key": security.tls_client_key}
    job = make_job(digits_url, "reassign", job_id="flow-over-tls", epochs=1)
    run = FlowRun(prefect_server, job, tls_cluster.scheduler_address, tmp_path / "with", tls=tls)
    out = run.finish()
    assert "STATE COMPLETED" in out, out[-3000:]
    assert torch.load(run.output, weights_only=True), "the model was written"
    refused = FlowRun(prefect_server, job, tls_cluster.scheduler_address, tmp_path / "without")
    out = refused.finish()
    assert "STATE FAILED" in out and "TLS" in out, out[-3000:]
