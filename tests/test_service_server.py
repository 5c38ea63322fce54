"""``verl-core serve`` with the real ``tinker`` client and tinker-cookbook's loops (docs/embedding.md,
"Serving the Tinker API"): one server (a subprocess, on loopback, over the demo's tiny model) for the
module; the unmodified client trains and samples through it; bad input comes back as clear errors and
the server keeps serving; a restarted server loads what an earlier one saved; the cookbook's
supervised loop lowers the loss and its RL loop raises the reward; no process reaches beyond
loopback. The wire codec is checked against the client's own protobuf module."""

from __future__ import annotations

import ast
import contextlib
import http.client
import json
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

tinker = pytest.importorskip(
    "tinker", reason="the tinker client: pip install tinker==0.38.0 (nox integrations)"
)
pytest.importorskip(
    "tinker_cookbook",
    reason="tinker-cookbook: pip install tinker-cookbook (0.5.8 on Python 3.11; nox integrations)",
)

from fixtures.demo import build_small_demo  # noqa: E402
from fixtures.sockets import describe, recorded, spied_environment  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tinker import types  # noqa: E402

TOKEN = "tml-verl-core-test"
NAME = "verl-demo/tiny"
COOKBOOK_RUN = Path(__file__).parent / "fixtures" / "tinker_cookbook_run.py"


