"""``ClientEndpoint``: SGLang's ``RuntimeEndpoint`` that says who is calling, and records it.

sglang 0.5.23's ``RuntimeEndpoint`` sends every request through ``sglang.utils.http_request``
(urllib, no timeout, no extra headers or JSON fields; ``api_key`` becomes ``Authorization:
Bearer``, the one hook). A multi-tenant server must attribute every call, so this subclass
sends each HTTP call the frontend makes through one transport that adds the caller's
identity the three ways the load-test harness does, whichever the server reads::

    X-Client-Id: <client>          header: our server's identity when it has no tenant keys
    "routing_key": "<client>"      /generate JSON: SGLang's own field (cache-aware routing)
    "interaction_id", "app",       /generate JSON: the program run is one interaction, each
    "stage"                        call's index its stage (FairServe; SGLang ignores them)
    Authorization: Bearer <key>    when the client has an API key: the only identity with keys

It also bounds every call (connect and read timeouts: a dead server is an error, not a hang),
and records every ``/generate`` item as a harness ``CallRecord`` in a shared :class:`CallLog`
(send, first token, finish, prompt/completion/cached tokens from ``meta_info``, finish
reason, error), so frontend programs are measured by the load test's own code.

What is replaced, and what is kept:

* ``select`` is SGLang's, untouched: its two requests (the prefix with ``max_new_tokens`` 0,
  then one batch of prefix + each choice with ``return_logprob``) go through
  ``_generate_http_request``, which is overridden; the logprob arithmetic stays SGLang's.
* ``generate`` sends the body ``RuntimeEndpoint.generate`` sends, streamed (``stream_gen``)
  so the first-token time is observed; the frontend still gets ``(text, meta_info)``.
* ``generate_stream``, ``commit_lazy_operations`` (what ``fork`` sends), ``cache_prefix``
  (what ``run_batch`` sends), ``fill_image``, ``flush_cache``, ``get_server_info`` and
  ``concatenate_and_append`` send their usual requests through the same transport.
* ``__init__`` fetches ``/get_model_info`` through it too (the parent's has no timeout).

Records: one per prompt of a request (a ``select`` batch of 3 choices is 3 records, as the
server counts them), ``rid = f"{program_id}/{seq:03d}-{kind}[.i]"``, kind ``gen``, ``fork``,
``select.prefix``, ``select.choices``, ``cache`` ...; the wire ``rid`` is prefixed by the
log's ``run_tag``. A call that produced no tokens (``max_new_tokens`` 0: ``fork``, ``select``)
has its prefill done when it returns, so its ``first_token_s`` is its finish; a streamed call's
is its first chunk with tokens; a call that was not streamed and produced tokens is one
chunk at its response (an upper bound, as the harness does for a server that does not stream).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import requests
from requests.adapters import HTTPAdapter
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path
from sglang.lang.global_config import global_config

from ..loadclient import CallFailed, CallRecord, apply_chunk
from .call_log import (
    CallLog,
    EndpointUnreachable,
    FrontendCallError,
    call_kind,
    requests_by_kind,
)

__all__ = [
    "CallLog",
    "ClientEndpoint",
    "EndpointUnreachable",
    "FrontendCallError",
    "call_kind",
    "requests_by_kind",
]

_decode = msgspec.json.decode
# The optional request fields RuntimeEndpoint.generate copies from the sampling parameters.
_LOGPROB_FIELDS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class _Tag:
    """Which program an endpoint's calls belong to (see ``ClientEndpoint.for_program``)."""

    program_id: str
    app: str
    start_s: float | None
    seq: Any  # itertools.count: next() is atomic, executor threads share it


