"""``TinkerServer``: Tinker's HTTP protocol over a ``ServiceClient``, so that the unmodified ``tinker``
client (and the loops built on it, tinker-cookbook's) trains and samples with local models
(docs/embedding.md, "Serving the Tinker API"; ``verl-core serve`` starts one).

Standard library only (``http.server``, one thread per connection). Every request needs the token in
the ``X-API-Key`` header (the client sends its API key there). A mutating call (``create_model``,
``forward_backward``, ``optim_step``, saving and loading, ``asample``) answers a request id at once
and runs on the ``ServiceClient``'s clients in the order each model's calls arrive; the client then
polls ``retrieve_future``, which waits a little for the result and answers it, ``try_again``, or the
call's error (``{"error": message, "category": "user"}`` for bad input: the client raises it as a
``RequestFailedError`` with our message). ``forward_backward`` arrives and its output and samples go
back in protobuf (``verl_core.service.wire``), as the client insists; the rest is JSON.

Model ids are Tinker's ``<session_id>:train:<n>``, sampler ids ``<session_id>:sample:<n>``; states
and sampler weights live under the ``ServiceClient``'s ``state_dir`` as ``tinker://`` paths, so a
server restarted on the same ``state_dir`` loads what an earlier one saved. A session's clients (and
their engines) are released when its client closes, or falls silent for ``session_timeout_s``; at
most ``samplers_in_memory`` samplers stay loaded, the others reloaded from their folder when asked
for; a request repeated with the same ``X-Idempotency-Key`` (the client's retry) runs once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs

from verl_core.service.clients import (
    LORA_MODULES,
    RUN_FILE,
    SAMPLER_WEIGHTS,
    SamplingClient,
    ServiceClient,
    TrainingClient,
    _Run,
)
from verl_core.service.types import AdamParams, ModelInput, SamplingParams
from verl_core.service.wire import (
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)

#: The header the ``tinker`` client sends its API key in.
TOKEN_HEADER = "X-API-Key"
#: Seconds a ``retrieve_future`` waits for the result before answering ``try_again``.
POLL_WAIT_S = 5.0
#: Seconds a result stays retrievable after it was first answered (a client may poll again when the
#: answer did not reach it); then it is dropped.
RETAIN_S = 300.0
#: What ``client/config`` tells the client: send each model's calls one after the other, uncompressed,
#: over httpx (no Rust transport), and poll each future on its own.
CLIENT_CONFIG = {
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
#: The calls that change state: a repeat of one (the client retrying with the same ``X-Idempotency-Key``)
#: gets the first one's answer instead of running again.
MUTATING = {
    "create_session",
    "create_model",
    "forward_backward",
    "optim_step",
    "save_weights",
    "load_weights",
    "save_weights_for_sampler",
    "create_sampling_session",
    "asample",
}
#: The header of the key the client keeps across the retries of one request.
IDEMPOTENCY_HEADER = "X-Idempotency-Key"
#: Errors of bad input: the client sees them as category ``user``; anything else is ``server``.
USER_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, FileExistsError, WireError)
#: The content type of protobuf bodies (``forward_backward`` requests; its outputs and samples).
PROTOBUF = "application/x-protobuf"

#: What of Tinker's API this server does not serve, each with why: the answer a client gets.
UNSUPPORTED = {
    "create_custom_loss": "server-side custom losses are not supported: forward_backward_custom runs "
    "the loss in the client (the client's default)",
    "copy_weights": "copy_weights is not supported: states stay in this server's state_dir",
    "save_weights_external": "save_weights_external is not supported: use save_state (tinker:// paths "
    "under the server's state_dir)",
    "join_sampling_session": "join_sampling_session is not supported: sampling clients are not shared "
    "between processes",
    "retrieve_futures": "retrieve_futures is not supported: poll each request with retrieve_future",
    "training_runs": "the REST API of training runs and checkpoints is not supported: the server's "
    "state_dir holds them",
    "checkpoints": "the REST API of checkpoints is not supported: the server's state_dir holds them",
    "sessions": "the REST API of sessions is not supported",
    "weights_info": "weights_info is not supported",
    "auth": "token exchange is not supported: send the server's token as the API key (TINKER_API_KEY)",
}


class _Failure(Exception):
    """An HTTP error answered at once (not through a future): status and message."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


@attrs.define
class _Reply:
    """The answer to a mutating request, for its repeats."""

    done: threading.Event = attrs.field(factory=threading.Event)
    value: tuple[str, bytes] | None = None
    error: BaseException | None = None
    when: float = 0.0


