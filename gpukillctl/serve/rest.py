"""The REST API (FastAPI) under /v1: gpukilld's methods over HTTP, as the user who runs the server.

`build_rest(connect)` returns the app; `gpukillctl serve` (gpukillctl/serve/server.py) puts the token check in front
of it and mounts the MCP app beside it. Each request opens its own connection with `connect` (an async
function returning a connected GpukillClient), makes its calls through the typed client and closes it, as the
MCP tools do: the server is an ordinary unprivileged D-Bus client, so polkit decides each kill and reset as
for gpukillctl, and the journal names the server's user. Nothing asks for a password (no one is there to type
it): what polkit grants only after one is AccessDenied.

Bodies are the plain (JSON) form of gpukill/records/, as `gpukillctl list --json` writes it: every key
present, null where the daemon could not read a value. The response models are derived from the records'
declarations (`model_of`), so the OpenAPI schema documents each field with the record's own text and cannot
drift from what is sent. Text from processes (comm, cmdline, evidence) is exact data inside JSON strings.

Errors are {"error": NAME, "message": TEXT}: NAME is the D-Bus error name where the daemon (or the bus) said
it, and the HTTP status follows STATUS_FOR_ERROR; request bodies and parameters that do not validate are 422
with org.freedesktop.DBus.Error.InvalidArgs, as the daemon names its own argument errors. A parameter is
honoured or refused, never dropped: a query parameter the operation does not declare, or a scalar one given
twice, is 422 naming it (StrictRoute, for every route), and so is a body key the request model does not
declare (extra="forbid"), so that a client guessing a name (gpu-kill's `filter` before it existed here) is
told instead of being answered as if it had not asked.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, Literal

from dbus_fast import Variant
from fastapi import Body, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, create_model
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Match

from gpukill import errors
from gpukill.limits import MAX_GRACE
from gpukill.managed_policy import KINDS, MAX_ALLOWED_USERS, MAX_GRACE_PERIOD
from gpukill.outcome import reclaim_text
from gpukill.policy import MAX_POLICY_BYTES
from gpukill.procstat import read_stat
from gpukill.records.audit import Finding
from gpukill.records.base import Wire, specs, to_plain
from gpukill.records.guard import Decision, GuardStatus, ManagedPolicyEntry
from gpukill.records.manager import Device, Process
from gpukill.records.reclaim import CheckpointStep, Reclaim
from gpukill.records.status import ResetReply
from gpukill.records.suspend import SuspendedProcess
from gpukill.records.usage import UsageBy, UsageReport
from gpukill.regex import RegexError, compile_regex
from gpukill.units import (
    DURATION_FORMS,
    MAX_DURATION_TEXT,
    MAX_SIZE,
    MAX_SIZE_TEXT,
    SIZE_FORMS,
    parse_duration,
    parse_size,
)

from ..client.api import error_name
from ..client.dbus import ClientError, Connect, DaemonUnavailable, GpukillClient, using
from ..client.usage import MAX_WHEN_TEXT, parse_when

API_PREFIX = "/v1"
OPENAPI_URL = f"{API_PREFIX}/openapi.json"
MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1
MAX_PID = 2**22  # the kernel's PID_MAX_LIMIT
# Characters of each text filter. Four of them, each character up to 12 bytes percent-encoded, stay within
# the 16 KiB uvicorn allows a request line and its headers (past it: a bare 400 from the HTTP layer).
MAX_FILTER_TEXT = 256
INVALID_ARGS = errors.InvalidArgs.dbus_name
NO_NUL = r"^[^\x00]*$"  # in the schema, so that clients (and schemathesis) know; bus_text checks it too


def bus_text(value: str) -> str:
    """A string that can travel on the bus: D-Bus strings are UTF-8 without NUL. Refused here (422), a string
    the client library could not even send would otherwise end as a failure of the connection."""
    if "\x00" in value:
        raise ValueError("a NUL character cannot be sent to gpukilld")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode (a lone surrogate)") from None
    return value


BusText = Annotated[str, AfterValidator(bus_text)]


def re2_pattern(value: str) -> str:
    """A pattern RE2 compiles, checked here so that the refusal names the parameter the client gave (the
    daemon compiles it again, and would name its own key)."""
    try:
        compile_regex(value)
    except RegexError as e:
        raise ValueError(str(e)) from None
    return value


Re2Text = Annotated[str, AfterValidator(bus_text), AfterValidator(re2_pattern)]


def _takes_many(annotation: Any) -> bool:
    """Whether a parameter's annotation is a list (or tuple, set), bare or in a union with None: a parameter
    that may repeat in the query."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_takes_many(a) for a in typing.get_args(annotation) if a is not type(None))
    return origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set, frozenset)


