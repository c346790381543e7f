"""The managed user, group and GPU policies (gpukill/managed_policy.py) as files in the Guard policy directory.

Each managed policy is an ordinary policy file in guard.d ([guard] policy_dir), written by gpukilld, so it is
visible, diffable and validated FILE:LINE:COL like every policy; its first line lets read_file() recover the
record, and edited() tells a file changed by hand since. A change (SetPolicy, RemovePolicy, ImportPolicies) is:

1. checked in memory: guard.d's files as they would be after it, parsed together as a reload parses them. If
   they do not validate, nothing is written and the error names FILE:LINE:COL (InvalidPolicy);
2. written atomically, file by file: a temporary file (root's, 0644 whatever the unit's UMask) renamed over
   the old one, whose inode is kept under a hard link until the end so that it can be put back exactly;
3. applied as a reload does (GuardRunner.reload_files). Should the directory still not validate (a hand edit
   in between), every file is put back as it was and the directory re-read: the policy in force is never lost.

Each changed policy gets a journal entry (journal.GUARD_MANAGED_POLICY: operation, kind, target, file, caller
uid). Everything a caller controls is bounded before use: the target's length, the settings' count, the import
text (gpukill.policy.MAX_POLICY_BYTES), the number of managed policies (MAX_MANAGED); a file name comes from
managed_policy.file_name() and is checked again here to be a plain name inside guard.d. All of it is small
file work done on the main loop, bounded by those limits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpukill import managed_policy
from gpukill.errors import GpukillError, InvalidArgs
from gpukill.managed_policy import ManagedPolicy
from gpukill.policy import (
    MAX_POLICY_BYTES,
    PolicyError,
    check_text,
    directory_texts,
    load_texts,
    policy_paths,
    read_text,
)
from gpukill.records.base import from_plain
from gpukill.records.guard import ManagedPolicyEntry
from gpukill.text import shown

from .. import journal
from ..files import fsync_dir, replace_file
from .runner import GuardRunner

log = logging.getLogger(__name__)

MAX_MANAGED = 256  # managed policies in guard.d: a few per user, group or GPU of one machine
MAX_TARGET = 256  # characters of a target (user and group names are at most 32 on Linux)
MAX_SETTINGS = 16  # keys of one SetPolicy's settings (six are defined)
MAX_LIST = 1024  # entries of a list setting (allowed_users)
# What a file name from managed_policy.file_name() must look like: one plain *.yaml name, no path, no dot file.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,200}\.yaml")
FILE_MODE = 0o644  # readable by all, as every file in guard.d: admins and `gpukillctl guard validate` read it
LISTING_TTL = 1.0  # seconds a listing of guard.d is served before its files are looked at (stat) again
OLD = ".gpukilld-old"  # the suffix of a replaced file, kept until the change is in force (not *.yaml)


def check_target(kind: str, target: str) -> None:
    """Bounds first, before the model reads them: a kind the model knows, a target of bounded length."""
    if kind not in managed_policy.KINDS:
        raise InvalidArgs(f"unknown policy kind {shown(kind[:40])!r}: use one of {', '.join(managed_policy.KINDS)}")
    if not target or len(target) > MAX_TARGET:
        raise InvalidArgs(f"the {kind} policy's target must be 1 to {MAX_TARGET} characters")


def check_settings(settings: Mapping[str, Any]) -> None:
    if len(settings) > MAX_SETTINGS:
        raise InvalidArgs(f"{len(settings)} settings: at most {MAX_SETTINGS}")
    for key, value in settings.items():
        if isinstance(value, list | tuple) and len(value) > MAX_LIST:
            raise InvalidArgs(f"setting {shown(str(key)[:40])}: {len(value)} entries, at most {MAX_LIST}")


def parse_import(name: str, text: str) -> list[ManagedPolicy]:
    """An ImportPolicies text as records: bounded (MAX_POLICY_BYTES, no NUL) before the parser spends anything.
    A megabyte of YAML costs the parser seconds, so the service runs this in a thread, off the main loop."""
    check_text(text, name)
    return managed_policy.import_text(text, name)


@dataclass(frozen=True, slots=True)
class Managed:
    """A managed policy as found in guard.d."""

    name: str  # the file's name in the directory
    policy: ManagedPolicy
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return self.policy.kind, self.policy.target


@dataclass(frozen=True, slots=True)
class Operation:
    """One policy's change, as its journal entry tells it."""

    operation: str  # "set", "remove", "import", "import-remove"
    policy: ManagedPolicy
    name: str


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _directory_state(directory: str) -> tuple:
    """What a listing of guard.d depends on, read with stat only: each *.yaml's name, inode, size and change
    times. Any write, rename or hand edit changes it."""
    state = []
    for path in policy_paths(directory):
        try:
            st = os.stat(path)
        except OSError:
            continue
        state.append((path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return directory, tuple(state)


class ManagedPolicies:
    def __init__(self, runner: GuardRunner, auditor: journal.Audit) -> None:
        self.runner = runner
        self.audit = auditor
        # ListPolicies and ExportPolicies are open to every user: what they read of guard.d, parsed once for as
        # long as the files stay as they were (stat says so, looked at most every LISTING_TTL seconds), not at
        # every call of every caller. A change made here forgets it at once.
        self._listed: tuple[tuple, list[ManagedPolicyEntry], str] | None = None
        self._listed_at = 0.0
        self._listed_with: object = None  # the policy in force when it was looked at

    @property
    def directory(self) -> str:
        return self.runner.policy_dir  # follows a reload of gpukilld.conf

    def _path(self, name: str) -> str:
        if not SAFE_NAME.fullmatch(name) or os.path.basename(name) != name:  # never a path out of guard.d
            raise GpukillError(f"refusing the policy file name {shown(name[:80])!r}: not a plain *.yaml name")
        return os.path.join(self.directory, name)

    # -- reading -------------------------------------------------------------------------------------------

    def found(self) -> dict[tuple[str, str], Managed]:
        """The managed files of guard.d by (kind, target), in file name order. A file that cannot be read, or
        is not a managed one, is not listed (a reload reports an unreadable file)."""
        out: dict[tuple[str, str], Managed] = {}
        for path, text in self._texts().items():
            name = os.path.basename(path)
            try:
                policy = managed_policy.read_file(name, text)
            except (PolicyError, InvalidArgs, ValueError):  # a header damaged by hand: an ordinary file now
                policy = None
            if policy is not None and (policy.kind, policy.target) not in out:
                out[(policy.kind, policy.target)] = Managed(name, policy, text)
        return out

    def _texts(self) -> dict[str, str]:
        """path -> text of guard.d's *.yaml, each read as the daemon reads them (regular files only, bounded)."""
        texts = {}
        for path in policy_paths(self.directory):
            try:
                texts[path] = read_text(path, regular_only=True)
            except PolicyError:
                continue
        return texts

    def entry(self, m: Managed) -> ManagedPolicyEntry:
        plain = {
            "kind": m.policy.kind,
            "target": m.policy.target,
            "file": os.path.join(self.directory, m.name),
            "edited": managed_policy.edited(m.policy, m.text),
            **managed_policy.as_settings(m.policy),
        }
        return from_plain(ManagedPolicyEntry, plain)

    def entries(self) -> list[ManagedPolicyEntry]:
        """Every managed policy, sorted by kind and target; at most MAX_MANAGED (the reply stays bounded)."""
        return self._listing()[1]

    def export(self) -> str:
        return self._listing()[2]

    def _listing(self) -> tuple[tuple, list[ManagedPolicyEntry], str]:
        """(the directory's state, the entries, the export), read again only when the state changed: a hand
        edit of guard.d shows within LISTING_TTL seconds, or at once after a reload."""
        now = time.monotonic()
        in_force = self.runner.policy  # a reload (SIGHUP, a change here) makes a new one: look again at once
        if self._listed is not None and now - self._listed_at < LISTING_TTL and in_force is self._listed_with:
            return self._listed
        state = _directory_state(self.directory)
        if self._listed is None or self._listed[0] != state:
            found = self.found()
            keys = sorted(found)[:MAX_MANAGED]
            self._listed = (
                state,
                [self.entry(found[key]) for key in keys],
                managed_policy.export_text([found[key].policy for key in keys]),
            )
        self._listed_at, self._listed_with = now, in_force
        return self._listed

    # -- changing ------------------------------------------------------------------------------------------

    def set(self, kind: str, target: str, settings: Mapping[str, Any], uid: int, who: str) -> ManagedPolicyEntry:
        check_target(kind, target)
        check_settings(settings)
        policy = managed_policy.parse_settings(kind, target, settings, caller=True)
        found = self.found()
        changes, ops = self._place([policy], found, "set")
        self._apply(changes, ops, uid, who)
        return self.entry(self.found()[(policy.kind, policy.target)])

    def remove(self, kind: str, target: str, uid: int, who: str) -> None:
        check_target(kind, target)
        found = self.found()
        m = found.get((kind, target))
        if m is None:
            raise InvalidArgs(f"no {kind} policy for {shown(target)}")
        self._apply({m.name: None}, [Operation("remove", m.policy, m.name)], uid, who)

    def import_(self, name: str, text: str, replace: bool, uid: int, who: str) -> list[ManagedPolicyEntry]:
        """All or nothing: every policy of the text (and, with replace, the removal of every managed policy it
        does not name) in one change."""
        return self.import_parsed(name, parse_import(name, text), replace, uid, who)

    def import_parsed(
        self, name: str, policies: list[ManagedPolicy], replace: bool, uid: int, who: str
    ) -> list[ManagedPolicyEntry]:
        """import_ of a text parse_import() read (the service parses it off the main loop)."""
        keys = [(p.kind, p.target) for p in policies]
        if len(set(keys)) != len(keys):
            raise InvalidArgs(f"{name}: a policy is given twice for the same kind and target")
        if len(policies) > MAX_MANAGED:
            raise InvalidArgs(f"{name}: {len(policies)} policies, at most {MAX_MANAGED}")
        found = self.found()
        changes, ops = self._place(policies, found, "import", replace)
        if replace:
            for key, m in found.items():
                if key not in keys:
                    changes[m.name] = None
                    ops.append(Operation("import-remove", m.policy, m.name))
        self._apply(changes, ops, uid, who)
        after = self.found()
        return [self.entry(after[key]) for key in sorted(keys)]

    def _place(
        self,
        policies: list[ManagedPolicy],
        found: dict[tuple[str, str], Managed],
        operation: str,
        replace: bool = False,
    ) -> tuple[dict[str, str | None], list[Operation]]:
        """Each policy's file and text: the file it already has, or file_name()'s, which must not be an
        admin's own file or another managed policy's. A policy whose file already says the same is left out."""
        taken = {m.name: m for m in found.values()}
        existing = set(os.path.basename(p) for p in policy_paths(self.directory))
        kept = len(found) if not replace else len({(p.kind, p.target) for p in policies} & set(found))
        changes: dict[str, str | None] = {}
        ops: list[Operation] = []
        for policy in policies:
            key = (policy.kind, policy.target)
            text = managed_policy.render(policy)
            if len(text.encode()) > MAX_POLICY_BYTES:
                raise InvalidArgs(
                    f"the {policy.kind} policy for {shown(policy.target)} would be larger than "
                    f"{MAX_POLICY_BYTES // 1024} KiB"
                )
            if key in found:
                name = found[key].name
                if found[key].text == text:
                    continue
            else:
                name = managed_policy.file_name(policy)
                self._path(name)
                if name in taken:
                    other = taken[name].policy
                    raise InvalidArgs(
                        f"{self._path(name)} holds the {other.kind} policy for {shown(other.target)}; remove it first"
                    )
                if name in existing:
                    raise InvalidArgs(
                        f"{self._path(name)} exists and is not a managed policy: gpukilld leaves "
                        "it alone (rename it, or remove it)"
                    )
                kept += 1
                if kept > MAX_MANAGED:
                    raise InvalidArgs(f"at most {MAX_MANAGED} managed policies")
            changes[name] = text
            ops.append(Operation(operation, policy, name))
        return changes, ops

    def _apply(self, changes: dict[str, str | None], ops: list[Operation], uid: int, who: str) -> None:
        if not changes:
            return
        try:
            self._validate(changes)
        except PolicyError as e:
            self._journal(ops, uid, who, "rejected", error=str(e))
            raise
        undo = self._write(changes)
        self._listed = None  # whatever happens next, the files changed
        if self.runner.reload_files(who):
            self._commit(undo)
            self._journal(ops, uid, who, "changed")
            return
        error = self.runner.policy_error or f"{self.directory}:1:1: the policy directory did not validate"
        self._revert(undo)
        self.runner.reload_files(who)  # the files as they were: what was in force stays in force
        self._journal(ops, uid, who, "rejected", error=error)
        raise PolicyError([error])

    def _validate(self, changes: dict[str, str | None]) -> None:
        """guard.d as it would be after the change, parsed together as reload_files parses it."""
        texts = dict(directory_texts(self.directory))
        for name, text in changes.items():
            path = self._path(name)
            if text is None:
                texts.pop(path, None)
            else:
                texts[path] = text
        if texts:
            load_texts(sorted(texts.items()))

    def _write(self, changes: dict[str, str | None]) -> list[tuple[str, str | None]]:
        """Write or remove each file; (path, kept old file or None) for each, to undo or commit. An error
        undoes what was done and is one line."""
        undo: list[tuple[str, str | None]] = []
        path = self.directory
        try:
            if not os.path.isdir(self.directory):
                os.makedirs(self.directory, mode=0o755, exist_ok=True)
                os.chmod(self.directory, 0o755)  # the unit's UMask=0077 would leave it 0700
            for name, text in changes.items():
                path = self._path(name)
                kept = None
                if os.path.lexists(path):
                    kept = path + OLD
                    _unlink(kept)
                    os.link(path, kept, follow_symlinks=False)
                undo.append((path, kept))
                if text is None:
                    os.unlink(path)
                else:
                    replace_file(path, text, FILE_MODE, sync_dir=False)  # guard.d is synced once, below
            fsync_dir(self.directory)
        except OSError as e:
            self._revert(undo)
            raise GpukillError(f"cannot write {path}: {e.strerror or e}") from None
        return undo

    def _revert(self, undo: list[tuple[str, str | None]]) -> None:
        for path, kept in reversed(undo):
            try:
                if kept is not None:
                    os.replace(kept, path)  # the very file that was there, mode and owner included
                else:
                    _unlink(path)
            except OSError as e:
                log.error("cannot put %s back as it was: %s", path, e.strerror or e)
        with contextlib.suppress(OSError):
            fsync_dir(self.directory)

    @staticmethod
    def _commit(undo: list[tuple[str, str | None]]) -> None:
        for _, kept in undo:
            if kept is not None:
                with contextlib.suppress(OSError):
                    os.unlink(kept)

    def _journal(self, ops: list[Operation], uid: int, who: str, result: str, error: str | None = None) -> None:
        for op in ops:
            p = op.policy
            done = {"set": "set", "remove": "removed", "import": "imported", "import-remove": "removed by an import"}
            what = f"the {p.kind} policy for {p.target}"
            message = (
                f"Guard managed policy: {what} {done[op.operation]} by {who}"
                if result == "changed"
                else f"Guard managed policy: {op.operation} of {what} by {who} rejected; nothing changed: {error}"
            )
            self.audit.log(
                journal.GUARD_MANAGED_POLICY,
                message,
                action="guard",
                operation=op.operation,
                policy_kind=p.kind,
                policy_target=p.target,
                file=os.path.join(self.directory, op.name),
                caller_uid=uid,
                requested_by=who,
                result=result,
                error=error,
            )