class ClientEndpoint(RuntimeEndpoint):
    """A ``RuntimeEndpoint`` whose every call carries ``client`` (see the module docstring).

    ``api_key``: sent as ``Authorization: Bearer`` (required by a server with tenant keys).
    ``timeout_s``: the longest a call may take (and the longest wait for a byte);
    ``connect_timeout_s``: for the connection. ``stream_gen``: ``gen`` calls stream over the
    wire (first-token time observed). ``log``: where records go (default: a new one).
    ``chat_template_name``: as RuntimeEndpoint (default: from the served model's path).
    """

    def __init__(
        self,
        base_url: str,
        client: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        stream_gen: bool = True,
        routing_key: bool = True,
        log: CallLog | None = None,
        chat_template_name: str | None = None,
    ) -> None:
        # RuntimeEndpoint.__init__ would fetch /get_model_info with no timeout and no identity;
        # this sets the same attributes through our transport.
        if not isinstance(client, str) or not client:
            raise ValueError("ClientEndpoint: field 'client' must be a non-empty string")
        super(RuntimeEndpoint, self).__init__()  # BaseBackend's
        self.support_concate_and_append = True
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = None
        self.client = client
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.stream_gen = stream_gen
        self.routing_key = routing_key
        self.log = log if log is not None else CallLog()
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=512)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._tag = _Tag(f"{client}-sgl", "sgl", None, itertools.count())
        self._local = threading.local()
        try:
            self.model_info = self._json(self._request("GET", "/get_model_info"))
        except FrontendCallError as e:
            raise EndpointUnreachable(str(e)) from None
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = get_chat_template_by_model_path(self.model_info["model_path"])

    def for_program(
        self, program_id: str, *, app: str, start_s: float | None = None
    ) -> ClientEndpoint:
        """This endpoint for one program run: its calls are recorded under ``program_id``;
        ``start_s`` (log time) is its first call's ``arrival_s`` (the program's scheduled
        start, so a late start shows as the harness's send lag)."""
        ep = copy.copy(self)  # shares the session, the log and the model info
        ep._tag = _Tag(program_id, app, start_s, itertools.count())
        ep._local = threading.local()
        return ep

    @property
    def headers(self) -> dict[str, str]:
        h = {"X-Client-Id": self.client, "Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    # ---- RuntimeEndpoint's calls, through the transport ----------------------------------

    def generate(self, s, sampling_params):
        data = self._generate_body(s, sampling_params)
        if not self.stream_gen:
            obj = self._generate(data, kind="gen", stream=False)
            return obj["text"], obj["meta_info"]
        text, meta = "", {}
        for text, meta in self._generate(data, kind="gen", stream=True):  # noqa: B007
            pass
        return text, meta

    def generate_stream(self, s, sampling_params):
        data = self._generate_body(s, sampling_params)
        pos = 0
        for text, meta in self._generate(data, kind="gen", stream=True):
            yield text[pos:], meta
            pos = len(text)

    def select(self, s, choices, temperature, choices_method):
        self._local.kind = "select"
        try:
            return super().select(s, choices, temperature, choices_method)
        finally:
            self._local.kind = None

    def _generate_http_request(self, s, data):
        self._add_images(s, data)
        kind = getattr(self._local, "kind", None) or "prefill"
        if kind == "select":  # its prefix alone, then one batch of prefix + each choice
            kind = "select.choices" if _is_batch(data) else "select.prefix"
        return self._generate(data, kind=kind, stream=False)

    def commit_lazy_operations(self, s):
        data = {"text": s.text_, "sampling_params": {"max_new_tokens": 0}}
        self._add_images(s, data)
        self._generate(data, kind="fork", stream=False)

    def fill_image(self, s):
        data = {"text": s.text_, "sampling_params": {"max_new_tokens": 0}}
        self._add_images(s, data)
        self._generate(data, kind="image", stream=False)

    def cache_prefix(self, prefix_str):
        data = {"text": prefix_str, "sampling_params": {"max_new_tokens": 0}}
        self._generate(data, kind="cache", stream=False)

    def flush_cache(self):
        self._request("POST", "/flush_cache").close()

    def get_server_info(self):
        return self._json(self._request("GET", "/server_info"))

    def concatenate_and_append(self, src_rids, dst_rid):
        body = {"src_rids": src_rids, "dst_rid": dst_rid}
        self._request("POST", "/concate_and_append_request", body).close()

    def _generate_body(self, s, sampling_params) -> dict[str, Any]:
        """The ``/generate`` body RuntimeEndpoint.generate sends."""
        self._handle_dtype_to_regex(sampling_params)
        sampling = {
            "skip_special_tokens": global_config.skip_special_tokens_in_output,
            "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
            **sampling_params.to_srt_kwargs(),
        }
        data: dict[str, Any] = {"text": s.text_, "sampling_params": sampling}
        for name in _LOGPROB_FIELDS:
            value = getattr(sampling_params, name, None)
            if value is not None:
                data[name] = value
        self._add_images(s, data)
        return data

    # ---- the transport --------------------------------------------------------------------

    def _request(
        self, method: str, path: str, body: Any = None, *, stream: bool = False
    ) -> requests.Response:
        """One HTTP call with the identity headers; FrontendCallError unless 2xx."""
        url = f"{self.base_url}{path}"
        try:
            resp = self._session.request(
                method,
                url,
                data=None if body is None else msgspec.json.encode(body),
                headers=self.headers,
                stream=stream,
                timeout=(self.connect_timeout_s, self.timeout_s),
            )
        except requests.Timeout:
            raise FrontendCallError(
                f"timeout: no answer from {url} within {self.timeout_s:g} s"
            ) from None
        except requests.RequestException as e:
            raise FrontendCallError(f"transport error: {url}: {_why(e)}") from None
        if not 200 <= resp.status_code < 300:
            text = resp.text.strip().replace("\n", " ")
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                text = str(_decode(text)["error"]["message"])
            resp.close()
            raise FrontendCallError(
                f"HTTP {resp.status_code} from {path}: {text[:300]}", status=resp.status_code
            )
        return resp

    def _json(self, resp: requests.Response) -> Any:
        try:
            return _decode(resp.content)
        except (msgspec.DecodeError, requests.RequestException) as e:
            raise FrontendCallError(f"bad response from {resp.url}: {e}") from None
        finally:
            resp.close()

    def _generate(self, data: dict[str, Any], *, kind: str, stream: bool) -> Any:
        """POST /generate with identity and rids; records every item; returns the JSON (or,
        streaming, an iterator of cumulative ``(text, meta_info)``)."""
        batch = _is_batch(data)
        n = len(data.get("text", data.get("input_ids"))) if batch else 1
        recs = self._begin(data, kind, n)
        if self.routing_key:
            data.setdefault("routing_key", self.client)
        # one program run is one interaction (FairServe); each call's index is its stage
        data.setdefault("interaction_id", f"{self.log.run_tag}-{self._tag.program_id}")
        data.setdefault("app", self._tag.app)
        data.setdefault("stage", recs[0].stage)
        if "rid" not in data:
            data["rid"] = [r.wire_rid for r in recs] if batch else recs[0].wire_rid
        data["stream"] = stream
        if stream:
            return self._streamed(data, recs[0])
        try:
            resp = self._request("POST", "/generate", data)
            obj = self._json(resp)
            objs = obj if batch else [obj]
            if not isinstance(objs, list) or len(objs) != n:
                raise FrontendCallError(f"/generate answered {str(obj)[:200]} for {n} prompts")
            with self.log.lock:
                t = self.log.now()
                for rec, item in zip(recs, objs, strict=True):
                    rec.status = resp.status_code
                    apply_chunk(rec, item, t)
                    _finish(rec, t)
            return obj
        except Exception as e:
            raise self._failed(recs, e) from None

    def _streamed(self, data: dict[str, Any], rec: CallRecord) -> Iterator[tuple[str, dict]]:
        try:
            resp = self._request("POST", "/generate", data, stream=True)
        except Exception as e:
            raise self._failed([rec], e) from None
        deadline = time.monotonic() + self.timeout_s
        rec.status = resp.status_code
        try:
            self.log.open_stream(resp)
            finished = done = False
            for raw in resp.iter_lines():
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    obj = _decode(payload)
                except msgspec.DecodeError:
                    raise CallFailed(f"bad SSE chunk: {payload[:200]}") from None
                with self.log.lock:
                    if self.log.closed:
                        raise FrontendCallError("the run was cut off during this call")
                    finished = apply_chunk(rec, obj, self.log.now()) or finished
                if isinstance(obj, Mapping):
                    yield str(obj.get("text") or ""), dict(obj.get("meta_info") or {})
                if time.monotonic() > deadline:
                    raise FrontendCallError(f"timeout: not finished within {self.timeout_s:g} s")
            if not finished and not done:
                raise CallFailed("stream ended without a finish_reason or [DONE]")
            with self.log.lock:
                _finish(rec, self.log.now())
        except Exception as e:
            raise self._failed([rec], e) from None
        finally:
            self.log.close_stream(resp)

    def _begin(self, data: dict[str, Any], kind: str, n: int) -> list[CallRecord]:
        tag = self._tag
        seq = next(tag.seq)
        node = f"{seq:03d}-{kind}"
        sp = data.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * n
        max_new = [int(x.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)) for x in sps]
        now = self.log.now()
        arrival = tag.start_s if seq == 0 and tag.start_s is not None else now
        template = CallRecord(
            rid=f"{tag.program_id}/{node}",
            wire_rid=f"{self.log.run_tag}-{tag.program_id}/{node}",
            client=self.client,
            program_id=tag.program_id,
            node=node,
            app=tag.app,
            stage=seq,
            input_len=0,
            max_new_tokens=0,
            arrival_s=arrival,
        )
        return self.log.begin(template, n, max_new)

    def _failed(self, recs: list[CallRecord], e: Exception) -> FrontendCallError:
        """Mark ``recs`` failed (unless the run was cut off); the error to raise."""
        if isinstance(e, FrontendCallError):
            err = e
        elif isinstance(e, CallFailed):  # the server answered, not with a full generation
            err = FrontendCallError(str(e))
        elif isinstance(e, requests.RequestException):
            err = FrontendCallError(f"transport error: {type(e).__name__}: {e}")
        else:
            err = FrontendCallError(f"{type(e).__name__}: {e}")
        with self.log.lock:
            if not self.log.closed:
                t = self.log.now()
                for rec in (r for r in recs if r.state == "in_flight"):
                    rec.status = err.status if err.status is not None else rec.status
                    rec.state, rec.error, rec.failed_s, rec.finish_s = "failed", str(err), t, None
                    self.log.failed_programs.add(rec.program_id)
        return err


def _why(e: BaseException) -> str:
    """The innermost cause of a transport error (``[Errno 111] Connection refused``), not
    requests' and urllib3's wrappers around it."""
    seen: set[int] = set()
    while id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and not isinstance(e, requests.RequestException):
            return str(e) or type(e).__name__
        nxt = e.__cause__ or e.__context__ or getattr(e, "reason", None)
        if nxt is None and e.args and isinstance(e.args[0], BaseException):
            nxt = e.args[0]
        if not isinstance(nxt, BaseException):
            break
        e = nxt
    return f"{type(e).__name__}: {e}"


def _is_batch(data: Mapping[str, Any]) -> bool:
    """A list of prompts: ``text`` a list, or ``input_ids`` a list of lists."""
    if "text" in data:
        return isinstance(data["text"], list)
    ids = data.get("input_ids")
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def _finish(rec: CallRecord, t: float) -> None:
    """A call answered in full: ``ok``, with what the server said it was (under the lock)."""
    if rec.finish_s is None:
        rec.finish_s = t
    if rec.prompt_tokens:
        rec.input_len = rec.prompt_tokens
    if rec.first_token_s is None and not rec.output_ids:  # prefill-only: done by now
        rec.first_token_s = rec.finish_s
    rec.state = "ok"