def _declared_query(dependant: Any) -> tuple[set[str], set[str]]:
    """The query parameters an operation declares (with its dependencies'), and those of them that take a
    list (which may repeat)."""
    names: set[str] = set()
    lists: set[str] = set()
    for field in dependant.query_params:
        names.add(field.alias)
        if _takes_many(field.field_info.annotation):  # list[str], list[str] | None, ...
            lists.add(field.alias)
    for sub in dependant.dependencies:
        more, more_lists = _declared_query(sub)
        names |= more
        lists |= more_lists
    return names, lists


class StrictRoute(APIRoute):
    """A route that refuses (422, as any invalid argument) the query parameters its operation does not
    declare, and a scalar one given more than once: FastAPI would drop the first silently and answer the
    second's last value, as if the client had not asked for what it asked. The declared names are the
    route's own (its dependant), so the OpenAPI schema, which lists them, says exactly what is accepted."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        declared, lists = _declared_query(self.dependant)

        async def strict(request: Request) -> Response:
            problems = []
            seen: set[str] = set()
            for key, _ in request.query_params.multi_items():
                if key not in declared:
                    takes = ", ".join(sorted(declared)) or "none"
                    problems.append(
                        {
                            "loc": ("query", key),
                            "type": "extra_forbidden",
                            "msg": f"unknown parameter (this operation takes: {takes})",
                        }
                    )
                elif key in seen and key not in lists:
                    problems.append(
                        {
                            "loc": ("query", key),
                            "type": "extra_forbidden",
                            "msg": "given more than once (it takes one value)",
                        }
                    )
                seen.add(key)
            if problems:
                raise RequestValidationError(_unique(problems))
            return await handle(request)

        return strict


def _unique(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in problems:
        if p not in out:
            out.append(p)
    return out


# The HTTP status of each daemon error, by the shared error class the client's exception is (client.ERRORS).
STATUS_FOR_ERROR: dict[type[Exception], int] = {
    DaemonUnavailable: 503,
    errors.AccessDenied: 403,  # polkit said no (also: it wanted a password, which nobody can type here)
    errors.Protected: 403,  # PID 1, a kernel thread, gpukilld: refused whoever asks
    errors.NoSuchProcess: 404,
    errors.NoSuchDevice: 404,
    errors.ProcessChanged: 409,  # the PID now names another process: list again
    errors.DeviceBusy: 409,  # processes still use the GPU (force kills them first)
    errors.NotAGpuProcess: 409,  # the process is not on a GPU (any more)
    errors.NotSupported: 409,  # this GPU cannot do it: a fact about the device, not a server failure
    errors.InvalidArgs: 422,
    errors.InvalidPolicy: 422,
    errors.TooBusy: 429,  # a per-user limit of the daemon: nothing was done, try again
    errors.ResetFailed: 502,  # the driver failed the reset; the device was left as it was
}
TIMEOUT_ERROR = "org.freedesktop.DBus.Error.Timeout"


def status_for(e: ClientError) -> int:
    """The HTTP status for a client error: its class's, 504 for a daemon that did not answer in time, else 502
    (gpukilld failed in a way it did not name)."""
    if e.name == TIMEOUT_ERROR:
        return 504
    return next((code for cls, code in STATUS_FOR_ERROR.items() if isinstance(e, cls)), 502)


# -- models: derived from the records' declarations ---------------------------------------------------------


_SCALARS: dict[str, Any] = {
    "u": Annotated[int, Field(ge=0, le=MAX_UINT32)],
    "t": Annotated[int, Field(ge=0, le=MAX_UINT64)],
    "d": float,
    "b": bool,
    "s": str,
    "as": list[str],
    "au": list[Annotated[int, Field(ge=0, le=MAX_UINT32)]],
    "at": list[Annotated[int, Field(ge=0, le=MAX_UINT64)]],
}


def _nullable(wire: Wire, default: Any) -> bool:
    """Whether the plain form may hold null: a value nobody could read, or an empty one left out (a flag
    left out is false, never null: records.to_plain)."""
    return default is None or (wire.omit_empty and wire.sig != "b")


@functools.cache
def model_of(cls: type, without: str | None = None, partial: bool = False) -> type[BaseModel]:
    """The pydantic model of a record's plain form (records.to_plain): every field required, typed by its
    D-Bus signature, described by its declaration. `without` drops a keyed map's key field and `partial`
    makes every field optional: a map's entries carry only the values that are known
    (records.known_values)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    fields: dict[str, Any] = {}
    for name, wire in specs(cls):
        if name == without:
            continue
        kind = _type_of(wire)
        if partial:
            fields[name] = (kind | None, Field(None, description=wire.doc))
        elif _nullable(wire, defaults[name]):
            fields[name] = (kind | None, Field(description=wire.doc))
        else:
            fields[name] = (kind, Field(description=wire.doc))
    title = cls.__name__ + ("Entry" if partial else "")
    return create_model(title, __doc__=(cls.__doc__ or "").split("\n\n")[0], **fields)


