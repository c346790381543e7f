"""What vulture (`make check`) takes for unused but something outside our calls uses: by name, by reflection or
by a protocol. vulture only parses this file; each name here counts as used wherever it is defined."""

# Record fields: read by reflection (dataclasses.fields, gpukill.records.base.specs), sent on the bus and in JSON
_.recent_more
_.windows_more
_.graces_more
_.mig_mode
_.parent_id
_.parent_tgid  # gpukilld/sampling/proc_events.Event: what a fork event carries, decoded with the rest
_.rogue_score  # gpukilld/guard/conditions: read by the attribute name gpukill/condition_types.py gives
_.rogue_kind

# The kernel's proc_event.what values (include/uapi/linux/cn_proc.h), kept whole beside the ones acted on
PROC_EVENT_GID
PROC_EVENT_SID
PROC_EVENT_PTRACE
PROC_EVENT_COREDUMP
PROC_EVENT_EXIT
LOW  # gpukillctl/notify/events: the notification spec's urgencies, LOW, NORMAL, CRITICAL

# Options a library reads: RE2's (gpukill/regex.py), selenium's (tests/helpers/browser.py)
_.max_mem
_.log_errors
_.binary_location

# Methods a framework calls: argparse's formatter hook and Action.__call__'s arguments, prometheus_client's
# collector protocol, uvicorn.Server's signal handling, queue.Queue's storage hooks, aiosmtpd's handler and
# http.server's request handler (tests/helpers/sinks.py)
_._get_formatter
namespace
option_string
_.collect
_.capture_signals
_._init
_._qsize
_._put
_.handle_RCPT
rcpt_options
_.handle_DATA
_.do_POST
_.log_message

# pydantic's and FastAPI's settings by name, the MCP SDK's tool schema, and a field of a tool's structured output
model_config
_.route_class
_.parameters
_.next_step

# D-Bus method arguments the signature declares (tests/clients/hostile_agent.py: polkit's agent interface)
action_id
icon_name
identities

# pytest fixtures a test requests for their effect alone (a policy removed, slurmd started)
no_policy
slurm
