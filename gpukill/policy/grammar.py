"""The grammar of a policy file: its top-level settings, its rules, and each rule's conditions, read from the
YAML node tree into gpukill.rules' records. Every error is kept, as FILE:LINE:COL, and nothing of a part with
an error is built."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..checkpoint import MAX_CHECKPOINT_WAIT, POLICY_PREFIX, BadDeclaration, Declaration, parse_signal
from ..condition_types import CELSIUS, CONDITION_TYPES, COUNT, DURATION, OPERATORS, PERCENT, SIZE
from ..limits import MAX_GRACE
from ..records.reclaim import KILL_PROCESS, KILL_SCOPES
from ..rules import (
    ACTIONS,
    CANCEL,
    EVERY,
    KILL,
    MATCHES,
    MAX_RESETS_PER_HOUR,
    MEAN,
    OVERS,
    PER_DEVICE,
    PER_PROCESS,
    REQUEUE,
    RESET,
    RESET_COOLDOWN,
    SCOPES,
    SELECTOR,
    SUBJECT,
    SUSPEND,
    Condition,
    Exemptions,
    Postpone,
    Rule,
    stops_subject,
    through_slurm,
)
from ..units import format_duration
from .bounds import (
    MAX_DESCRIPTION,
    MAX_DURATION,
    MAX_NAME,
    MAX_POSTPONE,
    MAX_POSTPONEMENTS,
    MAX_RESETS_PER_HOUR_LIMIT,
    MAX_RULES,
    MAX_WARNINGS,
    MIN_RESET_COOLDOWN,
)
from .messages import TOO_MANY_ERRORS, close_match, cut, described, quoted
from .readers import Fields, Stop, node_kind
from .values import ValueReader
from .yaml_safe import NotYaml, compose

TOP_KEYS = (
    "rules",
    "sample_interval",
    "dry_run",
    "max_kills_per_cycle",
    "cooldown",
    "kill_grace",
    "max_checkpoint_wait",
    "notify",
    "exemptions",
)
AT_START = "at_start"  # a warning when the grace period begins (with the violation)
NUMERIC_KINDS = (PERCENT, CELSIUS, SIZE, DURATION, COUNT)  # what a mean can be taken of
RULE_KEYS = (
    "name",
    "description",
    "conditions",
    "match",
    "scope",
    "action",
    "force",
    "grace_period",
    "kill_grace",
    "notify",
    "exemptions",
    "cooldown",
    "max_resets_per_hour",
    "warn",
    "kill_scope",
    "postpone",
    "checkpoint",
)
POSTPONE_KEYS = ("max", "times")
CHECKPOINT_KEYS = ("signal", "wait", "each")
RESET_KEYS = ("cooldown", "max_resets_per_hour")  # rule keys of action reset only
# The keys of action kill, and which stopping actions take each (the first named is kill).
KILL_KEY_ACTIONS: dict[str, tuple[str, ...]] = {
    "force": (KILL, RESET),  # a reset rule's force kills the device's holders first
    "grace_period": (KILL, SUSPEND, REQUEUE, CANCEL),
    "kill_grace": (KILL,),
    "warn": (KILL, SUSPEND, REQUEUE, CANCEL),
    "kill_scope": (KILL, SUSPEND),
    "postpone": (KILL,),
    "checkpoint": (KILL,),
}


def _listed(names: tuple[str, ...]) -> str:
    """ "kill and suspend", "kill, suspend, requeue and cancel"."""
    return ", ".join(names[:-1]) + " and " + names[-1]


CONDITION_KEYS = ("type", "operator", "value", "duration", "over", "scope", "description")

# Python's `re`, on a name whose length is bounded before matching (MAX_NAME); linear in it anyway
# (tests/test_policy_hostile.py measures 1 MiB).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class _KillSettings(NamedTuple):
    """A rule's keys of action kill, read."""

    force: bool
    grace_period: float
    kill_grace: float | None
    kill_scope: str
    warn: tuple[float, ...]
    postpone: Postpone | None
    checkpoint: Declaration | None