def _type_of(wire: Wire) -> Any:
    if wire.of is None:
        return _SCALARS[wire.sig]
    if wire.key is not None:
        return dict[str, model_of(wire.of, wire.key, True)]  # type: ignore[misc]  # a model made at run time
    if wire.sig == "aa{sv}":
        return list[model_of(wire.of)]  # type: ignore[misc]  # a model made at run time
    return model_of(wire.of)


# The records' pydantic models, made at run time (model_of): mypy cannot take them as types (hence the ignores below)
DeviceModel = model_of(Device)
ProcessModel = model_of(Process)
ResetReplyModel = model_of(ResetReply)
FindingModel = model_of(Finding)
GuardStatusModel = model_of(GuardStatus)
DecisionModel = model_of(Decision)
UsageReportModel = model_of(UsageReport)
SuspendedModel = model_of(SuspendedProcess)
PolicyEntryModel = model_of(ManagedPolicyEntry)
MAX_USAGE_LIMIT = 1000  # GetUsage's own bound
# A Literal built at run time from the shared table, for the OpenAPI schema's enum: to mypy, a str
if TYPE_CHECKING:
    PolicyKind = str
else:
    PolicyKind = Literal[KINDS]


class ErrorBody(BaseModel):
    """A failure: what refused the request, and why in one line."""

    error: str = Field(
        description="the D-Bus error name (org.gpukill1.Error.NoSuchProcess, "
        "org.freedesktop.DBus.Error.AccessDenied, ...); for a refusal of the HTTP "
        "layer itself: Unauthorized, NotFound, MethodNotAllowed, BadHost, BadOrigin, "
        "PayloadTooLarge, TooManyRequests"
    )
    message: str = Field(description="one line; it may name a process, whose name that process chose")


class DeviceList(BaseModel):
    devices: list[DeviceModel] = Field(description="the GPUs gpukilld manages")  # type: ignore[valid-type]


class SuspendedList(BaseModel):
    suspended: list[SuspendedModel] = Field(  # type: ignore[valid-type]  # a model made at run time
        description="the processes gpukilld holds suspended (their GPU memory set aside in host memory) or stuck "
        "after a failed step, by PID; other users' as the server's user may see them; empty where gpukilld "
        "suspends nothing"
    )


class ProcessList(BaseModel):
    processes: list[ProcessModel] = Field(  # type: ignore[valid-type]  # a model made at run time
        description="one record per (process, device) matching the filters; other users' processes as the "
        "server's user may see them"
    )


class FindingList(BaseModel):
    findings: list[FindingModel] = Field(  # type: ignore[valid-type]  # a model made at run time
        description="miners, resource abusers and idle holders, highest score first, as the server's user may see them"
    )


