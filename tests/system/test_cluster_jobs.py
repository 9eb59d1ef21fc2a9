"""`draftwire serve --ray` as a Ray job: a real head (`ray start --head` on loopback, token authentication on,
as in production), submitted through the Ray Jobs API with the repository as its working directory,
served to a real edge session, then stopped."""

import asyncio
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from draftwire.contract import SessionSpec
from edge_client.replay import ReplayDrafter
from edge_client.session import EdgeSession, GenerationRequest
from verifier_service.engine import TargetEngine
from verifier_service.session import reference_decode

job_submission = pytest.importorskip("ray.job_submission")

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    """A Ray head in its own process group, with a fresh token passed by the environment (nothing is
    written under ~/.ray). Yields (dashboard URL, token)."""
    token = secrets.token_hex(16)
    dashboard = free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "PATH": f"{BIN}:{os.environ['PATH']}",  # the job's entrypoint finds `draftwire` here
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # a test head stops at once on SIGTERM
    }
    env.pop("RAY_ADDRESS", None)
    temp_dir = Path(tempfile.mkdtemp(prefix="rayjobs", dir="/tmp"))  # short: Ray's socket paths are limited
    command = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1"]
    command += ["--port", str(free_port()), "--dashboard-host", "127.0.0.1"]
    command += ["--dashboard-port", str(dashboard), "--num-cpus", "2", "--disable-usage-stats"]
    # The job agent's HTTP port is 52365 unless given: another Ray on this machine (a test beside this one
    # in CI) may hold it, and then no job can be submitted ("No available agent to submit job").
    command += ["--dashboard-agent-listen-port", str(free_port())]
    command += ["--temp-dir", str(temp_dir)]
    with open(temp_dir / "head.log", "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{dashboard}", token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this fixture started: the head and its workers
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def client_for(url: str, token: str | None, timeout: float = 90):
    """A JobSubmissionClient once the head's dashboard answers; raises the last error after timeout."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    deadline = time.monotonic() + timeout
    while True:
        try:
            return job_submission.JobSubmissionClient(url, headers=headers)
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def submit(client, timeout: float = 90, **job) -> str:
    """The job's id; while the head's job agent is not up yet (the dashboard answers first: "No available
    agent to submit job, please try again later", seen on a loaded 2-core machine), tries again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(1)


def wait_for_address(client, job_id: str, timeout: float = 150) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = client.get_job_logs(job_id)
        m = re.search(r"draftwire: serving \S+ on (\S+:\d+)", logs)
        if m:
            return m.group(1)
        if client.get_job_status(job_id).is_terminal():
            break
        time.sleep(1)
    status, logs = client.get_job_status(job_id), client.get_job_logs(job_id)
    raise AssertionError(f"job {job_id} is {status}; logs:\n{logs}")


def test_the_pool_runs_as_a_ray_job_behind_token_authentication(head, test_pair):
    url, token = head
    client = client_for(url, token)
    with pytest.raises(Exception, match="(?i)authentication|unauthorized"):
        job_submission.JobSubmissionClient(url)  # no token: refused

    entrypoint = (
        f"draftwire serve --ray --target {test_pair.target_dir} --host 127.0.0.1 --port 0 "
        "--replicas 1 --replica-cpus 0.5 --replica-host 127.0.0.1"
    )
    job_id = submit(client, entrypoint=entrypoint, runtime_env={"working_dir": str(ROOT)})
    try:
        address = wait_for_address(client, job_id)
        engine = TargetEngine.load(test_pair.target_dir)
        prompt = tuple(range(40, 56))
        expected = reference_decode(engine, SessionSpec(prompt, max_new_tokens=24, ignore_eos=True))
        drafter = ReplayDrafter((*prompt, *expected), engine.info.vocabulary, corrupt=0.3)

        async def generate():
            async with grpc.aio.insecure_channel(address) as channel:
                request = GenerationRequest(prompt, max_new_tokens=24, ignore_eos=True)
                return await EdgeSession(channel, drafter).run(request)

        ids, _ = asyncio.run(generate())
        assert ids == expected
    finally:
        client.stop_job(job_id)
    deadline = time.monotonic() + 60
    while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert client.get_job_status(job_id) == job_submission.JobStatus.STOPPED