@dataclass(frozen=True, slots=True)
class PolicyFile:
    """One parsed file: the settings it sets (with where) and its rules, before files are merged."""

    name: str
    settings: dict[str, tuple[Any, str]]
    rules: tuple[Rule, ...]
    names: tuple[tuple[str, str, str], ...] = ()  # (user or group, name, FILE:LINE:COL): for name_warnings()


class _Parser(ValueReader):
    """One policy file's text read into its settings and rules, every error kept as FILE:LINE:COL."""

    # -- document --------------------------------------------------------------------------------------

    def parse(self) -> PolicyFile | None:
        """The file's settings and rules; None (with self.errors) when it has none to give."""
        try:
            root = self.compose()
            return None if root is None else self.document(root)
        except Stop as stop:
            if stop.more:
                self.errors.append(TOO_MANY_ERRORS)
            return None
        except RecursionError:  # not expected (depth is bounded), but never a crash
            self.errors.append(f"{self.file}:1:1: the policy is nested too deeply to be read")
            return None

    def compose(self) -> Node | None:
        """The document's node tree; errors of YAML itself (and of PyYAML) as FILE:LINE:COL."""
        try:
            root, self.loader = compose(self.text, self.file)
        except NotYaml as e:
            self.add(e.line)
            return None
        if root is None:
            self.add(
                f"{self.file}:1:1: the policy is empty: expected a mapping with a 'rules:' list "
                "(write 'rules: []' for none)"
            )
        return root

    def document(self, root: Node) -> PolicyFile | None:
        top = self.mapping(root, "the policy", TOP_KEYS)
        if top is None:
            return None
        settings = self.settings(top)
        rules: list[Rule] = []
        if "rules" not in top:
            self.error(root, "the policy has no 'rules:' list (write 'rules: []' for none)")
        else:
            key_node, rules_node = top["rules"]
            ok, value = self.scalar(rules_node)
            if not isinstance(rules_node, SequenceNode):
                shape = described(value) if ok else node_kind(rules_node)
                self.error(rules_node, f"'rules' must be a list, not {shape}")
            elif len(rules_node.value) > MAX_RULES:
                self.error(rules_node, f"more than {MAX_RULES} rules")
            else:
                self.budget(rules_node, len(rules_node.value))
                seen: dict[str, str] = {}
                for rule_node in rules_node.value:
                    rule = self.rule(rule_node)
                    if rule is None:
                        continue
                    if rule.name in seen:
                        self.add(
                            f"{rule.where}: duplicate rule name {rule.name!r} (first defined at {seen[rule.name]})"
                        )
                        continue
                    seen[rule.name] = rule.where
                    rules.append(rule)
        return PolicyFile(
            self.file, settings, tuple(rules), tuple((kind, name, where) for (kind, name), where in self.names.items())
        )

    def settings(self, top: Fields) -> dict[str, tuple[Any, str]]:
        out: dict[str, tuple[Any, str]] = {}
        for key, (_key_node, node) in top.items():
            value: Any = None
            if key == "sample_interval":
                value = self.duration(node, "sample_interval", 0.05, 3600.0)
            elif key == "dry_run":
                value = self.boolean(node, "dry_run")
            elif key == "max_kills_per_cycle":
                ok, raw = self.scalar(node)
                if ok and isinstance(raw, int) and not isinstance(raw, bool) and 1 <= raw <= 10_000:
                    value = raw
                else:
                    self.error(
                        node,
                        "max_kills_per_cycle must be a whole number from 1 to 10000, not "
                        f"{described(raw) if ok else node_kind(node)}",
                    )
            elif key == "cooldown":
                value = self.duration(node, "cooldown", 0.0, 86400.0)
            elif key == "kill_grace":
                value = self.duration(node, "kill_grace", 0.0, MAX_GRACE)
            elif key == "max_checkpoint_wait":
                value = self.duration(node, "max_checkpoint_wait", 0.0, MAX_CHECKPOINT_WAIT)
            elif key == "notify":
                value = self.notify_targets(node)
            elif key == "exemptions":
                value = self.exemptions(node)
            if value is not None:
                out[key] = (value, self.where(node))
        return out

    # -- rules -----------------------------------------------------------------------------------------

    def rule(self, node: Node) -> Rule | None:
        before = self.failures
        fields = self.mapping(node, "a rule", RULE_KEYS)
        if fields is None:
            return None
        name = self.rule_name(node, fields)
        label = f"rule {name!r}" if name else "the rule"
        description = ""
        if "description" in fields:
            description = (
                self.string(fields["description"][1], "description", allow_empty=True, max_len=MAX_DESCRIPTION) or ""
            )
        match = self.rule_match(fields)
        rule_scope = self.scope(fields["scope"][1]) if "scope" in fields else None
        action = self.rule_action(node, fields, label)
        kill = self.kill_settings(fields, action)
        reset_cooldown, max_resets = self.reset_settings(fields, action)
        notify = self.notify_targets(fields["notify"][1]) if "notify" in fields else None
        exemptions = Exemptions()
        if "exemptions" in fields:
            exemptions = self.exemptions(fields["exemptions"][1]) or Exemptions()
        cond_nodes = self.condition_nodes(node, fields, label)
        scope = self.agreed_scope(rule_scope, cond_nodes)
        conditions = [c for c in (self.condition(cn, scope) for cn in cond_nodes) if c is not None]
        self.check_match_any(fields, match, scope, conditions)
        self.check_kill_selects_some(node, label, scope, action, conditions)
        self.check_subjects_named(node, fields, label, scope, match, conditions, self.failures == before)
        self.check_reset_scope(fields, label, scope, action, conditions)
        self.check_suspend_scope(fields, label, scope, action)
        if self.failures > before or name is None or action is None:
            return None
        return Rule(
            name=name,
            description=description,
            conditions=tuple(conditions),
            match=match,
            scope=scope,
            action=action,
            force=kill.force,
            grace_period=kill.grace_period,
            kill_grace=kill.kill_grace,
            notify=notify,
            exemptions=exemptions,
            where=self.where(node),
            cooldown=reset_cooldown,
            max_resets_per_hour=max_resets,
            warn=kill.warn,
            kill_scope=kill.kill_scope,
            postpone=kill.postpone,
            checkpoint=kill.checkpoint,
        )

    # -- a rule's fields, each read alone ----------------------------------------------------------------

    def rule_name(self, node: Node, fields: Fields) -> str | None:
        if "name" not in fields:
            self.error(node, "a rule needs a 'name'")
            return None
        name = self.string(fields["name"][1], "the rule name")
        if name is not None and (len(name) > MAX_NAME or not _NAME.match(name)):
            self.error(
                fields["name"][1],
                f"rule name {quoted(name)} must be at most {MAX_NAME} letters, "
                "digits, '.', '_' or '-', starting with a letter or digit",
            )
            return None
        return name

    def rule_match(self, fields: Fields) -> str:
        if "match" not in fields:
            return "all"
        m = self.string(fields["match"][1], "match")
        if m is not None and m not in MATCHES:
            self.error(fields["match"][1], f"match must be 'all' or 'any', not {quoted(m)}")
            return "all"
        return "all" if m is None else m

    def rule_action(self, node: Node, fields: Fields, label: str) -> str | None:
        if "action" not in fields:
            self.error(node, f"{label} needs an 'action': {', '.join(ACTIONS[:-1])} or {ACTIONS[-1]}")
            return None
        action = self.string(fields["action"][1], "action")
        if action is not None and action not in ACTIONS:
            self.error(fields["action"][1], f"unknown action {quoted(action)} (known: {', '.join(ACTIONS)})")
            return None
        return action

    def kill_settings(self, fields: Fields, action: str | None) -> _KillSettings:
        """The keys of action kill, and those of them that other stopping actions share: suspend has grace_period,
        warn and kill_scope (the keys of when and what, not of signals); requeue and cancel have grace_period and
        warn (Slurm's own TERM, KillWait and KILL stop a job). Any of them on another action is an error."""
        force = bool(self.boolean(fields["force"][1], "force")) if "force" in fields else False
        grace = 0.0
        if "grace_period" in fields:
            grace = self.duration(fields["grace_period"][1], "grace_period", 0.0, 86400.0) or 0.0
        kill_grace = None
        if "kill_grace" in fields:
            kill_grace = self.duration(fields["kill_grace"][1], "kill_grace", 0.0, MAX_GRACE)
        kill_scope = self.rule_kill_scope(fields["kill_scope"][1]) if "kill_scope" in fields else KILL_PROCESS
        for key, allowed in KILL_KEY_ACTIONS.items():
            if key in fields and action is not None and action in ACTIONS and action not in allowed:
                where = f"action {allowed[0]}" if len(allowed) == 1 else f"actions {_listed(allowed)}"
                why = ": Slurm stops the job its own way (TERM, KillWait, KILL)" if through_slurm(action) else ""
                self.error(fields[key][0], f"{key} applies only to {where}, not {action}{why}")
        warn: tuple[float, ...] = ()
        if "warn" in fields and action is not None and stops_subject(action):
            warn = self.warn_schedule(fields["warn"][1], grace, fields["warn"][0] if not grace else None)
        postpone = None
        if "postpone" in fields and action == KILL:
            postpone = self.postpone(fields["postpone"][1], fields["postpone"][0] if not grace else None)
        checkpoint = None
        if "checkpoint" in fields and action == KILL:
            checkpoint = self.checkpoint(fields["checkpoint"][1])
        return _KillSettings(force, grace, kill_grace, kill_scope, warn, postpone, checkpoint)

    def postpone(self, node: Node, no_grace: Node | None) -> Postpone | None:
        """`postpone: {max: 1h, times: 2}`: how much more time an owner may ask for in one episode, in all
        (max, a duration) and in how many postponements (times)."""
        if no_grace is not None:
            self.error(no_grace, "postpone needs a grace_period: a postponement moves the end of the grace period")
            return None
        fields = self.mapping(node, "postpone", POSTPONE_KEYS)
        if fields is None:
            return None
        for key in POSTPONE_KEYS:
            if key not in fields:
                self.error(node, f"postpone needs '{key}' (e.g. postpone: {{max: 1h, times: 2}})")
        if len(fields) < len(POSTPONE_KEYS):
            return None
        most = self.duration(fields["max"][1], "postpone's max", 1.0, MAX_POSTPONE)
        times_node = fields["times"][1]
        ok, times = self.scalar(times_node)
        if not (ok and isinstance(times, int) and not isinstance(times, bool) and 1 <= times <= MAX_POSTPONEMENTS):
            shape = described(times) if ok else node_kind(times_node)
            self.error(
                times_node, f"postpone's times must be a whole number from 1 to {MAX_POSTPONEMENTS}, not {shape}"
            )
            return None
        return None if most is None else Postpone(most, times)

    def checkpoint(self, node: Node) -> Declaration | None:
        """`checkpoint: {signal: USR1, wait: 2m, each: false}`: the signal the rule's victims that declare none
        get before SIGTERM, and how long their exit is awaited (gpukill.checkpoint)."""
        fields = self.mapping(node, "checkpoint", CHECKPOINT_KEYS)
        if fields is None:
            return None
        before = self.failures
        for key in ("signal", "wait"):
            if key not in fields:
                self.error(node, f"checkpoint needs a '{key}' (e.g. checkpoint: {{signal: USR1, wait: 2m}})")
        number = 0
        if "signal" in fields:
            name = self.string(fields["signal"][1], "the checkpoint signal")
            if name is not None:
                try:
                    number = parse_signal(name)
                except BadDeclaration as e:
                    self.error(fields["signal"][1], str(e))
        wait = None
        if "wait" in fields:
            wait = self.duration(fields["wait"][1], "the checkpoint wait", 0.001, MAX_DURATION)
        each = bool(self.boolean(fields["each"][1], "each")) if "each" in fields else False
        if self.failures > before or wait is None:
            return None
        return Declaration(number, wait, each, POLICY_PREFIX + self.where(node))

    def rule_kill_scope(self, node: Node) -> str:
        ks = self.string(node, "kill_scope")
        if ks is not None and ks not in KILL_SCOPES:
            self.error(node, f"kill_scope must be one of {', '.join(KILL_SCOPES)}, not {quoted(ks)}")
            return KILL_PROCESS
        return KILL_PROCESS if ks is None else ks

    def reset_settings(self, fields: Fields, action: str | None) -> tuple[float, int]:
        """(cooldown, max_resets_per_hour): keys of action reset only; any of them on another action is an
        error."""
        reset_cooldown, max_resets = RESET_COOLDOWN, MAX_RESETS_PER_HOUR
        if action != RESET:
            for key in RESET_KEYS:
                if key in fields and action is not None:
                    self.error(fields[key][0], f"{key} applies only to action reset, not {action}")
            return reset_cooldown, max_resets
        if "cooldown" in fields:
            reset_cooldown = (
                self.duration(fields["cooldown"][1], "cooldown", MIN_RESET_COOLDOWN, 86400.0) or RESET_COOLDOWN
            )
        if "max_resets_per_hour" in fields:
            node = fields["max_resets_per_hour"][1]
            ok, raw = self.scalar(node)
            if ok and isinstance(raw, int) and not isinstance(raw, bool) and 1 <= raw <= MAX_RESETS_PER_HOUR_LIMIT:
                max_resets = raw
            else:
                shape = described(raw) if ok else node_kind(node)
                self.error(
                    node,
                    f"max_resets_per_hour must be a whole number from 1 to {MAX_RESETS_PER_HOUR_LIMIT}, not {shape}",
                )
        return reset_cooldown, max_resets

    def condition_nodes(self, node: Node, fields: Fields, label: str) -> list[Node]:
        if "conditions" not in fields:
            self.error(node, f"{label} needs 'conditions'")
            return []
        cnode = fields["conditions"][1]
        if not isinstance(cnode, SequenceNode):
            self.error(cnode, f"conditions must be a list, not {node_kind(cnode)}")
            return []
        if not cnode.value:
            self.error(cnode, f"{label} has an empty conditions list: it would match every process")
            return []
        self.budget(cnode, len(cnode.value))
        return list(cnode.value)

    def agreed_scope(self, rule_scope: str | None, cond_nodes: list[Node]) -> str:
        """The rule's scope: its own, or the one its conditions state (they must agree); else per_process."""
        scope = rule_scope
        for cn in cond_nodes:
            if not isinstance(cn, MappingNode):
                continue
            self.budget(cn, len(cn.value))
            for k, v in cn.value:
                if not (isinstance(k, ScalarNode) and k.value == "scope"):
                    continue
                s = self.scope(v)
                if s is None:
                    continue
                if scope is None:
                    scope = s
                elif s != scope:
                    where = "the rule's scope" if rule_scope else "another condition's scope"
                    self.error(v, f"condition scope {s} conflicts with {where} {scope}")
        return scope or PER_PROCESS

    # -- a rule's fields, checked together ---------------------------------------------------------------

    def check_match_any(self, fields: Fields, match: str, scope: str, conditions: list[Condition]) -> None:
        if match == "any" and any(c.role == SELECTOR for c in conditions):
            # selectors pick the processes a per_user/per_device rule counts; OR-ing them has no clear meaning
            self.error(
                fields["match"][1],
                f"match any is not supported with process conditions in scope {scope}; write one rule per alternative",
            )

    def check_kill_selects_some(
        self, node: Node, label: str, scope: str, action: str | None, conditions: list[Condition]
    ) -> None:
        if (
            conditions
            and scope != PER_PROCESS
            and all(c.role == SELECTOR for c in conditions)
            and action is not None
            and stops_subject(action)
        ):
            self.error(
                node,
                f"{label} in scope {scope} has only process conditions: with action {action} it would "
                f"{'stop' if action == KILL else action} every selected process; add a "
                f"{scope.removeprefix('per_')} condition or use scope per_process",
            )

    def check_subjects_named(
        self, node: Node, fields: Fields, label: str, scope: str, match: str, conditions: list[Condition], valid: bool
    ) -> None:
        """In a scope whose subjects a condition names (per_group: group), a rule has such a condition, with
        == or in; valid: no error was found in the rule so far."""
        naming = [t for t in CONDITION_TYPES.values() if scope in t.names]
        if (
            naming
            and conditions
            and valid
            and not any(
                c.type in {t.name for t in naming} and c.role == SUBJECT and c.operator in ("==", "in")
                for c in conditions
            )
        ):
            # Its subjects are what that condition names: a rule without one would look at every group of
            # every user (their primary groups, "users", ...), not at the group its author means.
            names = " or ".join(t.name for t in naming)
            self.error(
                node,
                f"{label} in scope {scope} needs a {names} condition with == or in naming its "
                f"{scope.removeprefix('per_')}(s)",
            )
        elif naming and match == "any":
            # The naming condition holds for every subject it names: with any, the rule would hold for all.
            self.error(
                fields["match"][1],
                f"match any is not supported in scope {scope}: its "
                f"{naming[0].name} condition holds for every subject it names",
            )

    def check_reset_scope(
        self, fields: Fields, label: str, scope: str, action: str | None, conditions: list[Condition]
    ) -> None:
        if action == RESET and scope != PER_DEVICE:
            self.error(
                fields["action"][1], f"action reset resets a device: {label} needs scope per_device, not {scope}"
            )
        elif action == RESET and any(c.role == SELECTOR for c in conditions):
            # A reset stops everything on the device: which processes a rule counts cannot change that.
            self.error(
                fields["action"][1],
                f"action reset acts on the whole device: {label} may have only device "
                "conditions, no process conditions",
            )

    def check_suspend_scope(self, fields: Fields, label: str, scope: str, action: str | None) -> None:
        if action == SUSPEND and scope == PER_DEVICE:
            # A device's processes are several owners' workloads: each is set aside for its owner to resume, and
            # a rule that frees a device for whoever comes next kills (or resets) instead.
            self.error(
                fields["action"][1],
                f"action suspend sets an owner's workload aside until they resume it: {label} needs scope "
                f"per_process, per_user or per_group, not {scope} (to free a device, use action kill)",
            )

    def warn_schedule(self, node: Node, grace: float, no_grace: Node | None) -> tuple[float, ...]:
        """`warn: [at_start, 15m, 1m]`: when to warn during the grace period, each item `at_start` or a duration
        before the grace ends; as seconds before the end, largest first (at_start: the grace period itself)."""
        if no_grace is not None:
            self.error(no_grace, "warn needs a grace_period: the warnings are sent during it")
            return ()
        items = node.value if isinstance(node, SequenceNode) else None
        if not items:
            self.error(
                node,
                "warn must be a list such as [at_start, 15m, 1m] (at_start, or a duration before the "
                f"grace period ends), not {'an empty list' if items == [] else node_kind(node)}",
            )
            return ()
        if len(items) > MAX_WARNINGS:
            self.error(node, f"warn has more than {MAX_WARNINGS} warnings")
            return ()
        before = self.failures
        offsets: list[float] = []
        for item in items:
            ok, raw = self.scalar(item)
            if ok and raw == AT_START:
                offset: float | None = grace
            else:
                offset = self.duration(item, "a warning", 0.0, MAX_DURATION)
                if offset is not None and not 0 < offset < grace:
                    self.error(
                        item,
                        f"a warning {format_duration(offset)} before the end must fall within the "
                        f"grace period ({format_duration(grace)}): more than 0s and less than it "
                        "(at_start warns when it begins)",
                    )
                    offset = None
            if offset is None:
                continue
            if offset in offsets:
                self.error(item, "this warning is in the list twice")
                continue
            offsets.append(offset)
        return tuple(sorted(offsets, reverse=True)) if self.failures == before else ()

    def scope(self, node: Node) -> str | None:
        s = self.string(node, "scope")
        if s is not None and s not in SCOPES:
            self.error(node, f"unknown scope {quoted(s)} (known: {', '.join(SCOPES)})")
            return None
        return s

    def condition(self, node: Node, scope: str) -> Condition | None:
        before = self.failures
        fields = self.mapping(node, "a condition", CONDITION_KEYS)
        if fields is None:
            return None
        if "type" not in fields:
            self.error(node, f"a condition needs a 'type' (one of: {', '.join(CONDITION_TYPES)})")
            return None
        type_name = self.string(fields["type"][1], "the condition type")
        if type_name is None:
            return None
        ctype = CONDITION_TYPES.get(type_name)
        if ctype is None:
            hint = close_match(type_name, tuple(CONDITION_TYPES))
            self.error(
                fields["type"][1],
                f"unknown condition type {quoted(type_name)}{hint} (known: {', '.join(CONDITION_TYPES)})",
            )
            return None
        role = ctype.roles.get(scope)
        if role is None:
            self.error(fields["type"][1], f"{ctype.needs} (the rule's scope is {scope})")
        if "operator" not in fields:
            self.error(node, f"the {type_name} condition needs an 'operator' ({', '.join(ctype.operators)})")
            return None
        op = self.string(fields["operator"][1], "operator")
        if op is None:
            return None
        if op not in ctype.operators:
            what = "unknown operator" if op not in OPERATORS else "operator"
            self.error(
                fields["operator"][1],
                f"{what} {quoted(op)} does not fit {type_name} (use one of: {', '.join(ctype.operators)})",
            )
            return None
        if "value" not in fields:
            self.error(node, f"the {type_name} condition needs a 'value'")
            return None
        value, percent, shown = self.condition_value(ctype, op, fields["value"][1])
        duration = None
        if "duration" in fields:
            duration = self.duration(fields["duration"][1], "duration", 0.001)
            if duration is not None and role == SELECTOR:
                self.error(
                    fields["duration"][0],
                    f"a duration on {type_name} is not supported in scope {scope}: "
                    "process conditions select processes there; put the duration "
                    "on a condition about the subject",
                )
        over = EVERY
        if "over" in fields:
            over = self.string(fields["over"][1], "over") or EVERY
            if over not in OVERS:
                self.error(fields["over"][1], f"over must be one of {', '.join(OVERS)}, not {quoted(over)}")
            elif over == MEAN and duration is None:
                self.error(fields["over"][0], "over: mean needs a duration: the mean is taken over it")
            elif over == MEAN and ctype.kind not in NUMERIC_KINDS:
                self.error(fields["over"][0], f"over: mean needs a condition on a number, not {type_name}")
        if "description" in fields:
            self.string(fields["description"][1], "description", allow_empty=True, max_len=MAX_DESCRIPTION)
        if self.failures > before or role is None:
            return None
        text = f"{type_name} {op} {shown}"
        if duration:
            text += (
                f" on average over {format_duration(duration)}" if over == MEAN else f" for {format_duration(duration)}"
            )
        return Condition(type_name, op, value, duration, percent, role, self.where(node), cut(text), over)