class DecisionList(BaseModel):
    decisions: list[DecisionModel] = Field(  # type: ignore[valid-type]  # a model made at run time
        description="what the policy would do with the current snapshot; nothing was done"
    )


class KillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pid: int = Field(ge=1, le=MAX_PID, description="the process to stop")
    start_time: int | None = Field(
        None,
        ge=0,
        le=MAX_UINT64,
        description=(
            "its start_time as listed: a PID reused since the listing is then refused (409 ProcessChanged) "
            "instead of signalling a newcomer; without it, the start time of the PID now is used"
        ),
    )
    force: bool = Field(False, description="send SIGKILL if it outlives the grace period")
    grace: float | None = Field(
        None, ge=0, le=MAX_GRACE, description="seconds to wait after SIGTERM (the daemon's default: 5)"
    )
    checkpoint: bool = Field(
        False,
        description="before SIGTERM, send the checkpoint signal the process declared and wait for it to save",
    )


class KillResult(BaseModel):
    pid: int = Field(description="the process")
    start_time: int = Field(description="the start time the kill was made for")
    outcome: Literal["terminated", "killed", "still-alive"] = Field(
        description="terminated: exited after SIGTERM; killed: needed SIGKILL (force); still-alive: outlived "
        "the grace without force (or SIGKILL: reclaim says stuck, why and the reset)"
    )
    reclaim: model_of(Reclaim) = Field(  # type: ignore[valid-type]  # a model made at run time
        description="the GPU's answer: its memory reclaimed (seconds after first_signal), still held by whom, or the "
        "process stuck and why"
    )
    answer: str = Field(description="the answer in words, as gpukillctl kill says it")
    checkpoint: model_of(CheckpointStep) | None = Field(  # type: ignore[valid-type]  # a model made at run time
        None, description="with checkpoint: what the checkpoint step did before SIGTERM"
    )


class ResetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: BusText = Field(min_length=1, max_length=256, pattern=NO_NUL, description="index, UUID or PCI bus id")
    force: bool = Field(False, description="kill the processes on the GPU first (through the kill path, audited)")


class PolicyTestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: BusText = Field(
        "", max_length=256, pattern=NO_NUL, description="the policy's name in its errors and decisions"
    )
    text: BusText = Field(
        "",
        max_length=MAX_POLICY_BYTES,
        pattern=NO_NUL,
        description='the policy (YAML, as in guard.d); "": the policy in force',
    )


class PolicyEntryList(BaseModel):
    policies: list[PolicyEntryModel] = Field(  # type: ignore[valid-type]  # a model made at run time
        description="the user, group and GPU policies gpukilld keeps as files in the Guard policy directory"
    )


def _size_value(value: int | str) -> int | str:
    """A size as bytes (an integer) or as typed (8GiB): checked here with the grammar the daemon reads it in,
    passed on as given, so that a text in B or KiB still says that a limit under 1 MiB is meant."""
    if isinstance(value, int):
        if not 1 <= value <= MAX_SIZE:
            raise ValueError(f"a number of bytes from 1 to 2^60, not {value}")
        return value
    parse_size(value, limit=True)
    return value.strip()


def _duration_value(value: float | str) -> float | str:
    """A duration as seconds (a number) or as typed (90s, 2min), at most MAX_GRACE_PERIOD."""
    seconds = parse_duration(value)
    if seconds > MAX_GRACE_PERIOD:
        raise ValueError(f"at most {MAX_GRACE_PERIOD:g} seconds, not {seconds:g}")
    return value.strip() if isinstance(value, str) else seconds


SIZE_DOC = f"; or text with a unit ({SIZE_FORMS}; a bare number as text is refused)"
SizeValue = Annotated[
    Annotated[int, Strict()] | Annotated[str, Strict(), Field(max_length=MAX_SIZE_TEXT)], AfterValidator(_size_value)
]
DurationValue = Annotated[
    Annotated[float, Strict()] | Annotated[str, Strict(), Field(max_length=MAX_DURATION_TEXT)],
    AfterValidator(_duration_value),
]


