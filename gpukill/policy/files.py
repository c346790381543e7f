"""Policy files: read (a guard.d directory's, or any path's), parsed one by one, and merged into one Policy;
every file's errors collected before giving up, each as FILE:LINE:COL."""

from __future__ import annotations

import glob
import os
import stat
from typing import Any

from ..condition_types import USER
from ..rules import EMPTY_POLICY, Exemptions, Policy, Rule, Settings
from .bounds import MAX_ERRORS, MAX_NAME_LOOKUPS, MAX_POLICY_BYTES
from .grammar import PolicyFile, _Parser
from .messages import PolicyError, quoted


def check_text(text: str, filename: str) -> None:
    """PolicyError unless text could be a policy at all (text, at most MAX_POLICY_BYTES, no NUL): cheap, so a
    caller's 30 MiB message is refused before anything is spent on it."""
    if not isinstance(text, str):
        raise PolicyError([f"{filename}:1:1: the policy is not text"])
    if len(text) > MAX_POLICY_BYTES or len(text.encode("utf-8", "replace")) > MAX_POLICY_BYTES:
        raise PolicyError([f"{filename}:1:1: the policy is larger than {MAX_POLICY_BYTES // 1024} KiB"])
    if "\0" in text:
        raise PolicyError([f"{filename}:1:1: the policy contains a NUL byte: not a text file"])


def parse_file_text(text: str, filename: str) -> PolicyFile:
    """Parse one policy file's text; PolicyError lists the problems found (at most MAX_ERRORS). Nothing else
    is raised, whatever the text: the daemon's start-up and reload rely on it."""
    check_text(text, filename)
    parser = _Parser(text, filename)
    try:
        parsed = parser.parse()
    except Exception as e:  # a bug of ours or PyYAML's: still an invalid policy, never a crash
        raise PolicyError(
            parser.errors[: MAX_ERRORS - 1]
            + [f"{filename}:1:1: the policy could not be read ({type(e).__name__}: {e})"]
        ) from e
    if parser.errors or parsed is None:
        raise PolicyError(parser.errors or [f"{filename}:1:1: the policy could not be read"])
    return parsed


def build_policy(files: list[PolicyFile]) -> Policy:
    """Merge parsed files in order: rules are concatenated (names unique across files), a setting in a later
    file overrides an earlier one, exemption lists are joined."""
    errors: list[str] = []
    seen: dict[str, str] = {}
    rules: list[Rule] = []
    values: dict[str, Any] = {}
    exemptions = Exemptions()
    for f in files:
        for key, (value, _where) in f.settings.items():
            if key == "exemptions":
                exemptions = exemptions.merged(value)
            else:
                values[key] = value
        for rule in f.rules:
            if rule.name in seen:
                errors.append(f"{rule.where}: duplicate rule name {rule.name!r} (first defined at {seen[rule.name]})")
                continue
            seen[rule.name] = rule.where
            rules.append(rule)
    settings = Settings(exemptions=exemptions, **values)
    names: dict[tuple[str, str], str] = {}
    for f in files:
        for kind, name, where in f.names:
            names.setdefault((kind, name), where)
    for rule in rules:
        if rule.action == "notify" and not (rule.notify if rule.notify is not None else settings.notify):
            errors.append(
                f"{rule.where}: rule {rule.name!r} has action notify but no notify targets "
                "(give 'notify:' in the rule or at the top of the policy)"
            )
    if errors:
        raise PolicyError(errors)
    return Policy(
        settings,
        tuple(rules),
        tuple(f.name for f in files),
        tuple((kind, name, where) for (kind, name), where in names.items()),
    )


def name_warnings(policy: Policy, limit: int = MAX_NAME_LOOKUPS) -> list[str]:
    """'FILE:LINE:COL: warning: no user 'alcie' on this host' for each user or group name the policy writes
    that this host's user and group databases (NSS: files, LDAP, ...) do not know. Not an error: the name may
    be created later, and a condition on it matches nobody until then. Each lookup may wait on NSS, so the
    daemon calls this off its main loop; at most `limit` names are looked up, the rest counted in one line."""
    import grp
    import pwd

    out: list[str] = []
    for kind, name, where in policy.names[:limit]:
        try:
            (pwd.getpwnam if kind == USER else grp.getgrnam)(name)
        except (KeyError, UnicodeEncodeError, ValueError):  # ValueError: an embedded NUL
            out.append(f"{where}: warning: no {kind} {quoted(name)} on this host")
        except OSError as e:  # NSS itself failed (an LDAP server down): say so rather than guess
            out.append(f"{where}: warning: {kind} {quoted(name)} could not be looked up: {e.strerror or e}")
    if len(policy.names) > limit:
        out.append(f"{policy.source}: warning: {len(policy.names) - limit} more user and group names not looked up")
    return out


def parse_policy(text: str, filename: str) -> Policy:
    return build_policy([parse_file_text(text, filename)])


def read_text(path: str, regular_only: bool = False) -> str:
    """A policy file's text; PolicyError (FILE:1:1) when it cannot be read. With regular_only (the daemon
    reading guard.d) nothing but a regular file is read: a FIFO would block the daemon's start-up. Without it
    (gpukillctl guard load FILE) a pipe such as /dev/stdin is read too. At most MAX_POLICY_BYTES + 1 bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)  # no wait for a writer
    except OSError as e:
        raise PolicyError([f"{path}:1:1: cannot read: {e.strerror}"]) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise PolicyError([f"{path}:1:1: cannot read: Is a directory"])
        if not stat.S_ISREG(mode):
            if regular_only:
                raise PolicyError([f"{path}:1:1: cannot read: not a regular file"])
            os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_POLICY_BYTES:
            chunk = os.read(fd, MAX_POLICY_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise PolicyError([f"{path}:1:1: cannot read: {e.strerror}"]) from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError([f"{path}:1:1: not UTF-8 text (byte {e.start})"]) from None


def policy_paths(directory: str) -> list[str]:
    """*.yaml in the directory, in name order (as systemd reads drop-ins)."""
    return sorted(glob.glob(os.path.join(glob.escape(directory), "*.yaml")))


def load_texts(texts: list[tuple[str, str]]) -> Policy:
    """Parse (name, text) pairs and merge them; every file's errors are collected before giving up."""
    errors: list[str] = []
    files: list[PolicyFile] = []
    for name, text in texts:
        try:
            files.append(parse_file_text(text, name))
        except PolicyError as e:
            errors.extend(e.errors)
    if errors:
        raise PolicyError(errors)
    return build_policy(files)


def read_paths(paths: list[str], regular_only: bool = False) -> list[tuple[str, str]]:
    errors: list[str] = []
    texts: list[tuple[str, str]] = []
    for path in paths:
        try:
            texts.append((path, read_text(path, regular_only)))
        except PolicyError as e:
            errors.extend(e.errors)
    if errors:
        raise PolicyError(errors)
    return texts


def load_paths(paths: list[str]) -> Policy:
    return load_texts(read_paths(paths))


def directory_texts(directory: str) -> list[tuple[str, str]]:
    """(path, text) of each policy file in a guard.d directory; none when the directory does not exist."""
    if not os.path.exists(directory):
        return []
    if not os.path.isdir(directory):
        raise PolicyError([f"{directory}:1:1: not a directory"])
    return read_paths(policy_paths(directory), regular_only=True)  # the daemon's: a FIFO must not block it


def load_directory(directory: str) -> Policy:
    """The policy of a guard.d directory; a missing directory is an empty policy (nothing to enforce)."""
    texts = directory_texts(directory)
    return load_texts(texts) if texts else EMPTY_POLICY