@attrs.define
class _Sampler:
    """A sampling session: its weights' ``folder``, and the ``client`` sampling them while it is in
    memory (``None`` once evicted: the next request loads it again)."""

    base_model: str
    model_path: str | None
    folder: Path
    client: SamplingClient | None
    used: float = 0.0
    lock: threading.Lock = attrs.field(factory=threading.Lock)


class TinkerServer:
    """Serve ``service`` on ``host:port`` (port 0: any free one; ``address`` says which) to clients that
    send ``token``. ``serve_forever`` blocks; ``shutdown`` stops it from another thread."""

    def __init__(
        self,
        service: ServiceClient,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        samplers_in_memory: int = 4,
        session_timeout_s: float = 600.0,
    ):
        if not token:
            raise ValueError("token is empty: clients must send a token the server knows")
        if samplers_in_memory < 1:
            raise ValueError(f"samplers_in_memory={samplers_in_memory}: keep at least 1 sampler in memory")
        self.service = service
        self.token = token
        #: Sampling sessions kept loaded; the least recently used beyond it are evicted (an RL loop makes
        #: one per step) and loaded again from their folder when asked for.
        self.samplers_in_memory = samplers_in_memory
        #: A session silent this long (the client heartbeats every 10 s) is finished as if it had closed.
        self.session_timeout_s = session_timeout_s
        self._lock = threading.Lock()
        self._futures: dict[str, tuple[concurrent.futures.Future, Callable[[Any], Any]]] = {}
        self._models: dict[str, TrainingClient] = {}
        self._samplers: dict[str, _Sampler] = {}
        #: Each session's last heartbeat (``time.monotonic()``).
        self._sessions: dict[str, float] = {}
        #: When each request's result was first answered (``RETAIN_S``).
        self._answered: dict[str, float] = {}
        #: Mutating requests' answers by idempotency key (``RETAIN_S``).
        self._replies: dict[str, _Reply] = {}
        handler = type("Handler", (_Handler,), {"server_state": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- routing -------------------------------------------------------------------------------

    def handle(
        self, method: str, path: str, body: bytes, content_type: str, idempotency_key: str | None = None
    ) -> tuple[str, bytes]:
        """The ``(content type, body)`` answering one authorised request; raises ``_Failure``. A
        mutating request repeated with the same ``idempotency_key`` gets the first one's answer."""
        route = path.split("?")[0].rstrip("/")
        if not route.startswith("/api/v1/"):
            raise _Failure(HTTPStatus.NOT_FOUND, f"{route}: not an endpoint of Tinker's API")
        name = route[len("/api/v1/") :]
        if idempotency_key and name in MUTATING:
            return self._once(idempotency_key, lambda: self._route(name, body, content_type))
        return self._route(name, body, content_type)

    def _once(self, key: str, compute: Callable[[], tuple[str, bytes]]) -> tuple[str, bytes]:
        with self._lock:
            reply, first = self._replies.get(key), False
            if reply is None:
                reply, first = self._replies.setdefault(key, _Reply()), True
        if first:
            try:
                reply.value = compute()
            except BaseException as error:
                reply.error = error
                raise
            finally:
                reply.when = time.monotonic()
                reply.done.set()
        reply.done.wait()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def _route(self, name: str, body: bytes, content_type: str) -> tuple[str, bytes]:
        if name == "forward_backward":
            if PROTOBUF not in content_type:
                raise _Failure(HTTPStatus.BAD_REQUEST, "forward_backward takes application/x-protobuf")
            return self._json(self._submit(lambda: self._forward_backward(body)))
        request = self._parse_json(body) if body else {}
        if name.startswith("samplers/"):
            return self._json(self._get_sampler(name[len("samplers/") :]))
        if name.startswith("sessions/") and name.endswith("/finish"):
            return self._json(self._finish_session(name.split("/")[1]))
        handler = self._ROUTES.get(name)
        if handler is None:
            reason = UNSUPPORTED.get(name.split("/")[0])
            message = reason or f"/api/v1/{name} is not an endpoint verl-core serve knows"
            raise _Failure(HTTPStatus.NOT_FOUND, f"{message} (verl-core serve)")
        result = handler(self, request)
        return (PROTOBUF, result) if isinstance(result, bytes) else self._json(result)

    @staticmethod
    def _parse_json(body: bytes) -> dict[str, Any]:
        try:
            request = json.loads(body)
        except ValueError as error:
            raise _Failure(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {error}") from None
        if not isinstance(request, dict):
            raise _Failure(HTTPStatus.BAD_REQUEST, "the body is not a JSON object")
        return request

    @staticmethod
    def _json(document: Any) -> tuple[str, bytes]:
        return "application/json", json.dumps(document).encode()

    # -- futures -------------------------------------------------------------------------------

    def _submit(
        self, start: Callable[[], tuple[concurrent.futures.Future | Any, Callable[[Any], Any]]], **extra: Any
    ) -> dict[str, Any]:
        """Start a call (``start`` returns its future, or a plain result, and how to answer its
        result) under a new request id; bad input raised by ``start`` fails the future, not the POST."""
        request_id = uuid.uuid4().hex
        try:
            result, answer = start()
        except BaseException as error:  # noqa: BLE001 - answered through the future
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(error)
            answer = _identity
        else:
            if isinstance(result, concurrent.futures.Future):
                future = result
            else:
                future = concurrent.futures.Future()
                future.set_result(result)
        with self._lock:
            self._futures[request_id] = (future, answer)
            now = time.monotonic()
            for key in [key for key, when in self._answered.items() if now - when > RETAIN_S]:
                del self._answered[key], self._futures[key]
            for key in [
                key for key, reply in self._replies.items() if reply.when and now - reply.when > RETAIN_S
            ]:
                del self._replies[key]
        return {"request_id": request_id, **extra}

    def _retrieve(self, request: Mapping[str, Any]) -> Any:
        request_id = request.get("request_id")
        with self._lock:
            entry = self._futures.get(request_id)
        if entry is None:
            raise _Failure(HTTPStatus.NOT_FOUND, f"no request {request_id!r} on this server")
        future, answer = entry
        try:
            result = future.result(timeout=POLL_WAIT_S)
        except concurrent.futures.TimeoutError:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        except BaseException as error:  # noqa: BLE001 - the call's error, for the client
            category = "user" if isinstance(error, USER_ERRORS) else "server"
            return {"error": _message(error), "category": category}
        with self._lock:
            self._answered.setdefault(request_id, time.monotonic())
        try:
            return answer(result)
        except BaseException as error:  # noqa: BLE001
            return {"error": _message(error), "category": "server"}

    # -- service -------------------------------------------------------------------------------

    def _create_session(self, request: Mapping[str, Any]) -> dict[str, Any]:
        session_id = uuid.uuid4().hex[:12]
        with self._lock:
            self._sessions[session_id] = time.monotonic()
        self._finish_silent_sessions()
        return {"type": "create_session", "session_id": session_id}

    def _heartbeat(self, request: Mapping[str, Any]) -> dict[str, Any]:
        session_id = request.get("session_id")
        with self._lock:
            known = session_id in self._sessions
            if known:
                self._sessions[session_id] = time.monotonic()
        self._finish_silent_sessions()
        if not known:  # 410: the client stops heartbeating
            raise _Failure(HTTPStatus.GONE, f"session {session_id!r} has finished (or this server restarted)")
        return {"type": "session_heartbeat"}

    def _finish_silent_sessions(self) -> None:
        """Finish the sessions whose client went away without closing (no heartbeat for
        ``session_timeout_s``): their engines are released."""
        now = time.monotonic()
        with self._lock:
            silent = [key for key, seen in self._sessions.items() if now - seen > self.session_timeout_s]
        for session_id in silent:
            self._finish_session(session_id)

    def _finish_session(self, session_id: str) -> dict[str, Any]:
        """The session's clients are closed (after their calls in flight) and their engines released;
        what they saved stays in ``state_dir``."""
        prefix = f"{session_id}:"
        with self._lock:
            self._sessions.pop(session_id, None)
            clients: list[Any] = [
                self._models.pop(key) for key in list(self._models) if key.startswith(prefix)
            ]
            samplers = [self._samplers.pop(key) for key in list(self._samplers) if key.startswith(prefix)]
        for sampler in samplers:
            with sampler.lock:
                clients += [sampler.client] if sampler.client is not None else []
                sampler.client = None
        for client in clients:
            self._release(client)
        return {}

    def _release(self, client: TrainingClient | SamplingClient) -> None:
        """Close ``client`` (after its calls in flight) and let its engine or model go."""
        client.close()
        with contextlib.suppress(ValueError):
            self.service._clients.remove(client)

    def _capabilities(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "supported_models": [
                {"model_name": name, "trainable": True, "sampleable": True}
                for name in self.service.base_models
            ]
        }

    def _create_model(self, request: Mapping[str, Any]) -> dict[str, Any]:
        model_id = f"{request.get('session_id')}:train:{request.get('model_seq_id')}"

        def start() -> tuple[concurrent.futures.Future, Callable[[Any], Any]]:
            base_model, lora = request.get("base_model"), request.get("lora_config")
            if lora is None:  # not sent by the tinker client, which trains LoRA only
                self.service._model_path(base_model)
                run, seed = _Run(base_model, None), None
            else:
                flags = {flag: bool(lora.get(flag, True)) for flag in LORA_MODULES}
                run, seed = self.service._lora_run(base_model, lora.get("rank"), flags), lora.get("seed")
            future = self.service._worker.submit(lambda: self.service._create(run, seed, model_id=model_id))
            return future, self._register_model

        return self._submit(start, model_id=model_id)

    def _register_model(self, client: TrainingClient) -> dict[str, Any]:
        with self._lock:
            self._models[client.model_id] = client
        return {"type": "create_model", "model_id": client.model_id}

    def _model(self, model_id: Any) -> TrainingClient:
        with self._lock:
            client = self._models.get(model_id)
        if client is None:
            raise ValueError(
                f"no model {model_id!r} on this server: create it first (create_lora_training_client)"
            )
        return client

    def _get_info(self, request: Mapping[str, Any]) -> dict[str, Any]:
        try:
            client = self._model(request.get("model_id"))
        except ValueError as error:
            raise _Failure(HTTPStatus.NOT_FOUND, str(error)) from None
        info = client.get_info()
        return {
            "type": "get_info",
            "model_id": info.model_id,
            "model_data": {
                "model_name": info.model_data.model_name,
                "arch": "unknown",
                "tokenizer_id": self.service.base_models[info.model_data.model_name],
            },
            "is_lora": info.is_lora,
            "lora_rank": info.lora_rank,
            "model_name": info.model_data.model_name,
        }

    # -- training ------------------------------------------------------------------------------

    def _forward_backward(self, body: bytes) -> tuple[concurrent.futures.Future, Callable[[Any], Any]]:
        request = decode_forward_backward(body)
        client = self._model(request["model_id"])
        call = client.forward if request["forward_only"] else client.forward_backward
        config = request["loss_fn_config"] or None
        return call(request["data"], request["loss_fn"], config), encode_forward_backward_output

    def _optim_step(self, request: Mapping[str, Any]) -> dict[str, Any]:
        def start() -> tuple[concurrent.futures.Future, Callable[[Any], Any]]:
            params = request.get("adam_params") or request.get("optim_params")
            if not isinstance(params, dict):
                raise ValueError("optim_step takes adam_params (other optimisers are not supported)")
            fields = attrs.fields_dict(AdamParams)
            unknown = sorted(set(params) - set(fields) - {"type"})
            if unknown:
                raise ValueError(f"adam_params: unknown keys {unknown}; known: {sorted(fields)}")
            adam = AdamParams(**{key: float(value) for key, value in params.items() if key in fields})
            future = self._model(request.get("model_id")).optim_step(adam)
            return future, lambda response: {"type": "optim_step", "metrics": dict(response.metrics or {})}

        return self._submit(start)

    def _save_weights(self, request: Mapping[str, Any]) -> dict[str, Any]:
        def start() -> tuple[concurrent.futures.Future, Callable[[Any], Any]]:
            client = self._model(request.get("model_id"))
            name = request.get("path") or f"state-{uuid.uuid4().hex[:8]}"
            future = client.save_state(name, overwrite=bool(request.get("overwrite")))
            return future, lambda response: {"type": "save_weights", "path": response.path}

        return self._submit(start)

    def _load_weights(self, request: Mapping[str, Any]) -> dict[str, Any]:
        optimizer = bool(request.get("optimizer"))
        path = request.get("path")
        if request.get("model_id") is None:  # create_training_client_from_state: a new model
            model_id = f"{request.get('session_id')}:train:{request.get('model_seq_id')}"

            def create() -> tuple[concurrent.futures.Future, Callable[[Any], Any]]:
                future = self.service._from_state(path, optimizer, model_id=model_id)
                return future, lambda client: {
                    **self._register_model(client),
                    "type": "load_weights",
                    "path": path,
                }

            return self._submit(create, model_id=model_id)

        def start() -> tuple[concurrent.futures.Future, Callable[[Any], Any]]:
            client = self._model(request.get("model_id"))
            future = client.load_state_with_optimizer(path) if optimizer else client.load_state(path)
            return future, lambda response: {"type": "load_weights", "path": response.path}

        return self._submit(start)

    def _save_weights_for_sampler(self, request: Mapping[str, Any]) -> dict[str, Any]:
        def start() -> tuple[concurrent.futures.Future, Callable[[Any], Any]]:
            client = self._model(request.get("model_id"))
            if request.get("path"):
                future = client.save_weights_for_sampler(request["path"])
                return future, lambda response: {"type": "save_weights_for_sampler", "path": response.path}
            # save_weights_and_get_sampling_client: a sampling session on the weights as they are now
            sampler_id = f"{request.get('model_id')}:sample:{request.get('sampling_session_seq_id')}"
            future = client.save_weights_and_get_sampling_client()

            def answer(sampling: SamplingClient) -> dict[str, Any]:
                self._add_sampler(sampler_id, sampling, client._run.base_model, _tinker_path(sampling))
                return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

            return future, answer

        return self._submit(start)

    # -- sampling ------------------------------------------------------------------------------

    def _add_sampler(
        self, sampler_id: str, client: SamplingClient, base_model: str, path: str | None
    ) -> None:
        sampler = _Sampler(base_model, path, Path(client.model_path), client, time.monotonic())
        with self._lock:
            self._samplers[sampler_id] = sampler
        self._evict(keep=sampler)

    def _evict(self, keep: _Sampler) -> None:
        """Close the least recently used samplers beyond ``samplers_in_memory`` (``keep`` stays)."""
        with self._lock:
            live = sorted(
                (s for s in self._samplers.values() if s.client is not None and s is not keep),
                key=lambda s: s.used,
            )
        for sampler in live[: max(0, len(live) + 1 - self.samplers_in_memory)]:
            with sampler.lock:  # after the samples already submitted to it
                client, sampler.client = sampler.client, None
                if client is not None:
                    self._release(client)

    def _submit_sample(self, sampler: _Sampler, submit: Callable[[SamplingClient], Any]) -> Any:
        """``submit(client)`` on the sampler's client, loading it again if it was evicted."""
        with sampler.lock:
            loaded = sampler.client is None
            if loaded:
                sampler.client = self.service._sampling_client(sampler.folder, sampler.base_model or None)
            sampler.used = time.monotonic()
            result = submit(sampler.client)
        if loaded:
            self._evict(keep=sampler)
        return result

    def _create_sampling_session(self, request: Mapping[str, Any]) -> dict[str, Any]:
        sampler_id = f"{request.get('session_id')}:sample:{request.get('sampling_session_seq_id')}"
        model_path, base_model = request.get("model_path"), request.get("base_model")
        try:
            if model_path is not None:
                future = self.service.create_sampling_client(model_path=model_path)
                run = self._run_of(model_path)
                base_model = run.base_model if run is not None else base_model
            else:
                future = self.service.create_sampling_client(base_model=base_model)
            client = future.result()
        except FileNotFoundError as error:
            raise _Failure(
                HTTPStatus.BAD_REQUEST,
                f"{error}: no sampler weights were saved there; save them first (save_weights_for_sampler, "
                "or save_weights_and_get_sampling_client)",
            ) from None
        except USER_ERRORS as error:
            raise _Failure(HTTPStatus.BAD_REQUEST, _message(error)) from None
        self._add_sampler(sampler_id, client, base_model or "", model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _run_of(self, model_path: str) -> _Run | None:
        folder = self.service.resolve_path(model_path, SAMPLER_WEIGHTS)
        record = folder.parent.parent / RUN_FILE
        return _Run(**json.loads(record.read_text())) if record.is_file() else None

    def _sampler(self, sampler_id: Any) -> _Sampler:
        with self._lock:
            sampler = self._samplers.get(sampler_id)
        if sampler is None:
            raise ValueError(
                f"no sampling session {sampler_id!r} on this server: save weights for a sampler first "
                "(save_weights_and_get_sampling_client, or create_sampling_client with a saved path or "
                "a base model)"
            )
        return sampler

    def _get_sampler(self, sampler_id: str) -> dict[str, Any]:
        try:
            sampler = self._sampler(sampler_id)
        except ValueError as error:
            raise _Failure(HTTPStatus.NOT_FOUND, str(error)) from None
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def _asample(self, request: Mapping[str, Any]) -> dict[str, Any]:
        count = request.get("num_samples", 1)
        ids = [uuid.uuid4().hex for _ in range(count if isinstance(count, int) and count > 0 else 0)]

        def start() -> tuple[concurrent.futures.Future, Callable[[Any], Any]]:
            for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
                if request.get(key):
                    raise ValueError(f"{key} is not supported: leave it 0")
            for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
                if request.get(key) is not None:
                    raise ValueError(f"{key} is not supported: leave it unset")
            sampler = self._sampler(request.get("sampling_session_id"))
            prompt = _model_input(request.get("prompt"))
            params = dict(request.get("sampling_params") or {})
            fields = attrs.fields_dict(SamplingParams)
            unknown = sorted(set(params) - set(fields))
            if unknown:
                raise ValueError(f"sampling_params: unknown keys {unknown}; known: {sorted(fields)}")
            future = self._submit_sample(
                sampler,
                lambda client: client.sample(
                    prompt,
                    count,
                    SamplingParams(**params),
                    include_prompt_logprobs=bool(request.get("prompt_logprobs")),
                ),
            )
            return future, encode_sample_response

        return self._submit(start, sample_sequence_ids=ids)

    _ROUTES: dict[str, Callable[[TinkerServer, Mapping[str, Any]], Any]] = {
        "healthz": lambda self, request: {"status": "ok"},
        "client/config": lambda self, request: dict(CLIENT_CONFIG),
        "client/dynamic_config": lambda self, request: {},
        "telemetry": lambda self, request: {"status": "accepted"},
        "session_heartbeat": _heartbeat,
        "create_session": _create_session,
        "get_server_capabilities": _capabilities,
        "create_model": _create_model,
        "get_info": _get_info,
        "optim_step": _optim_step,
        "save_weights": _save_weights,
        "load_weights": _load_weights,
        "save_weights_for_sampler": _save_weights_for_sampler,
        "create_sampling_session": _create_sampling_session,
        "asample": _asample,
        "retrieve_future": _retrieve,
        "cancel_future": lambda self, request: {},
    }


def _identity(result: Any) -> Any:
    return result


def _message(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if not isinstance(error, KeyError) else f"missing key {text}"


def _tinker_path(client: SamplingClient) -> str:
    folder = Path(client.model_path)
    return f"tinker://{folder.parent.parent.name}/{SAMPLER_WEIGHTS}/{folder.name}"


def _model_input(value: Any) -> ModelInput:
    if not isinstance(value, dict) or not isinstance(value.get("chunks"), list):
        raise ValueError("prompt: a ModelInput ({'chunks': [...]}) is required")
    tokens = []
    for index, chunk in enumerate(value["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise ValueError(
                f"prompt.chunks[{index}] is {kind!r}: only encoded_text (token ids) is supported"
            )
        tokens += [int(token) for token in chunk.get("tokens", [])]
    return ModelInput.from_ints(tokens)


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests, answered by ``server_state`` (the ``TinkerServer``)."""

    server_state: TinkerServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        state = self.server_state
        try:
            if not hmac.compare_digest(self.headers.get(TOKEN_HEADER, "").encode(), state.token.encode()):
                raise _Failure(
                    HTTPStatus.UNAUTHORIZED,
                    f"no valid token in the {TOKEN_HEADER} header: set TINKER_API_KEY (or the client's "
                    "api_key) to the server's token (its config's token, or $VERL_CORE_SERVE_TOKEN)",
                )
            if self.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                raise _Failure(HTTPStatus.BAD_REQUEST, "compressed request bodies are not supported")
            result = state.handle(
                method,
                self.path,
                body,
                self.headers.get("Content-Type", ""),
                self.headers.get(IDEMPOTENCY_HEADER),
            )
            status = HTTPStatus.OK
        except _Failure as failure:
            status, result = (
                failure.status,
                ("application/json", json.dumps({"detail": str(failure)}).encode()),
            )
        except Exception as error:  # noqa: BLE001 - the server keeps serving; the client sees why
            print(f"verl-core serve: {method} {self.path}: {error!r}", file=sys.stderr)
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            result = ("application/json", json.dumps({"detail": _message(error)}).encode())
        content_type, payload = result
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            if status >= 400:
                self.send_header("x-should-retry", "false")
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client went away: its result stays retrievable
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # one line per poll would drown the log