class PolicySettings(BaseModel):
    """A managed policy's settings, as `gpukillctl guard policy add` takes them: only those given are set (a
    limit left out is no limit), at least one limit; which apply depends on the kind (gpukilld refuses the
    others, 422 InvalidArgs naming them)."""

    model_config = ConfigDict(extra="forbid")

    memory_limit: SizeValue | None = Field(
        None, description="bytes of GPU memory (user, group: summed over their processes)" + SIZE_DOC
    )
    utilization_limit: float | None = Field(None, ge=0, le=100, description="percent of GPU utilization")
    process_limit: int | None = Field(None, ge=0, le=MAX_UINT32, description="GPU processes at once (user, group)")
    allowed_users: list[BusText] | None = Field(
        None, max_length=MAX_ALLOWED_USERS, description="gpu: only these users may hold it"
    )
    reserved_memory: SizeValue | None = Field(None, description="gpu: bytes kept free on the device" + SIZE_DOC)
    grace: DurationValue | None = Field(
        None, description=f"seconds over a limit before the kill (default 30); or text ({DURATION_FORMS})"
    )


class PolicyRemoved(BaseModel):
    removed: Literal[True] = Field(description="the policy and its file are gone")


# Every operation may meet the HTTP layer's refusals (server.py) and the daemon's errors: each status it can
# answer with is documented with its body, so a client (and schemathesis) knows every response's shape.
_ERROR_STATUSES = {
    401: "no token, or the wrong one (Authorization: Bearer TOKEN)",
    403: "polkit denied it, the target is protected, or the Origin is not allowed",
    413: "the request body is too large",
    421: "the Host is not one this server answers to",
    422: "invalid arguments",
    429: "too many requests at once, or a per-user limit of gpukilld: try again",
    503: "gpukilld or the system bus is not reachable, or every connection of the server is being answered",
}
_ACTION_STATUSES = {
    404: "no such process or GPU",
    409: "the PID now names another process, the GPU is busy, the process is not on a GPU, or the GPU cannot do it",
    502: "gpukilld or the driver failed",
    504: "gpukilld did not answer in time",
}