class Server:
    """``verl-core serve`` in a subprocess; ``start`` waits for its address."""

    def __init__(self, folder: Path, config: Path, env: dict[str, str]):
        self.folder, self.config, self.env = folder, config, env
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = self.folder / f"server-{self.starts}.log"
        self.log = log
        with log.open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "verl_core", "serve", str(self.config)],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            for line in log.read_text().splitlines():
                if "listening on " in line:
                    self.url = line.split("listening on ")[1].split()[0]
                    return
            if self.process.poll() is not None:
                raise AssertionError(
                    f"verl-core serve exited {self.process.returncode}:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.2)
        raise AssertionError(f"verl-core serve did not start:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            assert self.process.wait(timeout=60) == 0, self.log.read_text()[-3000:]
        self.process = None

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def request(self, path: str, body: object = None, token: str | None = TOKEN) -> tuple[int, dict]:
        return post(self.url, path, body, token)


def post(url: str, path: str, body: object = None, token: str | None = TOKEN) -> tuple[int, dict]:
    """POST ``body`` as JSON to the server at ``url``: the status and the JSON answer."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json"} | ({"X-API-Key": token} if token else {})
    connection.request("POST", path, body=json.dumps(body or {}), headers=headers)
    response = connection.getresponse()
    answer = json.loads(response.read() or b"{}")
    connection.close()
    return response.status, answer


@contextlib.contextmanager
def in_process_server(served, **options):
    """A ``TinkerServer`` in this process (to look inside it) on the module's demo model: its URL."""
    from verl_core.config import EngineConfig, ModelConfig
    from verl_core.service import ServiceClient, TinkerServer

    model = str(served.demo.model)
    engine = EngineConfig(backend="ddp", device="cpu", model=ModelConfig(path=model))
    local = ServiceClient(
        {NAME: model}, state_dir=served.folder / f"state-{uuid.uuid4().hex[:6]}", engine=engine
    )
    server = TinkerServer(local, TOKEN, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.address
    try:
        yield server, f"http://{host}:{port}"
    finally:
        server.shutdown()
        local.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    demo = build_small_demo(folder / "demo", train_size=64, sft_size=64)
    config = folder / "serve.yaml"
    config.write_text(
        json.dumps(
            {
                "host": "127.0.0.1",
                "port": 0,
                "base_models": {NAME: str(demo.model)},
                "state_dir": str(folder / "state"),
                "engine": {
                    "backend": "ddp",
                    "device": "cpu",
                    "optim": {"betas": [0.9, 0.95], "eps": 1e-12, "weight_decay": 0.0, "clip_grad": 0.0},
                    "micro_batch": {"micro_batch_size": 8},
                },
            }
        )
    )
    env, log = spied_environment(folder)
    env |= {
        "VERL_CORE_SERVE_TOKEN": TOKEN,  # the config leaves token empty: the environment gives it
        "HF_HUB_OFFLINE": "1",
        "TINKER_API_KEY": TOKEN,
    }
    server = Server(folder, config, env)
    server.start()
    server.demo, server.socket_log = demo, log
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def service(served):
    client = tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
    yield client
    client.holder.close()


def sft_data(served, count: int = 4) -> list:
    from fixtures.tinker_loops import sft_datum, tokenizer_of

    tokenizer = tokenizer_of(str(served.demo.model))
    rows = [json.loads(line) for line in served.demo.sft.read_text().splitlines()[:count]]
    return [sft_datum(tokenizer, row["prompt"], row["response"]) for row in rows]


def train_steps(client, data, steps: int, learning_rate: float) -> list[float]:
    losses = []
    for _ in range(steps):
        result = client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
        losses.append(result.result().metrics["loss:sum"])
    return losses


def test_the_tinker_client_trains_and_samples(served, service) -> None:
    capabilities = service.get_server_capabilities()
    assert [model.model_name for model in capabilities.supported_models] == [NAME]
    client = service.create_lora_training_client(base_model=NAME, rank=8).result()
    info = client.get_info()
    assert info.model_data.model_name == NAME and info.lora_rank == 8
    assert client.get_tokenizer().decode(client.get_tokenizer().encode("rev 12=")) == "rev 12="  # offline
    data = sft_data(served)
    losses = train_steps(client, data, 4, learning_rate=2e-2)
    assert losses[-1] < losses[0] - 1.0, losses

    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = data[0].model_input
    response = sampler.sample(
        prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=4)
    ).result()
    assert len(response.sequences) == 3
    assert len({sequence.sequence_id for sequence in response.sequences}) == 3
    for sequence in response.sequences:
        assert 1 <= len(sequence.tokens) <= 4 and len(sequence.logprobs) == len(sequence.tokens)
        assert all(value <= 0 for value in sequence.logprobs)
    # The sampler scores the prompt as the training client does (LoRA merged into the sampler's weights).
    tokens = data[0].model_input.to_ints() + [data[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    trained = client.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert scored[0] is None
    assert scored[1:] == pytest.approx(trained, abs=1e-4)


def test_a_learning_rate_of_zero_leaves_the_loss_where_it_was(served, service) -> None:
    """The check above can fail: without updates the loss does not fall."""
    client = service.create_lora_training_client(base_model=NAME, rank=8).result()
    losses = train_steps(client, sft_data(served), 2, learning_rate=0.0)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_requests_without_the_token_are_refused(served) -> None:
    status, answer = served.request("/api/v1/get_server_capabilities", token=None)
    assert status == 401 and "X-API-Key" in answer["detail"] and "token" in answer["detail"]
    assert served.request("/api/v1/get_server_capabilities", token="tml-wrong")[0] == 401
    assert served.request("/api/v1/get_server_capabilities")[0] == 200  # the right token passes
    with pytest.raises(tinker.AuthenticationError, match="X-API-Key"):
        tinker.ServiceClient(base_url=served.url, api_key="tml-wrong").get_server_capabilities()


def test_bad_input_comes_back_as_a_clear_error_and_the_server_keeps_serving(served, service) -> None:
    with pytest.raises(tinker.RequestFailedError, match=rf"unknown base model 'nope'.*\['{NAME}'\]"):
        service.create_lora_training_client(base_model="nope").result()

    data = sft_data(served, 2)
    client = service.create_lora_training_client(base_model=NAME, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="nope.*cross_entropy"):
        client.forward_backward(data, "nope").result()

    client = service.create_lora_training_client(base_model=NAME, rank=4).result()
    short = types.Datum(
        model_input=data[0].model_input,
        loss_fn_inputs={"target_tokens": data[0].loss_fn_inputs["target_tokens"], "weights": [1.0]},
    )
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].*weights"):
        client.forward_backward([short], "cross_entropy").result()

    client = service.create_lora_training_client(base_model=NAME, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="no sampler weights were saved there; save them first"):
        service.create_sampling_client(model_path=f"tinker://{client.model_id}/sampler_weights/never").sample(
            data[0].model_input, 1, types.SamplingParams(max_tokens=2)
        ).result()
    # The server still trains, the last client included.
    assert len(train_steps(client, data, 1, learning_rate=1e-3)) == 1


def test_a_client_that_disconnects_mid_call_harms_nothing(served, service) -> None:
    host, port = served.host_port
    # A body cut short: the connection closes before the server has read it.
    with socket.create_connection((host, port), timeout=30) as raw:
        raw.sendall(
            b"POST /api/v1/create_model HTTP/1.1\r\nHost: x\r\nX-API-Key: "
            + TOKEN.encode()
            + b'\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"session_id":'
        )
    # A poll abandoned before its answer: the call runs on, and a later poll gets its result.
    status, future = served.request(
        "/api/v1/create_model",
        {"session_id": "raw", "model_seq_id": 0, "base_model": NAME, "lora_config": {"rank": 4}},
    )
    assert status == 200
    with socket.create_connection((host, port), timeout=30) as raw:
        body = json.dumps({"request_id": future["request_id"]}).encode()
        raw.sendall(
            b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: x\r\nX-API-Key: "
            + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
    answer = {"type": "try_again"}
    while answer.get("type") == "try_again":
        status, answer = served.request("/api/v1/retrieve_future", {"request_id": future["request_id"]})
    assert status == 200 and answer["model_id"] == "raw:train:0", answer
    assert served.request("/api/v1/healthz")[1] == {"status": "ok"}


def test_a_repeated_request_runs_once(served) -> None:
    """The client repeats a request whose answer it missed with the same X-Idempotency-Key: the
    second gets the first's request id (one optimiser step, not two); another key runs again."""
    step = {"model_id": "raw:train:0", "adam_params": {"learning_rate": 0.0}, "seq_id": 1}

    def post(key: str) -> dict:
        connection = http.client.HTTPConnection(*served.host_port, timeout=60)
        headers = {"Content-Type": "application/json", "X-API-Key": TOKEN, "X-Idempotency-Key": key}
        connection.request("POST", "/api/v1/optim_step", body=json.dumps(step), headers=headers)
        answer = json.loads(connection.getresponse().read())
        connection.close()
        return answer

    first, again, other = post("key-1"), post("key-1"), post("key-2")
    assert again["request_id"] == first["request_id"] != other["request_id"]


def test_an_evicted_sampler_loads_again_from_its_weights(served) -> None:
    """With one sampler in memory, a second evicts the first; the first, sampled again, is loaded
    from its folder and scores as before. (A server in this process, to see the eviction.)"""
    with in_process_server(served, samplers_in_memory=1) as (server, url):
        client = tinker.ServiceClient(base_url=url, api_key=TOKEN)
        training = client.create_lora_training_client(base_model=NAME, rank=8).result()
        data = sft_data(served)
        prompt = types.ModelInput.from_ints(data[0].model_input.to_ints())
        first = training.save_weights_and_get_sampling_client().result()
        before = first.compute_logprobs(prompt).result()
        train_steps(training, data, 2, learning_rate=2e-2)
        second = training.save_weights_and_get_sampling_client().result()
        trained = second.compute_logprobs(prompt).result()
        assert [sampler.client is None for sampler in server._samplers.values()] == [True, False]
        again = first.compute_logprobs(prompt).result()
        assert [sampler.client is None for sampler in server._samplers.values()] == [False, True]
        client.holder.close()
    assert again[1:] == pytest.approx(before[1:], abs=1e-5)
    assert trained[1:] != pytest.approx(before[1:], abs=1e-3)  # what a sampler on other weights scores


def test_a_silent_session_is_finished_and_its_models_released(served) -> None:
    """A client gone without closing stops heartbeating: after session_timeout_s its session is
    finished (its model released, its heartbeat answered 410: the client stops)."""
    with in_process_server(served, session_timeout_s=1.0) as (server, url):
        session = post(url, "/api/v1/create_session")[1]["session_id"]
        request = {"session_id": session, "model_seq_id": 0, "base_model": NAME, "lora_config": {"rank": 4}}
        future = post(url, "/api/v1/create_model", request)[1]
        answer = {"type": "try_again"}
        while answer.get("type") == "try_again":
            answer = post(url, "/api/v1/retrieve_future", {"request_id": future["request_id"]})[1]
        model = {"model_id": answer["model_id"]}
        assert post(url, "/api/v1/session_heartbeat", {"session_id": session})[0] == 200
        assert post(url, "/api/v1/get_info", model)[0] == 200
        time.sleep(1.2)
        post(url, "/api/v1/create_session")  # any session's start finishes the silent ones
        assert post(url, "/api/v1/get_info", model)[0] == 404
        assert post(url, "/api/v1/session_heartbeat", {"session_id": session})[0] == 410
        assert server._models == {}


def test_a_finished_session_releases_its_models(served) -> None:
    with tinker.ServiceClient(base_url=served.url, api_key=TOKEN) as session:
        model_id = session.create_lora_training_client(base_model=NAME, rank=4).result().model_id
        assert served.request("/api/v1/get_info", {"model_id": model_id})[0] == 200
    deadline = time.monotonic() + 30
    while (
        served.request("/api/v1/get_info", {"model_id": model_id})[0] == 200 and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    status, answer = served.request("/api/v1/get_info", {"model_id": model_id})
    assert status == 404 and "no model" in answer["detail"], answer


def test_a_restarted_server_loads_what_an_earlier_one_saved(served, service) -> None:
    client = service.create_lora_training_client(base_model=NAME, rank=8).result()
    data = sft_data(served)
    train_steps(client, data, 2, learning_rate=2e-2)
    path = client.save_state("resume").result().path
    before = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
    served.stop()
    served.start()
    restarted = tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
    try:
        resumed = restarted.create_training_client_from_state_with_optimizer(path).result()
        after = resumed.forward(data, "cross_entropy").result().metrics["loss:sum"]
        fresh = restarted.create_lora_training_client(base_model=NAME, rank=8).result()
        untrained = fresh.forward(data, "cross_entropy").result().metrics["loss:sum"]
    finally:
        restarted.holder.close()
    assert after == pytest.approx(before, rel=1e-5)
    assert untrained > before + 1.0  # what the comparison would see without the state


def test_the_docs_loop_runs_against_the_server(served, tmp_path) -> None:
    """docs/embedding.md's my_tinker_loop.py, as written, with the page's environment variables."""
    page = (Path(__file__).parents[1] / "docs" / "embedding.md").read_text()
    blocks = [
        block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "tinker.ServiceClient()" in block
    ]
    assert len(blocks) == 1
    (tmp_path / "my_tinker_loop.py").write_text(blocks[0])
    env = served.env | {"TINKER_BASE_URL": served.url, "TINKER_API_KEY": TOKEN}
    done = subprocess.run(
        [sys.executable, "my_tinker_loop.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    losses = [float(line.split()[1]) for line in lines[:5]]
    assert [line.split()[0] for line in lines[:5]] == ["0", "1", "2", "3", "4"] and losses[-1] < losses[0]
    assert re.fullmatch(r"tinker://\S+:train:\d+/weights/five-steps", lines[5])
    assert len(ast.literal_eval(lines[6])) == 2  # the two samples, decoded


def test_the_cookbook_loops_train_through_the_server(served, tmp_path) -> None:
    demo = served.demo
    settings = {
        "base_url": served.url,
        "model_name": NAME,
        "model_folder": str(demo.model),
        "sft_file": str(demo.sft),
        "rl_file": str(demo.train),
        "out": str(tmp_path),
        "lora_rank": 8,
        "sl_batch": 8,
        "sl_epochs": 2,
        "sl_lr": 2e-2,
        "rl_batch": 4,
        "rl_group": 16,
        "rl_steps": 8,
        "rl_lr": 5e-3,
    }
    done = subprocess.run(
        [sys.executable, str(COOKBOOK_RUN), json.dumps(settings)],
        env=served.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    from fixtures.tinker_loops import metrics

    nll = [row["train_mean_nll"] for row in metrics(tmp_path / "sl") if "train_mean_nll" in row]
    assert len(nll) == 16
    assert sum(nll[-4:]) / 4 < sum(nll[:2]) / 2 - 0.2, nll
    rewards = [
        row["env/all/reward/total"] for row in metrics(tmp_path / "rl") if "env/all/reward/total" in row
    ]
    assert len(rewards) == 8
    # A rise, not noise (sampling is not seeded: each run differs). Three runs here: slopes 0.030, 0.032
    # and 0.017 a step (each 3 to 11 standard errors above 0), last three steps 0.15 to 0.21 above the first.
    assert reward_slope(rewards) > 0.005 and sum(rewards[-3:]) / 3 > rewards[0] + 0.05, rewards

    started, calls = recorded(served.socket_log)
    commands = [line["argv"] for line in started]
    assert any("serve" in argv for argv in commands) and any(
        "tinker_cookbook_run" in argv for argv in commands
    )
    assert not calls, "a process reached beyond loopback:\n" + describe(calls)


def reward_slope(rewards: list[float]) -> float:
    """The least-squares slope of ``rewards`` over their steps."""
    steps = range(len(rewards))
    mean_step, mean_reward = sum(steps) / len(rewards), sum(rewards) / len(rewards)
    covariance = sum((s - mean_step) * (r - mean_reward) for s, r in zip(steps, rewards, strict=True))
    return covariance / sum((s - mean_step) ** 2 for s in steps)


# -- the wire codec against the client's own protobuf module ------------------------------------------

_datum = st.builds(
    lambda tokens, weights: (tokens, weights[: len(tokens)] + [0.5] * (len(tokens) - len(weights))),
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6),
    st.lists(st.floats(-4, 4, width=32), max_size=6),
)


@settings(max_examples=30, deadline=None)
@given(data=st.lists(_datum, min_size=1, max_size=3), lr=st.floats(0, 1), forward_only=st.booleans())
def test_forward_backward_requests_decode_as_the_client_encodes_them(data, lr, forward_only) -> None:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from verl_core.service.wire import decode_forward_backward

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens),
                    loss_fn_inputs={"target_tokens": tokens, "weights": weights},
                )
                for tokens, weights in data
            ],
            loss_fn="ppo",
            loss_fn_config={"clip_low_threshold": lr},
        ),
        model_id="m:train:0",
        seq_id=3,
    )
    proto = forward_backward_request_to_proto(request)
    proto.forward_only = forward_only
    decoded = decode_forward_backward(proto.SerializeToString())
    assert (decoded["model_id"], decoded["seq_id"], decoded["loss_fn"]) == ("m:train:0", 3, "ppo")
    assert decoded["forward_only"] is forward_only
    assert decoded["loss_fn_config"] == {"clip_low_threshold": lr}
    for datum, (tokens, weights) in zip(decoded["data"], data, strict=True):
        assert datum.model_input.to_ints() == tokens
        assert datum.loss_fn_inputs["target_tokens"].tolist() == tokens
        assert datum.loss_fn_inputs["weights"].tolist() == pytest.approx(weights)


@settings(max_examples=30, deadline=None)
@given(
    sequences=st.lists(
        st.lists(st.tuples(st.integers(0, 2**31 - 1), st.floats(-30, 0, width=32)), max_size=5),
        min_size=1,
        max_size=3,
    ),
    prompt=st.one_of(st.none(), st.lists(st.floats(-30, 0, width=32), max_size=4)),
)
def test_sample_responses_decode_as_the_client_reads_them(sequences, prompt) -> None:
    from tinker.proto.response_conv import deserialize_sample_response

    from verl_core.service.types import SampledSequence, SampleResponse
    from verl_core.service.wire import encode_sample_response

    ours = SampleResponse(
        [
            SampledSequence("stop" if index % 2 else "length", [t for t, _ in pairs], [lp for _, lp in pairs])
            for index, pairs in enumerate(sequences)
        ],
        None if prompt is None else [None, *prompt],
    )
    theirs = deserialize_sample_response(encode_sample_response(ours))
    for mine, read in zip(ours.sequences, theirs.sequences, strict=True):
        assert (read.stop_reason, read.tokens) == (mine.stop_reason, mine.tokens)
        assert (read.logprobs or []) == pytest.approx(mine.logprobs)  # no tokens: the client reads None
    if prompt is None:
        assert theirs.prompt_logprobs is None
    else:
        assert theirs.prompt_logprobs[0] is None and theirs.prompt_logprobs[1:] == pytest.approx(prompt)


def test_forward_backward_outputs_decode_as_the_client_reads_them() -> None:
    from tinker.proto.response_conv import deserialize_forward_backward_output

    from verl_core.service.types import ForwardBackwardOutput, TensorData
    from verl_core.service.wire import encode_forward_backward_output

    ours = ForwardBackwardOutput(
        "ArrayRecord",
        [
            {
                "logprobs": TensorData([-1.0, -2.5], "float32", [2]),
                "elementwise_loss": TensorData([1.0, 2.5], "float32", [2]),
            },
            {
                "logprobs": TensorData([-0.5], "float32", [1]),
                "elementwise_loss": TensorData([0.5], "float32", [1]),
            },
        ],
        {"loss:sum": 4.0},
    )
    theirs = deserialize_forward_backward_output(encode_forward_backward_output(ours))
    assert theirs.metrics == {"loss:sum": 4.0}
    assert [output["logprobs"].tolist() for output in theirs.loss_fn_outputs] == [[-1.0, -2.5], [-0.5]]
    assert [output["elementwise_loss"].shape for output in theirs.loss_fn_outputs] == [[2], [1]]
    assert not math.isnan(theirs.metrics["loss:sum"])