def _responses(extra: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    statuses = {**_ERROR_STATUSES, 502: _ACTION_STATUSES[502], 504: _ACTION_STATUSES[504], **(extra or {})}
    return {code: {"model": ErrorBody, "description": text} for code, text in sorted(statuses.items())}


# -- the app -------------------------------------------------------------------------------------------


def error_response(status: int, name: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": name, "message": message}, status_code=status, headers=headers)


_HTTP_ERROR_NAMES = {404: "NotFound", 405: "MethodNotAllowed", 413: "PayloadTooLarge"}


def build_rest(connect: Connect) -> FastAPI:
    """The REST app: routes under /v1, its OpenAPI at /v1/openapi.json (no docs pages: nothing is served that
    loads scripts from elsewhere)."""
    app = FastAPI(
        title="gpukill",
        version="1",
        openapi_url=OPENAPI_URL,
        docs_url=None,
        redoc_url=None,
        description="gpukilld's methods over HTTP, run as the user who started `gpukillctl serve`: "
        "polkit decides each kill and reset as for gpukillctl. Every request needs the "
        "server's token: Authorization: Bearer TOKEN. A query parameter an operation does not list, a "
        "scalar one given twice, or a body key its schema does not list is refused (422) with its name.",
    )
    app.router.route_class = StrictRoute  # every route below: unknown query parameters are refused
    _error_handlers(app)

    def with_daemon(act: Callable[[GpukillClient], Awaitable[Any]]) -> Awaitable[Any]:
        return using(connect, act)

    @app.get(
        f"{API_PREFIX}/devices",
        response_model=DeviceList,
        responses=_responses(),
        summary="the GPUs",
        operation_id="list_devices",
    )
    async def devices() -> dict:
        found = await with_daemon(lambda c: c.list_devices())
        return {"devices": [to_plain(d) for d in found]}

    @app.get(
        f"{API_PREFIX}/processes",
        response_model=ProcessList,
        responses=_responses(),
        summary="the processes on the GPUs, filtered",
        operation_id="list_processes",
    )
    async def processes(
        name: Annotated[
            BusText,
            Query(
                pattern=NO_NUL,
                max_length=MAX_FILTER_TEXT,
                description="only processes whose name contains this",
            ),
        ] = None,
        name_regex: Annotated[
            Re2Text,
            Query(
                pattern=NO_NUL,
                max_length=MAX_FILTER_TEXT,
                description=("only processes whose name matches this regular expression (RE2 syntax)"),
            ),
        ] = None,
        filter: Annotated[
            Re2Text,
            Query(
                pattern=NO_NUL,
                max_length=MAX_FILTER_TEXT,
                description="gpu-kill's name filter: name_regex by gpu-kill's name (`gpukill --filter`). "
                "With name, both must match, as every filter here combines; with name_regex: 422 (one "
                "pattern, given twice)",
            ),
        ] = None,
        user: Annotated[
            BusText,
            Query(pattern=NO_NUL, max_length=MAX_FILTER_TEXT, description="only this user's (name or uid)"),
        ] = None,
        device: Annotated[
            BusText,
            Query(
                pattern=NO_NUL,
                max_length=MAX_FILTER_TEXT,
                description="only on this GPU (index, UUID or PCI bus id)",
            ),
        ] = None,
        memory_gt: Annotated[
            int, Query(ge=0, lt=MAX_UINT64, description="only processes using more than this many bytes")
        ] = None,
    ) -> dict:
        if filter is not None and name_regex is not None:
            raise RequestValidationError(
                [
                    {
                        "loc": ("query", "filter"),
                        "type": "value_error",
                        "msg": "filter is name_regex by gpu-kill's name: give one of filter and name_regex, not both",
                    }
                ]
            )
        pattern = name_regex if filter is None else filter
        wanted: dict[str, Variant] = {}
        for key, value in (("name", name), ("name_regex", pattern), ("user", user), ("device", device)):
            if value is not None:
                wanted[key] = Variant("s", value)
        if memory_gt is not None:
            wanted["min_memory"] = Variant("t", memory_gt + 1)  # the daemon's floor is "at least"
        found = await with_daemon(lambda c: c.list_processes(wanted))
        return {"processes": [to_plain(p) for p in found]}

    @app.get(
        f"{API_PREFIX}/suspended",
        response_model=SuspendedList,
        responses=_responses(),
        summary="the suspended processes: off the GPUs, their memory held in host memory",
        operation_id="list_suspended",
    )
    async def suspended() -> dict:
        return {"suspended": [to_plain(r) for r in await with_daemon(lambda c: c.suspended())]}

    @app.post(
        f"{API_PREFIX}/kill",
        response_model=KillResult,
        responses=_responses(_ACTION_STATUSES),
        summary="stop a GPU process: SIGTERM, then SIGKILL with force",
        operation_id="kill_process",
    )
    async def kill(request: Annotated[KillRequest, Body()]) -> dict:
        async def act(client: GpukillClient) -> dict:
            start_time = request.start_time
            if start_time is None:
                listed = next((p for p in await client.list_processes() if p.pid == request.pid), None)
                start_time = listed.start_time if listed else _start_time_now(request.pid)
            report = await client.kill_report(
                request.pid, start_time, force=request.force, grace=request.grace, checkpoint=request.checkpoint
            )
            return {
                "pid": request.pid,
                "start_time": start_time,
                "outcome": report.outcome,
                "reclaim": to_plain(report.reclaim),
                "answer": reclaim_text(report.reclaim),
                "checkpoint": None if report.checkpoint is None else to_plain(report.checkpoint),
            }

        return await with_daemon(act)

    @app.post(
        f"{API_PREFIX}/reset",
        response_model=ResetReplyModel,
        responses=_responses(_ACTION_STATUSES),
        summary="reset a GPU (refused while processes use it, unless force)",
        operation_id="reset_device",
    )
    async def reset(request: Annotated[ResetRequest, Body()]) -> dict:
        return to_plain(await with_daemon(lambda c: c.reset(request.device, force=request.force)))

    @app.get(
        f"{API_PREFIX}/audit/rogue",
        response_model=FindingList,
        responses=_responses(),
        summary="the rogue-activity audit of the current snapshot",
        operation_id="audit_rogue",
    )
    async def audit() -> dict:
        return {"findings": [to_plain(f) for f in await with_daemon(lambda c: c.audit_rogue())]}

    @app.get(
        f"{API_PREFIX}/guard/status",
        response_model=GuardStatusModel,
        responses=_responses(),
        summary="Guard Mode: switches, the policy in force, counters",
        operation_id="guard_status",
    )
    async def guard_status() -> dict:
        return to_plain(await with_daemon(lambda c: c.guard_status()))

    @app.post(
        f"{API_PREFIX}/guard/test",
        response_model=DecisionList,
        responses=_responses({504: _ACTION_STATUSES[504]}),
        summary="what a policy would do now; never acts",
        operation_id="guard_test_policy",
    )
    async def guard_test(request: Annotated[PolicyTestRequest, Body()]) -> dict:
        found = await with_daemon(lambda c: c.guard_test(request.name, request.text))
        return {"decisions": [to_plain(d) for d in found]}

    @app.get(
        f"{API_PREFIX}/usage",
        response_model=UsageReportModel,
        responses=_responses(),
        summary="GPU usage accounting: GPU time, memory, energy per user, unit, job, pod, GPU or process",
        operation_id="get_usage",
    )
    async def usage(
        since: Annotated[
            str,
            Query(
                min_length=1,
                max_length=MAX_WHEN_TEXT,
                pattern=NO_NUL,
                description=("the range's start: " + WHEN_DOC + " (default: 24 hours before until)"),
            ),
        ] = None,
        until: Annotated[
            str,
            Query(
                min_length=1,
                max_length=MAX_WHEN_TEXT,
                pattern=NO_NUL,
                description=("the range's end, as since (default: now)"),
            ),
        ] = None,
        by: Annotated[UsageBy, Query(description="what the rows are grouped by (default: user)")] = "user",
        user: Annotated[BusText, usage_filter("only this user's records (name or uid)")] = None,
        name: Annotated[BusText, usage_filter("only processes whose name contains this")] = None,
        unit: Annotated[BusText, usage_filter("only this systemd unit's")] = None,
        job: Annotated[BusText, usage_filter("only this Slurm job's")] = None,
        pod: Annotated[BusText, usage_filter("only this Kubernetes pod's (its UID)")] = None,
        device: Annotated[BusText, usage_filter("only on this GPU (index, UUID or PCI bus id)")] = None,
        limit: Annotated[
            int,
            Query(
                ge=1,
                le=MAX_USAGE_LIMIT,
                description=("at most this many rows, largest GPU time first (default and most: 1000)"),
            ),
        ] = None,
    ) -> dict:
        """The records' totals over the range, grouped; processes still running count with their totals so
        far. Other users' records count as the server's user may see them."""
        query: dict[str, Any] = {
            "since": usage_instant("since", since),
            "until": usage_instant("until", until),
            "by": by,
            "user": user,
            "name": name,
            "unit": unit,
            "job": job,
            "pod": pod,
            "device": device,
            "limit": limit,
        }
        report = await with_daemon(lambda c: c.usage({k: v for k, v in query.items() if v is not None}))
        return to_plain(report)

    _policy_routes(app, with_daemon)
    _declare_token(app)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every failure as {"error": NAME, "message": TEXT}: the daemon's (its D-Bus error name, the status of
    STATUS_FOR_ERROR), arguments that do not validate (422 InvalidArgs), and the HTTP layer's own refusals."""

    @app.exception_handler(ClientError)
    async def daemon_error(request: Request, e: ClientError) -> JSONResponse:
        return error_response(status_for(e), error_name(e), str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', '')}" for err in e.errors()]
        return error_response(422, INVALID_ARGS, "; ".join(problems)[:1024] or "invalid arguments")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 400:  # a body FastAPI could not even decode (not UTF-8): invalid arguments too
            return error_response(422, INVALID_ARGS, str(e.detail))
        headers = dict(e.headers or {})
        if e.status_code == 405:  # Starlette names the methods of the first route of the path only
            headers = {k: v for k, v in headers.items() if k.lower() != "allow"}
            headers["Allow"] = ", ".join(_allowed_methods(app, request))
        return error_response(
            e.status_code, _HTTP_ERROR_NAMES.get(e.status_code, "HTTPError"), str(e.detail), headers=headers
        )


_POLICY_PATH = f"{API_PREFIX}/guard/policies/{{kind}}/{{target}}"
_POLICY_CHANGE_STATUSES = {
    403: "polkit denied it (org.gpukill.manage-policies: administrators only by default), or the Origin is not allowed",
    404: "the kind or the target holds a / (no such route)",
    504: _ACTION_STATUSES[504],
}
TargetParam = Annotated[
    BusText,
    Path(min_length=1, max_length=256, pattern=NO_NUL, description="the user name, group name or GPU index"),
]
KindParam = Annotated[PolicyKind, Path(description="user, group or gpu")]


def _policy_routes(app: FastAPI, with_daemon: Callable[[Callable[[GpukillClient], Awaitable[Any]]], Any]) -> None:
    """The managed user, group and GPU policies (as `gpukillctl guard policy`), for the dashboard's Guard page:
    listing needs nothing; a change is polkit's org.gpukill.manage-policies, decided for the server's user."""

    @app.get(
        f"{API_PREFIX}/guard/policies",
        response_model=PolicyEntryList,
        responses=_responses(),
        summary="the managed user, group and GPU policies",
        operation_id="guard_list_policies",
    )
    async def list_policies() -> dict:
        return {"policies": [to_plain(p) for p in await with_daemon(lambda c: c.guard_list_policies())]}

    @app.put(
        _POLICY_PATH,
        response_model=PolicyEntryModel,
        responses=_responses(_POLICY_CHANGE_STATUSES),
        summary="create or replace the kind's policy for target",
        operation_id="guard_set_policy",
    )
    async def set_policy(kind: KindParam, target: TargetParam, settings: Annotated[PolicySettings, Body()]) -> dict:
        given = settings.model_dump(exclude_none=True)
        return to_plain(await with_daemon(lambda c: c.guard_set_policy(kind, target, given)))

    @app.delete(
        _POLICY_PATH,
        response_model=PolicyRemoved,
        responses=_responses(_POLICY_CHANGE_STATUSES),
        summary="remove the kind's policy for target (422 InvalidArgs when there is none)",
        operation_id="guard_remove_policy",
    )
    async def remove_policy(kind: KindParam, target: TargetParam) -> dict:
        await with_daemon(lambda c: c.guard_remove_policy(kind, target))
        return {"removed": True}


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route of the request's path takes (PUT and DELETE of a policy are two routes)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


WHEN_DOC = (
    "seconds since the epoch, or gpukillctl usage's TIME: a duration ago (30d, 24h, 90min, 1h30m), a date "
    "(YYYY-MM-DD, 'YYYY-MM-DD HH:MM[:SS]', ISO 8601; the server's local time without an offset), today, "
    "yesterday, now"
)


def usage_instant(name: str, text: str | None) -> float | None:
    """since/until as seconds since the epoch; a text that is no time is 422 naming the parameter."""
    if text is None:
        return None
    try:
        return parse_when(text, epoch=True)
    except ValueError as e:
        raise RequestValidationError([{"loc": ("query", name), "type": "value_error", "msg": str(e)}]) from None


def usage_filter(what: str) -> Any:
    return Query(pattern=NO_NUL, max_length=MAX_FILTER_TEXT, description=what)


def _start_time_now(pid: int) -> int:
    """For a PID the daemon does not list (so that it can say why it refuses): its start time, 0 if gone."""
    stat = read_stat(pid)
    return stat.start_time if stat else 0


def _declare_token(app: FastAPI) -> None:
    """The OpenAPI schema says every operation needs the bearer token (server.py checks it, in front of this
    app and of /mcp alike)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            schema.setdefault("components", {})["securitySchemes"] = {
                "token": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the server's token: printed at start, kept in "
                    "$XDG_RUNTIME_DIR/gpukill/serve.token (serve-PORT.token on TCP)",
                }
            }
            schema["security"] = [{"token": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
